"""Judge errors.

    JudgeError
    └── InputError   the data set, the outputs or the task handed to the judge are wrong (exit 4)

The compiler's own ``InputError`` (``edgefleet.compiler.errors``) is also a judge ``InputError``, so a caller that
catches this one catches a bad input whichever side found it; ``edgefleet verify`` translates these to the agent's
``ConfigError`` at its boundary.
"""

from __future__ import annotations

from ..protocol.errors import EdgefleetError
from ..protocol.exits import ExitCode

__all__ = ["InputError", "JudgeError"]


class JudgeError(EdgefleetError):
    exit_code = ExitCode.INTERNAL


class InputError(JudgeError):
    exit_code = ExitCode.INPUT
