"""Open Inference Protocol (KServe v2) infer requests and responses, JSON and binary tensor data.

Pure functions, no I/O: every way a request can be wrong raises RequestError with a message that
names the tensor and says what was expected.

The binary tensor data extension (Triton's): the body is a JSON header of
``Inference-Header-Content-Length`` bytes followed by the raw tensors, in the order of the inputs that
carry ``"parameters": {"binary_data_size": n}``, each in row-major order with the datatype's
little-endian layout. Binary tensors become arrays with ``np.frombuffer`` (no copy); JSON ``data``
with one ``np.asarray``. Nothing here loops over elements in Python. JSON is parsed and written with
orjson (a 224x224x3 FP32 body: 17 ms to parse and convert against 82 ms with the standard library); a
body orjson refuses is parsed again by the standard library, so a body that is not strict JSON (NaN,
integers beyond 64 bits, deep nesting) gets the same precise message as before.

A response carries an output in binary when the request asks: ``"binary_data": true`` in the output's
``parameters``, or ``"binary_data_output": true`` in the request's ``parameters`` for every output it
does not say otherwise for. The response's JSON header then gives each binary output's
``binary_data_size`` and the HTTP header ``Inference-Header-Content-Length`` says where the JSON ends.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ...engines import NP_DTYPES
from ...protocol.manifest import TensorSpec
from ..core.request import InferRequest
from ..errors import InferenceFailed, RequestError

if TYPE_CHECKING:
    from .shm import SharedMemory

__all__ = ["CUDA_SHM_REFUSED", "HEADER_LENGTH", "MODEL_CONTROL_REFUSED", "InferRequest", "RequestTemplate",
           "decode_request", "encode_response", "parse_body", "raw_request", "request_template"]

# what a model load or unload asked by a local client gets (UNAVAILABLE over gRPC, 503 over HTTP: Triton's answer
# when its model control mode is not explicit)
MODEL_CONTROL_REFUSED = ("explicit model load / unload is not allowed: this agent loads the models its fleet's "
                         "desired state names (start a rollout from the fleet)")
CUDA_SHM_REFUSED = ("CUDA shared memory is not supported by this agent; pass tensors in system shared memory "
                    "(its status and unregister calls answer as for no region registered)")
HEADER_LENGTH = "inference-header-content-length"  # the HTTP header (lower case, as ASGI gives headers)

_REQ_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "shape", "datatype", "parameters", "data"}
_OUTPUT_KEYS = {"name", "parameters"}
MAX_PRIORITY = 2  # priority 1 is high; 0 (the default) and 2 are normal, as in Triton with two levels


def parse_body(body: bytes | memoryview, header_length: str | None, specs: tuple[TensorSpec, ...],
               out_specs: tuple[TensorSpec, ...], shm: SharedMemory | None = None) -> InferRequest:
    """An HTTP infer body -> a validated request. ``header_length`` is the ``Inference-Header-Content-Length``
    header's value, if the request has one (binary tensor data follows the JSON)."""
    binary: memoryview | None = None
    if header_length is not None:
        if not header_length.isdigit():
            raise RequestError(f"Inference-Header-Content-Length must be a byte count, got {header_length!r}")
        hl = int(header_length)
        if hl == 0:  # Triton's raw binary request: the whole body is the model's one input
            return decode_request(raw_request(len(body), specs), specs, out_specs, memoryview(body), shm=shm)
        if hl > len(body):
            raise RequestError(f"Inference-Header-Content-Length says the JSON header is {hl} bytes; the body has "
                               f"only {len(body)}")
        binary = memoryview(body)[hl:]
        # a header with nothing after it (Triton's clients frame shared-memory requests so): parsed as it is
        text: bytes | memoryview = body if hl == len(body) else memoryview(body)[:hl]
    else:
        text = body
    try:
        doc = _loads(bytes(text) if isinstance(text, memoryview) else text)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        where = "the JSON header (Inference-Header-Content-Length bytes)" if binary is not None else "the body"
        raise RequestError(f"{where} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise RequestError("the body's JSON is nested too deeply") from exc
    return decode_request(doc, specs, out_specs, binary, shm=shm)


def raw_request(size: int, specs: tuple[TensorSpec, ...]) -> dict[str, Any]:
    """The JSON request a raw binary request (``Inference-Header-Content-Length: 0``, the body one raw tensor) stands
    for, as Triton reads one: the model must have one input; its datatype and shape come from the model, the batch
    dimension (if any) from the body's length, ``size`` bytes; every output comes back binary. decode_request checks
    the rest as for any request (the batch bound, NaN)."""
    if len(specs) != 1:
        raise RequestError(f"a raw binary request (Inference-Header-Content-Length: 0) needs a model with one input; "
                           f"this one has {len(specs)} ({', '.join(s.name for s in specs)}): send a JSON header")
    spec = specs[0]
    item = np.dtype(NP_DTYPES[spec.datatype]).itemsize
    shape = list(spec.shape)
    for i, d in enumerate(shape):
        if d == -1 and i != spec.batch_axis:
            raise RequestError(f"a raw binary request needs input {spec.name!r}'s shape fixed but for its batch "
                               f"dimension; {shape} has another dynamic dimension ({i}): send a JSON header")
    per_item = item * int(np.prod([d for i, d in enumerate(shape) if i != spec.batch_axis], dtype=np.int64))
    if size == 0 or size % per_item or (spec.batch_axis is None and size != per_item):
        raise RequestError(f"a raw binary request of {size} bytes is not whole {spec.datatype} tensors of input "
                           f"{spec.name!r} ({shape}: {per_item} bytes each)")
    if spec.batch_axis is not None:
        shape[spec.batch_axis] = size // per_item
    return {"inputs": [{"name": spec.name, "shape": shape, "datatype": spec.datatype,
                        "parameters": {"binary_data_size": size}}],
            "parameters": {"binary_data_output": True}}


def _loads(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        # the standard library's verdict and message: it takes NaN (refused later, by name), big integers
        # (refused as out of range) and explains deep nesting
        return json.loads(text)


def decode_request(body: Any, specs: tuple[TensorSpec, ...], out_specs: tuple[TensorSpec, ...],
                   binary: memoryview | None = None, raw: dict[str, memoryview] | None = None,
                   shm: SharedMemory | None = None) -> InferRequest:
    """A parsed JSON request (and the binary data after its header, if any) -> a validated request. ``raw``:
    each input's bytes by name (gRPC's raw_input_contents), for inputs with ``binary_data_size``. ``shm``: the
    registered shared-memory regions, for inputs and outputs that name one."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object with an 'inputs' list")
    unknown = set(body) - _REQ_KEYS
    if unknown:
        raise RequestError(f"unknown request field(s) {sorted(unknown)}; allowed: {sorted(_REQ_KEYS)}")
    req_id = body.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise RequestError("'id' must be a string")
    params = _params(body.get("parameters"), "the request")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("'inputs' must be a non-empty list of tensors")
    by_name = {s.name: s for s in specs}
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    for i, t in enumerate(inputs):
        if not isinstance(t, dict):
            raise RequestError(f"inputs[{i}] must be an object with name, shape, datatype and data")
        bad = set(t) - _INPUT_KEYS
        if bad:
            raise RequestError(f"inputs[{i}]: unknown field(s) {sorted(bad)}")
        name = t.get("name")
        if not isinstance(name, str):
            raise RequestError(f"inputs[{i}]: 'name' must be a string, got {type(name).__name__}")
        if name not in by_name:
            raise RequestError(f"inputs[{i}]: unknown input {name!r}; the model takes {sorted(by_name)}")
        if name in feeds:
            raise RequestError(f"input {name!r} is given twice")
        feeds[name], offset = _decode_tensor(t, by_name[name], binary if raw is None else raw.get(name), offset,
                                             shm, raw is not None)
    if binary is not None and offset != len(binary):
        raise RequestError(f"the inputs' binary_data_size add up to {offset} bytes, but {len(binary)} bytes of "
                           "binary data follow the JSON header")
    missing = set(by_name) - set(feeds)
    if missing:
        raise RequestError(f"missing input(s) {sorted(missing)}")
    batches = {s.name: feeds[s.name].shape[s.batch_axis] for s in specs if s.batch_axis is not None}
    if len(set(batches.values())) > 1:
        raise RequestError(f"inputs disagree on the batch size: {batches}")
    all_binary = _flag(params, "binary_data_output", "the request")
    names = [s.name for s in out_specs]
    outputs = body.get("outputs")
    wanted: tuple[str, ...] | None = None
    binary_out = set(names) if all_binary else set()
    shm_out: dict[str, tuple[str, int, int]] = {}
    if outputs is not None:
        if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                     for o in outputs):
            raise RequestError("'outputs' must be a list of objects with a 'name'")
        wanted = tuple(o["name"] for o in outputs)
        unknown_out = [w for w in wanted if w not in names]
        if unknown_out:
            raise RequestError(f"unknown output(s) {unknown_out}; the model has {names}")
        for o in outputs:
            bad = set(o) - _OUTPUT_KEYS
            if bad:
                raise RequestError(f"output {o['name']!r}: unknown field(s) {sorted(bad)}")
            op = _params(o.get("parameters"), f"output {o['name']!r}")
            if "shared_memory_region" in op:
                if shm is None or not shm.enabled:
                    raise RequestError(f"output {o['name']!r}: this agent has no system shared memory")
                shm_out[o["name"]] = shm.check_output(op["shared_memory_region"], op.get("shared_memory_offset", 0),
                                                      op.get("shared_memory_byte_size"), f"output {o['name']!r}")
            if "binary_data" in op:
                if _flag(op, "binary_data", f"output {o['name']!r}"):
                    binary_out.add(o["name"])
                else:
                    binary_out.discard(o["name"])
            elif not all_binary:
                binary_out.discard(o["name"])
    priority = params.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= MAX_PRIORITY:
        raise RequestError(f"parameter 'priority' must be 0 (default), 1 (high) or 2 (normal), got {priority!r}")
    timeout = params.get("timeout")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1):
        raise RequestError(f"parameter 'timeout' must be a positive number of microseconds, got {timeout!r}")
    return InferRequest(feeds, wanted, frozenset(binary_out) - set(shm_out), req_id, priority, timeout, shm_out)


@dataclass(frozen=True)
class _InputPlan:
    name: str
    region: str | None  # shared memory: the region; None: binary data after the JSON header
    offset: int  # the region offset (shared memory)
    size: int  # bytes
    count: int
    shape: tuple[int, ...]
    dtype: np.dtype  # the model's
    what: str

    @property
    def le(self) -> np.dtype:
        return self.dtype.newbyteorder("<")


@dataclass(frozen=True)
class RequestTemplate:
    """What decode_request concluded from one JSON header that passed it (the local socket caches these by the
    header's exact bytes, agent/transports/local.py): everything that follows from the header and the model's specs
    alone. ``apply`` redoes every check that depends on anything else -- the binary data's length, each shared-memory
    region's registration, bounds and access (SharedMemory.read / check_output, as decode_request calls them),
    NaN and infinity in the data -- and raises RequestError where decode_request would refuse (the caller then
    runs decode_request for its exact verdict). Only headers whose inputs are all binary or in shared memory."""

    specs: tuple[TensorSpec, ...]
    out_specs: tuple[TensorSpec, ...]
    has_binary: bool
    inputs: tuple[_InputPlan, ...]
    shm_outputs: tuple[tuple[str, str, int, int, str], ...]  # (name, region, offset, byte_size, what)
    binary_size: int
    outputs: tuple[str, ...] | None
    binary_outputs: frozenset[str]
    id: str | None
    priority: int
    timeout_us: int | None

    # derived from the above (request_template): the shared-memory reads of the inputs, in order, and the outputs'
    # placements to check, as SharedMemory.gather takes them
    shm_reads: tuple[tuple[str, int, int, np.dtype, tuple[int, ...], str], ...] = ()
    shm_checks: tuple[tuple[str, int, int, str], ...] = ()
    # the answers' JSON to requests of this template, by their outputs' shapes (encode_response's memo)
    answers: dict[tuple, bytes] = field(default_factory=dict, compare=False)

    def apply(self, binary: memoryview | None, shm: SharedMemory | None) -> InferRequest:
        if (binary is not None) != self.has_binary:
            raise RequestError("the binary data does not match the template")
        if self.binary_size != (0 if binary is None else len(binary)):
            raise RequestError("the binary data's length does not match the inputs' binary_data_size")
        from_shm: list[np.ndarray] = []
        if self.shm_reads or self.shm_checks:
            if shm is None or not shm.enabled:
                raise RequestError("this agent has no system shared memory")
            from_shm = shm.gather(self.shm_reads, self.shm_checks)  # one lock, a read per input
        feeds: dict[str, np.ndarray] = {}
        offset = k = 0
        for p in self.inputs:
            if p.region is not None:
                arr = from_shm[k]
                k += 1
            else:
                assert binary is not None  # has_binary
                arr = np.frombuffer(binary, dtype=p.le, count=p.count, offset=offset).reshape(p.shape)
                if arr.ctypes.data % p.dtype.alignment:
                    arr = arr.copy()
                offset += p.size
            if not p.dtype.isnative:
                arr = arr.astype(p.dtype)
            if p.dtype.kind == "f" and not np.isfinite(arr).all():
                raise RequestError(f"{p.what}: data contains NaN or infinity")
            feeds[p.name] = arr
        return InferRequest(feeds, self.outputs, self.binary_outputs, self.id, self.priority, self.timeout_us,
                            {name: (region, off, size) for name, region, off, size, _ in self.shm_outputs})


def request_template(doc: Any, req: InferRequest, specs: tuple[TensorSpec, ...], out_specs: tuple[TensorSpec, ...],
                     has_binary: bool) -> RequestTemplate | None:
    """The template of a header ``doc`` that decode_request accepted as ``req`` (with these specs, binary data
    after it or not) -> a RequestTemplate, or None where it would not pay or not be exact (JSON ``data`` inputs:
    their values are in the header)."""
    by_name = {s.name: s for s in specs}
    plans = []
    total = 0
    for t in doc["inputs"]:
        name = t["name"]
        params = t.get("parameters") or {}
        dtype = np.dtype(NP_DTYPES[by_name[name].datatype])
        shape = tuple(t["shape"])
        count = math.prod(shape)
        what = f"input {name!r}"
        region = params.get("shared_memory_region")
        if region is not None:
            plans.append(_InputPlan(name, region, params.get("shared_memory_offset", 0), count * dtype.itemsize,
                                    count, shape, dtype, what))
        elif params.get("binary_data_size") is not None and "data" not in t:
            plans.append(_InputPlan(name, None, 0, params["binary_data_size"], count, shape, dtype, what))
            total += params["binary_data_size"]
        else:
            return None
    outs: list[tuple[str, str, int, int, str]] = []
    for o in doc.get("outputs") or ():
        op = o.get("parameters") or {}
        if "shared_memory_region" in op:
            outs.append((o["name"], op["shared_memory_region"], op.get("shared_memory_offset", 0),
                         op["shared_memory_byte_size"], f"output {o['name']!r}"))
    if {o[0] for o in outs} != set(req.shm_outputs):
        return None
    return RequestTemplate(specs, out_specs, has_binary, tuple(plans), tuple(outs), total, req.outputs,
                           req.binary_outputs, req.id, req.priority, req.timeout_us,
                           tuple((p.region, p.offset, p.size, p.le, p.shape, p.what) for p in plans
                                 if p.region is not None),
                           tuple((region, off, size, what) for _, region, off, size, what in outs))


def _params(p: Any, what: str) -> dict[str, Any]:
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise RequestError(f"{what}: 'parameters' must be an object")
    return p


def _flag(p: dict[str, Any], key: str, what: str) -> bool:
    v = p.get(key, False)
    if not isinstance(v, bool):
        raise RequestError(f"{what}: parameter {key!r} must be true or false, got {v!r}")
    return v


def _decode_tensor(t: dict[str, Any], spec: TensorSpec, binary: memoryview | None,
                   offset: int, shm: SharedMemory | None = None, own_buffer: bool = False) -> tuple[np.ndarray, int]:
    """-> (the array, the offset of the next binary tensor). ``own_buffer``: ``binary`` holds this tensor alone
    (gRPC), and ``offset`` is left alone."""
    name = spec.name
    dtype = t.get("datatype")
    if dtype != spec.datatype:
        raise RequestError(f"input {name!r}: datatype {dtype!r} does not match the model's {spec.datatype!r}")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise RequestError(f"input {name!r}: 'shape' must be a list of integers")
    want = list(spec.shape)
    if len(shape) != len(want):
        raise RequestError(f"input {name!r}: shape {shape} has {len(shape)} dimensions, the model expects "
                           f"{len(want)} ({_fmt(want, spec.batch_axis)})")
    b = spec.batch_axis
    if b is not None and shape[b] < 1:
        raise RequestError(f"input {name!r}: batch dimension must be at least 1, got {shape[b]}")
    for i, (have, w) in enumerate(zip(shape, want, strict=True)):
        if w != -1 and have != w:
            raise RequestError(f"input {name!r}: shape {shape} does not match the model's {_fmt(want, b)} "
                               f"(dimension {i} must be {w})")
        if have < 1:
            raise RequestError(f"input {name!r}: dimension {i} must be positive, got {have}")
    count = math.prod(shape)
    np_dtype = np.dtype(NP_DTYPES[spec.datatype])
    params = _params(t.get("parameters"), f"input {name!r}")
    size = params.get("binary_data_size")
    arr: np.ndarray
    region = params.get("shared_memory_region")
    if region is not None:
        if shm is None or not shm.enabled:
            raise RequestError(f"input {name!r}: this agent has no system shared memory")
        if size is not None or "data" in t:
            raise RequestError(f"input {name!r}: give one of 'data', binary_data_size or shared_memory_region")
        need = count * np_dtype.itemsize
        given = params.get("shared_memory_byte_size")
        if given != need or isinstance(given, bool):
            raise RequestError(f"input {name!r}: shared_memory_byte_size is {given!r}; shape {shape} of "
                               f"{spec.datatype} needs {need}")
        arr = shm.read(region, params.get("shared_memory_offset", 0), need, np_dtype.newbyteorder("<"), shape,
                       f"input {name!r}")
        if not np_dtype.isnative:
            arr = arr.astype(np_dtype)
    elif size is not None:
        if binary is None:
            raise RequestError(f"input {name!r} has binary_data_size but the request has no "
                               "Inference-Header-Content-Length header (no binary data)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RequestError(f"input {name!r}: binary_data_size must be a byte count, got {size!r}")
        if "data" in t:
            raise RequestError(f"input {name!r}: give either 'data' or binary_data_size, not both")
        need = count * np_dtype.itemsize
        if size != need:
            raise RequestError(f"input {name!r}: binary_data_size is {size} bytes; shape {shape} of "
                               f"{spec.datatype} needs {need}")
        start = 0 if own_buffer else offset
        if start + size > len(binary):
            raise RequestError(f"input {name!r}: binary data truncated: needs bytes {offset}..{offset + size} but "
                               f"only {len(binary)} bytes follow the JSON header")
        arr = np.frombuffer(binary, dtype=np_dtype.newbyteorder("<"), count=count, offset=start).reshape(shape)
        if arr.ctypes.data % np_dtype.alignment:  # the runtimes want aligned buffers; a copy is cheap next to them
            arr = arr.copy()
        if not np_dtype.isnative:
            arr = arr.astype(np_dtype)
        offset += 0 if own_buffer else size
    else:
        if "data" not in t:
            raise RequestError(f"input {name!r}: no 'data' and no binary_data_size")
        try:
            with np.errstate(over="raise", invalid="raise"):  # 1e39 into FP32 is an error, not inf
                arr = np.asarray(t["data"], dtype=np_dtype)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"input {name!r}: data is not a (nested) list of {spec.datatype} numbers "
                               f"({exc})") from exc
        except (OverflowError, RecursionError, FloatingPointError) as exc:
            raise RequestError(f"input {name!r}: a value does not fit {spec.datatype} or the data is nested too "
                               f"deeply ({exc})") from exc
        if arr.size != count:
            raise RequestError(f"input {name!r}: {arr.size} values given, shape {shape} needs {count}")
        arr = arr.reshape(shape)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise RequestError(f"input {name!r}: data contains NaN or infinity")
    return arr, offset


def _fmt(shape: list[int], batch_axis: int | None = 0) -> str:
    return "[" + ", ".join("N" if i == batch_axis else ("?" if d == -1 else str(d)) for i, d in enumerate(shape)) + "]"


def ordered_outputs(outputs: list[np.ndarray], specs: tuple[TensorSpec, ...],
                    req: InferRequest) -> Iterator[tuple[str, np.ndarray, TensorSpec]]:
    """The outputs a request asked for, in its order (every output in the model's order if it named none),
    each checked to hold no NaN or infinity: what the HTTP and the gRPC answers both encode."""
    order = req.outputs if req.outputs is not None else tuple(s.name for s in specs)
    by_name = {s.name: (arr, s) for arr, s in zip(outputs, specs, strict=True)}
    # the batcher checked the whole batch (agent.core.batching.dispatch.Outputs)
    checked = getattr(outputs, "finite", False)
    for name in order:
        arr, spec = by_name[name]
        if not checked and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise InferenceFailed(f"the model produced NaN or infinity in output {spec.name!r}")
        yield name, arr, spec


def encode_response(model: str, version: str, outputs: list[np.ndarray], specs: tuple[TensorSpec, ...],
                    req: InferRequest, shm: SharedMemory | None = None,
                    memo: dict[tuple, bytes] | None = None, describe_shm: bool = True) -> tuple[bytes, int | None]:
    """-> (the body, the length of its JSON header if binary data follows it, else None). Outputs the request
    placed in shared memory are written there (``shm``) and described without data. ``memo``: answers kept for
    requests of one RequestTemplate (its ``answers``): where every output goes to shared memory, the JSON depends only
    on the outputs' shapes (and the model's version), so it is built once per shape. ``describe_shm`` False: an output
    written to shared memory gets no ``parameters`` (Triton's HTTP answer: its C++ client, perf_analyzer's, reads
    an output's parameters as binary data and refuses ones without ``binary_data_size``)."""
    placed = ordered_outputs(outputs, specs, req)
    if memo is not None and shm is not None and req.shm_outputs and not req.binary_outputs \
            and len(req.shm_outputs) == len(outputs if req.outputs is None else req.outputs):
        key = (model, version, *(a.shape for a in outputs))
        head = memo.get(key)
        if head is not None:  # the same JSON as last time: only the data to write
            shm.scatter([(*req.shm_outputs[name], _little(arr, spec), f"output {name!r}")
                         for name, arr, spec in placed])
            return head, None
        if len(memo) >= 8:
            memo.clear()
    else:
        key = None
    out = []
    blobs: list[bytes] = []
    for name, arr, spec in placed:
        t: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype, "shape": list(arr.shape)}
        if name in req.shm_outputs:
            if shm is None:
                raise InferenceFailed(f"output {name!r}: the shared-memory regions are gone")
            region, off, size = req.shm_outputs[name]
            n = shm.write(region, off, size, _little(arr, spec), f"output {name!r}")
            if describe_shm:
                t["parameters"] = {"shared_memory_region": region, "shared_memory_byte_size": n,
                                   **({"shared_memory_offset": off} if off else {})}
        elif name in req.binary_outputs:
            data = _little(arr, spec).tobytes()
            t["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:
            t["data"] = arr.reshape(-1).tolist()
        out.append(t)
    resp: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": out}
    if req.id is not None:
        resp["id"] = req.id
    try:
        head = orjson.dumps(resp)
    except orjson.JSONEncodeError:  # an id with a lone surrogate (the json module let it in): escape it
        head = json.dumps(resp, separators=(",", ":")).encode()
    if key is not None and memo is not None and all("data" not in t for t in out):
        memo[key] = head
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)


_LITTLE = {k: np.dtype(v).newbyteorder("<") for k, v in NP_DTYPES.items()}


def _little(arr: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian array of its spec's datatype (no copy when it is one already)."""
    return np.ascontiguousarray(arr, dtype=_LITTLE[spec.datatype])
