"""TensorRT target (Jetson GPUs): an engine per profile, FP16, or INT8 calibrated on our data set.

TensorRT is imported only inside methods, so this module imports on a machine without it; there every
method raises a one-line :class:`ToolchainError`. Device memory, the TensorRT import, its logger and its
I/O APIs are the serving engine's own (:mod:`engines.cuda`, :mod:`engines.tensorrt`), and the gate runs
the built engine through :func:`engines.load` like the agent does.
Where the TensorRT 8.x and 10.x Python APIs differ (explicit-batch flag, workspace limit, I/O tensors by
name or bindings by index, execute_async_v3 or v2) the code asks the objects what they have; it never
parses version strings.

The engine takes batches of 1 to ``runtime.max_batch_size``; the engine splits larger ones. Tactic timings
persist in a timing cache per TensorRT version and GPU under ``$EDGEFLEET_CACHE_DIR/tensorrt`` (default
``~/.cache/edgefleet/tensorrt``), so a rebuild does not time every tactic again.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...engines.cuda import Device, DeviceBuffers, one_line, open_device
from ...engines.errors import EngineError
from ...engines.tensorrt import import_tensorrt, logged_errors, make_logger
from ...judge.data import Dataset
from ...protocol.fsutil import atomic_write
from ...protocol.manifest import QuantizationInfo
from ...protocol.profile import HardwareProfile, TensorRTSettings
from ..errors import CompilerError, InputError, ToolchainError
from ..graph import GraphInfo

__all__ = ["TensorRTTarget", "l4t_release"]

_log = logging.getLogger(__name__)

NV_TEGRA_RELEASE = Path("/etc/nv_tegra_release")
_CALIBRATORS = {"minmax": "IInt8MinMaxCalibrator", "entropy": "IInt8EntropyCalibrator2"}
BUILD_ADVICE = ("build TensorRT engines on the Jetson itself (JetPack ships TensorRT) or on a host with an NVIDIA "
                "GPU and `pip install tensorrt cuda-python`")
Shape = tuple[int, ...]


class TensorRTTarget:
    qdq_int8_min_opset: int | None = None
    builds_with_reference_runtime = False
    float_build_needs_samples = True

    def __init__(self, tegra_release: Path = NV_TEGRA_RELEASE):
        self._tegra_release = tegra_release
        self._logger: Any = None

    def _trt(self) -> Any:
        try:
            trt = import_tensorrt(BUILD_ADVICE)
        except EngineError as exc:
            raise ToolchainError(str(exc)) from exc
        if self._logger is None:
            self._logger = make_logger(trt)
        return trt

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> QuantizationInfo | None:
        trt = self._trt()
        if precision not in ("fp16", "int8"):
            raise InputError(f"the TensorRT target builds fp16 or int8, not {precision}")
        device = _device()
        try:
            return _Build(trt, self._logger, device, profile).run(source, info, precision, calibration, out_path)
        except EngineError as exc:  # CUDA failed while calibrating
            raise ToolchainError(f"TensorRT failed building {source.name} as {precision}: {exc}") from exc
        except RuntimeError as exc:  # what TensorRT's bindings raise
            raise ToolchainError(f"TensorRT failed building {source.name} as {precision}: {one_line(exc)}") from exc
        finally:
            device.close()

    def toolchain_versions(self) -> dict[str, str]:
        return {"tensorrt": str(self._trt().__version__)}

    def engine_compatibility(self) -> dict[str, str]:
        """An engine runs only on the TensorRT version and GPU architecture it was built for (and, on a
        Jetson, the L4T release that ships that TensorRT)."""
        trt = self._trt()
        device = _device()
        try:
            capability = device.compute_capability()
        finally:
            device.close()
        return {"tensorrt": str(trt.__version__), "gpu_compute_capability": capability,
                "l4t": l4t_release(self._tegra_release)}


def _device() -> Device:
    try:
        return open_device()
    except EngineError as exc:
        raise ToolchainError(str(exc)) from exc


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

    def __init__(self, data: Dataset, dtypes: dict[str, np.dtype], batch_size: int, device: Device):
        self.batch_size = batch_size
        self.batches = 0
        self.error: Exception | None = None
        self.calibrator: Any = None
        self._data = data
        self._dtypes = dtypes
        self._next = 0
        self._buffers = DeviceBuffers(device)

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
    def __init__(self, trt: Any, logger: Any, device: Device, profile: HardwareProfile):
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
                raise ToolchainError(f"feeding the calibration set failed: {one_line(feeder.error)}") from feeder.error
            if plan is None:
                raise ToolchainError(f"TensorRT could not build {source.name} as {precision}: "
                                     f"{logged_errors(self._logger)}")
        finally:
            if feeder is not None:
                feeder.close()
        _save_timing_cache(config, cache_file)
        try:
            atomic_write(out_path, bytes(plan))
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
                             f"{'; '.join(problems) or logged_errors(self._logger)}")

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
                raise ToolchainError(f"TensorRT refused the calibration profile: {logged_errors(self._logger)}")
        elif config.add_optimization_profile(opt) < 0:
            raise ToolchainError(f"TensorRT refused the optimization profile (batch {low}..{high}): "
                                 f"{logged_errors(self._logger)}")

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
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, bytes(cache.serialize()))
    except OSError as exc:
        _log.warning("cannot save the TensorRT timing cache %s: %s", path, exc.strerror)
