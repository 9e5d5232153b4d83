"""The edgefleet compiler: ONNX model + hardware profile -> quantized, benchmarked, gated bundle.

Importing this package imports no heavy toolchain; each build target loads its own lazily.
"""

from .errors import AccuracyGateFailed, CompilerError, InputError, ToolchainError

__all__ = ["AccuracyGateFailed", "CompilerError", "InputError", "ToolchainError"]
