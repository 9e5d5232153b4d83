"""TensorRT target (Jetson GPUs). Not built yet: TensorRT cannot be installed on the CI machines,
and the builder plus its test against a fake ``tensorrt`` module are tracked as their own issue.
This module says so plainly instead of pretending to build."""

from __future__ import annotations

from pathlib import Path

from compiler.data import Dataset
from compiler.errors import ToolchainError
from compiler.graph import GraphInfo
from compiler.targets.base import Runner
from protocol.profile import HardwareProfile

__all__ = ["TensorRTTarget"]


class TensorRTTarget:
    backend = "tensorrt"
    engine_suffix = ".engine"

    def _unavailable(self) -> ToolchainError:
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            return ToolchainError("the TensorRT toolchain is not installed here (import tensorrt failed); "
                                  "TensorRT engines must be built on a machine with JetPack/TensorRT")
        return ToolchainError("the TensorRT build target is not implemented in this release of edgefleet")

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> None:
        raise self._unavailable()

    def runner(self, engine: Path, profile: HardwareProfile) -> Runner:
        raise self._unavailable()

    def toolchain_versions(self) -> dict[str, str]:
        return {}

    def engine_compatibility(self) -> dict[str, str]:
        return {}
