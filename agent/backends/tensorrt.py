"""Native TensorRT backend (Jetson GPUs): a serialized engine, device buffers through cuda-python
(``cuda.bindings.runtime`` since 12.6, ``cuda.cudart`` before) or pycuda where a Jetson image carries that.

``tensorrt`` and the CUDA bindings are imported when a bundle asks for this backend, never at import time:
``import agent`` works on a box without a GPU, and a TensorRT bundle there fails to load with one line that
says what is missing. An engine runs only on the TensorRT version and GPU it was built for; the manifest's
``engine_compatibility`` is checked before TensorRT is handed the plan.

The engine takes batches up to its optimization profile's maximum; larger ones are split and the results
joined. TensorRT 8.5+ is driven by tensor name (``set_input_shape``, ``set_tensor_address``,
``execute_async_v3``), older releases by binding index (``execute_async_v2``).
"""

from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agent.backends.base import Backend
from agent.errors import BackendError
from protocol.manifest import Manifest

__all__ = ["TensorRTBackend"]

log = logging.getLogger("edgefleet.agent.backends.tensorrt")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _import_tensorrt() -> Any:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        raise BackendError(f"this bundle's engine is TensorRT and this machine has no tensorrt module "
                           f"({_one_line(exc)}): run it on a Jetson with JetPack, or install a bundle built for "
                           "this box's profile") from exc
    return tensorrt


def _make_logger(trt: Any) -> Any:
    class _Logger(trt.ILogger):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("TensorRT: %s", msg)

    return _Logger()


def _errors(logger: Any) -> str:
    return "; ".join(" ".join(e.split()) for e in logger.errors[-3:]) or "TensorRT logged no error"


# -- device memory ----------------------------------------------------------------------------------------
class _Device(Protocol):
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


class _CudaRuntime:
    """cuda-python's runtime API: every call returns (cudaError_t, *results); the primary context is current
    on every thread."""

    def __init__(self, cudart: Any):
        self._rt = cudart
        self._stream: Any = None

    def _call(self, what: str, result: tuple[Any, ...]) -> Any:
        err, *rest = result
        if err != self._rt.cudaError_t.cudaSuccess:
            raise BackendError(f"CUDA {what} failed: {getattr(err, 'name', err)}")
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


class _PyCuda:
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
            raise BackendError(f"CUDA {what} failed (pycuda): {_one_line(exc)}") from exc

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


def _open_device() -> _Device:
    problems = []
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return _CudaRuntime(importlib.import_module(name))
        except ImportError as exc:
            problems.append(_one_line(exc))
    try:
        import pycuda.autoinit as autoinit  # creates the CUDA context pycuda works in
        import pycuda.driver as driver
    except ImportError as exc:
        problems.append(_one_line(exc))
    except Exception as exc:  # pycuda raises its own types when no GPU can be opened
        raise BackendError(f"pycuda cannot open a CUDA device: {_one_line(exc)}") from exc
    else:
        return _PyCuda(driver, getattr(autoinit, "context", None))
    raise BackendError(f"TensorRT needs CUDA Python bindings for device memory and none imports "
                       f"({'; '.join(problems)}): pip install cuda-python (or pycuda)")


class _Buffers:
    """Device allocations by tensor name, replaced by a larger one when a tensor outgrows its buffer."""

    def __init__(self, device: _Device):
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

    def release(self) -> None:
        held, self._held = self._held, {}
        for ptr, _ in held.values():
            self._device.free(ptr)


# -- TensorRT's two I/O APIs ------------------------------------------------------------------------------
class _TensorIO:
    """TensorRT 8.5 and later: I/O tensors by name, execute_async_v3."""

    def __init__(self, trt: Any, engine: Any, context: Any):
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        self.max_shapes = {n: tuple(engine.get_tensor_profile_shape(n, 0)[2]) for n in self.inputs}
        self._context = context

    def set_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        return bool(self._context.set_input_shape(name, shape))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._context.get_tensor_shape(name))

    def execute(self, addresses: dict[str, int], stream: int) -> bool:
        if not all(self._context.set_tensor_address(n, p) for n, p in addresses.items()):
            return False
        return bool(self._context.execute_async_v3(stream_handle=stream))


class _BindingIO:
    """TensorRT 8.4 and earlier: bindings by index, execute_async_v2."""

    def __init__(self, trt: Any, engine: Any, context: Any):
        self._names = [engine.get_binding_name(i) for i in range(engine.num_bindings)]
        self._index = {n: i for i, n in enumerate(self._names)}
        self.inputs = [n for i, n in enumerate(self._names) if engine.binding_is_input(i)]
        self.outputs = [n for n in self._names if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_binding_dtype(i))) for i, n in enumerate(self._names)}
        self.max_shapes = {n: tuple(engine.get_profile_shape(0, self._index[n])[2]) for n in self.inputs}
        self._context = context

    def set_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        return bool(self._context.set_binding_shape(self._index[name], shape))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._context.get_binding_shape(self._index[name]))

    def execute(self, addresses: dict[str, int], stream: int) -> bool:
        return bool(self._context.execute_async_v2(bindings=[addresses[n] for n in self._names], stream_handle=stream))


def _take(x: np.ndarray, axis: int | None, start: int, stop: int) -> np.ndarray:
    return x if axis is None else x[(slice(None),) * axis + (slice(start, stop),)]


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, manifest: Manifest):
        super().__init__(manifest)
        self._lock = threading.Lock()  # one execution context runs one batch at a time
        self._device: _Device | None = None
        self._buffers: _Buffers | None = None
        self._context: Any = None
        self.max_batch = 0

    def load(self, engine: Path, threads: int) -> None:
        trt = _import_tensorrt()
        want = self.manifest.engine_compatibility.get("tensorrt")
        if want and want != str(trt.__version__):
            raise BackendError(f"{engine.name} was built for TensorRT {want}; this box has {trt.__version__} "
                               "(an engine runs only on the TensorRT it was built with): rebuild for this JetPack")
        try:
            plan = engine.read_bytes()
        except OSError as exc:
            raise BackendError(f"{engine}: cannot read the engine ({exc.strerror})") from exc
        device = _open_device()
        try:
            self._open(trt, device, plan, engine.name)
        except BaseException:
            self._release(device)
            raise

    def _open(self, trt: Any, device: _Device, plan: bytes, where: str) -> None:
        want_cc = self.manifest.engine_compatibility.get("gpu_compute_capability")
        have_cc = device.compute_capability()
        if want_cc and want_cc != have_cc:
            raise BackendError(f"{where} was built for a GPU of compute capability {want_cc}; this one is {have_cc}")
        self._device = device
        self._buffers = _Buffers(device)
        logger = _make_logger(trt)
        self._logger = logger
        device.enter()
        try:
            self._runtime = trt.Runtime(logger)
            self._engine = self._runtime.deserialize_cuda_engine(plan)
            if self._engine is None:
                raise BackendError(f"TensorRT {trt.__version__} cannot load {where} ({_errors(logger)})")
            context = self._engine.create_execution_context()
            if context is None:
                raise BackendError(f"TensorRT cannot create an execution context for {where} ({_errors(logger)})")
            io = _TensorIO(trt, self._engine, context) if hasattr(context, "execute_async_v3") else \
                _BindingIO(trt, self._engine, context)
        except RuntimeError as exc:  # what TensorRT's bindings raise
            raise BackendError(f"TensorRT cannot run {where}: {_one_line(exc)}") from exc
        finally:
            device.leave()
        for what, have, specs in (("input", io.inputs, self.inputs), ("output", io.outputs, self.outputs)):
            missing = [s.name for s in specs if s.name not in have]
            if missing:
                raise BackendError(f"the engine has no {what} {missing[0]!r} (it has {have})")
        self._io = io
        self._context = context
        batched = [(s.name, s.batch_axis) for s in self.inputs if s.batch_axis is not None]
        self.max_batch = min((io.max_shapes[n][a] for n, a in batched), default=1)
        self.device = f"TensorRT {trt.__version__} on GPU sm{have_cc.replace('.', '')}"

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        axes = {s.name: s.batch_axis for s in self.inputs}
        total = next((int(feeds[n].shape[a]) for n, a in axes.items() if a is not None), 0)
        with self._lock:
            if self._context is None:
                raise BackendError("the TensorRT backend is closed")
            assert self._device is not None
            self._device.enter()
            try:
                if total <= self.max_batch:
                    return self._run(feeds)
                parts = [self._run({n: _take(v, axes[n], s, s + self.max_batch) for n, v in feeds.items()})
                         for s in range(0, total, self.max_batch)]
            finally:
                self._device.leave()
        return [parts[0][i] if spec.batch_axis is None else
                np.concatenate([p[i] for p in parts], axis=spec.batch_axis) for i, spec in enumerate(self.outputs)]

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        device, buffers, io = self._device, self._buffers, self._io
        assert device is not None and buffers is not None
        self._logger.errors.clear()
        addresses = {}
        for spec in self.inputs:
            host = np.ascontiguousarray(feeds[spec.name], dtype=io.dtypes[spec.name])
            if not io.set_shape(spec.name, host.shape):
                raise BackendError(f"input {spec.name!r} of shape {list(host.shape)} does not fit the engine "
                                   f"(at most {list(io.max_shapes[spec.name])}): {_errors(self._logger)}")
            addresses[spec.name] = ptr = buffers.get(spec.name, host.nbytes)
            device.to_device(ptr, host)
        outs: dict[str, np.ndarray] = {}
        for name in io.outputs:
            shape = io.shape(name)
            if any(d < 0 for d in shape):
                raise BackendError(f"output {name!r} has a data-dependent shape {list(shape)}, which this backend "
                                   "does not support")
            outs[name] = np.empty(shape, io.dtypes[name])
            addresses[name] = buffers.get(name, outs[name].nbytes)
        if not io.execute(addresses, device.stream()):
            raise BackendError(f"TensorRT inference failed: {_errors(self._logger)}")
        device.synchronize()
        for name, host in outs.items():
            device.to_host(host, addresses[name])
        return [outs[s.name] for s in self.outputs]

    def _release(self, device: _Device | None) -> None:
        if self._buffers is not None:
            self._buffers.release()
            self._buffers = None
        if device is not None:
            device.close()
        self._device = None

    def close(self) -> None:
        with self._lock:
            self._context = None
            self._engine = None
            self._release(self._device)
