"""Hardware profiles: one YAML per target in ``hw-profiles/``."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator

from ._strict import StrictModel, parse_document
from .cpu import BF16_FEATURES, KNOWN_FEATURES, VNNI_FEATURES
from .errors import SchemaError
from .manifest import Backend, Int8Scheme, Precision

__all__ = ["HardwareProfile", "list_profiles", "load_profile", "profile_dir", "resolve_fallback_path",
           "resolve_profile_path"]

PROFILE_VERSION = 1
MAX_PROFILE_BYTES = 256 * 1024  # a profile is a page of YAML
PROFILE_NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,63}$"  # a file name in hw-profiles/, as the fleet's API accepts it


class QuantizationSettings(StrictModel):
    method: Literal["static", "none"] = "static"
    format: Literal["qdq"] = "qdq"
    # how INT8 is laid out; "auto" derives it from cpu_features (see HardwareProfile.int8_scheme):
    #   u8s8          uint8 activations, int8 weights, full range: exact only with VNNI on x86
    #   u8s8_reduced  the same with 7-bit weights: the 16-bit pairwise sums of AVX2 cannot saturate
    #   u8u8          uint8 weights as well: exact everywhere, slower GEMM kernels on AVX2
    #   s8s8          int8 activations and weights (TFLite, TensorRT); on x86 onnxruntime as u8s8
    scheme: Literal["auto"] | Int8Scheme = "auto"
    per_channel: bool = True
    calibration_method: Literal["minmax", "entropy", "percentile"] = "minmax"
    max_calibration_samples: int = Field(default=512, gt=0)


class AccuracySettings(StrictModel):
    max_drop: float = Field(default=0.01, ge=0.0, le=1.0)  # absolute top-1 drop allowed
    min_agreement: float = Field(default=0.99, ge=0.0, le=1.0)  # per output vs fp32, when there are no labels


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
    # another profile (a CPU one of the same arch) whose bundle this profile's devices can run: built instead
    # when the build host lacks this profile's toolchain, and rolled out to its devices when a model version
    # has no bundle of their own profile. Checked against that profile when loaded (load_profile).
    cpu_fallback: str | None = Field(default=None, pattern=PROFILE_NAME_RE)

    @field_validator("cpu_features")
    @classmethod
    def _known_features(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for f in v:
            if f not in KNOWN_FEATURES:
                near = difflib.get_close_matches(f, sorted(KNOWN_FEATURES), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(f"unknown CPU feature {f!r}{hint}; known: {', '.join(sorted(KNOWN_FEATURES))}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> HardwareProfile:
        if self.quantization.scheme in ("u8s8", "s8s8") and self._saturates_full_range():
            raise ValueError(
                f"quantization.scheme {self.quantization.scheme!r} (full-range int8 weights) saturates the 16-bit "
                f"sums of AVX2 kernels on CPUs without VNNI, and this profile promises only {list(self.cpu_features)}; "
                "use 'auto', 'u8s8_reduced' or 'u8u8', or add avx512_vnni to cpu_features")
        if self.default_precision not in self.precisions:
            raise ValueError(f"default_precision {self.default_precision!r} is not in precisions")
        if self.backend == "tensorrt" and self.accelerator != "gpu":
            raise ValueError("backend 'tensorrt' needs accelerator 'gpu'")
        if "fp16" in self.precisions and self.accelerator == "cpu":
            raise ValueError("fp16 is for GPU targets; CPU profiles use int8 or fp32 (bf16 where they promise it)")
        if "bf16" in self.precisions:
            self._check_bf16()
        if self.cpu_fallback is not None and self.cpu_fallback == self.name:
            raise ValueError(f"cpu_fallback {self.cpu_fallback!r} names this profile itself; name another, CPU "
                             "profile of the same arch")
        return self

    def _check_bf16(self) -> None:
        """bf16 is allowed only where every CPU the profile admits computes it natively: an x86 CPU profile that
        promises avx512_bf16 or amx_bf16 (a profile admits every CPU with at least its features, so one that
        does not promise them admits CPUs where a bf16 engine cannot run), served by OpenVINO on onnxruntime's
        ONNX files."""
        if self.accelerator != "cpu" or self.arch != "x86_64" or self.backend != "onnxruntime":
            raise ValueError(f"bf16 is for x86_64 CPU profiles with backend onnxruntime (OpenVINO runs their ONNX "
                             f"files in bf16), not {self.arch} {self.accelerator} {self.backend}")
        if not set(self.cpu_features) & BF16_FEATURES:
            raise ValueError(f"bf16 needs CPUs with {' or '.join(sorted(BF16_FEATURES))}, and this profile promises "
                             f"only {list(self.cpu_features)}: a device it admits could not run a bf16 engine; add "
                             "avx512_bf16 to cpu_features (or use a profile that promises it, e.g. x86-cpu-bf16)")

    def _saturates_full_range(self) -> bool:
        """A profile admits every CPU with at least its features, so on x86 full-range u8s8 is safe
        only when VNNI is promised."""
        return self.arch == "x86_64" and not (set(self.cpu_features) & VNNI_FEATURES)

    def int8_scheme(self) -> tuple[Int8Scheme, str]:
        """The INT8 scheme for the weakest CPU this profile admits, and why."""
        if self.quantization.scheme != "auto":
            return self.quantization.scheme, f"set by the profile (quantization.scheme: {self.quantization.scheme})"
        if self._saturates_full_range():
            return "u8s8_reduced", (f"{self.name} admits x86 CPUs without VNNI (promises "
                                    f"{', '.join(self.cpu_features) or 'nothing'}): 7-bit weights keep the "
                                    "AVX2 kernels' 16-bit sums from saturating")
        if self.backend != "onnxruntime":
            return "s8s8", (f"{self.backend} quantizes symmetrically: int8 activations and int8 weights, "
                            "which its kernels sum in 32 bits")
        if self.arch != "x86_64":
            return "u8s8", f"{self.arch} kernels sum in 32 bits: full-range weights compute exactly"
        return "u8s8", (f"{self.name} promises {', '.join(sorted(set(self.cpu_features) & VNNI_FEATURES))}: "
                        "VNNI sums in 32 bits, so full-range weights compute exactly")


def list_profiles() -> list[str]:
    return sorted(q.stem for q in profile_dir().glob("*.yaml"))


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


def resolve_fallback_path(profile_path: Path, fallback: str) -> Path:
    """Where a profile's ``cpu_fallback`` is: beside the profile that names it, else in :func:`profile_dir`."""
    beside = profile_path.parent / f"{fallback}.yaml"
    return beside if beside.exists() else profile_dir() / f"{fallback}.yaml"


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name (``hw-profiles/NAME.yaml``) or path, checked, with its ``cpu_fallback`` checked too."""
    path = resolve_profile_path(name_or_path)
    prof = _load(path, name_or_path)
    if prof.cpu_fallback is not None:
        _check_fallback(prof, path)
    return prof


def _check_fallback(prof: HardwareProfile, path: Path) -> None:
    name = prof.cpu_fallback
    assert name is not None
    fb_path = resolve_fallback_path(path, name)
    if not fb_path.exists():
        known = sorted({q.stem for q in (*path.parent.glob("*.yaml"), *profile_dir().glob("*.yaml"))})
        near = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SchemaError(str(path), [f"key 'cpu_fallback': no profile {name!r}; {hint}known profiles: "
                                      f"{', '.join(known)}"])
    try:
        fb = _load(fb_path, name)
    except SchemaError as exc:
        raise SchemaError(str(path), [f"key 'cpu_fallback': profile {name!r} does not load: {exc}"]) from exc
    problems = []
    if fb.accelerator != "cpu":
        problems.append(f"{name} is a {fb.accelerator} profile (backend {fb.backend}); a fallback must be a CPU "
                        "profile (accelerator: cpu)")
    if fb.arch != prof.arch:
        problems.append(f"{name} is for {fb.arch} while {prof.name} devices are {prof.arch}")
    if fb.cpu_fallback is not None:
        problems.append(f"{name} names a cpu_fallback of its own ({fb.cpu_fallback}); a fallback is one step")
    if problems:
        raise SchemaError(str(path), [f"key 'cpu_fallback': {p}" for p in problems])


def _load(path: Path, name_or_path: str) -> HardwareProfile:
    if not path.exists():
        known = list_profiles()
        near = difflib.get_close_matches(name_or_path, known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SchemaError(str(path), [f"no such profile; {hint}known profiles: {', '.join(known)}"])
    raw = path.read_bytes()
    if len(raw) > MAX_PROFILE_BYTES:
        raise SchemaError(str(path), [f"{len(raw)} bytes exceeds the {MAX_PROFILE_BYTES}-byte limit of a profile"])
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SchemaError(str(path), [f"not valid YAML: {exc}"]) from exc
    except RecursionError as exc:  # PyYAML composes nested collections recursively
        raise SchemaError(str(path), ["nested too deeply"]) from exc
    if isinstance(data, dict):
        pv = data.get("profile_version")
        if isinstance(pv, int) and pv > PROFILE_VERSION:
            raise SchemaError(str(path), [f"profile_version {pv} is newer than this edgefleet understands "
                                          f"({PROFILE_VERSION})"])
    prof = parse_document(HardwareProfile, data, str(path))
    if prof.name != path.stem:
        raise SchemaError(str(path), [f"key 'name': {prof.name!r} must match the file name {path.stem!r}"])
    return prof
