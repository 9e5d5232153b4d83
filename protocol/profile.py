"""Hardware profiles: one YAML per target in ``hw-profiles/``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from protocol._strict import StrictModel, parse_document
from protocol.errors import SchemaError
from protocol.manifest import Backend, Precision

__all__ = ["HardwareProfile", "load_profile", "profile_dir", "resolve_profile_path"]

PROFILE_VERSION = 1


class QuantizationSettings(StrictModel):
    method: Literal["static", "none"] = "static"
    format: Literal["qdq"] = "qdq"
    per_channel: bool = True
    calibration_method: Literal["minmax", "entropy", "percentile"] = "minmax"
    max_calibration_samples: int = Field(default=512, gt=0)


class AccuracySettings(StrictModel):
    max_drop: float = Field(default=0.01, ge=0.0, le=1.0)  # absolute top-1 drop allowed


class BenchmarkSettings(StrictModel):
    batch_sizes: tuple[int, ...] = (1, 16)
    iterations: int = Field(default=30, gt=0)
    warmup: int = Field(default=5, ge=0)


class RuntimeSettings(StrictModel):
    intra_op_threads: int = Field(default=2, gt=0)
    max_batch_size: int = Field(default=16, gt=0)


class TensorRTSettings(StrictModel):
    workspace_mb: int = Field(default=1024, gt=0)
    dla_core: int | None = None


class HardwareProfile(StrictModel):
    profile_version: int
    name: str
    description: str
    arch: Literal["x86_64", "aarch64"]
    accelerator: Literal["cpu", "gpu"]
    backend: Backend
    precisions: tuple[Precision, ...] = Field(min_length=1)
    default_precision: Precision
    cpu_features: tuple[str, ...] = ()
    quantization: QuantizationSettings = QuantizationSettings()
    accuracy: AccuracySettings = AccuracySettings()
    benchmark: BenchmarkSettings = BenchmarkSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    tensorrt: TensorRTSettings | None = None

    @model_validator(mode="after")
    def _consistent(self) -> HardwareProfile:
        if self.default_precision not in self.precisions:
            raise ValueError(f"default_precision {self.default_precision!r} is not in precisions")
        if self.backend == "tensorrt" and self.accelerator != "gpu":
            raise ValueError("backend 'tensorrt' needs accelerator 'gpu'")
        if "fp16" in self.precisions and self.accelerator == "cpu":
            raise ValueError("fp16 is for GPU targets; CPU profiles use int8 or fp32")
        return self


def profile_dir() -> Path:
    """The ``hw-profiles`` folder: beside the packages in a checkout, else the installed copy."""
    import sys

    here = Path(__file__).resolve().parent.parent / "hw-profiles"
    if here.is_dir():
        return here
    return Path(sys.prefix) / "share" / "edgefleet" / "hw-profiles"


def resolve_profile_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return profile_dir() / f"{name_or_path}.yaml"


def load_profile(name_or_path: str) -> HardwareProfile:
    path = resolve_profile_path(name_or_path)
    if not path.exists():
        known = sorted(q.stem for q in profile_dir().glob("*.yaml"))
        raise SchemaError(str(path), [f"no such profile; known profiles: {', '.join(known)}"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SchemaError(str(path), [f"not valid YAML: {exc}"]) from exc
    if isinstance(data, dict):
        pv = data.get("profile_version")
        if isinstance(pv, int) and pv > PROFILE_VERSION:
            raise SchemaError(str(path), [f"profile_version {pv} is newer than this edgefleet understands "
                                          f"({PROFILE_VERSION})"])
    prof = parse_document(HardwareProfile, data, str(path))
    if prof.name != path.stem:
        raise SchemaError(str(path), [f"key 'name': {prof.name!r} must match the file name {path.stem!r}"])
    return prof
