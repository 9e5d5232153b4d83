"""Tiny stand-in models, one per task the compiler's gate judges, each with a damaged twin.

Run from the repository root:  python models/tasks/make_tasks.py OUT_DIR

Nothing is committed: each graph is a few hundred bytes of seeded weights built here in milliseconds.
For every task ``T`` it writes ``T.onnx`` (the faithful model), ``T-damaged.onnx`` (the same graph with
one deliberate fault that changes what the task sees) and ``T.npz`` (inputs that exercise it):

  classification  x [N, 16] -> logits [N, 10]          damage: classes 0 and 1 swapped
  detection       feat [N, 7, 64] -> [N, 4+3, 64]      yolov8 layout (cx, cy, w, h, 3 class scores per
                                                        anchor); damage: every box 1.6x wider and taller
  ctc             x [1, T, 12] -> probs [1, T, 12]     fixed batch 1, dynamic T (like an OCR recognizer);
                                                        greedy CTC with blank 0; damage: classes 3 and 4 swapped
  segmentation    image [N, 1, 16, 16] -> mask prob     3x3 box filter, sigmoid; damage: threshold lowered, masks
                                                        grow by about a pixel
  regression      x [N, 8] -> prob [N, 1]              a sigmoid probability; damage: a bias that flips decisions
  embedding       x [N, 16] -> emb [N, 32]             damage: 60% relative noise on the projection

Inputs are drawn so that each decision has a clear margin: a faithful INT8 build keeps it, the damage does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["TASKS", "build", "data"]

TASKS = ("classification", "detection", "ctc", "segmentation", "regression", "embedding")
CLASSES, PROTO_DIM = 10, 16
ANCHORS, DET_CLASSES = 64, 3
VOCAB = 12


def _model(nodes: list, inputs: list, outputs: list, inits: list, name: str) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _f(name: str, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _w(arr: np.ndarray, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, np.float32), name)


def _protos() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(CLASSES, PROTO_DIM)).astype(np.float32)


def _graph(task: str, damaged: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    if task == "classification":
        w = _protos().T * 2.0
        if damaged:
            w[:, [0, 1]] = w[:, [1, 0]]
        return _model([helper.make_node("MatMul", ["x", "w"], ["logits"])], [_f("x", ["N", PROTO_DIM])],
                      [_f("logits", ["N", CLASSES])], [_w(w, "w")], task)
    if task == "detection":
        ch = 4 + DET_CLASSES
        w = np.eye(ch, dtype=np.float32)
        if damaged:
            w[2, 2] = w[3, 3] = 1.6
        nodes = [helper.make_node("Conv", ["feat", "w"], ["h"]),
                 helper.make_node("Split", ["h", "split"], ["box", "cls"], axis=1),
                 helper.make_node("Sigmoid", ["cls"], ["score"]),
                 helper.make_node("Concat", ["box", "score"], ["out"], axis=1)]
        return _model(nodes, [_f("feat", ["N", ch, ANCHORS])], [_f("out", ["N", ch, ANCHORS])],
                      [_w(w[:, :, None], "w"), numpy_helper.from_array(np.array([4, DET_CLASSES], np.int64), "split")],
                      task)
    if task == "ctc":
        w = np.eye(VOCAB, dtype=np.float32) * 4.0
        if damaged:
            w[:, [3, 4]] = w[:, [4, 3]]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["z"]), helper.make_node("Softmax", ["z"], ["probs"], axis=-1)]
        return _model(nodes, [_f("x", [1, "T", VOCAB])], [_f("probs", [1, "T", VOCAB])], [_w(w, "w")], task)
    if task == "segmentation":
        k = np.full((1, 1, 3, 3), 1 / 9, np.float32)
        bias = np.array([-0.5 + (0.3 if damaged else 0.0)], np.float32) * 8
        nodes = [helper.make_node("Conv", ["image", "k", "b"], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node("Mul", ["c", "gain"], ["g"]), helper.make_node("Sigmoid", ["g"], ["mask"])]
        return _model(nodes, [_f("image", ["N", 1, 16, 16])], [_f("mask", ["N", 1, 16, 16])],
                      [_w(k * 8, "k"), _w(bias, "b"), _w(np.array(1.0), "gain")], task)
    if task == "regression":
        w = np.ones((8, 1), np.float32)
        b = np.array([2.5 if damaged else 0.0], np.float32)
        nodes = [helper.make_node("MatMul", ["x", "w"], ["z"]), helper.make_node("Add", ["z", "b"], ["zb"]),
                 helper.make_node("Sigmoid", ["zb"], ["prob"])]
        return _model(nodes, [_f("x", ["N", 8])], [_f("prob", ["N", 1])], [_w(w, "w"), _w(b, "b")], task)
    if task == "embedding":
        w = rng.normal(size=(PROTO_DIM, 32)).astype(np.float32)
        if damaged:
            w = w + 0.6 * rng.normal(size=w.shape).astype(np.float32)
        return _model([helper.make_node("MatMul", ["x", "w"], ["emb"])], [_f("x", ["N", PROTO_DIM])],
                      [_f("emb", ["N", 32])], [_w(w, "w")], task)
    raise ValueError(f"unknown task {task!r}")


def build(task: str, out_dir: Path, damaged: bool = False) -> Path:
    """Write ``TASK.onnx`` (or ``TASK-damaged.onnx``) into ``out_dir``; return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{task}{'-damaged' if damaged else ''}.onnx"
    onnx.save(_graph(task, damaged), str(path))
    return path


def data(task: str, n: int, seed: int) -> dict[str, np.ndarray]:
    """Inputs for ``task``, samples on axis 0 (the ctc model takes one per call: [n, T, VOCAB] stacks them)."""
    rng = np.random.default_rng(seed)
    if task in ("classification", "embedding"):
        labels = rng.integers(0, CLASSES, n)
        return {"x": (_protos()[labels] + 0.1 * rng.normal(size=(n, PROTO_DIM))).astype(np.float32)}
    if task == "detection":
        feat = np.zeros((n, 4 + DET_CLASSES, ANCHORS), np.float32)
        feat[:, 0:2] = rng.uniform(8, 56, size=(n, 2, ANCHORS))
        feat[:, 2:4] = rng.uniform(4, 12, size=(n, 2, ANCHORS))
        feat[:, 4:] = -5.0
        for i in range(n):
            for a in rng.choice(ANCHORS, 4, replace=False):
                feat[i, 4 + rng.integers(0, DET_CLASSES), a] = 4.0
        return {"feat": feat}
    if task == "ctc":
        steps = 24
        x = np.zeros((n, steps, VOCAB), np.float32)
        for i in range(n):
            seq = rng.integers(0, VOCAB, steps)
            seq[rng.random(steps) < 0.4] = 0  # blanks
            x[i, np.arange(steps), seq] = 1.0
        return {"x": x + 0.05 * rng.normal(size=x.shape).astype(np.float32)}
    if task == "segmentation":
        img = np.zeros((n, 1, 16, 16), np.float32)
        for i in range(n):
            r, c = rng.integers(2, 8, 2)
            img[i, 0, r:r + 6, c:c + 6] = 1.0
        return {"image": img + 0.02 * rng.normal(size=img.shape).astype(np.float32)}
    if task == "regression":
        sign = rng.choice([-1.0, 1.0], size=(n, 1))
        return {"x": (sign * rng.uniform(0.05, 0.6, size=(n, 8))).astype(np.float32)}
    raise ValueError(f"unknown task {task!r}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    for task in TASKS:
        build(task, out)
        build(task, out, damaged=True)
        np.savez(out / f"{task}.npz", **data(task, 64, 3))
        print(out / f"{task}.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
