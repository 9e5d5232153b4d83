"""The build-target interface."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from compiler.data import Dataset
from compiler.graph import GraphInfo
from protocol.manifest import QuantizationInfo
from protocol.profile import HardwareProfile

__all__ = ["BuildTarget", "Runner"]

# feeds a batch {input name: array} and returns the outputs in the manifest's output order
Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


class BuildTarget(Protocol):
    backend: str
    engine_suffix: str

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> QuantizationInfo | None:
        """Write the engine for ``precision`` to ``out_path``; for INT8, say how it was quantized."""

    def runner(self, engine: Path, profile: HardwareProfile, output_names: Sequence[str] | None = None) -> Runner:
        """Load an engine built by this target and return a callable that runs it; its results come in
        the order of ``output_names`` (the source model's outputs) when given."""

    def toolchain_versions(self) -> dict[str, str]:
        """Versions of the tools that made the engine, for the manifest."""

    def engine_compatibility(self) -> dict[str, str]:
        """What a device needs for this engine beyond the profile's CPU features (manifest field
        ``engine_compatibility``): e.g. TensorRT version, GPU compute capability, JetPack. ``{}`` if nothing."""
