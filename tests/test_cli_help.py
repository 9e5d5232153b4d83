"""Every command's ``--help``, as an operator reads it: it exits 0, and each option states its default at most
once and truly (never "(default: None)"; a setting the agent's --config file can also give says so, with the
agent's own default)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from edgefleet.cli import build_parser, main

DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every (sub)command of the CLI, hidden aliases included."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(build_parser()))


def _entries(help_text: str) -> dict[str, str]:
    """Option and argument entries of a help page: invocation -> its whole (re-joined) help text."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        if re.match(r"^  \S", line):  # an entry starts at the section's indent
            current = line.strip().split("  ")[0]
            entries[current] = line.strip()
        elif line.startswith("   ") and current is not None:  # its help, wrapped
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def _help(path: tuple[str, ...], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0, f"'edgefleet {' '.join(path)} --help' exited {done.value.code}"
    return out


def test_the_walk_sees_every_command_group():
    names = {" ".join(p) for p in COMMANDS}
    assert {"", "compile", "agent", "agent install-service", "fleet serve", "rollout create", "keys rotate",
            "toolchain status", "simulate", "demo"} <= names, names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "edgefleet")
def test_help_exits_0_and_states_each_default_once(path, capsys):
    out = _help(path, capsys)
    assert "usage: edgefleet" in out
    assert "default: None" not in out and "(default: False)" not in out, out
    for entry, text in _entries(out).items():
        assert len(DEFAULT.findall(text)) <= 1, f"'edgefleet {' '.join(path)}' {entry}: default stated twice: {text}"


def test_agent_options_a_config_file_can_set_name_the_file_and_the_agents_own_default(capsys):
    from edgefleet.agent.config import AgentConfig

    entries = _entries(_help(("agent",), capsys))
    host = AgentConfig.model_fields["http_host"].default
    assert entries["--http-host HTTP_HOST"].endswith(f"(default: from --config, else {host})"), entries
    for flag, key in (("--http-port HTTP_PORT", "http_port"), ("--max-batch-size MAX_BATCH_SIZE", "max_batch_size"),
                      ("--threads THREADS", "intra_op_threads"), ("--instances INSTANCES", "instances")):
        default = AgentConfig.model_fields[key].default
        assert f"(default: from --config, else {default})" in entries[flag], entries[flag]
    assert "(required: here or in --config)" in entries["--device-id DEVICE_ID"]
    # one without a value in the config: what none means, said once
    assert entries["--grpc-port GRPC_PORT"].endswith("(default: from --config, else off)"), entries


def test_the_help_a_shell_prints_is_the_same():
    """The real entry point, as a shell runs it."""
    r = subprocess.run([sys.executable, "-m", "edgefleet", "agent", "--help"], capture_output=True, text=True,
                       timeout=120)
    words = " ".join(r.stdout.split())  # as wrapped for the terminal's width
    assert r.returncode == 0 and "(default: from --config, else 127.0.0.1)" in words, r.stdout + r.stderr
    assert "default: None" not in words
