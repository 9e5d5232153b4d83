"""A fake CUDA device: "device" memory is host memory (ctypes buffers at real addresses), so copies really
move bytes, out-of-bounds access is caught, and a fake engine reads its inputs from the pointers it is given.

:func:`make_cudart` builds a module shaped like cuda-python's runtime API (``cuda.cudart``, or
``cuda.bindings.runtime`` since 12.6): every call returns a tuple whose first item is a ``cudaError_t``.
:func:`make_pycuda` builds the subset of ``pycuda.driver`` (plus ``pycuda.autoinit``) edgefleet uses.
"""

from __future__ import annotations

import ctypes
import itertools
from enum import IntEnum
from types import ModuleType

import numpy as np

__all__ = ["DeviceMemory", "make_cudart", "make_pycuda"]


class DeviceMemory:
    """Allocations and streams of one fake GPU."""

    def __init__(self, compute_capability: tuple[int, int] = (8, 7)):
        self.compute_capability = compute_capability
        self._blocks: dict[int, ctypes.Array] = {}
        self.streams: set[int] = set()
        self._stream_ids = itertools.count(0x5000)
        self.allocations_made = 0

    @property
    def live(self) -> int:
        return len(self._blocks)

    def alloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError("allocation of 0 bytes")
        block = ctypes.create_string_buffer(nbytes)
        self._blocks[ctypes.addressof(block)] = block
        self.allocations_made += 1
        return ctypes.addressof(block)

    def free(self, ptr: int) -> None:
        del self._blocks[ptr]

    def check(self, ptr: int, nbytes: int) -> None:
        for start, block in self._blocks.items():
            if start <= ptr and ptr + nbytes <= start + ctypes.sizeof(block):
                return
        raise ValueError(f"{nbytes} bytes at {ptr:#x} are not inside one device allocation")

    def read(self, ptr: int, nbytes: int) -> bytes:
        self.check(ptr, nbytes)
        return ctypes.string_at(ptr, nbytes)

    def write(self, ptr: int, data: bytes) -> None:
        self.check(ptr, len(data))
        ctypes.memmove(ptr, data, len(data))

    def new_stream(self) -> int:
        handle = next(self._stream_ids)
        self.streams.add(handle)
        return handle


def make_cudart(memory: DeviceMemory) -> ModuleType:
    mod = ModuleType("cuda.cudart")

    class cudaError_t(IntEnum):
        cudaSuccess = 0
        cudaErrorInvalidValue = 1
        cudaErrorMemoryAllocation = 2
        cudaErrorInvalidDevicePointer = 17
        cudaErrorInvalidResourceHandle = 400

    class cudaMemcpyKind(IntEnum):
        cudaMemcpyHostToHost = 0
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2
        cudaMemcpyDeviceToDevice = 3

    class cudaDeviceAttr(IntEnum):
        cudaDevAttrComputeCapabilityMajor = 75
        cudaDevAttrComputeCapabilityMinor = 76

    class cudaStream_t:
        def __init__(self, handle: int):
            self._handle = handle

        def __int__(self) -> int:
            return self._handle

    ok = cudaError_t.cudaSuccess

    def cudaMalloc(size: int) -> tuple[cudaError_t, int]:
        try:
            return ok, memory.alloc(int(size))
        except ValueError:
            return cudaError_t.cudaErrorInvalidValue, 0

    def cudaFree(ptr: int) -> tuple[cudaError_t]:
        try:
            memory.free(int(ptr))
        except KeyError:
            return (cudaError_t.cudaErrorInvalidDevicePointer,)
        return (ok,)

    def cudaMemcpy(dst: int, src: int, count: int, kind: cudaMemcpyKind) -> tuple[cudaError_t]:
        try:
            if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
                memory.check(int(dst), count)
            elif kind == cudaMemcpyKind.cudaMemcpyDeviceToHost:
                memory.check(int(src), count)
            else:
                return (cudaError_t.cudaErrorInvalidValue,)
        except ValueError:
            return (cudaError_t.cudaErrorInvalidValue,)
        ctypes.memmove(int(dst), int(src), count)
        return (ok,)

    def cudaStreamCreate() -> tuple[cudaError_t, cudaStream_t]:
        return ok, cudaStream_t(memory.new_stream())

    def cudaStreamSynchronize(stream: cudaStream_t | int) -> tuple[cudaError_t]:
        return (ok,) if int(stream) in memory.streams else (cudaError_t.cudaErrorInvalidResourceHandle,)

    def cudaStreamDestroy(stream: cudaStream_t | int) -> tuple[cudaError_t]:
        if int(stream) not in memory.streams:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        memory.streams.discard(int(stream))
        return (ok,)

    def cudaGetDevice() -> tuple[cudaError_t, int]:
        return ok, 0

    def cudaDeviceGetAttribute(attr: cudaDeviceAttr, device: int) -> tuple[cudaError_t, int]:
        major, minor = memory.compute_capability
        return ok, major if attr == cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor else minor

    for obj in (cudaError_t, cudaMemcpyKind, cudaDeviceAttr, cudaStream_t, cudaMalloc, cudaFree, cudaMemcpy,
                cudaStreamCreate, cudaStreamSynchronize, cudaStreamDestroy, cudaGetDevice, cudaDeviceGetAttribute):
        setattr(mod, obj.__name__, obj)
    return mod


def make_pycuda(memory: DeviceMemory) -> dict[str, ModuleType]:
    """``{"pycuda": ..., "pycuda.driver": ..., "pycuda.autoinit": ...}`` for sys.modules."""
    drv = ModuleType("pycuda.driver")

    class Error(Exception):
        pass

    class DeviceAllocation:
        def __init__(self, ptr: int):
            self._ptr = ptr

        def __int__(self) -> int:
            return self._ptr

        def free(self) -> None:
            try:
                memory.free(self._ptr)
            except KeyError as exc:
                raise Error("cuMemFree failed: invalid argument") from exc

    def mem_alloc(nbytes: int) -> DeviceAllocation:
        try:
            return DeviceAllocation(memory.alloc(int(nbytes)))
        except ValueError as exc:
            raise Error(f"cuMemAlloc failed: {exc}") from exc

    def memcpy_htod(dest: int | DeviceAllocation, src: np.ndarray) -> None:
        try:
            memory.write(int(dest), src.tobytes())
        except ValueError as exc:
            raise Error(f"cuMemcpyHtoD failed: {exc}") from exc

    def memcpy_dtoh(dest: np.ndarray, src: int | DeviceAllocation) -> None:
        try:
            data = memory.read(int(src), dest.nbytes)
        except ValueError as exc:
            raise Error(f"cuMemcpyDtoH failed: {exc}") from exc
        ctypes.memmove(dest.ctypes.data, data, len(data))

    class Stream:
        def __init__(self) -> None:
            self.handle = memory.new_stream()

        def synchronize(self) -> None:
            pass

    class Device:
        def __init__(self, ordinal: int):
            self.ordinal = ordinal

        def compute_capability(self) -> tuple[int, int]:
            return memory.compute_capability

    class Context:
        @staticmethod
        def get_device() -> Device:
            return Device(0)

    for obj in (Error, DeviceAllocation, mem_alloc, memcpy_htod, memcpy_dtoh, Stream, Device, Context):
        setattr(drv, obj.__name__, obj)
    autoinit = ModuleType("pycuda.autoinit")
    autoinit.device = Device(0)  # type: ignore[attr-defined]
    pkg = ModuleType("pycuda")
    pkg.__path__ = []
    pkg.driver = drv  # type: ignore[attr-defined]
    pkg.autoinit = autoinit  # type: ignore[attr-defined]
    return {"pycuda": pkg, "pycuda.driver": drv, "pycuda.autoinit": autoinit}
