"""Graph checks: the source model must be a valid ONNX graph with a dynamic batch dimension."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from compiler.data import Dataset
from compiler.errors import InputError
from protocol.manifest import TensorSpec

__all__ = ["GraphInfo", "check_model", "ensure_opset"]

_ONNX_TO_KSERVE = {1: "FP32", 10: "FP16", 3: "INT8", 2: "UINT8", 6: "INT32", 7: "INT64", 9: "BOOL"}


@dataclass(frozen=True)
class GraphInfo:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    op_types: frozenset[str]
    opset: int
    metadata: dict[str, str]

    @property
    def has_conv(self) -> bool:
        return bool(self.op_types & {"Conv", "ConvTranspose"})


def _specs(values, what: str, path: Path) -> tuple[TensorSpec, ...]:
    out = []
    for v in values:
        tt = v.type.tensor_type
        dtype = _ONNX_TO_KSERVE.get(tt.elem_type)
        if dtype is None:
            raise InputError(f"{path}: {what} {v.name!r} has an unsupported element type {tt.elem_type}")
        dims = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0 and i > 0:
                dims.append(int(d.dim_value))
            elif i == 0:
                if d.HasField("dim_value") and d.dim_value > 0:
                    others = [j for j, e in enumerate(tt.shape.dim) if j > 0 and not e.HasField("dim_value")]
                    hint = (f"its dimension {others[0]} is dynamic: if that is the batch (recurrent state often "
                            "is [layers, N, hidden]), edgefleet cannot batch on it yet" if others else
                            "export the model with a dynamic first dimension (e.g. dynamic_axes={'input': {0: 'N'}}) "
                            "if it takes a batch")
                    raise InputError(f"{path}: {what} {v.name!r} has a fixed first dimension {d.dim_value}; {hint}")
                dims.append(-1)
            else:
                dims.append(-1)
        if not dims:
            raise InputError(f"{path}: {what} {v.name!r} is a scalar with no batch dimension; edgefleet serves "
                             "models whose every input and output is batched on axis 0 (feed a scalar parameter as a "
                             "[N] or [N, 1] input, or fold it into the graph as a constant)")
        out.append(TensorSpec.model_validate({"name": v.name, "datatype": dtype, "shape": tuple(dims)}))
    return tuple(out)


def _check_runs(path: Path) -> None:
    """Every node must have an onnxruntime CPU kernel (the fp32 reference and the x86/ARM targets run
    on it); name the node that has none."""
    import re

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        text = str(exc)
        m = re.search(r"Could not find an implementation for (\S+)\((\d+)\) node with name '([^']*)'", text)
        if m:
            raise InputError(f"{path}: node {m[3]!r} ({m[1]}, opset {m[2]}) has no onnxruntime CPU kernel, so the "
                             "onnxruntime targets cannot run it; replace the op or export with another opset") from exc
        raise InputError(f"{path}: onnxruntime cannot load the model: {text.strip().splitlines()[-1]}") from exc


def check_model(path: Path) -> GraphInfo:
    import onnx

    if not path.exists():
        raise InputError(f"{path}: model file not found")
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises several unrelated types
        raise InputError(f"{path}: not a valid ONNX model: {exc}") from exc
    _check_runs(path)
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    return GraphInfo(
        inputs=_specs(inputs, "input", path),
        outputs=_specs(model.graph.output, "output", path),
        op_types=frozenset(n.op_type for n in model.graph.node),
        opset=opset,
        metadata={p.key: p.value for p in model.metadata_props},
    )


def ensure_opset(path: Path, opset: int, out_path: Path, sample: Dataset) -> Path:
    """Convert the model to ``opset`` (onnx's version converter) and check that the converted graph
    computes what the original does on ``sample``; return the converted file."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(onnx.load(str(path)), opset)
        onnx.checker.check_model(converted)
        onnx.save(converted, str(out_path))
    except Exception as exc:  # the converter raises assorted types for ops it cannot lift
        raise InputError(f"{path}: cannot convert the graph to opset {opset}, which per-channel int8 needs "
                         f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); "
                         f"re-export the model with opset {opset} or newer, or compile with --precision fp32") from exc

    def run(p: Path) -> tuple[list[str], list[np.ndarray]]:
        sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        return [o.name for o in sess.get_outputs()], list(sess.run(None, sample.inputs))

    try:
        (names, before), (_, after) = run(path), run(out_path)
    except Exception as exc:
        raise InputError(f"{path}: the graph converted to opset {opset} does not run: {exc}") from exc
    for name, a, b in zip(names, before, after, strict=True):
        tol = 1e-4 + 1e-4 * float(np.abs(a).max(initial=0.0))
        diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0.0)) if a.shape == b.shape \
            else float("inf")
        if diff > tol:
            raise InputError(f"{path}: converting to opset {opset} changed output {name!r} (max abs difference "
                             f"{diff:.3g}); re-export the model with opset {opset} or newer")
    return out_path
