"""A fake ``tensorrt``: the subset of the TensorRT Python API that edgefleet's build target uses, in two flavours
that differ where the real ones do:

- ``api="10"`` (TensorRT 10): I/O tensors by name, ``execute_async_v3``, ``set_memory_pool_limit``, no implicit
  batch (the EXPLICIT_BATCH flag still exists and is ignored), parser errors that name their node;
- ``api="8"`` (TensorRT 8.2): bindings by index, ``execute_async_v2``, ``max_workspace_size``, implicit-batch
  networks unless created with EXPLICIT_BATCH (which its ONNX parser needs), parser errors with a node index.

The engine is real enough to run. The builder checks what TensorRT checks (an optimization profile for dynamic
inputs that fits the network, a DLA core that exists, calibration data for INT8), pulls every calibration batch
from the calibrator and reads it from fake device memory, then writes a JSON header of what it was asked (flags,
profiles, workspace, DLA core, the calibration it consumed, the timing cache it was given) followed by the ONNX
bytes. The runtime executes that ONNX with onnxruntime in fp32 (precision flags are recorded, not emulated),
reading inputs from and writing outputs to the addresses it is given in :class:`DeviceMemory`.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx

from tests.fakes.fake_cuda import DeviceMemory

__all__ = ["make_tensorrt", "read_engine"]

MAGIC = b"FAKETRT1"


def read_engine(data: bytes | Path) -> tuple[dict[str, Any], bytes]:
    """The JSON header and the ONNX bytes of a fake engine."""
    raw = data.read_bytes() if isinstance(data, Path) else bytes(data)
    if not raw.startswith(MAGIC):
        raise ValueError("not a fake TensorRT engine")
    (size,) = struct.unpack_from("<Q", raw, len(MAGIC))
    start = len(MAGIC) + 8
    return json.loads(raw[start:start + size]), raw[start + size:]


class Severity(IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    Severity = Severity

    def __init__(self) -> None:
        pass

    def log(self, severity: int, msg: str) -> None:
        raise NotImplementedError


class Logger(ILogger):
    INTERNAL_ERROR = Severity.INTERNAL_ERROR
    ERROR = Severity.ERROR
    WARNING = Severity.WARNING
    INFO = Severity.INFO
    VERBOSE = Severity.VERBOSE

    def __init__(self, min_severity: Severity = Severity.WARNING):
        super().__init__()
        self.min_severity = min_severity
        self.messages: list[tuple[int, str]] = []

    def log(self, severity: int, msg: str) -> None:
        if severity <= self.min_severity:
            self.messages.append((severity, msg))


class DataType(IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    INT64 = 8


_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}
_FROM_ONNX: dict[int, DataType] = {onnx.TensorProto.FLOAT: DataType.FLOAT, onnx.TensorProto.FLOAT16: DataType.HALF,
              onnx.TensorProto.INT8: DataType.INT8, onnx.TensorProto.INT32: DataType.INT32,
              onnx.TensorProto.BOOL: DataType.BOOL, onnx.TensorProto.UINT8: DataType.UINT8,
              onnx.TensorProto.INT64: DataType.INT64}


def nptype(dtype: DataType) -> type:
    return _NP[DataType(dtype)]


class TensorIOMode(IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class BuilderFlag(IntEnum):
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 5
    TF32 = 7


class MemoryPoolType(IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1


class DeviceType(IntEnum):
    GPU = 0
    DLA = 1


class NetworkDefinitionCreationFlag8(IntEnum):
    EXPLICIT_BATCH = 0
    EXPLICIT_PRECISION = 1


class NetworkDefinitionCreationFlag10(IntEnum):
    EXPLICIT_BATCH = 0  # deprecated and ignored: every network is explicit batch
    STRONGLY_TYPED = 1


class ErrorCode(IntEnum):
    SUCCESS = 0
    INTERNAL_ERROR = 1
    MEM_ALLOC_FAILED = 2
    MODEL_DESERIALIZE_FAILED = 3
    INVALID_VALUE = 4
    INVALID_GRAPH = 5
    INVALID_NODE = 6
    UNSUPPORTED_GRAPH = 7
    UNSUPPORTED_NODE = 8


class CalibrationAlgoType(IntEnum):
    LEGACY_CALIBRATION = 0
    ENTROPY_CALIBRATION = 1
    ENTROPY_CALIBRATION_2 = 2
    MINMAX_CALIBRATION = 3


class IInt8Calibrator:
    """What TensorRT calls back; a subclass implements the four methods."""

    def __init__(self) -> None:
        pass

    def get_batch_size(self) -> int:
        raise NotImplementedError

    def get_batch(self, names: list[str]) -> list[int] | None:
        raise NotImplementedError

    def read_calibration_cache(self) -> bytes | None:
        raise NotImplementedError

    def write_calibration_cache(self, cache: bytes) -> None:
        raise NotImplementedError

    def get_algorithm(self) -> CalibrationAlgoType:
        return CalibrationAlgoType.LEGACY_CALIBRATION


class IInt8EntropyCalibrator2(IInt8Calibrator):
    def get_algorithm(self) -> CalibrationAlgoType:
        return CalibrationAlgoType.ENTROPY_CALIBRATION_2


class IInt8MinMaxCalibrator(IInt8Calibrator):
    def get_algorithm(self) -> CalibrationAlgoType:
        return CalibrationAlgoType.MINMAX_CALIBRATION


class HostMemory(bytes):
    """IHostMemory: a buffer."""

    @property
    def nbytes(self) -> int:
        return len(self)


@dataclass
class _Env:
    api: str
    version: str
    memory: DeviceMemory
    dla_cores: int

    @property
    def device(self) -> str:
        major, minor = self.memory.compute_capability
        return f"sm{major}{minor}"


@dataclass
class ITensor:
    name: str
    shape: tuple[int, ...]
    dtype: DataType


def _tensor(value: onnx.ValueInfoProto) -> ITensor:
    tt = value.type.tensor_type
    dims = tuple(int(d.dim_value) if d.HasField("dim_value") else -1 for d in tt.shape.dim)
    return ITensor(value.name, dims, _FROM_ONNX[tt.elem_type])


class INetworkDefinition:
    def __init__(self, env: _Env, flags: int):
        self.flags = int(flags)
        self.explicit_batch = env.api == "10" or bool(self.flags & (1 << NetworkDefinitionCreationFlag8.EXPLICIT_BATCH))
        self.inputs: list[ITensor] = []
        self.outputs: list[ITensor] = []
        self.onnx: bytes | None = None

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def get_input(self, index: int) -> ITensor:
        return self.inputs[index]

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_output(self, index: int) -> ITensor:
        return self.outputs[index]


class ParserError:
    def __init__(self, code: ErrorCode, desc: str, node: int = -1, node_name: str = "", op: str = ""):
        self._code, self._desc, self._node, self._node_name, self._op = code, desc, node, node_name, op

    def code(self) -> ErrorCode:
        return self._code

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._node

    def file(self) -> str:
        return "ModelImporter.cpp"

    def line(self) -> int:
        return 0

    def func(self) -> str:
        return "parseGraph"


class ParserError10(ParserError):
    def node_name(self) -> str:
        return self._node_name

    def node_operator(self) -> str:
        return self._op


class OnnxParser:
    _env: _Env

    def __init__(self, network: INetworkDefinition, logger: ILogger):
        self._network = network
        self._logger = logger
        self._errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> ParserError:
        return self._errors[index]

    def clear_errors(self) -> None:
        self._errors.clear()

    def _fail(self, code: ErrorCode, desc: str, node: int = -1, name: str = "", op: str = "") -> bool:
        cls = ParserError10 if self._env.api == "10" else ParserError
        self._errors.append(cls(code, desc, node, name, op))
        self._logger.log(Severity.ERROR, f"ModelImporter: In node {node}: {code.name}: {desc}")
        return False

    def parse_from_file(self, model: str) -> bool:
        try:
            data = Path(model).read_bytes()
        except OSError as exc:
            return self._fail(ErrorCode.MODEL_DESERIALIZE_FAILED, f"Failed to open {model}: {exc.strerror}")
        return self.parse(data, model)

    def parse(self, model: bytes, path: str | None = None) -> bool:
        if not self._network.explicit_batch:
            return self._fail(ErrorCode.INVALID_VALUE, "the ONNX parser supports only networks created with the "
                                                       "EXPLICIT_BATCH flag")
        try:
            graph = onnx.load_from_string(bytes(model))
            onnx.checker.check_model(graph)
        except Exception as exc:  # onnx raises several types for a bad model
            return self._fail(ErrorCode.MODEL_DESERIALIZE_FAILED, f"Failed to parse ONNX model: {exc}")
        for i, node in enumerate(graph.graph.node):
            if not onnx.defs.has(node.op_type, node.domain or ""):
                return self._fail(ErrorCode.UNSUPPORTED_NODE, f"No importer registered for op: {node.op_type}", i,
                                  node.name, node.op_type)
        initializers = {t.name for t in graph.graph.initializer}
        self._network.inputs = [_tensor(v) for v in graph.graph.input if v.name not in initializers]
        self._network.outputs = [_tensor(v) for v in graph.graph.output]
        self._network.onnx = bytes(model)
        return True


Shape = tuple[int, ...]


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
        self.valid = True

    def set_shape(self, input: str, min: Shape, opt: Shape, max: Shape) -> None:
        lo, mid, hi = (tuple(int(d) for d in s) for s in (min, opt, max))
        if not len(lo) == len(mid) == len(hi) or any(not 0 <= a <= b <= c for a, b, c in zip(lo, mid, hi, strict=True)):
            self.valid = False
        self.shapes[input] = (lo, mid, hi)

    def get_shape(self, input: str) -> list[Shape]:
        return list(self.shapes[input])


class ITimingCache:
    def __init__(self, device: str, entries: dict[str, str] | None = None):
        self.device = device
        self.entries = dict(entries or {})

    def serialize(self) -> HostMemory:
        return HostMemory(json.dumps({"fake_timing_cache": 1, "device": self.device,
                                      "entries": self.entries}).encode())

    def combine(self, other: ITimingCache, ignore_mismatch: bool) -> bool:
        if other.device != self.device and not ignore_mismatch:
            return False
        self.entries.update(other.entries)
        return True


class IBuilderConfig:
    def __init__(self, env: _Env):
        self._env = env
        self._flags: set[BuilderFlag] = set()
        self.int8_calibrator: IInt8Calibrator | None = None
        self.profiles: list[IOptimizationProfile] = []
        self.calibration_profile: IOptimizationProfile | None = None
        self.default_device_type = DeviceType.GPU
        self.DLA_core = -1
        self._timing_cache: ITimingCache | None = None

    def set_flag(self, flag: BuilderFlag) -> None:
        self._flags.add(BuilderFlag(flag))

    def clear_flag(self, flag: BuilderFlag) -> None:
        self._flags.discard(BuilderFlag(flag))

    def get_flag(self, flag: BuilderFlag) -> bool:
        return BuilderFlag(flag) in self._flags

    @property
    def flag_names(self) -> list[str]:
        return sorted(f.name for f in self._flags)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        if not profile.valid:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def set_calibration_profile(self, profile: IOptimizationProfile) -> bool:
        if not profile.valid:
            return False
        self.calibration_profile = profile
        return True

    def get_calibration_profile(self) -> IOptimizationProfile | None:
        return self.calibration_profile

    def create_timing_cache(self, serialized: bytes) -> ITimingCache | None:
        if not serialized:
            return ITimingCache(self._env.device)
        try:
            doc = json.loads(bytes(serialized))
            if doc["fake_timing_cache"] != 1:
                return None
            return ITimingCache(str(doc["device"]), dict(doc["entries"]))
        except (ValueError, KeyError, TypeError):
            return None

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        if cache.device != self._env.device and not ignore_mismatch:
            return False
        self._timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self._timing_cache

    def workspace_bytes(self) -> int | None:
        raise NotImplementedError


class IBuilderConfig8(IBuilderConfig):
    def __init__(self, env: _Env):
        super().__init__(env)
        self.max_workspace_size = 0

    def workspace_bytes(self) -> int | None:
        return self.max_workspace_size or None


class IBuilderConfig10(IBuilderConfig):
    def __init__(self, env: _Env):
        super().__init__(env)
        self._pools: dict[MemoryPoolType, int] = {}

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self._pools[MemoryPoolType(pool)] = int(pool_size)

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self._pools.get(MemoryPoolType(pool), 0)

    def workspace_bytes(self) -> int | None:
        return self._pools.get(MemoryPoolType.WORKSPACE)


class Builder:
    _env: _Env

    def __init__(self, logger: ILogger):
        self.logger = logger

    @property
    def num_DLA_cores(self) -> int:
        return self._env.dla_cores

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(self._env, flags)

    def create_builder_config(self) -> IBuilderConfig:
        return (IBuilderConfig10 if self._env.api == "10" else IBuilderConfig8)(self._env)

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> HostMemory | None:
        problems = self._problems(network, config)
        if problems:
            for p in problems:
                self.logger.log(Severity.ERROR, p)
            return None
        assert network.onnx is not None
        calibration = None
        if config.get_flag(BuilderFlag.INT8):
            calibration = self._calibrate(network, config)
            if calibration is None:
                return None
        cache = config.get_timing_cache()
        header = {
            "tensorrt_version": self._env.version, "device": self._env.device, "network_flags": network.flags,
            "flags": config.flag_names, "workspace_bytes": config.workspace_bytes(),
            "profiles": [{n: [list(s) for s in shapes] for n, shapes in p.shapes.items()} for p in config.profiles],
            "dla_core": config.DLA_core if config.default_device_type == DeviceType.DLA else None,
            "timing_cache_entries_given": None if cache is None else len(cache.entries),
            "calibration": calibration,
            "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": int(t.dtype)} for t in network.inputs],
            "outputs": [{"name": t.name, "shape": list(t.shape), "dtype": int(t.dtype)} for t in network.outputs],
        }
        if cache is not None:
            key = hashlib.sha256(network.onnx + json.dumps(config.flag_names).encode()).hexdigest()[:16]
            cache.entries[key] = f"tactics timed for {len(onnx.load_from_string(network.onnx).graph.node)} nodes"
        blob = json.dumps(header).encode()
        return HostMemory(MAGIC + struct.pack("<Q", len(blob)) + blob + network.onnx)

    def _problems(self, network: INetworkDefinition, config: IBuilderConfig) -> list[str]:
        if network.onnx is None:
            return ["Network must have at least one output"]
        dynamic = [t for t in network.inputs if -1 in t.shape]
        if dynamic and not config.profiles:
            return ["Network has dynamic or shape inputs, but no optimization profile has been defined."]
        problems = []
        for i, profile in enumerate(config.profiles):
            for t in network.inputs:
                if t.name not in profile.shapes:
                    if t in dynamic:
                        problems.append(f"{t.name}: dynamic input is missing dimensions in profile {i}.")
                    continue
                for shape in profile.shapes[t.name]:
                    if len(shape) != len(t.shape) or any(d not in (-1, s) for d, s in zip(t.shape, shape, strict=True)):
                        problems.append(f"{t.name}: profile {i} shape {list(shape)} does not match the network's "
                                        f"{list(t.shape)}")
        if config.default_device_type == DeviceType.DLA:
            if not 0 <= config.DLA_core < self._env.dla_cores:
                problems.append(f"DLA core {config.DLA_core} is not available ({self._env.dla_cores} cores)")
            if not (config.get_flag(BuilderFlag.FP16) or config.get_flag(BuilderFlag.INT8)):
                problems.append("DLA requires FP16 or INT8 precision")
        return problems

    def _calibrate(self, network: INetworkDefinition, config: IBuilderConfig) -> dict[str, Any] | None:
        calibrator = config.int8_calibrator
        if not isinstance(calibrator, IInt8Calibrator):
            self.logger.log(Severity.ERROR, "Calibration failure occurred with no scaling factors detected: INT8 "
                                            "needs a calibrator or dynamic ranges")
            return None
        record: dict[str, Any] = {"algorithm": calibrator.get_algorithm().name}
        if calibrator.read_calibration_cache():
            return {**record, "from_cache": True}
        profile = config.calibration_profile
        if profile is None and config.profiles:
            self.logger.log(Severity.WARNING, "Calibration Profile is not defined. Calibrating with Profile 0")
            profile = config.profiles[0]
        shapes = {t.name: profile.shapes[t.name][1] if profile and t.name in profile.shapes else t.shape
                  for t in network.inputs}
        record.update(batch_size=int(calibrator.get_batch_size()), shapes={n: list(s) for n, s in shapes.items()},
                      batches=0, sample_sums={t.name: [] for t in network.inputs}, ranges={})
        names = [t.name for t in network.inputs]
        while ptrs := calibrator.get_batch(names):
            if len(ptrs) != len(names):
                self.logger.log(Severity.ERROR, f"Calibration failure: get_batch returned {len(ptrs)} pointers for "
                                                f"{len(names)} inputs")
                return None
            for t, ptr in zip(network.inputs, ptrs, strict=True):
                arr = self._read(int(ptr), shapes[t.name], np.dtype(nptype(t.dtype)))
                if arr is None:
                    return None
                lo, hi = record["ranges"].get(t.name, (math.inf, -math.inf))
                record["ranges"][t.name] = (min(lo, float(arr.min())), max(hi, float(arr.max())))
                record["sample_sums"][t.name] += arr.reshape(arr.shape[0], -1).sum(axis=1, dtype=np.float64).tolist()
            record["batches"] += 1
        calibrator.write_calibration_cache(HostMemory(json.dumps(record["ranges"]).encode()))
        return record

    def _read(self, ptr: int, shape: Shape, dtype: np.dtype) -> np.ndarray | None:
        try:
            data = self._env.memory.read(ptr, math.prod(shape) * dtype.itemsize)
        except ValueError as exc:
            self.logger.log(Severity.ERROR, f"Calibration failure: {exc}")
            return None
        return np.frombuffer(data, dtype).reshape(shape)


class Builder8(Builder):
    max_batch_size = 1  # implicit-batch mode, removed in TensorRT 10


class Runtime:
    _env: _Env

    def __init__(self, logger: ILogger):
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> ICudaEngine | None:
        try:
            header, model = read_engine(bytes(serialized_engine))
        except ValueError:
            self.logger.log(Severity.ERROR, "1: [stdArchiveReader.cpp::StdArchiveReader::32] Error Code 1: "
                                            "Serialization (Serialization assertion magicTagRead == kMAGIC_TAG "
                                            "failed.Magic tag does not match)")
            return None
        if header["tensorrt_version"] != self._env.version:
            self.logger.log(Severity.ERROR, f"The engine plan file is not compatible with this version of TensorRT, "
                                            f"expecting library version {self._env.version} got "
                                            f"{header['tensorrt_version']}, please rebuild.")
            return None
        if header["device"] != self._env.device:
            self.logger.log(Severity.ERROR, f"The engine plan file was built for {header['device']}, this GPU is "
                                            f"{self._env.device}, please rebuild.")
            return None
        cls = ICudaEngine10 if self._env.api == "10" else ICudaEngine8
        return cls(self._env, self.logger, header, model)


@dataclass(frozen=True)
class _IO:
    name: str
    mode: TensorIOMode
    dtype: DataType
    shape: Shape


class ICudaEngine:
    def __init__(self, env: _Env, logger: ILogger, header: dict[str, Any], model: bytes):
        import onnxruntime as ort

        self._env = env
        self._logger = logger
        self.header = header
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self._session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        self._io = [_IO(t["name"], mode, DataType(t["dtype"]), tuple(t["shape"]))
                    for key, mode in (("inputs", TensorIOMode.INPUT), ("outputs", TensorIOMode.OUTPUT))
                    for t in header[key]]
        self._by_name = {io.name: io for io in self._io}
        self._output_shapes: dict[tuple[Shape, ...], dict[str, Shape]] = {}

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.header["profiles"])

    def create_execution_context(self) -> IExecutionContext:
        return (IExecutionContext10 if self._env.api == "10" else IExecutionContext8)(self)

    def profile_range(self, name: str) -> tuple[Shape, Shape]:
        lo, _, hi = self.header["profiles"][0][name]
        return tuple(lo), tuple(hi)

    def output_shapes(self, inputs: dict[str, Shape]) -> dict[str, Shape]:
        key = tuple(inputs[io.name] for io in self._io if io.mode == TensorIOMode.INPUT)
        if key not in self._output_shapes:
            feed: dict[str, np.ndarray] = {n: np.zeros(s, nptype(self._by_name[n].dtype)) for n, s in inputs.items()}
            names = [o.name for o in self._session.get_outputs()]
            outs = self._session.run(None, feed)
            self._output_shapes[key] = {n: tuple(a.shape) for n, a in zip(names, outs, strict=True)}
        return self._output_shapes[key]

    def run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self._session.get_outputs()]
        return dict(zip(names, self._session.run(None, feed), strict=True))


class ICudaEngine10(ICudaEngine):
    @property
    def num_io_tensors(self) -> int:
        return len(self._io)

    def get_tensor_name(self, index: int) -> str:
        return self._io[index].name

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self._by_name[name].mode if name in self._by_name else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return self._by_name[name].dtype

    def get_tensor_shape(self, name: str) -> Shape:
        return self._by_name[name].shape

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Shape]:
        return [tuple(s) for s in self.header["profiles"][profile_index][name]]


class ICudaEngine8(ICudaEngine):
    @property
    def num_bindings(self) -> int:
        return len(self._io)

    def get_binding_name(self, index: int) -> str:
        return self._io[index].name

    def binding_is_input(self, index: int) -> bool:
        return self._io[index].mode == TensorIOMode.INPUT

    def get_binding_dtype(self, index: int) -> DataType:
        return self._io[index].dtype

    def get_binding_shape(self, index: int) -> Shape:
        return self._io[index].shape

    def get_profile_shape(self, profile_index: int, binding: int) -> list[Shape]:
        return [tuple(s) for s in self.header["profiles"][profile_index][self._io[binding].name]]


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self._shapes: dict[str, Shape] = {}
        self._addresses: dict[str, int] = {}

    def _error(self, msg: str) -> bool:
        self.engine._logger.log(Severity.ERROR, msg)
        return False

    def _inputs(self) -> list[_IO]:
        return [io for io in self.engine._io if io.mode == TensorIOMode.INPUT]

    def _set_shape(self, name: str, shape: Shape) -> bool:
        io = self.engine._by_name.get(name)
        if io is None or io.mode != TensorIOMode.INPUT:
            return self._error(f"setInputShape: {name!r} is not an input tensor")
        shape = tuple(int(d) for d in shape)
        lo, hi = self.engine.profile_range(name)
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi, strict=True)):
            return self._error(f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Given invalid "
                               f"tensor shape {list(shape)} for {name}: outside the profile [{list(lo)}, {list(hi)}])")
        self._shapes[name] = shape
        return True

    def _shape(self, name: str) -> Shape:
        io = self.engine._by_name[name]
        if io.mode == TensorIOMode.INPUT:
            return self._shapes.get(name, io.shape)
        if all(i.name in self._shapes for i in self._inputs()):
            return self.engine.output_shapes(self._shapes)[name]
        return io.shape

    def _execute(self, stream_handle: int) -> bool:
        memory = self.engine._env.memory
        if int(stream_handle) not in memory.streams:
            return self._error(f"enqueue: invalid CUDA stream {stream_handle:#x}")
        feed = {}
        for io in self._inputs():
            if io.name not in self._shapes:
                return self._error(f"enqueue: the shape of input {io.name} is not set")
            if io.name not in self._addresses:
                return self._error(f"enqueue: no address set for {io.name}")
            dtype = np.dtype(nptype(io.dtype))
            shape = self._shapes[io.name]
            try:
                data = memory.read(self._addresses[io.name], math.prod(shape) * dtype.itemsize)
            except ValueError as exc:
                return self._error(f"enqueue: input {io.name}: {exc}")
            feed[io.name] = np.frombuffer(data, dtype).reshape(shape)
        for name, arr in self.engine.run(feed).items():
            if name not in self._addresses:
                return self._error(f"enqueue: no address set for {name}")
            try:
                memory.write(self._addresses[name], arr.astype(nptype(self.engine._by_name[name].dtype)).tobytes())
            except ValueError as exc:
                return self._error(f"enqueue: output {name}: {exc}")
        return True


class IExecutionContext10(IExecutionContext):
    def set_input_shape(self, name: str, shape: Shape) -> bool:
        return self._set_shape(name, shape)

    def get_tensor_shape(self, name: str) -> Shape:
        return self._shape(name)

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if name not in self.engine._by_name:
            return self._error(f"setTensorAddress: {name!r} is not an I/O tensor")
        self._addresses[name] = int(memory)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        return self._execute(stream_handle)


class IExecutionContext8(IExecutionContext):
    def set_binding_shape(self, binding: int, shape: Shape) -> bool:
        return self._set_shape(self.engine._io[binding].name, shape)

    def get_binding_shape(self, binding: int) -> Shape:
        return self._shape(self.engine._io[binding].name)

    @property
    def all_binding_shapes_specified(self) -> bool:
        return all(io.name in self._shapes for io in self._inputs())

    def execute_async_v2(self, bindings: list[int], stream_handle: int) -> bool:
        if len(bindings) != len(self.engine._io):
            return self._error(f"enqueueV2: {len(bindings)} bindings for {len(self.engine._io)} tensors")
        self._addresses = {io.name: int(p) for io, p in zip(self.engine._io, bindings, strict=True)}
        return self._execute(stream_handle)


def make_tensorrt(memory: DeviceMemory, api: str = "10", version: str | None = None, dla_cores: int = 0) -> ModuleType:
    """A ``tensorrt`` module of the given API flavour whose GPU is ``memory``."""
    if api not in ("8", "10"):
        raise ValueError(f"api is '8' or '10', not {api!r}")
    env = _Env(api, version or ("10.3.0" if api == "10" else "8.2.1.8"), memory, dla_cores)
    mod = ModuleType("tensorrt")
    mod.__version__ = env.version  # type: ignore[attr-defined]
    common: list[Any] = [ILogger, Logger, DataType, nptype, BuilderFlag, DeviceType, ErrorCode, CalibrationAlgoType,
              IInt8Calibrator, IInt8EntropyCalibrator2, IInt8MinMaxCalibrator]
    newer = [TensorIOMode, MemoryPoolType] if api == "10" else []
    for obj in common + newer:
        setattr(mod, obj.__name__, obj)
    mod.NetworkDefinitionCreationFlag = (  # type: ignore[attr-defined]
        NetworkDefinitionCreationFlag10 if api == "10" else NetworkDefinitionCreationFlag8)
    mod.Builder = type("Builder", (Builder8 if api == "8" else Builder,), {"_env": env})  # type: ignore[attr-defined]
    mod.Runtime = type("Runtime", (Runtime,), {"_env": env})  # type: ignore[attr-defined]
    mod.OnnxParser = type("OnnxParser", (OnnxParser,), {"_env": env})  # type: ignore[attr-defined]
    return mod
