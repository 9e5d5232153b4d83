"""The build-target interface: a target only *builds*; the built engine is run (gated, benchmarked, served)
through :func:`engines.load`, the same code the agent serves with."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ...judge.data import Dataset
from ...protocol.manifest import Int8Scheme, QuantizationInfo
from ...protocol.profile import HardwareProfile
from ..graph import GraphInfo

__all__ = ["BuildTarget"]


class BuildTarget(Protocol):
    """What it builds (backend, file suffix, precisions) is its runtime's record (:class:`engines.base.Runtime`);
    what the pipeline must know of how it builds is here."""

    # int8 engines are ONNX QDQ graphs from onnxruntime's quantizer, so the source needs opset >= this (None: the
    # target quantizes otherwise), chosen layers can stay in float (the float fallback; a detector's box head), and
    # the build host's int8 kernels must compute what the devices' do (u8s8 saturates on AVX2 without VNNI)
    qdq_int8_min_opset: int | None
    # builds with the runtime that ran the fp32 reference: once fp32 ran, a failed quantized build is this model's
    # limit with the quantizer, not a broken toolchain
    builds_with_reference_runtime: bool
    # a float build fixes the dynamic dimensions other than the batch at the sizes of sample inputs (TensorRT)
    float_build_needs_samples: bool

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> QuantizationInfo | None:
        """Write the engine for ``precision`` to ``out_path``; for INT8, say how it was quantized."""

    def prepare_float(self, source: Path, out_path: Path) -> Path:
        """Targets whose int8 is ONNX QDQ (``qdq_int8_min_opset`` set): the float model their int8 build quantizes,
        written to ``out_path`` with every node named; the float fallback ranks and keeps layers by these names."""

    def build_int8_keeping_float(self, prepared: Path, profile: HardwareProfile, calibration: Dataset, out_path: Path,
                                 keep_float: tuple[str, ...], scheme: Int8Scheme | None = None) -> QuantizationInfo:
        """Targets whose int8 is ONNX QDQ: the int8 engine of a model from :meth:`prepare_float`, with
        the ``keep_float`` nodes left in float (the float fallback's builds); in ``scheme`` (one that
        :meth:`full_weight_scheme` named) instead of the profile's when given."""

    def full_weight_scheme(self, profile: HardwareProfile) -> Int8Scheme | None:
        """Targets whose int8 is ONNX QDQ: a scheme with 8-bit weights that computes the same outputs on every device
        the profile admits, where the profile's own scheme has fewer weight bits (a build that loses too much with
        them tries it); None where there is none."""

    def toolchain_versions(self) -> dict[str, str]:
        """Versions of the tools that made the engine, for the manifest."""

    def engine_compatibility(self) -> dict[str, str]:
        """What a device needs for this engine beyond the profile's CPU features (manifest field
        ``engine_compatibility``): e.g. TensorRT version, GPU compute capability, JetPack. ``{}`` if nothing."""
