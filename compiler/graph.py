"""Graph checks: the source model must be a valid ONNX graph, and each tensor's batch axis is known.

Batch axes are read from the declared shapes, then tested against what the model does
(:func:`probe_batching`): a model whose outputs do not grow with the batch (a detector that folds the
batch into its anchor axis) is refused batching and served one sample at a time. A model with a fixed
batch of 1 (``[1, 1, 64, W]``: dynamic width) is evaluated sample by sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..judge.data import Dataset, sample_axes
from ..protocol.manifest import TensorSpec
from .errors import InputError

__all__ = ["QUANTIZED_OPS", "GraphInfo", "all_nodes", "check_model", "ensure_opset", "is_quantized_op", "name_nodes",
           "probe_batching", "quantized_ops", "quantized_phrase"]

_ONNX_TO_KSERVE = {1: "FP32", 10: "FP16", 3: "INT8", 2: "UINT8", 6: "INT32", 7: "INT64", 9: "BOOL"}


@dataclass(frozen=True)
class GraphInfo:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    op_types: frozenset[str]
    opset: int
    metadata: dict[str, str]
    # the model takes one sample per call (a fixed batch of 1, or batching refused): the data stacks samples
    # on axis 0 of every input and the eval runs them one at a time
    per_sample: bool = False
    batching_note: str = ""  # why the batch axes are what they are, when not simply axis 0
    data_axes: dict[str, int | None] = field(default_factory=dict)  # where the data stacks samples, if not as above
    # the export fixed this batch (> 1) and the graph cannot take another (compiler.batch): the specs show the batch
    # dynamic, and the engines pad up to it (engines.base.Engine.infer; manifest fixed_batch)
    fixed_batch: int | None = None

    def sample_axes(self) -> dict[str, int | None]:
        """Where the data holds the samples, per input (judge.data.sample_axes: what ``edgefleet verify`` reads too)."""
        return sample_axes(self.inputs, self.per_sample, self.data_axes)

    @property
    def has_conv(self) -> bool:
        return bool(self.op_types & {"Conv", "ConvTranspose"})


def _specs(values, what: str, path: Path) -> list[tuple[str, str, list[int], int | str | None]]:
    """(name, datatype, shape with -1 for dynamic dims, batch axis | None | "fixed") per tensor."""
    out: list[tuple[str, str, list[int], int | str | None]] = []
    for v in values:
        tt = v.type.tensor_type
        dtype = _ONNX_TO_KSERVE.get(tt.elem_type)
        if dtype is None:
            raise InputError(f"{path}: {what} {v.name!r} has an unsupported element type {tt.elem_type}")
        dims = [int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tt.shape.dim]
        dynamic = [i for i, d in enumerate(dims) if d == -1]
        axis: int | str | None
        if dims and dims[0] == -1:
            axis = 0
        elif dims and dims[0] == 1:
            axis = "one"  # a fixed batch of 1, e.g. [1, 1, 64, W]: one sample per call (or [1, N, H] state)
        elif len(dynamic) == 1:
            axis = dynamic[0]  # e.g. recurrent state [layers, N, hidden]
        elif not dynamic:
            axis = "fixed"  # a parameter shared by the batch, if anything else in the model is batched
        else:
            raise InputError(f"{path}: {what} {v.name!r} has shape {dims} with several dynamic dimensions and a "
                             "fixed first one: edgefleet cannot tell which is the batch; export it with the batch "
                             "first (dynamic_axes={name: {0: 'N'}})")
        out.append((v.name, dtype, dims, axis))
    return out


def _resolve(inputs: list, outputs: list, path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], bool]:
    """Fixed-shape tensors have no batch if anything else is batched; a model with no batch anywhere
    was most likely exported with a fixed batch by mistake, unless that batch is 1 (one sample per call)."""
    batched = any(isinstance(a, int) for *_, a in inputs)
    if not batched and any(a == "one" for *_, a in inputs):  # fixed batch 1: no tensor has a batch axis
        return (tuple(_spec((n, d, s, None)) for n, d, s, _ in inputs),
                tuple(_spec((n, d, s, None)) for n, d, s, _ in outputs), True)

    def settle(t: tuple[str, str, list[int], int | str | None]) -> tuple[str, str, list[int], int | str | None]:
        name, dtype, dims, axis = t
        if axis != "one":
            return t
        dynamic = [i for i, d in enumerate(dims) if d == -1]  # beside batched tensors: state [1, N, hidden]
        return (name, dtype, dims, dynamic[0] if len(dynamic) == 1 else "fixed")

    inputs, outputs = [settle(t) for t in inputs], [settle(t) for t in outputs]
    if all(a == "fixed" for *_, a in inputs):
        name, _, dims, _ = inputs[0]
        if not dims:
            raise InputError(f"{path}: input {name!r} is a scalar and no input has a batch dimension; edgefleet "
                             "serves batched models (feed the scalar as a [N] input, or fold it into the graph)")
        raise InputError(f"{path}: input {name!r} has a fixed first dimension {dims[0]} and no input has a dynamic "
                         "one; export the model with a dynamic first dimension (e.g. dynamic_axes={'input': {0: "
                         "'N'}}) if it takes a batch")

    return tuple(_spec(t) for t in inputs), tuple(_spec(t) for t in outputs), False


def _spec(t: tuple[str, str, list[int], int | str | None]) -> TensorSpec:
    name, dtype, dims, axis = t
    return TensorSpec.model_validate({"name": name, "datatype": dtype, "shape": tuple(dims),
                                      "batch_axis": axis if isinstance(axis, int) else None})


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
    in_specs, out_specs = _specs(inputs, "input", path), _specs(model.graph.output, "output", path)
    fixed = _fixed_first(in_specs)
    if fixed is not None:  # served at that batch: seen from outside, the batch is dynamic on axis 0
        in_specs, out_specs = ([(n, d, [-1, *s[1:]], 0) if s and s[0] == fixed else (n, d, s, a)
                                for n, d, s, a in specs] for specs in (in_specs, out_specs))
    ins, outs, per_sample = _resolve(in_specs, out_specs, path)
    return GraphInfo(
        inputs=ins,
        outputs=outs,
        op_types=frozenset(n.op_type for n in model.graph.node),
        opset=opset,
        metadata={p.key: p.value for p in model.metadata_props},
        per_sample=per_sample,
        batching_note="a fixed batch of 1: evaluated and served one sample at a time" if per_sample else
        f"a fixed batch of {fixed}: the engine pads smaller batches up to it" if fixed else "",
        fixed_batch=fixed,
    )


def _fixed_first(specs: list[tuple[str, str, list[int], int | str | None]]) -> int | None:
    """The batch (> 1) every input fixes on its first dimension, the same for all; None otherwise."""
    firsts = {s[0] if s else None for _, _, s, _ in specs}
    first = firsts.pop() if len(firsts) == 1 else None
    return first if first is not None and first > 1 else None


# the node types a quantizer writes (ONNX and onnxruntime's com.microsoft ops): a model holding any of them is
# quantized already. QLinear* (QLinearConv, QLinearMatMul, ...) and QOrdered* are matched by prefix.
QUANTIZED_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",  # QDQ, and dynamic quantization's activations
    "ConvInteger", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM",
    "QGemm", "QAttention", "QEmbedLayerNormalization", "QuantizeWithOrder", "DequantizeWithOrder",
    "MatMulNBits", "MatMulBnb4", "GatherBlockQuantized",  # block-quantized (4-bit) weights
})
_QUANTIZED_PREFIXES = ("QLinear", "QOrdered")


def is_quantized_op(op_type: str) -> bool:
    return op_type in QUANTIZED_OPS or op_type.startswith(_QUANTIZED_PREFIXES)


def all_nodes(graph) -> list:
    """Every node of ``graph`` and of the subgraphs inside its nodes (If branches, Loop and Scan bodies)."""
    out = []
    for node in graph.node:
        out.append(node)
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                out.extend(all_nodes(g))
    return out


def quantized_ops(path: Path) -> dict[str, int]:
    """The quantized node types an ONNX model holds (subgraphs included) and how many of each, most first; empty
    for a float model. Such a model was quantized before it came here (onnxruntime's quantize_dynamic writes
    DynamicQuantizeLinear with ConvInteger/MatMulInteger/DynamicQuantizeLSTM, a static export QuantizeLinear and
    DequantizeLinear pairs or QLinear* ops): quantizing it again is not what int8 means here, and onnxruntime's
    quantizer fails on it (KeyError on a '..._scale' it expects to add)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for n in all_nodes(model.graph):
        if is_quantized_op(n.op_type):
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def quantized_phrase(counts: dict[str, int]) -> str:
    """'already quantized (22 DynamicQuantizeLinear, 21 ConvInteger, 1 DynamicQuantizeLSTM, 1 MatMulInteger)'"""
    return "already quantized (" + ", ".join(f"{n} {op}" for op, n in counts.items()) + ")"


def _set_axis(spec: TensorSpec, axis: int | None) -> TensorSpec:
    return TensorSpec.model_validate({**spec.model_dump(), "batch_axis": axis})


def probe_batching(path: Path, info: GraphInfo, data: Dataset) -> GraphInfo:
    """Check the declared batch axes against what the model computes: run it on the first sample and on the
    first two, and find in each output the axis that goes from 1 to 2 while the others stay. An output with
    no such axis does not scale with the batch: the model is refused batching (each input's first dimension
    pinned to 1, served one sample at a time). An output whose scaling axis is not the declared one gets the
    measured one (state laid out [layers, N, hidden])."""
    import onnxruntime as ort

    if info.per_sample or info.fixed_batch or len(data) < 2 or all(s.batch_axis is None for s in info.inputs):
        return info  # a fixed batch: the engine pads to it (and source_model checked what the graph allows)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        one = sess.run(None, data.take(0, 1))
        two = sess.run(None, data.take(0, 2))
    except Exception as exc:  # onnxruntime's own types: a model that cannot run two samples at once
        return _refuse_batching(info, f"it fails on a batch of 2 ({' '.join(str(exc).split())[:200]})")
    outs = []
    moved = []
    for spec, a, b in zip(info.outputs, one, two, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        scales = [i for i in range(min(a.ndim, b.ndim)) if a.ndim == b.ndim and a.shape[i] == 1 and b.shape[i] == 2
                  and a.shape[:i] + a.shape[i + 1:] == b.shape[:i] + b.shape[i + 1:]]
        if spec.batch_axis is None:
            outs.append(spec)
        elif spec.batch_axis in scales:
            outs.append(spec)
        elif len(scales) == 1 and spec.shape[scales[0]] == -1:
            moved.append(f"output {spec.name!r} grows with the batch on axis {scales[0]}, not {spec.batch_axis}")
            outs.append(_set_axis(spec, scales[0]))
        else:
            return _refuse_batching(info, f"output {spec.name!r} has shape {list(a.shape)} for one sample and "
                                          f"{list(b.shape)} for two: it does not keep a batch axis")
    return GraphInfo(info.inputs, tuple(outs), info.op_types, info.opset, info.metadata, False, "; ".join(moved))


def _refuse_batching(info: GraphInfo, why: str) -> GraphInfo:
    """One sample per call: inputs with a batch get a first dimension of 1 (the engine refuses more), and no
    tensor keeps a batch axis, so the manifest is not batchable."""
    def pin(s: TensorSpec) -> TensorSpec:
        if s.batch_axis is None:
            return s
        shape = list(s.shape)
        shape[s.batch_axis] = 1
        return TensorSpec.model_validate({**s.model_dump(), "shape": tuple(shape), "batch_axis": None})

    return GraphInfo(tuple(pin(s) for s in info.inputs), tuple(_set_axis(s, None) for s in info.outputs),
                     info.op_types, info.opset, info.metadata, True,
                     f"batching refused: {why}; served one sample at a time",
                     {s.name: s.batch_axis for s in info.inputs})


def ensure_opset(path: Path, opset: int, out_path: Path, sample: Dataset) -> Path:
    """Convert the model to ``opset`` (onnx's version converter) and check that the converted graph
    computes what the original does on ``sample``; return the converted file."""
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

    # a model that takes one sample per call (a fixed batch of 1) is checked on its first samples one at a time
    feeds = [sample.take(i, i + 1) for i in range(min(len(sample), 4))] if sample.per_sample else [sample.inputs]

    def run(p: Path) -> tuple[list[str], list[np.ndarray]]:
        sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        outs = [sess.run(None, f) for f in feeds]
        return [o.name for o in sess.get_outputs()], [np.concatenate([np.asarray(o[j]).reshape(-1) for o in outs])
                                                      for j in range(len(outs[0]))]

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


def name_nodes(path: Path, out: Path) -> Path:
    """A copy of the model in which every node has a unique name (exclusion goes by node name)."""
    import onnx

    model = onnx.load(str(path))
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)
    onnx.save(model, str(out))
    return out
