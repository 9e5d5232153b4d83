"""Run ``edgefleet`` as a device would, dying like a power cut (os._exit, no clean-up) when the model store
reaches one step of an install: extracted, moved, before_commit, after_commit.

The shipped agent has no such hook: this launcher, used only by tests (``LocalFleet.start_agent(launcher=...)``),
wraps the store's own step callback before the CLI runs.

usage: python tests/crash_at.py POINT PYTHON -m edgefleet.cli ARGS...
"""

from __future__ import annotations

import os
import sys

EXIT_CODE = 137  # what a SIGKILL'd process reports


def main() -> None:
    point, argv = sys.argv[1], sys.argv[2:]
    if argv[1:3] != ["-m", "edgefleet.cli"]:
        raise SystemExit(f"crash_at: expected PYTHON -m edgefleet.cli ARGS, got {argv[:3]}")
    from edgefleet.agent.install import store

    init = store.ModelStore.__init__

    def crashing_init(self, root, fault=None):
        def crash(at: str) -> None:
            if fault is not None:
                fault(at)
            if at == point:
                print(f"crash_at: dying at {point}", file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)

        init(self, root, fault=crash)

    store.ModelStore.__init__ = crashing_init  # type: ignore[method-assign]
    from edgefleet.cli import main as cli

    sys.exit(cli(argv[3:]))


if __name__ == "__main__":
    main()
