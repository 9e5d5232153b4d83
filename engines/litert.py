"""LiteRT (TFLite) engine: ``ai-edge-litert``'s Interpreter, or ``tflite_runtime``'s identical one where only
that is installed (old numpy 1 images).

The compiler (``compiler/targets/litert.py``) embeds a metadata entry ``edgefleet_io`` in every engine it
builds: the signature to run and, per ONNX input and output in ONNX order, the signature key and the transpose
between the ONNX and the engine layout (onnx2tf renames quantized outputs ``output_0``... and leaves 3-5D
outputs channels-last). That contract is :class:`IOMap` here, written by the compiler with ``IOMap.to_json``
and read by :func:`read_io_map`. This engine reads it straight from the flatbuffer (no TensorFlow, no schema module)
and feeds and returns tensors in the manifest's names, order and layout. An engine without it is read by
onnx2tf's naming rules. Integer-quantized inputs and outputs (``-iqd``/``-oqd`` engines) are quantized and
dequantized with the tensor's own scale and zero point, so the manifest's float spec holds either way.

One Interpreter per instance: LiteRT interpreters are not thread-safe, and several instances of this engine
(several batcher instances) each own one.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol import jsonlimits
from ..protocol.errors import ContractError
from .base import Engine, EngineSpec, Runtime
from .errors import EngineLoadError, EngineRunError

__all__ = [
    "IO_FORMAT",
    "IO_METADATA",
    "RUNTIME",
    "IOMap",
    "LiteRTEngine",
    "Port",
    "interpreter_class",
    "read_io_map",
    "read_tflite_metadata",
]

log = logging.getLogger("edgefleet.engines.litert")

IO_METADATA = "edgefleet_io"
IO_FORMAT = 1


@dataclass(frozen=True)
class Port:
    name: str  # the ONNX (manifest) tensor name
    key: str  # the signature key in the engine
    perm: tuple[int, ...] | None  # input: manifest layout -> engine; output: engine -> manifest


@dataclass(frozen=True)
class IOMap:
    signature: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]

    def to_json(self) -> dict[str, Any]:
        def ports(ps: tuple[Port, ...]) -> list[dict[str, Any]]:
            return [{"name": p.name, "key": p.key, "perm": list(p.perm) if p.perm else None} for p in ps]

        return {"format": IO_FORMAT, "signature": self.signature, "inputs": ports(self.inputs),
                "outputs": ports(self.outputs)}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> IOMap:
        def ports(items: list[dict[str, Any]]) -> tuple[Port, ...]:
            return tuple(Port(str(i["name"]), str(i["key"]), tuple(int(d) for d in i["perm"])
                              if i.get("perm") else None) for i in items)

        return IOMap(str(doc["signature"]), ports(doc["inputs"]), ports(doc["outputs"]))


def interpreter_class() -> tuple[Any, str]:
    try:
        from ai_edge_litert.interpreter import Interpreter
        return Interpreter, "ai-edge-litert"
    except ImportError as first:
        try:
            from tflite_runtime.interpreter import Interpreter  # the predecessor, for numpy 1 images
            return Interpreter, "tflite-runtime"
        except ImportError:
            raise EngineLoadError(f"this bundle's engine is LiteRT (.tflite) and neither ai_edge_litert nor "
                               f"tflite_runtime imports ({first}): pip install ai-edge-litert") from first


# -- the flatbuffer ---------------------------------------------------------------------------------------
# TFLite's schema: Model { version, operator_codes, subgraphs, description, buffers (4), metadata_buffer,
# metadata (6), signature_defs }; Buffer { data: [ubyte] (0), offset: ulong (1), size: ulong (2) };
# Metadata { name: string (0), buffer: uint (1) }.
class _FB:
    def __init__(self, raw: bytes):
        self.raw = raw

    def u32(self, at: int) -> int:
        return int(struct.unpack_from("<I", self.raw, at)[0])

    def field(self, table: int, index: int) -> int | None:
        """Absolute position of a table's field, or None when absent."""
        vtable = table - int(struct.unpack_from("<i", self.raw, table)[0])
        vsize = int(struct.unpack_from("<H", self.raw, vtable)[0])
        slot = 4 + 2 * index
        if slot >= vsize:
            return None
        off = int(struct.unpack_from("<H", self.raw, vtable + slot)[0])
        return table + off if off else None

    def deref(self, at: int) -> int:
        return at + self.u32(at)

    def vector(self, table: int, index: int) -> tuple[int, int] | None:
        """(first element position, length) of a vector field."""
        at = self.field(table, index)
        if at is None:
            return None
        vec = self.deref(at)
        return vec + 4, self.u32(vec)

    def tables(self, table: int, index: int) -> list[int]:
        vec = self.vector(table, index)
        if vec is None:
            return []
        start, n = vec
        return [self.deref(start + 4 * i) for i in range(n)]


def read_tflite_metadata(raw: bytes, name: str) -> bytes | None:
    """The bytes of a named metadata entry of a TFLite flatbuffer, or None."""
    try:
        fb = _FB(raw)
        model = fb.deref(0)
        buffers = fb.tables(model, 4)
        for entry in fb.tables(model, 6):
            name_vec = fb.vector(entry, 0)
            if name_vec is None or raw[name_vec[0]:name_vec[0] + name_vec[1]] != name.encode():
                continue
            at = fb.field(entry, 1)
            index = fb.u32(at) if at is not None else 0
            if index >= len(buffers):
                return None
            buf = buffers[index]
            data = fb.vector(buf, 0)
            if data is not None and data[1]:
                return raw[data[0]:data[0] + data[1]]
            off_at, size_at = fb.field(buf, 1), fb.field(buf, 2)  # models over 2 GB keep buffers after the tree
            if off_at is not None and size_at is not None:
                off, size = struct.unpack_from("<Q", raw, off_at)[0], struct.unpack_from("<Q", raw, size_at)[0]
                return raw[off:off + size]
            return None
    except (struct.error, IndexError) as exc:
        raise EngineLoadError(f"not a readable TFLite flatbuffer ({exc})") from exc
    return None


def read_io_map(raw: bytes, signatures: dict[str, dict[str, list[str]]]) -> IOMap:
    """The engine's manifest <-> signature mapping: ``edgefleet_io`` when present, else onnx2tf's naming
    (inputs by key, outputs ``output_<i>`` by i, else in key order, no layout changes)."""
    data = read_tflite_metadata(raw, IO_METADATA)
    if data is not None:
        try:
            doc = jsonlimits.loads(data, source=IO_METADATA, max_bytes=1024**2)
            if doc.get("format") == IO_FORMAT:
                return IOMap.from_json(doc)
            log.warning("%s metadata has format %r (this agent reads %d); using onnx2tf's naming", IO_METADATA,
                        doc.get("format"), IO_FORMAT)
        except (ValueError, KeyError, TypeError, AttributeError, ContractError) as exc:
            raise EngineLoadError(f"the engine's {IO_METADATA} metadata is malformed: {exc}") from exc
    if not signatures:
        raise EngineLoadError("the .tflite engine has no signature; edgefleet runs TFLite models through signatures")
    signature = next(iter(signatures))
    ins, outs = signatures[signature]["inputs"], signatures[signature]["outputs"]
    numbered = {int(k.split("_")[1]): k for k in outs if re.fullmatch(r"output_\d+", k)}
    order = [numbered[i] for i in sorted(numbered)] if len(numbered) == len(outs) else list(outs)
    return IOMap(signature, tuple(Port(k, k, None) for k in ins), tuple(Port(k, k, None) for k in order))


# -- the engine -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    port: Port
    index: int
    dtype: np.dtype
    scale: float  # 0.0: not quantized
    zero_point: int


def _quantize(x: np.ndarray, t: _Tensor) -> np.ndarray:
    info = np.iinfo(t.dtype)
    q = np.round(x.astype(np.float32) / np.float32(t.scale)) + t.zero_point
    return np.clip(q, info.min, info.max).astype(t.dtype)


class LiteRTEngine(Engine):
    kind = "litert"

    def __init__(self, spec: EngineSpec, providers: tuple[str, ...] | None = None):
        super().__init__(spec)
        self._interp: Any = None
        self._lock = threading.Lock()  # one Interpreter runs one batch at a time
        self._shapes: dict[int, tuple[int, ...]] = {}

    def load(self, engine: Path, threads: int) -> None:
        interpreter, dist = interpreter_class()
        try:
            raw = engine.read_bytes()
        except OSError as exc:
            raise EngineLoadError(f"{engine}: cannot read the engine ({exc.strerror})") from exc
        if raw[4:8] != b"TFL3":
            raise EngineLoadError(f"{engine.name} is not a TFLite flatbuffer (no TFL3 identifier)")
        try:
            interp = interpreter(model_content=raw, num_threads=threads)
            interp.allocate_tensors()
            signatures = interp.get_signature_list()
        except (ValueError, RuntimeError) as exc:
            raise EngineLoadError(f"LiteRT ({dist}) cannot load {engine.name}: {' '.join(str(exc).split())}") from exc
        io = read_io_map(raw, signatures)
        if io.signature not in signatures:
            raise EngineLoadError(f"the engine has no signature {io.signature!r} (it has {sorted(signatures)})")
        runner = interp.get_signature_runner(io.signature)
        in_details, out_details = runner.get_input_details(), runner.get_output_details()

        def tensor(port: Port, details: dict[str, Any], what: str) -> _Tensor:
            if port.key not in details:
                raise EngineLoadError(f"the engine's signature {io.signature!r} has no {what} {port.key!r} "
                                   f"(it has {sorted(details)})")
            d = details[port.key]
            scale, zero = d.get("quantization", (0.0, 0))
            dtype = np.dtype(d["dtype"])
            quantized = dtype.kind in "iu" and scale > 0
            return _Tensor(port, int(d["index"]), dtype, float(scale) if quantized else 0.0, int(zero))

        by_name_in = {p.name: p for p in io.inputs}
        by_name_out = {p.name: p for p in io.outputs}
        missing = [s.name for s in self.inputs if s.name not in by_name_in] + \
                  [s.name for s in self.outputs if s.name not in by_name_out]
        if missing:
            raise EngineLoadError(f"the engine has no tensor {missing[0]!r} of the spec (it maps "
                               f"{sorted([*by_name_in, *by_name_out])})")
        self._in = [tensor(by_name_in[s.name], in_details, "input") for s in self.inputs]
        self._out = [tensor(by_name_out[s.name], out_details, "output") for s in self.outputs]
        self._shapes = {int(d["index"]): tuple(int(n) for n in d["shape"]) for d in interp.get_input_details()}
        self._interp = interp
        self.device = f"{dist} CPU ({threads} threads)"

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        arrays = []
        for t in self._in:
            x = feeds[t.port.name]
            if t.port.perm:
                x = x.transpose(t.port.perm)
            x = _quantize(x, t) if t.scale else x.astype(t.dtype, copy=False)
            arrays.append((t.index, np.ascontiguousarray(x)))
        with self._lock:
            interp = self._interp
            if interp is None:
                raise EngineRunError(f"{self.spec.label}: the LiteRT interpreter is gone")
            resized = False
            for index, arr in arrays:
                if self._shapes.get(index) != arr.shape:  # the batch size changed: resize, reallocate
                    interp.resize_tensor_input(index, list(arr.shape))
                    self._shapes[index] = arr.shape
                    resized = True
            if resized:
                interp.allocate_tensors()
            for index, arr in arrays:
                interp.set_tensor(index, arr)
            interp.invoke()
            raw = [interp.get_tensor(t.index) for t in self._out]  # copies
        outs = []
        for t, o in zip(self._out, raw, strict=True):
            if t.scale:
                o = ((o.astype(np.float32) - np.float32(t.zero_point)) * np.float32(t.scale))
            if t.port.perm:
                o = np.ascontiguousarray(o.transpose(t.port.perm))
            outs.append(o)
        return outs

    def _close_impl(self) -> None:
        with self._lock:
            self._interp = None


RUNTIME = Runtime(LiteRTEngine, backend="litert", precisions=("fp32", "fp16", "int8"),
                  modules=("ai_edge_litert", "tflite_runtime"), extra="edgefleet[agent]", suffix=".tflite",
                  target="edgefleet.compiler.targets.litert:LiteRTTarget", order=10)
