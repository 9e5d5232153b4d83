"""The edgefleet compiler: ONNX model + hardware profile -> quantized, benchmarked, gated bundle.

Importing this package imports no heavy toolchain; each build target loads its own lazily.
"""

if __name__ != "edgefleet.compiler":  # the folder compiler/ is installed as edgefleet.compiler (pyproject.toml)
    raise ImportError(f"import edgefleet.compiler, not {__name__}: edgefleet installs one top-level name")

from edgefleet.compiler.errors import AccuracyGateFailed, CompilerError, InputError, ToolchainError

__all__ = ["AccuracyGateFailed", "CompilerError", "InputError", "ToolchainError"]
