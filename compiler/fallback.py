"""A profile's CPU fallback: built instead of the profile when this build host lacks the profile's toolchain.

The Jetson profiles build TensorRT engines, and TensorRT exists only on a Jetson or a host with an NVIDIA GPU.
A profile may name a ``cpu_fallback`` (a CPU profile of the same arch, checked by
:func:`protocol.profile.load_profile`); when the build host cannot build the profile's own backend, the
compiler builds the fallback's bundle instead and says so, and the fleet rolls that bundle out to the
profile's devices as long as the model version has no bundle of their own profile.

Whether the toolchain is here is looked up without importing it (``importlib.util.find_spec``), the way
:mod:`compiler.targets.tensorrt` keeps ``tensorrt`` out of ``sys.modules`` until a build asks for it. A
toolchain that is found but then fails (no GPU, a broken install) fails the build as before.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

from ..protocol.profile import (
    HardwareProfile,
    load_profile,
    profile_dir,
    resolve_fallback_path,
    resolve_profile_path,
)

__all__ = ["CpuFallback", "choose", "missing_toolchain"]

# backend -> (the module its build target imports, what to call it)
TOOLCHAIN_MODULES = {"tensorrt": ("tensorrt", "TensorRT")}


def _importable(module: str) -> bool:
    if module in sys.modules:  # imported already, or blocked (None), e.g. by a test
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_toolchain(profile: HardwareProfile) -> str | None:
    """Why this host cannot build ``profile``'s backend (one phrase), or None when nothing says it cannot."""
    entry = TOOLCHAIN_MODULES.get(profile.backend)
    if entry is None or _importable(entry[0]):
        return None
    return f"{entry[1]} is not installed on this build host"


@dataclass(frozen=True)
class CpuFallback:
    requested: str  # the profile asked for (its name)
    built: str  # its cpu_fallback, built instead
    reason: str  # why the requested one could not be built here
    backend: str  # the requested profile's backend, e.g. tensorrt
    profile_arg: str  # what to hand the compiler for the fallback: its name, or its path beside a custom profile

    def line(self) -> str:
        what = TOOLCHAIN_MODULES.get(self.backend, ("", self.backend))[1]
        return (f"{self.requested}: {self.reason}; built its CPU fallback {self.built} instead "
                f"({self.requested} devices get it until a {what} bundle is uploaded)")

    def as_json(self) -> dict[str, Any]:
        return {"requested": self.requested, "built": self.built, "reason": self.reason}


def choose(profile_arg: str) -> CpuFallback | None:
    """The fallback to build instead of ``profile_arg`` (a name or a path) on this host, or None: build it as
    asked (its toolchain may be here, it names no fallback, or it does not load, which the build will report)."""
    from ..protocol.errors import EdgefleetError

    try:
        profile = load_profile(profile_arg)
    except EdgefleetError:
        return None
    if profile.cpu_fallback is None:
        return None
    why = missing_toolchain(profile)
    if why is None:
        return None
    fb_path = resolve_fallback_path(resolve_profile_path(profile_arg), profile.cpu_fallback)
    in_dir = fb_path.parent.resolve() == profile_dir().resolve()
    return CpuFallback(requested=profile.name, built=profile.cpu_fallback, reason=why, backend=profile.backend,
                       profile_arg=profile.cpu_fallback if in_dir else str(fb_path))
