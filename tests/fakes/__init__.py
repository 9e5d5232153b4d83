"""Fakes of toolchains that cannot be installed on the test machines (TensorRT and CUDA need an NVIDIA GPU).

Each fake implements, honestly, the subset of the real API the code under test uses; it replaces only the
third-party module (through ``sys.modules``), never edgefleet's own code.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType

import pytest

from tests.fakes.fake_cuda import DeviceMemory, make_cudart, make_pycuda
from tests.fakes.fake_tensorrt import make_tensorrt

__all__ = ["CUDA_MODULES", "FakeGPU", "install_fake_gpu"]

CUDA_MODULES = ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart", "pycuda", "pycuda.driver",
                "pycuda.autoinit")


@dataclass(frozen=True)
class FakeGPU:
    trt: ModuleType
    memory: DeviceMemory


def install_fake_gpu(monkeypatch: pytest.MonkeyPatch, api: str = "10", cuda: str | None = "bindings",
                     dla_cores: int = 0, compute_capability: tuple[int, int] = (8, 7),
                     version: str | None = None) -> FakeGPU:
    """Put a fake ``tensorrt`` and fake CUDA bindings in ``sys.modules`` for one test.

    ``cuda``: "bindings" (cuda-python 12.6+, ``cuda.bindings.runtime``), "cudart" (older cuda-python,
    ``cuda.cudart``), "pycuda", or None (no CUDA bindings at all). Real modules of those names are hidden.
    """
    memory = DeviceMemory(compute_capability)
    trt = make_tensorrt(memory, api=api, version=version, dla_cores=dla_cores)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    for name in CUDA_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    if cuda in ("bindings", "cudart"):
        runtime = make_cudart(memory)
        pkg = ModuleType("cuda")
        pkg.__path__ = []
        if cuda == "bindings":
            bindings = ModuleType("cuda.bindings")
            bindings.__path__ = []
            bindings.runtime = runtime  # type: ignore[attr-defined]
            pkg.bindings = bindings  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
            monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
        else:
            pkg.cudart = runtime  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, "cuda.cudart", runtime)
        monkeypatch.setitem(sys.modules, "cuda", pkg)
    elif cuda == "pycuda":
        for name, module in make_pycuda(memory).items():
            monkeypatch.setitem(sys.modules, name, module)
    elif cuda is not None:
        raise ValueError(f"cuda is 'bindings', 'cudart', 'pycuda' or None, not {cuda!r}")
    return FakeGPU(trt, memory)
