"""``edgefleet``: one command line for the compiler, the fleet, the agent and the demo, a module per command group
(compile, verify, toolchain, keys, fleet, agent, demo, simulate, rollout, windows).

Every command opens and closes the same way (``command`` in command.py): the extras it needs are checked first, and
an error it raises ends it with one line on stderr and its exit code, from the one table (protocol/exits.py, printed
by ``edgefleet --help``).
"""

from __future__ import annotations

import argparse

from edgefleet.cli import agent, demo, fleet, keys, rollout, simulate, toolchain, verify, windows
from edgefleet.cli import compile as compiling  # the module, not the builtin
from edgefleet.cli.command import Formatter
from edgefleet.protocol.exits import table

__all__ = ["build_parser", "main"]

GROUPS = (compiling, verify, toolchain, keys, fleet, agent, demo, simulate, rollout, windows)  # the help's order


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgefleet", formatter_class=Formatter, description=(
        "edgefleet: compile models into signed bundles, roll them out to edge devices over MQTT, and serve\n"
        "them on each device with dynamic batching.\n\n"
        "  edgefleet demo                       the whole loop on this machine, in one command\n"
        "  edgefleet compile MODEL --profile P  build a quantized, gated, benchmarked bundle\n"
        "  edgefleet compile-pipeline P.yaml    build a detector + reader pipeline as one bundle\n"
        "  edgefleet keys init DIR              make the TUF signing keys\n"
        "  edgefleet fleet serve ...            run the fleet server (REST, console, TUF repo, MQTT)\n"
        "  edgefleet agent ...                  run the device daemon"), epilog=table())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130
