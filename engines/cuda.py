"""GPU device memory for TensorRT, written once for the engine that serves and the builder that calibrates:
cuda-python (``cuda.bindings.runtime`` since 12.6, ``cuda.cudart`` before) or pycuda where a Jetson image
carries that. Imported lazily by :func:`open_device`: nothing here needs CUDA until a device is opened.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import numpy as np

from .errors import EngineLoadError, EngineRunError

__all__ = ["CudaRuntime", "Device", "DeviceBuffers", "PyCuda", "one_line", "open_device"]


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# -- device memory ----------------------------------------------------------------------------------------
class Device(Protocol):
    def stream(self) -> int: ...

    def alloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def to_device(self, ptr: int, host: np.ndarray) -> None: ...

    def to_host(self, host: np.ndarray, ptr: int) -> None: ...

    def synchronize(self) -> None: ...

    def compute_capability(self) -> str: ...

    def enter(self) -> None: ...

    def leave(self) -> None: ...

    def close(self) -> None: ...


class CudaRuntime:
    """cuda-python's runtime API: every call returns (cudaError_t, *results); the primary context is current
    on every thread."""

    def __init__(self, cudart: Any):
        self._rt = cudart
        self._stream: Any = None

    def _call(self, what: str, result: tuple[Any, ...]) -> Any:
        err, *rest = result
        if err != self._rt.cudaError_t.cudaSuccess:
            raise EngineRunError(f"CUDA {what} failed: {getattr(err, 'name', err)}")
        return rest[0] if rest else None

    def stream(self) -> int:
        if self._stream is None:
            self._stream = self._call("cudaStreamCreate", self._rt.cudaStreamCreate())
        return int(self._stream)

    def alloc(self, nbytes: int) -> int:
        return int(self._call("cudaMalloc", self._rt.cudaMalloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        self._call("cudaFree", self._rt.cudaFree(ptr))

    def to_device(self, ptr: int, host: np.ndarray) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._call("cudaMemcpy", self._rt.cudaMemcpy(ptr, host.ctypes.data, host.nbytes, kind))

    def to_host(self, host: np.ndarray, ptr: int) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._call("cudaMemcpy", self._rt.cudaMemcpy(host.ctypes.data, ptr, host.nbytes, kind))

    def synchronize(self) -> None:
        self._call("cudaStreamSynchronize", self._rt.cudaStreamSynchronize(self.stream()))

    def compute_capability(self) -> str:
        attr = self._rt.cudaDeviceAttr
        dev = self._call("cudaGetDevice", self._rt.cudaGetDevice())
        major = self._call("cudaDeviceGetAttribute",
                           self._rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, dev))
        minor = self._call("cudaDeviceGetAttribute",
                           self._rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, dev))
        return f"{major}.{minor}"

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            self._call("cudaStreamDestroy", self._rt.cudaStreamDestroy(stream))


class PyCuda:
    """pycuda's driver API; its context (from ``pycuda.autoinit``) is pushed around each call, since the
    batcher runs inference on a thread of its own."""

    def __init__(self, driver: Any, context: Any):
        self._drv = driver
        self._ctx = context
        self._stream: Any = None
        self._allocations: dict[int, Any] = {}

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._drv.Error as exc:
            raise EngineRunError(f"CUDA {what} failed (pycuda): {one_line(exc)}") from exc

    def stream(self) -> int:
        if self._stream is None:
            self._stream = self._call("stream creation", self._drv.Stream)
        return int(self._stream.handle)

    def alloc(self, nbytes: int) -> int:
        allocation = self._call("mem_alloc", self._drv.mem_alloc, max(nbytes, 1))
        self._allocations[int(allocation)] = allocation
        return int(allocation)

    def free(self, ptr: int) -> None:
        self._call("free", self._allocations.pop(ptr).free)

    def to_device(self, ptr: int, host: np.ndarray) -> None:
        self._call("memcpy_htod", self._drv.memcpy_htod, ptr, host)

    def to_host(self, host: np.ndarray, ptr: int) -> None:
        self._call("memcpy_dtoh", self._drv.memcpy_dtoh, host, ptr)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._call("stream synchronize", self._stream.synchronize)

    def compute_capability(self) -> str:
        major, minor = self._call("compute_capability", lambda: self._drv.Context.get_device().compute_capability())
        return f"{major}.{minor}"

    def enter(self) -> None:
        if self._ctx is not None:
            self._ctx.push()

    def leave(self) -> None:
        if self._ctx is not None:
            self._ctx.pop()

    def close(self) -> None:
        self._stream = None


def open_device() -> Device:
    problems = []
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return CudaRuntime(importlib.import_module(name))
        except ImportError as exc:
            problems.append(one_line(exc))
    try:
        import pycuda.autoinit as autoinit  # creates the CUDA context pycuda works in
        import pycuda.driver as driver
    except ImportError as exc:
        problems.append(one_line(exc))
    except Exception as exc:  # pycuda raises its own types when no GPU can be opened
        raise EngineLoadError(f"pycuda cannot open a CUDA device: {one_line(exc)}") from exc
    else:
        return PyCuda(driver, getattr(autoinit, "context", None))
    raise EngineLoadError(f"TensorRT needs CUDA Python bindings for device memory and none imports "
                       f"({'; '.join(problems)}): pip install cuda-python (or pycuda)")


class DeviceBuffers:
    """Device allocations by tensor name, replaced by a larger one when a tensor outgrows its buffer."""

    def __init__(self, device: Device):
        self._device = device
        self._held: dict[str, tuple[int, int]] = {}

    def get(self, name: str, nbytes: int) -> int:
        held = self._held.get(name)
        if held is not None and held[1] >= nbytes:
            return held[0]
        if held is not None:
            del self._held[name]
            self._device.free(held[0])
        ptr = self._device.alloc(nbytes)
        self._held[name] = (ptr, nbytes)
        return ptr

    def upload(self, name: str, host: np.ndarray) -> int:
        ptr = self.get(name, host.nbytes)
        self._device.to_device(ptr, host)
        return ptr

    def release(self) -> None:
        held, self._held = self._held, {}
        for ptr, _ in held.values():
            self._device.free(ptr)
