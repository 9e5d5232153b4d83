"""What the CPU this process runs on can execute, as CPUID reports it (not as /proc/cpuinfo claims).

onnxruntime picks its INT8 kernels from CPUID, and the answers differ between CPUs: uint8 x int8
products summed pairwise into 16 bits saturate on AVX2 kernels without VNNI, and do not with VNNI.
So a hardware profile states the instruction sets it promises (``cpu_features``), the compiler
quantizes for the weakest CPU that promise admits, and the agent refuses a bundle whose features
its CPU lacks before downloading it.

Detection reads numpy's runtime-dispatch table, which numpy fills from CPUID and XGETBV at import
time. That is what a process really gets: under qemu user-mode emulation (``as-cpu Haswell``) it
reports the emulated CPU, while ``/proc/cpuinfo`` would still describe the host.

Names follow the Linux ``/proc/cpuinfo`` flag spelling (``avx2``, ``fma``, ``avx512_vnni``).
"""

from __future__ import annotations

import functools
import platform

__all__ = [
    "BF16_FEATURES",
    "KNOWN_FEATURES",
    "VNNI_FEATURES",
    "bf16_feature",
    "cpu_arch",
    "cpu_features",
    "missing_features",
    "u8s8_saturates",
]

# numpy's name -> the Linux flag name used in profiles and manifests
_NUMPY_TO_LINUX = {
    "SSE3": "pni", "SSSE3": "ssse3", "SSE41": "sse4_1", "SSE42": "sse4_2", "POPCNT": "popcnt",
    "AVX": "avx", "F16C": "f16c", "FMA3": "fma", "AVX2": "avx2", "BMI": "bmi1", "BMI2": "bmi2",
    "AVX512F": "avx512f", "AVX512CD": "avx512cd", "AVX512BW": "avx512bw", "AVX512DQ": "avx512dq",
    "AVX512VL": "avx512vl", "AVX512VNNI": "avx512_vnni", "AVX512BF16": "avx512_bf16",
    "AVX512FP16": "avx512_fp16", "AVX512VBMI": "avx512vbmi",
    # no numpy carries AMX (its tiles need the kernel's permission too, which /proc/cpuinfo's flag reflects)
    "AMX_BF16": "amx_bf16", "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8",
    "NEON": "neon", "ASIMD": "asimd", "ASIMDDP": "asimddp", "ASIMDHP": "asimdhp", "SVE": "sve",
}
KNOWN_FEATURES: frozenset[str] = frozenset(_NUMPY_TO_LINUX.values())
# with any of these, onnxruntime's u8s8 kernels accumulate in 32 bits and cannot saturate
VNNI_FEATURES: frozenset[str] = frozenset({"avx512_vnni"})
# with any of these, a CPU computes bf16 products natively (OpenVINO's CPU plugin runs bf16 there, and only there:
# on other CPUs it would emulate nothing and run f32); Zen 4 and Cooper Lake have avx512_bf16, Sapphire Rapids both
BF16_FEATURES: frozenset[str] = frozenset({"avx512_bf16", "amx_bf16"})
# names only a CPU with AVX-512F has (Sapphire Rapids and later for AMX; Cooper Lake, Zen 4 for AVX512_BF16)
AVX512_IMPLIED: frozenset[str] = frozenset({"amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_fp16"})


def cpu_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The instruction-set features of this CPU that edgefleet knows about (CPUID, via numpy)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as table  # numpy >= 2
    except ImportError:
        try:  # numpy 1.26
            from numpy.core._multiarray_umath import __cpu_features__ as table  # type: ignore[no-redef]
        except ImportError:  # a numpy without the table: the kernel's view (wrong under emulation)
            return _proc_cpuinfo_flags()
    feats = {_NUMPY_TO_LINUX[k] for k, on in table.items() if on and k in _NUMPY_TO_LINUX}
    # names this numpy's table does not carry at all (numpy < 2.3, the newest on Python 3.10, has no BMI,
    # BMI2 or AVX512BF16): the kernel's view, the only one there is
    unknown = {name for k, name in _NUMPY_TO_LINUX.items() if k not in table}
    if unknown:
        kernel = _proc_cpuinfo_flags() & unknown
        if "AVX512F" in table and "avx512f" not in feats:
            # the kernel describes the host, CPUID the CPU this runs on: under emulation (qemu -cpu Haswell on a
            # Sapphire Rapids host) /proc/cpuinfo still lists AMX. Every CPU with AMX or AVX512_BF16 has AVX-512F,
            # so where CPUID says it has none, the kernel's AVX-512 and AMX names are the host's, not this CPU's
            kernel -= AVX512_IMPLIED
        feats |= kernel
    if cpu_arch() == "aarch64":
        feats |= {"neon", "asimd"}  # mandatory on ARMv8-A
    return frozenset(feats)


def _proc_cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split()) & KNOWN_FEATURES
    return frozenset()


def bf16_feature(have: frozenset[str] | tuple[str, ...] | None = None) -> str | None:
    """The bf16 instruction set this CPU (or ``have``) has, AMX first; None when it has neither."""
    have = cpu_features() if have is None else frozenset(have)
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in have), None)


def missing_features(required: tuple[str, ...] | list[str] | frozenset[str],
                     have: frozenset[str] | None = None) -> list[str]:
    """The features in ``required`` that this CPU (or ``have``) lacks, in the order given."""
    have = cpu_features() if have is None else have
    return [f for f in required if f not in have]


def u8s8_saturates(have: frozenset[str] | None = None) -> bool:
    """Whether onnxruntime's x86 u8s8 kernels on this CPU (or ``have``) sum pairs of uint8 x int8
    products into 16 bits with saturation: AVX2 and AVX-512BW without VNNI do (vpmaddubsw); VNNI
    accumulates in 32 bits and SSE-only CPUs widen to 16-bit operands first, so both are exact."""
    have = cpu_features() if have is None else have
    return "avx2" in have and not (have & VNNI_FEATURES)
