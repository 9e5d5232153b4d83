"""The exit codes of every ``edgefleet`` command (``MEANING`` below, the one table: ``edgefleet --help`` prints
it), and the one rule that maps an error to its code (``exit_for``).

It lives in ``protocol`` because it is a contract (between the tool and the CI scripts that branch on its codes)
that the compiler's errors, the fleet client's errors and the command line all name: ``protocol`` is the one floor
every part may import, so an error class carries its code (``exit_code = ExitCode.TOOLCHAIN``) without its
package importing the command line (``edgefleet.cli``, the top floor).
"""

from __future__ import annotations

from enum import IntEnum

from .errors import EdgefleetError

__all__ = ["MEANING", "ExitCode", "exit_for", "table"]


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2
    GATE = 3
    INPUT = 4
    TOOLCHAIN = 5
    FLEET = 6
    ROLLOUT = 7


MEANING = {  # stable: a code never changes its meaning
    ExitCode.OK: "success",
    ExitCode.INTERNAL: "unexpected internal error (a bug: please report it with the traceback)",
    ExitCode.USAGE: "usage error (bad flags)",
    ExitCode.GATE: "the accuracy gate refused the model, or this CPU computes other answers than were gated",
    ExitCode.INPUT: "bad input or configuration (model, data set, profile, config file, keys, a path or a port)",
    ExitCode.TOOLCHAIN: "a build toolchain is missing or failed",
    ExitCode.FLEET: "the fleet server is unreachable or answered with an error",
    ExitCode.ROLLOUT: "a rollout finished with failed devices, or did not finish in time",
}


def table() -> str:
    """The exit codes as a help page prints them."""
    return "Exit codes (stable, for CI):\n" + "\n".join(f"  {int(c)}  {MEANING[c]}" for c in ExitCode)


def exit_for(exc: BaseException) -> tuple[ExitCode, str]:
    """The exit code and the one-line message for an error that ends a command.

    An error that names its code (an ``exit_code`` attribute: the compiler's tree, the fleet client's) gets that
    code; any other error edgefleet raises on purpose is bad input or configuration (4), and so is an ``OSError``
    (a file, folder or port the operator named); anything else is a bug (1), whose traceback the caller keeps.
    """
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool) and code in ExitCode._value2member_map_:
        found = ExitCode(code)
    elif isinstance(exc, (EdgefleetError, OSError)):
        found = ExitCode.INPUT
    else:
        found = ExitCode.INTERNAL
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line, as said
    return found, text or type(exc).__name__
