"""Build targets: one module per runtime, each implementing :class:`compiler.targets.base.BuildTarget` (building
only; the engines it builds run through :mod:`engines`)."""

from __future__ import annotations

from edgefleet.compiler.errors import ToolchainError
from edgefleet.compiler.targets.base import BuildTarget

__all__ = ["BuildTarget", "get_target"]


def get_target(backend: str) -> BuildTarget:
    if backend == "onnxruntime":
        from edgefleet.compiler.targets.onnxruntime import OnnxRuntimeTarget

        return OnnxRuntimeTarget()
    if backend == "tensorrt":
        from edgefleet.compiler.targets.tensorrt import TensorRTTarget

        return TensorRTTarget()
    if backend == "litert":
        from edgefleet.compiler.targets.litert import LiteRTTarget

        return LiteRTTarget()
    raise ToolchainError(f"no build target for backend {backend!r}")
