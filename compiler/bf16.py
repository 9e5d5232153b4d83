"""bf16, a precision the compiler builds and gates like int8 (issue 35).

The bf16 engine is the fp32 build's ONNX file, tagged bf16 and run by OpenVINO with ``INFERENCE_PRECISION_HINT``
bf16 (engines/openvino.py): OpenVINO ran a MobileNetV2-like model 1.65-2.3x faster that way than onnxruntime
FP32 on a 2-core AVX-512 EPYC, with answers that differ (max abs 0.013, one top-1 in 16 flipped on near-tied
logits), so it ships only after the same task-level gate as int8, on the build host, as the devices would run it.

That needs a build host that runs bf16: an x86 CPU with avx512_bf16 or amx_bf16 (protocol.cpu.BF16_FEATURES)
and OpenVINO installed (edgefleet[openvino]) whose CPU plugin says BF16. Elsewhere :func:`host_cannot_run_bf16`
says why, and the pipeline refuses ``--precision bf16`` with that reason and leaves bf16 out of
``--precision auto`` (noted in the manifest's candidates). Only profiles that allow bf16 offer it
(protocol.profile: those promising a bf16 instruction set, e.g. x86-cpu-bf16).
"""

from __future__ import annotations

from edgefleet.protocol.cpu import BF16_FEATURES, bf16_feature, cpu_arch, cpu_features
from edgefleet.protocol.manifest import BF16_VERSION
from edgefleet.protocol.profile import HardwareProfile

__all__ = ["RUNTIME", "cache_key", "host_cannot_run_bf16", "manifest_version", "toolchain_versions"]

RUNTIME = "openvino"  # the runtime that runs (and so gates) bf16 engines


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
    from edgefleet.engines import EXTRAS, runtime_installed

    if not runtime_installed(RUNTIME):
        return f"OpenVINO, which runs bf16 engines, is not installed on the build host (install {EXTRAS[RUNTIME]})"
    from edgefleet.engines.openvino import bf16_capable

    if not bf16_capable():
        return (f"OpenVINO on the build host does not list BF16 among its CPU capabilities although the CPU reports "
                f"{bf16_feature(have)}; it would run f32, so no bf16 engine can be gated here")
    return None


def manifest_version(version: int, precisions: list[str]) -> int:
    """The lowest manifest version that carries the bundle's precisions: at least :data:`BF16_VERSION` with bf16."""
    return max(version, BF16_VERSION) if "bf16" in precisions else version


def toolchain_versions(precisions: list[str]) -> dict[str, str]:
    """OpenVINO's version for the manifest's toolchain when a bf16 engine ships (it made the gated answers)."""
    if "bf16" not in precisions:
        return {}
    import openvino

    return {"openvino": openvino.__version__.split("-")[0]}


def cache_key(profile: HardwareProfile) -> dict[str, str]:
    """What a cached build of a profile that allows bf16 also depends on: OpenVINO here or not, and its version
    (installing it turns a 'not built' bf16 into a built one). Nothing for other profiles."""
    if "bf16" not in profile.precisions:
        return {}
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"openvino": version("openvino")}
    except PackageNotFoundError:
        return {"openvino": "absent"}
