"""TensorRT target (Jetson GPUs): an engine per profile, FP16, or INT8 calibrated on our data set.

TensorRT is imported only inside methods, so this module imports on a machine without it; there every
method raises a one-line :class:`ToolchainError`. Device memory goes through cuda-python
(``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6) or, where only that exists, pycuda.
Where the TensorRT 8.x and 10.x Python APIs differ (explicit-batch flag, workspace limit, I/O tensors by
name or bindings by index, execute_async_v3 or v2) the code asks the objects what they have; it never
parses version strings.

The engine takes batches of 1 to ``runtime.max_batch_size``; the runner splits larger ones. Tactic timings
persist in a timing cache per TensorRT version and GPU under ``$EDGEFLEET_CACHE_DIR/tensorrt`` (default
``~/.cache/edgefleet/tensorrt``), so a rebuild does not time every tactic again.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from compiler.data import Dataset
from compiler.errors import CompilerError, InputError, ToolchainError
from compiler.graph import GraphInfo
from compiler.targets.base import Runner
from protocol.manifest import QuantizationInfo
from protocol.profile import HardwareProfile, TensorRTSettings

__all__ = ["TensorRTTarget", "l4t_release"]

_log = logging.getLogger(__name__)

NV_TEGRA_RELEASE = Path("/etc/nv_tegra_release")
_CALIBRATORS = {"minmax": "IInt8MinMaxCalibrator", "entropy": "IInt8EntropyCalibrator2"}
Shape = tuple[int, ...]


class TensorRTTarget:
    backend = "tensorrt"
    engine_suffix = ".engine"

    def __init__(self, tegra_release: Path = NV_TEGRA_RELEASE):
        self._tegra_release = tegra_release
        self._logger: Any = None

    def _trt(self) -> Any:
        trt = _import_tensorrt()
        if self._logger is None:
            self._logger = _make_logger(trt)
        return trt

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> QuantizationInfo | None:
        trt = self._trt()
        if precision not in ("fp16", "int8"):
            raise InputError(f"the TensorRT target builds fp16 or int8, not {precision}")
        device = _open_device()
        try:
            return _Build(trt, self._logger, device, profile).run(source, info, precision, calibration, out_path)
        except RuntimeError as exc:  # what TensorRT's bindings raise
            raise ToolchainError(f"TensorRT failed building {source.name} as {precision}: {_one_line(exc)}") from exc
        finally:
            device.close()

    def runner(self, engine: Path, profile: HardwareProfile, output_names: Sequence[str] | None = None) -> Runner:
        """``output_names`` (the manifest's outputs) orders the results by tensor name; without it they come
        in the engine's order, which TensorRT's ONNX parser takes from the graph's outputs."""
        trt = self._trt()
        try:
            plan = engine.read_bytes()
        except OSError as exc:
            raise ToolchainError(f"{engine}: cannot read the engine ({exc.strerror})") from exc
        device = _open_device()
        try:
            return _EngineRunner(trt, self._logger, device, plan, profile.runtime.max_batch_size, output_names,
                                 str(engine))
        except RuntimeError as exc:
            device.close()
            raise ToolchainError(f"{engine}: TensorRT cannot run the engine: {_one_line(exc)}") from exc
        except BaseException:
            device.close()
            raise

    def toolchain_versions(self) -> dict[str, str]:
        return {"tensorrt": str(self._trt().__version__)}

    def engine_compatibility(self) -> dict[str, str]:
        """An engine runs only on the TensorRT version and GPU architecture it was built for (and, on a
        Jetson, the L4T release that ships that TensorRT)."""
        trt = self._trt()
        device = _open_device()
        try:
            capability = device.compute_capability()
        finally:
            device.close()
        return {"tensorrt": str(trt.__version__), "gpu_compute_capability": capability,
                "l4t": l4t_release(self._tegra_release)}


def l4t_release(path: Path = NV_TEGRA_RELEASE) -> str:
    """The L4T (JetPack's Linux) release from ``/etc/nv_tegra_release``, e.g. "36.3.0"; "none" off a Jetson."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "none"
    except OSError:
        return "unknown"
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"{m[1]}.{m[2]}" if m else "unknown"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _import_tensorrt() -> Any:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        raise ToolchainError(
            f"TensorRT is not installed on this machine ({_one_line(exc)}): build TensorRT engines on the Jetson "
            "itself (JetPack ships TensorRT) or on a host with an NVIDIA GPU and `pip install tensorrt cuda-python`"
        ) from exc
    return tensorrt


def _make_logger(trt: Any) -> Any:
    """A TensorRT logger that keeps errors for the exception message and passes warnings to logging."""

    class _Logger(trt.ILogger):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
            elif severity == trt.ILogger.Severity.WARNING:
                _log.warning("TensorRT: %s", msg)

    return _Logger()


def _errors(logger: Any) -> str:
    text = "; ".join(" ".join(e.split()) for e in logger.errors[-3:]) or "TensorRT logged no error"
    logger.errors.clear()
    return text


# ---- device memory ------------------------------------------------------------------------------------------


class _Device(Protocol):
    @property
    def stream(self) -> int: ...

    def alloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def to_device(self, ptr: int, host: np.ndarray) -> None: ...

    def to_host(self, host: np.ndarray, ptr: int) -> None: ...

    def synchronize(self) -> None: ...

    def compute_capability(self) -> str: ...

    def close(self) -> None: ...


class _CudaRuntime:
    """cuda-python's runtime API: every call returns (cudaError_t, *results)."""

    def __init__(self, cudart: Any):
        self._rt = cudart
        self._stream: Any = None

    def _call(self, what: str, result: tuple[Any, ...]) -> Any:
        err, *rest = result
        if err != self._rt.cudaError_t.cudaSuccess:
            raise ToolchainError(f"CUDA {what} failed: {getattr(err, 'name', err)}")
        return rest[0] if rest else None

    @property
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
        self._call("cudaStreamSynchronize", self._rt.cudaStreamSynchronize(self.stream))

    def compute_capability(self) -> str:
        attr = self._rt.cudaDeviceAttr
        dev = self._call("cudaGetDevice", self._rt.cudaGetDevice())
        major = self._call("cudaDeviceGetAttribute",
                           self._rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, dev))
        minor = self._call("cudaDeviceGetAttribute",
                           self._rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, dev))
        return f"{major}.{minor}"

    def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            self._call("cudaStreamDestroy", self._rt.cudaStreamDestroy(stream))


class _PyCuda:
    """pycuda's driver API (its context comes from ``pycuda.autoinit``)."""

    def __init__(self, driver: Any):
        self._drv = driver
        self._stream: Any = None
        self._allocations: dict[int, Any] = {}

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._drv.Error as exc:
            raise ToolchainError(f"CUDA {what} failed (pycuda): {_one_line(exc)}") from exc

    @property
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
        import pycuda.autoinit  # noqa: F401  (creates the CUDA context pycuda works in)
        import pycuda.driver as driver
    except ImportError as exc:
        problems.append(_one_line(exc))
    except Exception as exc:  # pycuda raises its own types when no GPU can be opened
        raise ToolchainError(f"pycuda cannot open a CUDA device: {_one_line(exc)}") from exc
    else:
        return _PyCuda(driver)
    raise ToolchainError(f"TensorRT needs CUDA Python bindings for device memory and none imports "
                         f"({'; '.join(problems)}): `pip install cuda-python` (or pycuda)")


class _DeviceBuffers:
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

    def upload(self, name: str, host: np.ndarray) -> int:
        ptr = self.get(name, host.nbytes)
        self._device.to_device(ptr, host)
        return ptr

    def release(self) -> None:
        held, self._held = self._held, {}
        for ptr, _ in held.values():
            self._device.free(ptr)


# ---- build --------------------------------------------------------------------------------------------------


def _batch_axis(shape: Shape) -> int | None:
    """The batch axis of an engine tensor, by the rule of :mod:`compiler.graph`."""
    dynamic = [i for i, d in enumerate(shape) if d < 0]
    if shape and shape[0] < 0:
        return 0
    return dynamic[0] if len(dynamic) == 1 else None


@dataclass(frozen=True)
class _InputRange:
    """One network input: every dimension fixed but the batch."""

    batch_axis: int | None
    fixed: Shape

    def at(self, batch: int) -> Shape:
        return tuple(batch if i == self.batch_axis else d for i, d in enumerate(self.fixed))


def _input_ranges(network_inputs: dict[str, Shape], info: GraphInfo,
                  calibration: Dataset | None) -> dict[str, _InputRange]:
    """The batch axis from the graph; other dynamic dimensions at the size of the calibration data."""
    specs = {s.name: s for s in info.inputs}
    out = {}
    for name, shape in network_inputs.items():
        axis = specs[name].batch_axis if name in specs else _batch_axis(shape)
        if axis is not None and shape[axis] >= 0:
            axis = None
        fixed = list(shape)
        for i, d in enumerate(shape):
            if d >= 0 or i == axis:
                continue
            if calibration is None or name not in calibration.inputs:
                raise InputError(f"input {name!r} has dynamic dimensions besides the batch ({list(shape)}); TensorRT "
                                 "builds them at the size of the calibration data, and none was given (--calibration)")
            fixed[i] = int(calibration.inputs[name].shape[i])
        out[name] = _InputRange(axis, tuple(fixed))
    return out


class _Feeder:
    """Our calibration set as TensorRT asks for it: fixed-size batches in device memory. The last batch is
    completed with samples from the start, so every sample is seen and the batch shape never changes."""

    def __init__(self, data: Dataset, dtypes: dict[str, np.dtype], batch_size: int, device: _Device):
        self.batch_size = batch_size
        self.batches = 0
        self.error: Exception | None = None
        self.calibrator: Any = None
        self._data = data
        self._dtypes = dtypes
        self._next = 0
        self._buffers = _DeviceBuffers(device)

    def next_batch(self, names: list[str]) -> list[int] | None:
        try:
            return self._next_batch(names)
        except Exception as exc:  # an exception must not cross into TensorRT's C++; re-raised after the build
            self.error = exc
            return None

    def _next_batch(self, names: list[str]) -> list[int] | None:
        if self._next >= len(self._data):
            return None
        feed = self._data.pick(np.arange(self._next, self._next + self.batch_size) % len(self._data))
        ptrs = [self._buffers.upload(n, np.ascontiguousarray(feed[n], dtype=self._dtypes[n])) for n in names]
        self._next += self.batch_size
        self.batches += 1
        return ptrs

    def close(self) -> None:
        self._buffers.release()


def _calibrator(base: Any, feeder: _Feeder) -> Any:
    class _Calibrator(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)

        def get_batch_size(self) -> int:
            return feeder.batch_size

        def get_batch(self, names: list[str]) -> list[int] | None:
            return feeder.next_batch(names)

        def read_calibration_cache(self) -> bytes | None:
            return None  # always calibrate on the data set given to this build

        def write_calibration_cache(self, cache: Any) -> None:
            return None

    return _Calibrator()


class _Build:
    def __init__(self, trt: Any, logger: Any, device: _Device, profile: HardwareProfile):
        self._trt = trt
        self._logger = logger
        self._device = device
        self._profile = profile
        self._settings = profile.tensorrt or TensorRTSettings()

    def run(self, source: Path, info: GraphInfo, precision: str, calibration: Dataset | None,
            out_path: Path) -> QuantizationInfo | None:
        trt = self._trt
        self._logger.errors.clear()
        builder = trt.Builder(self._logger)
        network = builder.create_network(self._network_flags(builder))
        parser = trt.OnnxParser(network, self._logger)
        self._parse(parser, source)
        config = builder.create_builder_config()
        self._set_workspace(config)
        tensors = [network.get_input(i) for i in range(network.num_inputs)]
        dtypes = {t.name: np.dtype(trt.nptype(t.dtype)) for t in tensors}
        ranges = _input_ranges({t.name: tuple(t.shape) for t in tensors}, info, calibration)
        max_batch = self._profile.runtime.max_batch_size
        self._add_profile(builder, config, ranges, 1, max_batch)
        if self._settings.dla_core is not None:
            self._use_dla(builder, config, self._settings.dla_core)
        cache_file = self._timing_cache_file()
        _load_timing_cache(config, cache_file)
        feeder: _Feeder | None = None
        quantization = None
        try:
            if precision == "fp16":
                config.set_flag(trt.BuilderFlag.FP16)
            else:
                feeder, quantization = self._setup_int8(builder, config, ranges, dtypes, calibration)
            plan = builder.build_serialized_network(network, config)
            if feeder is not None and feeder.error is not None:
                if isinstance(feeder.error, CompilerError):
                    raise feeder.error
                raise ToolchainError(f"feeding the calibration set failed: {_one_line(feeder.error)}") from feeder.error
            if plan is None:
                raise ToolchainError(f"TensorRT could not build {source.name} as {precision}: {_errors(self._logger)}")
        finally:
            if feeder is not None:
                feeder.close()
        _save_timing_cache(config, cache_file)
        try:
            _write_atomic(out_path, memoryview(plan))
        except OSError as exc:
            raise ToolchainError(f"cannot write the engine to {out_path}: {exc.strerror}") from exc
        return quantization

    def _network_flags(self, builder: Any) -> int:
        """TensorRT 8 makes implicit-batch networks unless told (its ONNX parser needs explicit batch);
        TensorRT 10 has only explicit batch, and no implicit-batch max_batch_size left on the builder."""
        if hasattr(builder, "max_batch_size"):
            return 1 << int(self._trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        return 0

    def _parse(self, parser: Any, source: Path) -> None:
        if parser.parse_from_file(str(source)):
            return
        problems = [_parser_problem(parser.get_error(i), source) for i in range(parser.num_errors)]
        raise ToolchainError(f"TensorRT's ONNX parser rejected {source.name}: "
                             f"{'; '.join(problems) or _errors(self._logger)}")

    def _set_workspace(self, config: Any) -> None:
        size = self._settings.workspace_mb << 20
        if hasattr(config, "set_memory_pool_limit"):
            config.set_memory_pool_limit(self._trt.MemoryPoolType.WORKSPACE, size)
        else:
            config.max_workspace_size = size

    def _add_profile(self, builder: Any, config: Any, ranges: dict[str, _InputRange], low: int, high: int,
                     calibration: bool = False) -> None:
        opt = builder.create_optimization_profile()
        for name, r in ranges.items():
            opt.set_shape(name, r.at(low), r.at(high), r.at(high))
        if calibration:
            if not config.set_calibration_profile(opt):
                raise ToolchainError(f"TensorRT refused the calibration profile: {_errors(self._logger)}")
        elif config.add_optimization_profile(opt) < 0:
            raise ToolchainError(f"TensorRT refused the optimization profile (batch {low}..{high}): "
                                 f"{_errors(self._logger)}")

    def _use_dla(self, builder: Any, config: Any, core: int) -> None:
        available = int(builder.num_DLA_cores)
        if not 0 <= core < available:
            raise ToolchainError(f"profile {self._profile.name} asks for DLA core {core} and this device has "
                                 f"{available} DLA cores: build on the Jetson the profile is for, or drop "
                                 "tensorrt.dla_core from the profile")
        config.default_device_type = self._trt.DeviceType.DLA
        config.DLA_core = core
        config.set_flag(self._trt.BuilderFlag.GPU_FALLBACK)

    def _timing_cache_file(self) -> Path:
        version = re.sub(r"[^0-9A-Za-z.]+", "_", str(self._trt.__version__))
        capability = self._device.compute_capability().replace(".", "")
        return _cache_root() / f"timing-{version}-sm{capability}.cache"

    def _setup_int8(self, builder: Any, config: Any, ranges: dict[str, _InputRange], dtypes: dict[str, np.dtype],
                    calibration: Dataset | None) -> tuple[_Feeder, QuantizationInfo]:
        q = self._profile.quantization
        if calibration is None:
            raise InputError("TensorRT int8 needs a calibration set (--calibration)")
        if q.method != "static":
            raise InputError(f"profile {self._profile.name}: int8 needs quantization.method 'static'")
        base = _CALIBRATORS.get(q.calibration_method)
        if base is None:
            raise InputError(f"profile {self._profile.name}: TensorRT has no {q.calibration_method} calibrator; set "
                             "quantization.calibration_method to 'entropy' or 'minmax'")
        data = calibration.head(q.max_calibration_samples)
        feeder = _Feeder(data, dtypes, min(self._profile.runtime.max_batch_size, len(data)), self._device)
        feeder.calibrator = _calibrator(getattr(self._trt, base), feeder)
        config.set_flag(self._trt.BuilderFlag.INT8)
        config.set_flag(self._trt.BuilderFlag.FP16)
        config.int8_calibrator = feeder.calibrator
        if hasattr(config, "set_calibration_profile"):
            self._add_profile(builder, config, ranges, feeder.batch_size, feeder.batch_size, calibration=True)
        return feeder, QuantizationInfo(
            scheme="s8s8", activation_type="int8", weight_type="int8", weight_bits=8, per_channel=True,
            calibration_method=q.calibration_method, calibration_samples=len(data),
            reason=f"TensorRT INT8: symmetric int8 activations calibrated per tensor on {len(data)} samples "
                   f"({base}) and int8 weights per channel; layers without int8 kernels run in fp16")


def _parser_problem(err: Any, source: Path) -> str:
    """One parser error, naming its node: TensorRT 10 says the node's name, 8 only its index in the graph."""
    name = err.node_name() if hasattr(err, "node_name") else ""
    op = err.node_operator() if hasattr(err, "node_operator") else ""
    index = int(err.node())
    if not name and index >= 0:
        name, op = _onnx_node(source, index)
    if name:
        where = f"node {name!r}" + (f" ({op})" if op else "")
    else:
        where = f"node #{index}" if index >= 0 else "graph"
    return f"{where}: {' '.join(str(err.desc()).split())}"


def _onnx_node(source: Path, index: int) -> tuple[str, str]:
    import onnx

    try:
        node = onnx.load(str(source), load_external_data=False).graph.node[index]
    except Exception:  # naming the node is a courtesy; the parser's own message still stands
        return "", ""
    return node.name, node.op_type


def _cache_root() -> Path:
    base = os.environ.get("EDGEFLEET_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "edgefleet") / "tensorrt"


def _load_timing_cache(config: Any, path: Path) -> None:
    """Give the builder the timing cache of earlier builds; a missing, damaged or mismatched one only costs time."""
    blob = b""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        pass
    except OSError as exc:
        _log.warning("cannot read the TensorRT timing cache %s: %s", path, exc.strerror)
    cache = None
    if blob:
        try:
            cache = config.create_timing_cache(blob)
        except RuntimeError:
            cache = None
    if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
        return
    if blob:
        _log.warning("the TensorRT timing cache %s does not fit this TensorRT and GPU; starting a new one", path)
    config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _save_timing_cache(config: Any, path: Path) -> None:
    cache = config.get_timing_cache()
    if cache is None:
        return
    try:
        _write_atomic(path, memoryview(cache.serialize()))
    except OSError as exc:
        _log.warning("cannot save the TensorRT timing cache %s: %s", path, exc.strerror)


def _write_atomic(path: Path, data: memoryview) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- run ----------------------------------------------------------------------------------------------------


class _TensorIO:
    """TensorRT 8.5 and later: I/O tensors by name, execute_async_v3."""

    def __init__(self, trt: Any, engine: Any, context: Any):
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        self.shapes = {n: tuple(engine.get_tensor_shape(n)) for n in names}
        self._context = context

    def set_shape(self, name: str, shape: Shape) -> bool:
        return bool(self._context.set_input_shape(name, shape))

    def shape(self, name: str) -> Shape:
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
        self.shapes = {n: tuple(engine.get_binding_shape(i)) for i, n in enumerate(self._names)}
        self._context = context

    def set_shape(self, name: str, shape: Shape) -> bool:
        return bool(self._context.set_binding_shape(self._index[name], shape))

    def shape(self, name: str) -> Shape:
        return tuple(self._context.get_binding_shape(self._index[name]))

    def execute(self, addresses: dict[str, int], stream: int) -> bool:
        return bool(self._context.execute_async_v2(bindings=[addresses[n] for n in self._names], stream_handle=stream))


def _release(buffers: _DeviceBuffers, device: _Device) -> None:
    buffers.release()
    device.close()


class _EngineRunner:
    """Runs a serialized engine: shapes set per call, batches above the engine's maximum split."""

    def __init__(self, trt: Any, logger: Any, device: _Device, plan: bytes, max_batch: int,
                 output_names: Sequence[str] | None, where: str):
        logger.errors.clear()
        self._logger = logger
        self._runtime = trt.Runtime(logger)
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise ToolchainError(f"{where}: TensorRT {trt.__version__} cannot load this engine ({_errors(logger)}); "
                                 "an engine runs only on the TensorRT version and GPU it was built for")
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise ToolchainError(f"{where}: TensorRT cannot create an execution context ({_errors(logger)})")
        has_v3 = hasattr(self._context, "execute_async_v3")
        self._io = _TensorIO(trt, self._engine, self._context) if has_v3 else _BindingIO(trt, self._engine,
                                                                                         self._context)
        self._order = list(self._io.outputs if output_names is None else output_names)
        unknown = [n for n in self._order if n not in self._io.outputs]
        if unknown:
            raise ToolchainError(f"{where}: the engine has no output {unknown[0]!r} (it has {self._io.outputs})")
        self._axes = {n: _batch_axis(s) for n, s in self._io.shapes.items()}
        self._max_batch = max_batch
        self._device = device
        self._buffers = _DeviceBuffers(device)
        self._finalizer = weakref.finalize(self, _release, self._buffers, device)

    def close(self) -> None:
        self._finalizer()

    def __call__(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [n for n in self._io.inputs if n not in feed]
        if missing:
            raise InputError(f"the engine needs inputs {missing}; got {sorted(feed)}")
        total = next((feed[n].shape[a] for n in self._io.inputs if (a := self._axes[n]) is not None), 0)
        if total <= self._max_batch:
            outs = self._run(feed)
        else:
            parts = [self._run(self._slice(feed, s, s + self._max_batch)) for s in range(0, total, self._max_batch)]
            outs = {n: parts[0][n] if (a := self._axes[n]) is None else np.concatenate([p[n] for p in parts], axis=a)
                    for n in self._io.outputs}
        return [outs[n] for n in self._order]

    def _slice(self, feed: dict[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
        out = {}
        for n in self._io.inputs:
            a = self._axes[n]
            out[n] = feed[n] if a is None else feed[n][(slice(None),) * a + (slice(start, stop),)]
        return out

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        addresses = {}
        for name in self._io.inputs:
            host = np.ascontiguousarray(feed[name], dtype=self._io.dtypes[name])
            if not self._io.set_shape(name, host.shape):
                raise InputError(f"input {name!r} of shape {list(host.shape)} does not fit the engine "
                                 f"({list(self._io.shapes[name])}, batch 1..{self._max_batch}): "
                                 f"{_errors(self._logger)}")
            addresses[name] = self._buffers.upload(name, host)
        outs = {}
        for name in self._io.outputs:
            shape = self._io.shape(name)
            if any(d < 0 for d in shape):
                raise ToolchainError(f"output {name!r} has a data-dependent shape {list(shape)}, which this runner "
                                     "does not support")
            outs[name] = np.empty(shape, self._io.dtypes[name])
            addresses[name] = self._buffers.get(name, outs[name].nbytes)
        if not self._io.execute(addresses, self._device.stream):
            raise ToolchainError(f"TensorRT inference failed: {_errors(self._logger)}")
        self._device.synchronize()
        for name, host in outs.items():
            self._device.to_host(host, addresses[name])
        return outs
