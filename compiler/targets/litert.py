"""LiteRT (TFLite) target for ARM64 CPUs. Building goes through onnx2tf in its own toolchain
environment (it pins old numpy/onnx); that environment is not set up by this release, so the
target refuses with a clear message rather than pretending to build."""

from __future__ import annotations

from pathlib import Path

from compiler.data import Dataset
from compiler.errors import ToolchainError
from compiler.graph import GraphInfo
from compiler.targets.base import Runner
from protocol.profile import HardwareProfile

__all__ = ["LiteRTTarget"]


class LiteRTTarget:
    backend = "litert"
    engine_suffix = ".tflite"

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> None:
        raise ToolchainError("the LiteRT build target (onnx2tf toolchain environment) is not available in this "
                             "release; compile for x86-cpu or x86-cpu-vnni instead")

    def runner(self, engine: Path, profile: HardwareProfile) -> Runner:
        raise ToolchainError("the LiteRT build target is not available in this release")

    def toolchain_versions(self) -> dict[str, str]:
        return {}

    def engine_compatibility(self) -> dict[str, str]:
        return {}
