"""A model exported with a fixed batch larger than 1 (``[10, 3, 32, 32]``): its first dimension made dynamic.

The user often cannot re-export it (it came in a wheel, whose library makes the dimension dynamic itself at load
time). :func:`dynamic_batch` does the same graph edit: every input's and output's first dimension becomes ``N``, the
intermediate shapes recorded in ``value_info`` are dropped (onnxruntime infers them again), and a Reshape to a
constant shape that bakes the batch in (``[10, 512]``) gets ``-1`` there. The edited graph is then checked against
the original on the same inputs: at the original batch (max abs difference), and at batches of 1 and 2 against the
original's rows for those samples (a graph that mixes samples across the batch, or a Reshape that keeps the batch
elsewhere, such as ``[10, -1]``, gives other numbers or fails). Only a graph that passes is used; the note says what
was measured. One that fails keeps its fixed batch: the engines pad up to it (manifest ``fixed_batch``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["dynamic_batch", "fixed_input_batch"]

_NP = {1: np.float32, 10: np.float16, 11: np.float64, 3: np.int8, 2: np.uint8, 6: np.int32, 7: np.int64, 9: np.bool_}


def _fixed_batch(model) -> int | None:
    """The batch every graph input fixes on its first dimension, when it is larger than 1 and the same for all."""
    inits = {i.name for i in model.graph.initializer}
    firsts = set()
    for v in model.graph.input:
        if v.name in inits:
            continue
        dims = v.type.tensor_type.shape.dim
        if not dims or not dims[0].HasField("dim_value"):
            return None
        firsts.add(int(dims[0].dim_value))
    return firsts.pop() if len(firsts) == 1 and next(iter(firsts)) > 1 else None


def fixed_input_batch(path: Path) -> int | None:
    """The batch (> 1) every input of the ONNX file fixes, if one does (its graph only, not its weights)."""
    import onnx

    return _fixed_batch(onnx.load(str(path), load_external_data=False))


def _edit(model, batch: int) -> list[str]:
    """Make dimension 0 dynamic in place; the Reshapes whose constant shape bakes the batch in that were given -1 (a
    shape that already has a -1 elsewhere is left as it is, and the check shows whether the graph still holds)."""
    from onnx import numpy_helper

    inits = {i.name for i in model.graph.initializer}
    for v in [*[i for i in model.graph.input if i.name not in inits], *model.graph.output]:
        dims = v.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value == batch:
            dims[0].Clear()
            dims[0].dim_param = "N"
    del model.graph.value_info[:]
    consts = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    edited = []
    for n in model.graph.node:
        if n.op_type != "Reshape" or len(n.input) < 2 or n.input[1] not in consts:
            continue
        t = consts[n.input[1]]
        shape = numpy_helper.to_array(t)
        if shape.ndim != 1 or not shape.size or shape[0] != batch or (shape == -1).any():
            continue
        shape = shape.copy()
        shape[0] = -1
        t.CopyFrom(numpy_helper.from_array(shape, t.name))
        edited.append(n.name or n.output[0])
    return edited


def _feeds(model, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, np.ndarray] = {}
    for v in model.graph.input:
        if v.name in inits:
            continue
        tt = v.type.tensor_type
        shape = [batch, *(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in tt.shape.dim[1:])]
        dtype = _NP.get(tt.elem_type, np.float32)
        out[v.name] = (rng.normal(size=shape) if np.issubdtype(dtype, np.floating) else np.zeros(shape)).astype(dtype)
    return out


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    if [x.shape for x in a] != [x.shape for x in b]:
        return float("inf")
    return max((float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max(initial=0.0)) for x, y in zip(a, b,
                                                                                                           strict=True)),
               default=0.0)


def dynamic_batch(model_path: Path, folder: Path) -> tuple[Path, str, str]:
    """(the model to compile, the note of what was done, why it could not be done). A model whose inputs do not all
    fix one batch > 1 comes back as it is with ("", "")."""
    import onnx
    import onnxruntime as ort

    try:
        model = onnx.load(str(model_path))
    except Exception:  # not an ONNX file: check_model says why
        return model_path, "", ""
    batch = _fixed_batch(model)
    if batch is None:
        return model_path, "", ""
    edited = _edit(model, batch)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / model_path.name
    onnx.save(model, str(out))
    so = ort.SessionOptions()
    so.log_severity_level = 4
    feeds = _feeds(model, batch)
    try:
        want = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"]).run(None, feeds)
        sess = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
        full = _max_diff(want, sess.run(None, feeds))
        rows = max(_max_diff([w[:k] for w in want], sess.run(None, {n: v[:k] for n, v in feeds.items()}))
                   for k in (1, 2))
    except Exception as exc:  # onnxruntime's own types: the edited graph does not run at another batch
        return model_path, "", (f"the graph does not run with its first dimension made dynamic "
                                f"({' '.join(str(exc).split())[:200]})")
    scale = max((float(np.abs(w).max(initial=0.0)) for w in want if w.size), default=0.0)
    tol = 1e-5 + 1e-5 * scale
    if full > tol or rows > tol:
        return model_path, "", (f"with its first dimension made dynamic the graph computes other numbers (max abs "
                                f"difference {full:.3g} at batch {batch}, {rows:.3g} on batches of 1 and 2 against "
                                "the original's rows): it mixes the samples of a batch or keeps the batch in a shape")
    reshaped = f"; {len(edited)} Reshape(s) to a constant shape given -1 for the batch ({', '.join(edited[:4])})" \
        if edited else ""
    return out, (f"input dimension 0, fixed at {batch} by the export, made dynamic{reshaped}; checked against the "
                 f"original on the same random inputs: max abs difference {full:.3g} at batch {batch}, {rows:.3g} "
                 "on batches of 1 and 2 against the original's rows"), ""
