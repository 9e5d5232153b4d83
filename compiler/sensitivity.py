"""Which layers of a QDQ model lose the most to quantization (for the float fallback).

Both the float model and its QDQ twin keep the float tensors between layers under the same names
(QDQ inserts QuantizeLinear/DequantizeLinear pairs beside them). So each compute node's input and
output can be read from both models on a few calibration samples, and its *local* damage measured:
the signal-to-quantization-noise ratio (dB) its output loses compared with its input. The nodes that
lose the most are kept in float first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .graph import name_nodes  # also the onnxruntime target's: in graph, below both

__all__ = ["COMPUTE_OPS", "head_nodes", "input_layers", "name_nodes", "quantize_keeping_head",
           "rank_sensitive_nodes"]

COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
MAX_SQNR_DB = 100.0


def head_nodes(path: Path, output: str, last_layers: bool = False, max_nodes: int = 2000) -> tuple[str, ...]:
    """The nodes between the last compute layers (Conv, MatMul, Gemm) and ``output``: a detector's decode head
    (split into boxes and scores, sigmoid, anchor grid and stride arithmetic, the final Concat). Quantized, they
    put box coordinates (0..image size) and class scores (0..1) under one 8-bit range, which zeroes every score;
    kept in float they cost a few element-wise ops. With ``last_layers``, the compute layers that feed the head
    too: their outputs are the scores' logits and the boxes' distances, whose 8-bit steps become coarse steps of
    every score (0.80, 0.84, 0.87, ...) and box edge. Walks at most ``max_nodes`` nodes (named as by
    :func:`name_nodes`)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {t: n for n in graph.node for t in n.output}
    out: list[str] = []
    seen: set[str] = set()
    todo = [output]
    while todo and len(out) < max_nodes:
        node = producer.get(todo.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type in COMPUTE_OPS:
            if last_layers:
                out.append(node.name)
            continue
        out.append(node.name)
        todo.extend(t for t in node.input if t)
    return tuple(out)


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(np.sum((ref.astype(np.float64) - got.astype(np.float64)) ** 2))
    signal = float(np.sum(ref.astype(np.float64) ** 2))
    if noise == 0.0:
        return MAX_SQNR_DB
    return min(MAX_SQNR_DB, 10 * np.log10(max(signal, 1e-30) / noise))


def _activations(model_path: Path, names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(model_path))
    have = {o.name for o in model.graph.output}
    produced = {t for node in model.graph.node for t in node.output}  # fusions may have removed some
    names = [n for n in names if n in produced]
    for n in names:
        if n not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=n))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    wanted = [n for n in names if n in {o.name for o in sess.get_outputs()}]
    if not wanted:  # onnxruntime runs every output for an empty list (a graph input left in float has no DQ output)
        return {}
    return dict(zip(wanted, sess.run(wanted, feeds), strict=True))


def rank_sensitive_nodes(float_model: Path, qdq_model: Path,
                         feeds: dict[str, np.ndarray]) -> list[tuple[tuple[str, ...], float]]:
    """Where quantization hurts most, worst first: [(nodes to keep in float, dB lost)].

    QDQ quantizes a *tensor* once, between its producer and its consumers, so keeping a tensor in
    float means keeping its producer (with any nodes the quantizer fused into it) and its consumers
    in float. A tensor's damage is the SQNR it has lost relative to the nearest upstream tensor both
    models still have. Every op type counts, not only convolutions."""
    import onnx

    graph = onnx.load(str(float_model)).graph
    inits = {i.name for i in graph.initializer}
    graph_inputs = {i.name for i in graph.input} - inits
    producer = {t: n for n in graph.node for t in n.output}
    consumers: dict[str, list[str]] = {}
    for n in graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n.name)
    names = sorted(t for t in producer if t)
    ref = _activations(float_model, names, feeds)
    got = _activations(qdq_model, names, feeds)
    sq = {t: _sqnr(ref[t], got[t]) for t in names if t in ref and t in got and ref[t].shape == got[t].shape}
    # a graph input is quantized too: its noise is what the first layers start from
    dq = _activations(qdq_model, [f"{i}_DequantizeLinear_Output" for i in graph_inputs], feeds)
    start = {i: _sqnr(feeds[i], dq[f"{i}_DequantizeLinear_Output"]) if f"{i}_DequantizeLinear_Output" in dq
             else MAX_SQNR_DB for i in graph_inputs if i in feeds}

    def fused(t: str) -> tuple[list[str], list[str]]:
        """The nodes that make tensor ``t`` in the QDQ model (its producer and any producers the quantizer
        fused into it) and the tensors both models have where that group starts."""
        nodes: list[str] = []
        edge: list[str] = []
        todo = [t]
        while todo:
            node = producer[todo.pop()]
            if node.name in nodes:
                continue
            nodes.append(node.name)
            for i in node.input:
                if not i or i in inits:
                    continue
                if i in sq or i in graph_inputs or i not in producer:
                    edge.append(i)
                else:
                    todo.append(i)
        return nodes, edge

    ranked = []
    for t, s_out in sq.items():
        group, edge = fused(t)
        s_in = min((start.get(e, MAX_SQNR_DB) if e in graph_inputs else sq.get(e, MAX_SQNR_DB) for e in edge),
                   default=MAX_SQNR_DB)
        # the noise enters where the group's inputs are quantized: keep those tensors float as well,
        # which means their producers (fused groups) and every consumer
        keep = list(group)
        for e in edge:
            if e in producer:
                keep += fused(e)[0]
            keep += consumers.get(e, [])
        ranked.append((tuple(dict.fromkeys(keep)), round(s_in - s_out, 3)))
    return sorted(ranked, key=lambda x: -x[1])


def input_layers(path: Path, max_nodes: int = 64) -> tuple[str, ...]:
    """The first compute layers (Conv, MatMul, Gemm) fed by a graph input, and the nodes between them and the input
    (a YOLOX Focus's slices, a normalisation). An image's first convolution has few input channels, so each output
    is a sum of a few dozen products and the 7-bit weights' steps stay in it unaveraged: on the YOLOv8n DocLayNet
    detector it lost 72 dB of SQNR, the next layer 18 (compiler.sensitivity.rank_sensitive_nodes). Kept in float it
    costs about 1% of the model's compute. Walks at most ``max_nodes`` nodes (named as by :func:`name_nodes`)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    consumers: dict[str, list[Any]] = {}
    for n in graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    out: list[str] = []
    todo = [i.name for i in graph.input if i.name not in inits]
    seen: set[str] = set()
    while todo and len(out) < max_nodes:
        for node in consumers.get(todo.pop(), []):
            if node.name in seen:
                continue
            seen.add(node.name)
            out.append(node.name)
            if node.op_type not in COMPUTE_OPS:
                todo.extend(t for t in node.output if t)
    return tuple(out[:max_nodes])


def quantize_keeping_head(source: Path, profile: Any, calibration: Any, out_path: Path,
                          output: str) -> Any:
    """Static INT8 of ``source`` (as the onnxruntime target builds it) with the decode head of ``output`` kept in
    float (:func:`head_nodes`): a detector's boxes and scores keep their own ranges; and its input layer
    (:func:`input_layers`). The result's ``float_nodes`` name them, so the fallbacks keep them float too."""
    import tempfile

    from .targets.onnxruntime import check_quantized, prepare_or_raw, quantize

    with tempfile.TemporaryDirectory(prefix="edgefleet-quant-") as tmp:
        prepared, how = prepare_or_raw(source, Path(tmp) / "prepared.onnx")
        head = head_nodes(prepared, output)
        first = tuple(n for n in input_layers(prepared) if n not in head)
        quant = quantize(prepared, profile, calibration, out_path, keep_float=(*head, *first))
    ops = check_quantized(out_path)
    return quant.model_copy(update={"reason": f"{quant.reason}; {how}; {ops} quantize/dequantize ops; the decode "
                                              f"head of {output!r} ({len(head)} nodes) kept in float so boxes and "
                                              f"scores keep their own ranges, and the input layer ({len(first)} "
                                              "nodes: its few input channels leave the weights' steps unaveraged)"})
