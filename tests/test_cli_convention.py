"""One convention for the fleet's URL and token across the CLI: ``--fleet`` / ``$EDGEFLEET_URL`` and ``--token`` /
``$EDGEFLEET_TOKEN``, a flag over the environment, for every command that talks to a fleet's API."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.fleet_harness import api, running_fleet
from tests.test_compiler import run_cli

URL, TOKEN = "http://fleet.example:8700", "t0ken-from-env"
# commands with a --fleet of another meaning, and why
OTHER_MEANING = {
    ("agent",): "a device's fleet comes from its --config file or --fleet; it holds no operator token",
}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every (sub)command of the CLI with its parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))
    yield path, parser


def _minimal_argv(path: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    """The command with a placeholder for each required argument."""
    argv = list(path)
    for action in parser._actions:
        if action.option_strings and action.required:
            argv += [action.option_strings[0], "1"]
        elif not action.option_strings and not isinstance(action, argparse._SubParsersAction) \
                and action.nargs not in ("?", "*"):
            argv.append("1")
    return argv


def test_every_command_that_talks_to_a_fleet_takes_the_url_and_token_alike(monkeypatch):
    from edgefleet.cli import build_parser
    from edgefleet.fleet.client import FleetClient

    monkeypatch.setenv("EDGEFLEET_URL", URL)
    monkeypatch.setenv("EDGEFLEET_TOKEN", TOKEN)
    checked = []
    for path, parser in _commands(build_parser()):
        options = {o for a in parser._actions for o in a.option_strings}
        if "--fleet" not in options or path in OTHER_MEANING:
            continue
        assert "--token" in options, f"'edgefleet {' '.join(path)}' takes --fleet but no --token"
        argv = _minimal_argv(path, parser)
        if path == ("simulate",):  # simulate enrolls devices only when asked to (--fleet), never by default
            assert build_parser().parse_args(argv).fleet is None
            argv += ["--fleet", URL]
        a = build_parser().parse_args(argv)
        assert a.fleet == URL, f"'edgefleet {' '.join(path)}' ignores $EDGEFLEET_URL"
        # the token the command's client sends (every command goes through FleetClient)
        assert FleetClient(a.fleet, token=a.token).token == TOKEN, f"'{' '.join(path)}' ignores $EDGEFLEET_TOKEN"
        a = build_parser().parse_args([*argv, "--fleet", "http://other:1", "--token", "flag"])
        assert (a.fleet, FleetClient(a.fleet, token=a.token).token) == ("http://other:1", "flag"), path  # flags win
        checked.append(" ".join(path))
    # the fleet's client commands, the rollout commands and the simulator are all among them
    assert {"fleet upload", "fleet devices", "fleet enroll", "fleet rollout", "rollout create", "rollout status",
            "simulate"} <= set(checked), checked


def test_fleet_upload_and_devices_read_the_url_and_token_from_the_environment(tmp_path, mosquitto, digits_bundle,
                                                                               monkeypatch):
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        monkeypatch.setenv("EDGEFLEET_URL", url)
        monkeypatch.setenv("EDGEFLEET_TOKEN", "not-a-token")
        r = run_cli("fleet", "devices")
        assert r.returncode == 6 and "401" in r.stderr, r.stderr  # it asked this fleet, with that token
        r = run_cli("fleet", "upload", str(digits_bundle), "--token", api.token, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["target"] == "digits/1.0.0/x86-cpu.tar"
        monkeypatch.setenv("EDGEFLEET_TOKEN", api.token)
        r = run_cli("fleet", "models", "--json")
        assert r.returncode == 0 and [m["version"] for m in json.loads(r.stdout)] == ["1.0.0"], r.stderr


@pytest.mark.parametrize("argv", [["fleet", "devices"], ["rollout", "list"]])
def test_the_fleet_from_the_environment_is_the_one_asked(argv, monkeypatch):
    """No flag: the URL in $EDGEFLEET_URL is the one asked, and named when it does not answer."""
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("EDGEFLEET_URL", url)
    monkeypatch.delenv("EDGEFLEET_TOKEN", raising=False)
    r = run_cli(*argv)
    assert r.returncode == 6 and f"cannot reach the fleet at {url}" in r.stderr, r.stderr
