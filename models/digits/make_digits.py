"""Build the digits reference model: a small CNN trained on scikit-learn's bundled digits set.

Run from the repository root:  python models/digits/make_digits.py

Writes, next to this script:
  split.json        the fixed train / calibration / test indices into sklearn's digits set
  calibration.npz   "input" float32 [N,1,8,8] (pixels / 16), for the quantizer
  test.npz          "input" and "labels", for the accuracy gate and the demo
  model.onnx        FP32 CNN, input "input" [N,1,8,8], output "logits" [N,10], dynamic batch

Training is plain NumPy (im2col convolutions, Adam), seeded, so no deep-learning framework is
needed. The ONNX file records the sha256 of this script in its metadata; a test checks it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SEED = 20261122
N_CALIBRATION = 128
TEST_FRACTION = 0.2
EPOCHS = 30
BATCH = 32
LR = 2e-3


def script_sha256() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def load_digits_split() -> tuple[np.ndarray, np.ndarray, dict[str, list[int]]]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(SEED)
    test_idx: list[int] = []
    rest: list[int] = []
    for cls in range(10):  # stratified split
        idx = np.flatnonzero(y == cls)
        rng.shuffle(idx)
        n_test = round(len(idx) * TEST_FRACTION)
        test_idx += idx[:n_test].tolist()
        rest += idx[n_test:].tolist()
    rest_arr = np.array(rest)
    rng.shuffle(rest_arr)
    split = {
        "calibration": sorted(rest_arr[:N_CALIBRATION].tolist()),
        "train": sorted(rest_arr[N_CALIBRATION:].tolist()),
        "test": sorted(test_idx),
    }
    return x, y, split


# ---- a tiny CNN in NumPy ---------------------------------------------------------------------

def im2col(x: np.ndarray, k: int, stride: int, pad: int) -> tuple[np.ndarray, int, int]:
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (h + 2 * pad - k) // stride + 1
    ow = (w + 2 * pad - k) // stride + 1
    cols = np.empty((n, c, k, k, oh, ow), dtype=x.dtype)
    for i in range(k):
        for j in range(k):
            cols[:, :, i, j] = xp[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride]
    return cols.transpose(0, 4, 5, 1, 2, 3).reshape(n * oh * ow, c * k * k), oh, ow


def col2im(cols: np.ndarray, shape: tuple[int, ...], k: int, stride: int, pad: int, oh: int, ow: int) -> np.ndarray:
    n, c, h, w = shape
    cols6 = cols.reshape(n, oh, ow, c, k, k).transpose(0, 3, 4, 5, 1, 2)
    xp = np.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=cols.dtype)
    for i in range(k):
        for j in range(k):
            xp[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += cols6[:, :, i, j]
    return xp[:, :, pad : pad + h, pad : pad + w]


LAYERS = [  # (name, in_ch, out_ch, stride)
    ("conv1", 1, 16, 1),
    ("conv2", 16, 32, 2),
]
FC_IN = 32 * 4 * 4


def init_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    p: dict[str, np.ndarray] = {}
    for name, cin, cout, _ in LAYERS:
        p[name + ".w"] = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))).astype(np.float32)
        p[name + ".b"] = np.zeros(cout, np.float32)
    p["fc.w"] = (rng.standard_normal((10, FC_IN)) * np.sqrt(1.0 / FC_IN)).astype(np.float32)
    p["fc.b"] = np.zeros(10, np.float32)
    return p


def forward(p: dict[str, np.ndarray], x: np.ndarray, keep: bool = False) -> tuple[np.ndarray, list]:
    cache = []
    h = x
    for name, _cin, cout, stride in LAYERS:
        cols, oh, ow = im2col(h, 3, stride, 1)
        out = cols @ p[name + ".w"].reshape(cout, -1).T + p[name + ".b"]
        out = out.reshape(h.shape[0], oh, ow, cout).transpose(0, 3, 1, 2)
        relu = np.maximum(out, 0)
        if keep:
            cache.append((cols, h.shape, oh, ow, out))
        h = relu
    flat = h.reshape(h.shape[0], -1)
    logits = flat @ p["fc.w"].T + p["fc.b"]
    if keep:
        cache.append(flat)
    return logits, cache


def backward(p: dict[str, np.ndarray], cache: list, logits: np.ndarray,
             y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    n = logits.shape[0]
    z = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = float(-np.log(prob[np.arange(n), y] + 1e-12).mean())
    d = prob
    d[np.arange(n), y] -= 1
    d /= n
    g: dict[str, np.ndarray] = {}
    flat = cache[-1]
    g["fc.w"] = d.T @ flat
    g["fc.b"] = d.sum(axis=0)
    dh = (d @ p["fc.w"]).reshape(n, 32, 4, 4)
    for li in range(len(LAYERS) - 1, -1, -1):
        name, _cin, cout, stride = LAYERS[li]
        cols, in_shape, oh, ow, pre = cache[li]
        dpre = dh * (pre > 0)
        d2 = dpre.transpose(0, 2, 3, 1).reshape(-1, cout)
        g[name + ".w"] = (d2.T @ cols).reshape(p[name + ".w"].shape)
        g[name + ".b"] = d2.sum(axis=0)
        if li > 0:
            dcols = d2 @ p[name + ".w"].reshape(cout, -1)
            dh = col2im(dcols, in_shape, 3, stride, 1, oh, ow)
    return loss, g


def train(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    p = init_params(rng)
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    step = 0
    for epoch in range(EPOCHS):
        order = rng.permutation(len(x))
        total = 0.0
        for s in range(0, len(x), BATCH):
            idx = order[s : s + BATCH]
            logits, cache = forward(p, x[idx], keep=True)
            loss, g = backward(p, cache, logits, y[idx])
            total += loss * len(idx)
            step += 1
            for k in p:  # Adam
                m[k] = 0.9 * m[k] + 0.1 * g[k]
                v[k] = 0.999 * v[k] + 0.001 * g[k] ** 2
                mh = m[k] / (1 - 0.9**step)
                vh = v[k] / (1 - 0.999**step)
                p[k] -= (LR * mh / (np.sqrt(vh) + 1e-8)).astype(np.float32)
        print(f"epoch {epoch + 1:2d}/{EPOCHS} loss {total / len(x):.4f}", file=sys.stderr)
    return p


def to_onnx(p: dict[str, np.ndarray], test_acc: float):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(v, k) for k, v in p.items()]
    nodes = []
    prev = "input"
    for name, _cin, _cout, stride in LAYERS:
        nodes.append(helper.make_node("Conv", [prev, name + ".w", name + ".b"], [name + ".out"], name=name,
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride, stride]))
        nodes.append(helper.make_node("Relu", [name + ".out"], [name + ".relu"], name=name + "_relu"))
        prev = name + ".relu"
    nodes.append(helper.make_node("Flatten", [prev], ["flat"], name="flatten", axis=1))
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes, "digits_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edgefleet-make-digits")
    model.ir_version = 8
    helper.set_model_props(model, {
        "edgefleet.script_sha256": script_sha256(),
        "edgefleet.test_accuracy_fp32": f"{test_acc:.4f}",
        "edgefleet.labels": json.dumps([str(i) for i in range(10)]),
    })
    onnx.checker.check_model(model)
    return model


def main() -> int:
    import onnx

    x, y, split = load_digits_split()
    tr, ca, te = (np.array(split[k]) for k in ("train", "calibration", "test"))
    params = train(x[tr], y[tr])
    logits, _ = forward(params, x[te])
    acc = float((logits.argmax(1) == y[te]).mean())
    print(f"test accuracy (NumPy, FP32): {acc:.4f} on {len(te)} images", file=sys.stderr)
    (HERE / "split.json").write_text(json.dumps({"seed": SEED, **split}) + "\n")
    np.savez_compressed(HERE / "calibration.npz", input=x[ca])
    np.savez_compressed(HERE / "test.npz", input=x[te], labels=y[te])
    onnx.save(to_onnx(params, acc), HERE / "model.onnx")
    print(f"wrote {HERE / 'model.onnx'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
