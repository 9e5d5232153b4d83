"""Exit codes are one table (protocol/exits.py) and one rule maps an error to its code: every command fails the
same way, with one line on stderr (never a traceback for an error the operator can fix), its code, and under
--json a JSON document on stdout."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgefleet.protocol.errors import ConfigError, EdgefleetError
from edgefleet.protocol.exits import MEANING, ExitCode, exit_for

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgefleet.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_table_keeps_its_numbers_and_the_help_prints_it():
    assert [int(c) for c in ExitCode] == list(range(8)) and set(MEANING) == set(ExitCode)
    r = run_cli("--help")
    assert r.returncode == 0
    for code, meaning in MEANING.items():
        assert f"  {int(code)}  {meaning}" in r.stdout, r.stdout


def test_errors_carry_their_code_from_the_table():
    from edgefleet.compiler.errors import AccuracyGateFailed, InputError, ToolchainError
    from edgefleet.fleet.client import FleetHTTPError, FleetUnreachable

    assert exit_for(AccuracyGateFailed("lost 3 points")) == (ExitCode.GATE, "lost 3 points")
    assert exit_for(InputError("x"))[0] is ExitCode.INPUT and exit_for(ToolchainError("x"))[0] is ExitCode.TOOLCHAIN
    assert exit_for(FleetUnreachable("down"))[0] is ExitCode.FLEET
    assert exit_for(FleetHTTPError(409, "exists"))[0] is ExitCode.FLEET
    assert exit_for(ConfigError("bad key\n  in agent.yaml")) == (ExitCode.INPUT, "bad key in agent.yaml")  # one line
    assert exit_for(EdgefleetError())[1] == "EdgefleetError"  # never an empty message
    assert exit_for(PermissionError(13, "Permission denied"))[0] is ExitCode.INPUT  # a path the operator named
    assert exit_for(ValueError("x"))[0] is ExitCode.INTERNAL  # a bug


def test_a_path_that_cannot_be_a_folder_is_one_line_and_exit_4(tmp_path):
    (tmp_path / "file").write_text("")
    r = run_cli("keys", "init", str(tmp_path / "file" / "keys"))
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


def test_usage_errors_found_after_parsing_are_exit_2(tmp_path):
    (tmp_path / "b.tar").write_bytes(b"")
    r = run_cli("bench", str(tmp_path / "b.tar"), "--batch-sizes", "0")
    assert r.returncode == 2 and "--batch-sizes '0'" in r.stderr, r.stderr


def test_a_malformed_flag_value_of_the_simulator_is_a_usage_error_not_a_bug():
    r = run_cli("simulate", "--devices", "1", "--fail-version", "bad")
    assert r.returncode == 2 and "--fail-version 'bad' must look like VERSION=NUMBER" in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_a_missing_bundle_is_exit_4(command, tmp_path):
    r = run_cli(command, str(tmp_path / "nope.tar"))
    assert r.returncode == 4 and f"{tmp_path / 'nope.tar'}: no such bundle file" in r.stderr, r.stderr


def test_json_callers_get_a_json_document_when_it_fails(tmp_path):
    r = run_cli("verify", str(tmp_path / "nope.tar"), "--json")
    assert r.returncode == 4, r.stderr
    assert json.loads(r.stdout) == {"ok": False, "error": f"{tmp_path / 'nope.tar'}: no such bundle file"}


def test_the_older_rollout_name_works_but_is_not_listed():
    r = run_cli("fleet", "--help")
    assert r.returncode == 0 and "rollout" not in r.stdout, r.stdout
    r = run_cli("fleet", "rollout", "--help")
    assert r.returncode == 0 and "the same as 'edgefleet rollout create'" in " ".join(r.stdout.split())


def test_the_demo_does_not_import_the_command_line():
    """edgefleet/cli.py runs the demo; the demo must not import it back (the import circle)."""
    for path in (ROOT / "edgefleet").glob("*.py"):
        if path.name in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "edgefleet.cli" or n.startswith("edgefleet.cli.") for n in names), path


def test_every_command_exits_through_the_one_command_path():
    """Every (sub)command's handler is command()'s wrapper (edgefleet/cli/command.py), none a closing of its own:
    the rollout commands and simulate had theirs before the CLI became a package."""
    import argparse

    from edgefleet.cli import build_parser
    from edgefleet.cli.command import command

    closing = command()(lambda a: 0).__code__  # the one closing every handler runs

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, (*path, name))

    handlers = {" ".join(path): parser.get_default("fn") for path, parser in walk(build_parser())
                if not any(isinstance(x, argparse._SubParsersAction) and x.required for x in parser._actions)}
    assert {"compile", "fleet serve", "rollout create", "rollout pause", "simulate", "demo"} <= set(handlers)
    elsewhere = sorted(p for p, fn in handlers.items() if getattr(fn, "__code__", None) is not closing)
    assert not elsewhere, elsewhere
