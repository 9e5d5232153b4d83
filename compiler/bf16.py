"""bf16, a precision the compiler builds and gates like int8 (issue 35).

The bf16 engine is the fp32 build's ONNX file, tagged bf16 and run by OpenVINO with ``INFERENCE_PRECISION_HINT``
bf16 (engines/openvino.py): OpenVINO ran a MobileNetV2-like model 1.65-2.3x faster that way than onnxruntime
FP32 on a 2-core AVX-512 EPYC, with answers that differ (max abs 0.013, one top-1 in 16 flipped on near-tied
logits), so it ships only after the same task-level gate as int8, on the build host, as the devices would run it.

That needs a build host that runs bf16: an x86 CPU with avx512_bf16 or amx_bf16 (protocol.cpu.BF16_FEATURES)
and the runtime that runs the profile backend's bf16 files installed (the engine registry says which:
``engines.runtimes_for(backend, "bf16")``; OpenVINO today, edgefleet[openvino]) and able to run bf16 on this CPU
(its engine's ``cpu_runs``: OpenVINO's CPU plugin says BF16). Elsewhere :func:`host_cannot_run_bf16`
says why, and the pipeline refuses ``--precision bf16`` with that reason and leaves bf16 out of
``--precision auto`` (noted in the manifest's candidates). Only profiles that allow bf16 offer it
(protocol.profile: those promising a bf16 instruction set, e.g. x86-cpu-bf16).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ..protocol.cpu import BF16_FEATURES, bf16_feature, cpu_arch, cpu_features
from ..protocol.manifest import BF16_VERSION
from ..protocol.profile import HardwareProfile

__all__ = ["cache_key", "host_cannot_run_bf16", "manifest_version", "runtime", "toolchain_versions"]


def runtime(profile: HardwareProfile) -> str | None:
    """The runtime that runs (and so gates) ``profile``'s bf16 engines: the first the engine registry lists for its
    backend's files in bf16 (None: no runtime here runs them)."""
    from ..engines import runtimes_for

    return next(iter(runtimes_for(profile.backend, "bf16")), None)


def _versions(name: str) -> dict[str, str]:
    """The installed version of each distribution that provides runtime ``name`` (its record's modules)."""
    from ..engines import record

    out = {}
    for module in record(name).modules:
        try:
            out[module] = version(module)
        except PackageNotFoundError:
            continue
    return out


def host_cannot_run_bf16(profile: HardwareProfile, have: frozenset[str] | None = None) -> str | None:
    """Why this build host cannot build and gate ``profile``'s bf16 engine (None: it can). ``have``: this CPU's
    features (default: CPUID's). The phrase 'build host' in every reason makes the pipeline's refusal a toolchain
    error, not the input's."""
    if cpu_arch() != "x86_64":
        return f"the build host is {cpu_arch()}; bf16 engines are gated on an x86_64 CPU with avx512_bf16 or amx_bf16"
    have = cpu_features() if have is None else have
    if bf16_feature(have) is None:
        return (f"the build host's CPU has neither {' nor '.join(sorted(BF16_FEATURES))}, so it cannot run the bf16 "
                f"engine {profile.name} devices would run, and the gate would judge answers no device computes; "
                "build bf16 on a CPU with avx512_bf16 (AMD Zen 4, Intel Cooper Lake or Sapphire Rapids and newer)")
    from ..engines import EXTRAS, record, runtime_installed

    name = runtime(profile)
    if name is None:
        return f"no runtime runs {profile.backend} engines in bf16, so the build host cannot gate one"
    if not runtime_installed(name):
        return f"{name}, which runs bf16 engines, is not installed on the build host (install {EXTRAS[name]})"
    if not record(name).engine.cpu_runs("bf16"):
        return (f"{name} on the build host cannot run bf16 on its CPU although the CPU reports "
                f"{bf16_feature(have)}; it would run f32, so no bf16 engine can be gated here")
    return None


def manifest_version(version: int, precisions: list[str]) -> int:
    """The lowest manifest version that carries the bundle's precisions: at least :data:`BF16_VERSION` with bf16."""
    return max(version, BF16_VERSION) if "bf16" in precisions else version


def toolchain_versions(precisions: list[str], profile: HardwareProfile) -> dict[str, str]:
    """The bf16 runtime's version for the manifest's toolchain when a bf16 engine ships (it made the gated
    answers)."""
    name = runtime(profile)
    if "bf16" not in precisions or name is None:
        return {}
    return _versions(name)


def cache_key(profile: HardwareProfile) -> dict[str, str]:
    """What a cached build of a profile that allows bf16 also depends on: its bf16 runtime here or not, and its
    version (installing it turns a 'not built' bf16 into a built one). Nothing for other profiles."""
    name = runtime(profile)
    if "bf16" not in profile.precisions or name is None:
        return {}
    return _versions(name) or {name: "absent"}
