"""Native TensorRT engine (Jetson GPUs): a serialized engine, device buffers through :mod:`engines.cuda`.

``tensorrt`` and the CUDA bindings are imported when a bundle asks for this engine, never at import time:
``import agent`` works on a box without a GPU, and a TensorRT bundle there fails to load with one line that
says what is missing. An engine runs only on the TensorRT version and GPU it was built for; the manifest's
``engine_compatibility`` is checked before TensorRT is handed the plan.

The engine takes batches up to its optimization profile's maximum; larger ones are split and the results
joined. TensorRT 8.5+ is driven by tensor name (``set_input_shape``, ``set_tensor_address``,
``execute_async_v3``), older releases by binding index (``execute_async_v2``). The compiler's TensorRT
build target imports :func:`import_tensorrt`, :func:`make_logger` and the two I/O classes from here.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .base import Engine, EngineSpec, Runtime
from .cuda import Device, DeviceBuffers, one_line, open_device
from .errors import EngineLoadError, EngineRunError

__all__ = ["RUNTIME", "BindingIO", "TensorIO", "TensorRTEngine", "import_tensorrt", "logged_errors", "make_logger"]

log = logging.getLogger("edgefleet.engines.tensorrt")

RUN_ADVICE = "run it on a Jetson with JetPack, or install a bundle built for this box's profile"


def import_tensorrt(advice: str = RUN_ADVICE) -> Any:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        raise EngineLoadError(f"TensorRT is not installed on this machine ({one_line(exc)}): {advice}") from exc
    return tensorrt


def make_logger(trt: Any) -> Any:
    """A TensorRT logger that keeps errors for the exception message and passes warnings to logging."""

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


def logged_errors(logger: Any) -> str:
    """The last errors TensorRT logged, on one line (and forgotten: the next call reports its own)."""
    text = "; ".join(" ".join(e.split()) for e in logger.errors[-3:]) or "TensorRT logged no error"
    logger.errors.clear()
    return text


# -- TensorRT's two I/O APIs ------------------------------------------------------------------------------
class TensorIO:
    """TensorRT 8.5 and later: I/O tensors by name, execute_async_v3."""

    def __init__(self, trt: Any, engine: Any, context: Any):
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        self.shapes = {n: tuple(engine.get_tensor_shape(n)) for n in names}
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


class BindingIO:
    """TensorRT 8.4 and earlier: bindings by index, execute_async_v2."""

    def __init__(self, trt: Any, engine: Any, context: Any):
        self._names = [engine.get_binding_name(i) for i in range(engine.num_bindings)]
        self._index = {n: i for i, n in enumerate(self._names)}
        self.inputs = [n for i, n in enumerate(self._names) if engine.binding_is_input(i)]
        self.outputs = [n for n in self._names if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_binding_dtype(i))) for i, n in enumerate(self._names)}
        self.shapes = {n: tuple(engine.get_binding_shape(i)) for i, n in enumerate(self._names)}
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


class TensorRTEngine(Engine):
    kind = "tensorrt"

    def __init__(self, spec: EngineSpec, providers: tuple[str, ...] | None = None):
        super().__init__(spec)
        self.compatibility = spec.engine_compatibility  # checked before TensorRT is handed the plan
        self._lock = threading.Lock()  # one execution context runs one batch at a time
        self._device: Device | None = None
        self._buffers: DeviceBuffers | None = None
        self._context: Any = None
        self.max_batch = 0

    def load(self, engine: Path, threads: int) -> None:
        trt = import_tensorrt()
        want = self.compatibility.get("tensorrt")
        if want and want != str(trt.__version__):
            raise EngineLoadError(f"{engine.name} was built for TensorRT {want}; this box has {trt.__version__} "
                               "(an engine runs only on the TensorRT it was built with): rebuild for this JetPack")
        try:
            plan = engine.read_bytes()
        except OSError as exc:
            raise EngineLoadError(f"{engine}: cannot read the engine ({exc.strerror})") from exc
        device = open_device()
        try:
            self._open(trt, device, plan, engine.name)
        except BaseException:
            self._release(device)
            raise

    def _open(self, trt: Any, device: Device, plan: bytes, where: str) -> None:
        want_cc = self.compatibility.get("gpu_compute_capability")
        have_cc = device.compute_capability()
        if want_cc and want_cc != have_cc:
            raise EngineLoadError(f"{where} was built for a GPU of compute capability {want_cc}; this one is {have_cc}")
        self._device = device
        self._buffers = DeviceBuffers(device)
        logger = make_logger(trt)
        self._logger = logger
        device.enter()
        try:
            self._runtime = trt.Runtime(logger)
            self._engine = self._runtime.deserialize_cuda_engine(plan)
            if self._engine is None:
                raise EngineLoadError(f"TensorRT {trt.__version__} cannot load {where} ({logged_errors(logger)})")
            context = self._engine.create_execution_context()
            if context is None:
                raise EngineLoadError(f"TensorRT cannot create an execution context for {where} "
                                      f"({logged_errors(logger)})")
            io = TensorIO(trt, self._engine, context) if hasattr(context, "execute_async_v3") else \
                BindingIO(trt, self._engine, context)
        except RuntimeError as exc:  # what TensorRT's bindings raise
            raise EngineLoadError(f"TensorRT cannot run {where}: {one_line(exc)}") from exc
        finally:
            device.leave()
        for what, have, specs in (("input", io.inputs, self.inputs), ("output", io.outputs, self.outputs)):
            missing = [s.name for s in specs if s.name not in have]
            if missing:
                raise EngineLoadError(f"the engine has no {what} {missing[0]!r} (it has {have})")
        self._io = io
        self._context = context
        batched = [(s.name, s.batch_axis) for s in self.inputs if s.batch_axis is not None]
        self.max_batch = min((io.max_shapes[n][a] for n, a in batched), default=1)
        self.device = f"TensorRT {trt.__version__} on GPU sm{have_cc.replace('.', '')}"

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        axes = {s.name: s.batch_axis for s in self.inputs}
        total = next((int(feeds[n].shape[a]) for n, a in axes.items() if a is not None), 0)
        with self._lock:
            if self._context is None:
                raise EngineRunError(f"{self.spec.label}: the TensorRT execution context is gone")
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
                raise EngineRunError(f"input {spec.name!r} of shape {list(host.shape)} does not fit the engine "
                                   f"(at most {list(io.max_shapes[spec.name])}): {logged_errors(self._logger)}")
            addresses[spec.name] = ptr = buffers.get(spec.name, host.nbytes)
            device.to_device(ptr, host)
        outs: dict[str, np.ndarray] = {}
        for name in io.outputs:
            shape = io.shape(name)
            if any(d < 0 for d in shape):
                raise EngineRunError(f"output {name!r} has a data-dependent shape {list(shape)}, which this engine "
                                   "does not support")
            outs[name] = np.empty(shape, io.dtypes[name])
            addresses[name] = buffers.get(name, outs[name].nbytes)
        if not io.execute(addresses, device.stream()):
            raise EngineRunError(f"TensorRT inference failed: {logged_errors(self._logger)}")
        device.synchronize()
        for name, host in outs.items():
            device.to_host(host, addresses[name])
        return [outs[s.name] for s in self.outputs]

    def _release(self, device: Device | None) -> None:
        if self._buffers is not None:
            self._buffers.release()
            self._buffers = None
        if device is not None:
            device.close()
        self._device = None

    def _close_impl(self) -> None:
        with self._lock:
            self._context = None
            self._engine = None
            self._release(self._device)


RUNTIME = Runtime(TensorRTEngine, backend="tensorrt", precisions=("fp32", "fp16", "int8"),
                  modules=("tensorrt",), extra="JetPack's tensorrt", accelerators=("gpu",), suffix=".engine",
                  target="edgefleet.compiler.targets.tensorrt:TensorRTTarget", order=20)
