"""Compiler errors.

    CompilerError
    ├── InputError          the model, data set or flags handed to the compiler are wrong (exit 4)
    ├── ToolchainError      a build toolchain is missing or failed (exit 5)
    └── AccuracyGateFailed  the quantized model lost more accuracy than allowed (exit 3)

Errors from onnx / onnxruntime are translated at the boundary and re-raised ``from exc``.
"""

from __future__ import annotations

from edgefleet.protocol.errors import EdgefleetError

__all__ = ["AccuracyGateFailed", "CompilerError", "InputError", "ToolchainError"]


class CompilerError(EdgefleetError):
    exit_code = 1


class InputError(CompilerError):
    exit_code = 4


class ToolchainError(CompilerError):
    exit_code = 5


class AccuracyGateFailed(CompilerError):
    exit_code = 3
