"""Open Inference Protocol (KServe v2) JSON: decode a request into validated arrays, encode outputs.

Pure functions, no I/O: every way a request can be wrong raises RequestError with a message that
names the tensor and says what was expected.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agent.backends.base import NP_DTYPES
from agent.errors import InferenceFailed, RequestError
from protocol.manifest import TensorSpec

__all__ = ["decode_request", "encode_response"]

_REQ_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "shape", "datatype", "parameters", "data"}


def decode_request(body: Any, specs: tuple[TensorSpec, ...], out_specs: tuple[TensorSpec, ...],
                   ) -> tuple[dict[str, np.ndarray], list[str] | None, str | None]:
    """-> (feeds by input name, requested output names or None, request id)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object with an 'inputs' list")
    unknown = set(body) - _REQ_KEYS
    if unknown:
        raise RequestError(f"unknown request field(s) {sorted(unknown)}; allowed: {sorted(_REQ_KEYS)}")
    req_id = body.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise RequestError("'id' must be a string")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("'inputs' must be a non-empty list of tensors")
    by_name = {s.name: s for s in specs}
    feeds: dict[str, np.ndarray] = {}
    for i, t in enumerate(inputs):
        if not isinstance(t, dict):
            raise RequestError(f"inputs[{i}] must be an object with name, shape, datatype and data")
        bad = set(t) - _INPUT_KEYS
        if bad:
            raise RequestError(f"inputs[{i}]: unknown field(s) {sorted(bad)}")
        name = t.get("name")
        if name not in by_name:
            raise RequestError(f"inputs[{i}]: unknown input {name!r}; the model takes {sorted(by_name)}")
        if name in feeds:
            raise RequestError(f"input {name!r} is given twice")
        feeds[name] = _decode_tensor(t, by_name[name])
    missing = set(by_name) - set(feeds)
    if missing:
        raise RequestError(f"missing input(s) {sorted(missing)}")
    batches = {s.name: feeds[s.name].shape[s.batch_axis] for s in specs if s.batch_axis is not None}
    if len(set(batches.values())) > 1:
        raise RequestError(f"inputs disagree on the batch size: {batches}")
    outputs = body.get("outputs")
    wanted: list[str] | None = None
    if outputs is not None:
        if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                     for o in outputs):
            raise RequestError("'outputs' must be a list of objects with a 'name'")
        wanted = [o["name"] for o in outputs]
        names = [s.name for s in out_specs]
        unknown_out = [w for w in wanted if w not in names]
        if unknown_out:
            raise RequestError(f"unknown output(s) {unknown_out}; the model has {names}")
    return feeds, wanted, req_id


def _decode_tensor(t: dict[str, Any], spec: TensorSpec) -> np.ndarray:
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
    if "data" not in t:
        raise RequestError(f"input {name!r}: no 'data'")
    try:
        with np.errstate(over="raise", invalid="raise"):  # 1e39 into FP32 is an error, not inf
            arr: np.ndarray = np.asarray(t["data"], dtype=NP_DTYPES[spec.datatype])
    except (ValueError, TypeError) as exc:
        raise RequestError(f"input {name!r}: data is not a (nested) list of {spec.datatype} numbers ({exc})") from exc
    except (OverflowError, RecursionError, FloatingPointError) as exc:
        raise RequestError(f"input {name!r}: a value does not fit {spec.datatype} or the data is nested too "
                           f"deeply ({exc})") from exc
    count = math.prod(shape)
    if arr.size != count:
        raise RequestError(f"input {name!r}: {arr.size} values given, shape {shape} needs {count}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise RequestError(f"input {name!r}: data contains NaN or infinity")
    return arr.reshape(shape)


def _fmt(shape: list[int], batch_axis: int | None = 0) -> str:
    return "[" + ", ".join("N" if i == batch_axis else ("?" if d == -1 else str(d)) for i, d in enumerate(shape)) + "]"


def encode_response(model: str, version: str, outputs: list[np.ndarray], specs: tuple[TensorSpec, ...],
                    wanted: list[str] | None, req_id: str | None) -> dict[str, Any]:
    out = []
    for arr, spec in zip(outputs, specs, strict=True):
        if wanted is not None and spec.name not in wanted:
            continue
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise InferenceFailed(f"the model produced NaN or infinity in output {spec.name!r}")
        out.append({"name": spec.name, "datatype": spec.datatype, "shape": list(arr.shape),
                    "data": arr.reshape(-1).tolist()})
    resp: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": out}
    if req_id is not None:
        resp["id"] = req_id
    return resp
