"""The build-target interface: a target only *builds*; the built engine is run (gated, benchmarked, served)
through :func:`engines.load`, the same code the agent serves with."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from edgefleet.compiler.graph import GraphInfo
from edgefleet.judge.data import Dataset
from edgefleet.protocol.manifest import QuantizationInfo
from edgefleet.protocol.profile import HardwareProfile

__all__ = ["BuildTarget"]


class BuildTarget(Protocol):
    backend: str  # the engines registry's kind of what it builds
    engine_suffix: str

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> QuantizationInfo | None:
        """Write the engine for ``precision`` to ``out_path``; for INT8, say how it was quantized."""

    def toolchain_versions(self) -> dict[str, str]:
        """Versions of the tools that made the engine, for the manifest."""

    def engine_compatibility(self) -> dict[str, str]:
        """What a device needs for this engine beyond the profile's CPU features (manifest field
        ``engine_compatibility``): e.g. TensorRT version, GPU compute capability, JetPack. ``{}`` if nothing."""
