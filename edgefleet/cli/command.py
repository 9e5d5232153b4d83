"""The one opening and closing of every ``edgefleet`` command (``command``), and what the command groups share:
the help formatter, the fleet's URL and token options, printing an answer.

An error a command raises ends it with one line on stderr and its exit code, from the one table
(protocol/exits.py, printed by ``edgefleet --help``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgefleet.protocol.errors import ConfigError, EdgefleetError
from edgefleet.protocol.exits import ExitCode, exit_for

__all__ = ["EXTRAS", "ApiCommand", "Command", "Formatter", "UsageError", "api_command", "bundle_file", "command",
           "fleet_options", "need", "print_answer", "require", "show", "unit_written"]

Command = Callable[[argparse.Namespace], int]
ApiCommand = Callable[[argparse.Namespace, Any], tuple[Any, str, int]]  # (args, FleetClient) -> (answer, text, exit)


class UsageError(Exception):
    """Flags that parse but do not make sense together (exit 2)."""

    exit_code = ExitCode.USAGE


def need(extra: str, exc: ImportError) -> int:
    print(f"error: this command needs edgefleet[{extra}] ({exc.name} is not installed): "
          f"pip install 'edgefleet[{extra}]'", file=sys.stderr)
    return ExitCode.INPUT


EXTRAS = {  # what each part imports lazily; checked up front so a missing one is a message, not a traceback
    # (the runtimes are not here: a box has the one its profile uses, and loading a bundle names a missing one)
    "agent": ("paho.mqtt", "starlette", "uvicorn", "tuf", "cryptography", "psutil"),
    "compiler": ("onnx", "onnxruntime.quantization", "tuf", "cryptography"),
    "fleet": ("fastapi", "uvicorn", "sqlalchemy", "paho.mqtt", "tuf", "cryptography"),
    "broker": ("amqtt",),  # the fleet's embedded broker
    "keys": ("tuf", "cryptography"),  # in both [compiler] and [fleet]
    "demo": ("httpx",),  # the demo's load client
}


def require(*extras: str) -> None:
    import importlib.util

    for extra in extras:
        for mod in EXTRAS[extra]:
            try:
                found = importlib.util.find_spec(mod) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                raise ImportError(f"No module named {mod!r}", name=mod)


def command(*extras: str, advise: str | None = None, imports: tuple[str, ...] = (),
            json_error: Callable[[argparse.Namespace, str, ExitCode], dict[str, Any]] | None = None
            ) -> Callable[[Command], Command]:
    """A command's one opening and closing.

    Opening: the ``extras`` it needs are installed and its heavy ``imports`` import (else one line naming the
    extra to install: ``advise``, default the first extra; exit 4). Closing: an error the body raises is one line on
    stderr and its code (``exit_for``), with ``json_error``'s document on stdout under ``--json``; a bug (exit 1,
    not an error edgefleet raises on purpose) keeps its traceback.
    """

    def wrap(fn: Command) -> Command:
        @functools.wraps(fn)
        def run(a: argparse.Namespace) -> int:
            try:
                require(*extras)
                for mod in imports:
                    importlib.import_module(mod)
            except ImportError as exc:
                return need(advise or (extras[0] if extras else "all"), exc)
            try:
                return int(fn(a))
            except Exception as exc:
                code, line = exit_for(exc)
                if code is ExitCode.INTERNAL and not isinstance(exc, EdgefleetError):
                    raise
                print(f"error: {line}", file=sys.stderr)
                if json_error is not None and getattr(a, "json", False):
                    print(json.dumps(json_error(a, line, code)))
                return code

        return run

    return wrap


def bundle_file(path: Path) -> Path:
    if not path.is_file():
        raise ConfigError(f"{path}: no such bundle file")
    return path


def show(doc: Any, as_json: bool, human: str) -> None:
    print(json.dumps(doc, indent=2) if as_json else human)


def print_answer(answer: Any, as_json: bool, human: str) -> None:
    """A typed answer of the fleet: ``--json`` prints it as the fleet sent it."""
    from pydantic import TypeAdapter

    show(TypeAdapter(Any).dump_python(answer, mode="json", exclude_unset=True), as_json, human)


def unit_written(unit: str, a: argparse.Namespace, install: Callable[[str, Path], Path], service: str) -> int:
    """An install-service command's end: its systemd unit printed (``--dry-run``) or written into ``--unit-dir``,
    and how to enable it (it never runs systemctl)."""
    if a.dry_run:
        print(unit, end="")
        return ExitCode.OK
    path = install(unit, a.unit_dir)
    print(f"wrote {path}\nnext: systemctl daemon-reload && systemctl enable --now {service}")
    return ExitCode.OK


def fleet_options(p: argparse.ArgumentParser) -> None:
    """The fleet's URL and API token, the same in every command that talks to a fleet's API."""
    p.add_argument("--fleet", default=os.environ.get("EDGEFLEET_URL", "http://127.0.0.1:8700"),
                   help="fleet server URL (default: $EDGEFLEET_URL, else http://127.0.0.1:8700)")
    p.add_argument("--token", help="API token (default: $EDGEFLEET_TOKEN)")


def api_command(p: argparse.ArgumentParser, fn: ApiCommand) -> argparse.ArgumentParser:
    """``p`` as a command that talks to the fleet's API: the fleet's URL and token, ``--json`` and ``--timeout-s``;
    ``fn`` is called with a ``FleetClient`` through the one ``command`` path (a failed call: one line on stderr and
    its exit code, 6 for the fleet's refusal or silence) and its answer printed (``--json``: as the fleet sent it)."""

    @command()
    def run(a: argparse.Namespace) -> int:
        from edgefleet.fleet.client import FleetClient

        answer, human, code = fn(a, FleetClient(a.fleet, a.timeout_s, a.token))
        print_answer(answer, a.json, human)
        return code

    fleet_options(p)
    p.add_argument("--json", action="store_true", help="print the fleet's answer as JSON")
    p.add_argument("--timeout-s", type=float, default=30.0, help="HTTP timeout")
    p.set_defaults(fn=run)
    return p


def _shown(value: Any) -> str:
    """A default as an operator would type it (a list as its comma list), %-escaped for argparse."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, bool):
        value = "on" if value else "off"
    return str(value).replace("%", "%%")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default stated once, and only where it says something: not for an
    option whose help already states it (or what its absence means), a flag, or a default of nothing."""

    settings: dict[str, tuple[str, str | None]] = {}  # flags a config file can set too (the agent's)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.dest in self.settings:
            return text + self._setting(*self.settings[action.dest], action.dest)
        default = action.default
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or default in ([], ()) or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        return f"{text} (default: {_shown(default)})"

    @staticmethod
    def _setting(key: str, none_means: str | None, dest: str) -> str:
        from edgefleet.agent.config import AgentConfig  # at --help only; pydantic and PyYAML are base dependencies

        field = AgentConfig.model_fields[key]
        named = "" if key == dest else f" (key {key} in --config)"
        if field.is_required():
            return f"{named} (required: here or in --config)"
        value = field.get_default(call_default_factory=True)
        return f"{named} (default: from --config, else {(none_means or 'none') if value is None else _shown(value)})"
