"""Compiler errors.

    CompilerError
    ├── InputError          the model, data set or flags handed to the compiler are wrong (exit 4); also a
    │                       judge InputError (edgefleet.judge.errors), so one except clause catches a bad input
    │                       whether the compiler or the judge it gates with found it
    ├── ToolchainError      a build toolchain is missing or failed (exit 5)
    └── AccuracyGateFailed  the quantized model lost more accuracy than allowed (exit 3)

Errors from onnx / onnxruntime are translated at the boundary and re-raised ``from exc``. Each class carries its
exit code from the one table, ``protocol/exits.py``.
"""

from __future__ import annotations

from ..judge.errors import InputError as JudgeInputError
from ..protocol.errors import EdgefleetError
from ..protocol.exits import ExitCode

__all__ = ["AccuracyGateFailed", "CompilerError", "InputError", "ToolchainError"]


class CompilerError(EdgefleetError):
    exit_code = ExitCode.INTERNAL


class InputError(CompilerError, JudgeInputError):
    exit_code = ExitCode.INPUT


class ToolchainError(CompilerError):
    exit_code = ExitCode.TOOLCHAIN


class AccuracyGateFailed(CompilerError):
    exit_code = ExitCode.GATE
