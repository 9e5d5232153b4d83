"""Build the speed-reference models: MobileNetV2-like and ResNet-18-like ONNX graphs with seeded weights.

Run from the repository root:  python models/zoo/make_zoo.py [mobilenetv2] [resnet18] [--out DIR] [--force]

The files are large (15 MB and 47 MB of weights, 77 MB and 39 MB of data), so they are not committed:
each model is built into ``models/zoo/build/<name>/`` (git-ignored) on demand by :func:`ensure`,
which rebuilds only when a file is missing or this script changed since the build:

  model.onnx        FP32, input "input" [N,3,224,224], output "logits" [N,1000], dynamic batch, opset 13
  calibration.npz   "input" float32 [128,3,224,224], for the quantizer
  eval.npz          "input" float32 [64,3,224,224] and "labels" int64 [64]: the FP32 model's own argmax,
                    so an accuracy gate on it measures top-1 agreement with FP32

The weights are random, so these models are for speed only: their labels mean nothing.

- Graphs follow torchvision's ``mobilenet_v2`` (width 1.0, inverted residuals, depthwise convs, ReLU6
  as ``Clip(0, 6)``) and ``resnet18`` (basic blocks), as ``torch.onnx.export`` writes them in eval mode:
  BatchNorm folded into the convolutions' weights and biases, global average pool, Flatten, Gemm.
- Weights are He-initialised (gain 2 before a ReLU/ReLU6, gain 1 before a linear output) from fixed seeds.
  Each BatchNorm gets the running statistics a trained network would have for these weights (its running
  variance is the conv output's predicted second moment), so every folded conv outputs about unit
  variance and activations stay in range through all the blocks; the last BatchNorm of a residual branch
  has a small gamma, as in trained ResNets. Biases stay small.
- Images are smooth synthetic pictures (a few octaves of bilinearly upsampled random grids and a colour
  tint), quantised to 8-bit pixels and normalised with ImageNet's mean and std.
- The same bytes on every machine: the weights and images use only seeded NumPy draws and elementwise
  arithmetic (no BLAS, no transcendental functions), ``.npz`` files are written uncompressed with fixed zip
  timestamps, and the ONNX file is a plain protobuf. Only the labels come from running the model (in
  onnxruntime); an evaluation image whose top-1 logit beats the runner-up by less than ``MIN_MARGIN`` of its
  logits' spread is replaced by the next one, so a last-bit difference between CPUs cannot flip a label.

The ONNX file records the sha256 of this script in its metadata (``edgefleet.script_sha256``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BUILD", "NAMES", "build", "ensure", "is_current", "script_sha256"]

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build"
NAMES = ("mobilenetv2", "resnet18")
FILES = ("calibration.npz", "eval.npz", "model.onnx")  # written in this order: the model last, as the marker
SEED = 20261122
WEIGHT_SEEDS = {"mobilenetv2": 1, "resnet18": 2}  # spawn keys under SEED, so each model has its own stream
CALIBRATION_STREAM, EVAL_STREAM = 10, 11
N_CALIBRATION = 128
N_EVAL = 64
MAX_EVAL_CANDIDATES = 4 * N_EVAL  # bounded: images drawn while looking for 64 with a clear top-1
MIN_MARGIN = 1e-3  # (top-1 - top-2 logit) / std(logits) below this: the label could flip between CPUs
SIZE = 224
NUM_CLASSES = 1000
OPSET = 13
IR_VERSION = 8
BN_EPS = 1e-5
RESIDUAL_GAMMA = 0.3  # mean gamma of the last BatchNorm in a residual branch
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
OCTAVES = ((2, 1.0), (4, 0.6), (8, 0.35), (16, 0.2))  # (grid cells across the image, amplitude)


def script_sha256() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


# ---- the graph ------------------------------------------------------------------------------------


class _Net:
    """ONNX nodes and initializers under construction, with the weights drawn from one seeded stream.

    ``q`` tracks each tensor's expected second moment (a Python float, so exact and portable); the
    BatchNorm running variance of a conv is the second moment its output is predicted to have.
    (A plain class, not a dataclass: this file is also loaded by path, outside ``sys.modules``.)
    """

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[Any] = []
        self.inits: dict[str, np.ndarray] = {}
        self.q: dict[str, float] = {"input": 1.0}  # images normalised like ImageNet input: unit second moment

    def _node(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        from onnx import helper

        out = f"{name}.out"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def conv_bn(self, x: str, name: str, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1,
                gain: float = 2.0, gamma_mean: float = 1.0) -> str:
        """Conv + BatchNorm folded (as an eval-mode export writes it): He-initialised weights scaled by
        gamma / sqrt(running_var + eps), bias beta - running_mean * that scale."""
        fan_in = cin // groups * k * k
        w = self.rng.standard_normal((cout, cin // groups, k, k), dtype=np.float32)
        w = w * np.float32(np.sqrt(gain / fan_in))
        pre_q = gain * self.q[x]  # E[y^2] of the conv output for an input of second moment q
        gamma = gamma_mean * self.rng.uniform(0.8, 1.2, cout)
        beta = 0.02 * self.rng.standard_normal(cout)
        running_mean = 0.02 * np.sqrt(pre_q) * self.rng.standard_normal(cout)
        running_var = pre_q * self.rng.uniform(0.8, 1.25, cout)
        scale = gamma / np.sqrt(running_var + BN_EPS)
        self.inits[f"{name}.weight"] = (w * scale.astype(np.float32)[:, None, None, None]).astype(np.float32)
        self.inits[f"{name}.bias"] = (beta - running_mean * scale).astype(np.float32)
        out = self._node("Conv", [x, f"{name}.weight", f"{name}.bias"], name, kernel_shape=[k, k],
                         strides=[stride, stride], pads=[k // 2] * 4, group=groups, dilations=[1, 1])
        self.q[out] = gamma_mean**2
        return out

    def relu(self, x: str, name: str) -> str:
        out = self._node("Relu", [x], name)
        self.q[out] = self.q[x] / 2
        return out

    def relu6(self, x: str, name: str) -> str:
        if "relu6.min" not in self.inits:
            self.inits["relu6.min"] = np.array(0.0, np.float32)
            self.inits["relu6.max"] = np.array(6.0, np.float32)
        out = self._node("Clip", [x, "relu6.min", "relu6.max"], name)
        self.q[out] = self.q[x] / 2
        return out

    def add(self, a: str, b: str, name: str) -> str:
        out = self._node("Add", [a, b], name)
        self.q[out] = self.q[a] + self.q[b]
        return out

    def maxpool(self, x: str, name: str) -> str:
        out = self._node("MaxPool", [x], name, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
        self.q[out] = self.q[x]
        return out

    def head(self, x: str, features: int) -> str:
        """Global average pool, Flatten, Gemm to the logits (the classifier: gain 1, small bias)."""
        from onnx import helper

        pooled = self._node("GlobalAveragePool", [x], "avgpool")
        flat = self._node("Flatten", [pooled], "flatten", axis=1)
        w = self.rng.standard_normal((NUM_CLASSES, features), dtype=np.float32) * np.float32(np.sqrt(1.0 / features))
        self.inits["fc.weight"] = w
        self.inits["fc.bias"] = (0.01 * self.rng.standard_normal(NUM_CLASSES)).astype(np.float32)
        self.nodes.append(helper.make_node("Gemm", [flat, "fc.weight", "fc.bias"], ["logits"], name="fc",
                                           alpha=1.0, beta=1.0, transB=1))
        return "logits"


def _mobilenetv2(net: _Net) -> str:
    """torchvision's mobilenet_v2(width_mult=1.0): 17 inverted residual blocks, 10 with a skip."""
    x = net.relu6(net.conv_bn("input", "features.0", 3, 32, 3, stride=2), "features.0.relu6")
    cin, idx = 32, 1
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            stride = s if i == 0 else 1
            p = f"features.{idx}"
            hidden = cin * t
            h = x
            if t != 1:
                h = net.relu6(net.conv_bn(h, f"{p}.expand", cin, hidden, 1), f"{p}.expand.relu6")
            h = net.relu6(net.conv_bn(h, f"{p}.dw", hidden, hidden, 3, stride=stride, groups=hidden), f"{p}.dw.relu6")
            skip = stride == 1 and cin == c
            h = net.conv_bn(h, f"{p}.project", hidden, c, 1, gain=1.0, gamma_mean=RESIDUAL_GAMMA if skip else 1.0)
            x = net.add(x, h, f"{p}.add") if skip else h
            cin, idx = c, idx + 1
    x = net.relu6(net.conv_bn(x, f"features.{idx}", cin, 1280, 1), f"features.{idx}.relu6")
    return net.head(x, 1280)


def _resnet18(net: _Net) -> str:
    """torchvision's resnet18: 7x7 stem, max pool, four stages of two basic blocks."""
    x = net.maxpool(net.relu(net.conv_bn("input", "conv1", 3, 64, 7, stride=2), "relu"), "maxpool")
    cin = 64
    for stage, c in enumerate((64, 128, 256, 512), start=1):
        for b in range(2):
            stride = 2 if stage > 1 and b == 0 else 1
            p = f"layer{stage}.{b}"
            h = net.relu(net.conv_bn(x, f"{p}.conv1", cin, c, 3, stride=stride), f"{p}.relu1")
            h = net.conv_bn(h, f"{p}.conv2", c, c, 3, gain=1.0, gamma_mean=RESIDUAL_GAMMA)
            skip = x if stride == 1 and cin == c else net.conv_bn(x, f"{p}.downsample", cin, c, 1, stride=stride,
                                                                  gain=1.0)
            x = net.relu(net.add(h, skip, f"{p}.add"), f"{p}.relu2")
            cin = c
    return net.head(x, 512)


ARCHITECTURES: dict[str, Callable[[_Net], str]] = {"mobilenetv2": _mobilenetv2, "resnet18": _resnet18}


def make_model(name: str) -> Any:
    """The FP32 ModelProto of ``name``, checked by onnx."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if name not in ARCHITECTURES:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(NAMES)}")
    net = _Net(np.random.default_rng([SEED, WEIGHT_SEEDS[name]]))
    ARCHITECTURES[name](net)
    graph = helper.make_graph(
        net.nodes, name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", NUM_CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in net.inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="edgefleet-make-zoo")
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {
        "edgefleet.script_sha256": script_sha256(),
        "edgefleet.purpose": "speed reference: seeded random weights, labels mean nothing",
        "edgefleet.seed": f"{SEED}/{WEIGHT_SEEDS[name]}",
    })
    onnx.checker.check_model(model)
    return model


# ---- the data -------------------------------------------------------------------------------------


def _upsample(grid: np.ndarray) -> np.ndarray:
    """Bilinear upsampling of [n, c, g+1, g+1] corner values to [n, c, SIZE, SIZE], elementwise only."""
    g = grid.shape[-1] - 1
    pos = np.arange(SIZE, dtype=np.float64) * g / (SIZE - 1)
    i0 = np.minimum(np.floor(pos).astype(np.int64), g - 1)
    t = (pos - i0).astype(np.float32)
    rows = grid[:, :, i0, :] * (1 - t)[:, None] + grid[:, :, i0 + 1, :] * t[:, None]
    return rows[:, :, :, i0] * (1 - t) + rows[:, :, :, i0 + 1] * t


def synthetic_images(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` smooth RGB images as float32 [n, 3, SIZE, SIZE], normalised like ImageNet input."""
    field_ = np.zeros((n, 3, SIZE, SIZE), np.float32)
    for cells, amplitude in OCTAVES:
        field_ += _upsample(rng.standard_normal((n, 3, cells + 1, cells + 1), dtype=np.float32)) * np.float32(amplitude)
    brightness = rng.uniform(60.0, 190.0, (n, 1, 1, 1)).astype(np.float32)
    tint = rng.normal(0.0, 20.0, (n, 3, 1, 1)).astype(np.float32)
    contrast = rng.uniform(25.0, 55.0, (n, 1, 1, 1)).astype(np.float32)
    pixels = np.clip(np.round(brightness + tint + contrast * field_), 0, 255).astype(np.uint8)
    mean = np.array(IMAGENET_MEAN, np.float32)[None, :, None, None]
    std = np.array(IMAGENET_STD, np.float32)[None, :, None, None]
    return ((pixels.astype(np.float32) / np.float32(255) - mean) / std).astype(np.float32)


def _session(model_bytes: bytes) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def check_logits(logits: np.ndarray, what: str) -> None:
    """Random weights can still make a broken model: non-finite or input-independent logits."""
    if not np.isfinite(logits).all():
        raise RuntimeError(f"{what}: FP32 logits are not all finite")
    if float(logits.std(axis=1).min()) <= 0 or float(np.ptp(logits, axis=0).max()) <= 0:
        raise RuntimeError(f"{what}: FP32 logits are constant across classes or across images")


def eval_set(model_bytes: bytes, name: str, batch: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """N_EVAL images with a clear FP32 top-1 and that top-1 as the label."""
    sess = _session(model_bytes)
    rng = np.random.default_rng([SEED, EVAL_STREAM])
    keep_x: list[np.ndarray] = []
    keep_y: list[int] = []
    drawn = 0
    while len(keep_y) < N_EVAL:
        if drawn >= MAX_EVAL_CANDIDATES:
            raise RuntimeError(f"{name}: only {len(keep_y)} of {drawn} images have a top-1 margin >= {MIN_MARGIN}")
        x = synthetic_images(rng, batch)
        drawn += batch
        logits = sess.run(["logits"], {"input": x})[0]
        check_logits(logits, name)
        top2 = np.sort(logits, axis=1)[:, -2:]
        margin = (top2[:, 1] - top2[:, 0]) / logits.std(axis=1)
        for i in np.flatnonzero(margin >= MIN_MARGIN):
            if len(keep_y) < N_EVAL:
                keep_x.append(x[i])
                keep_y.append(int(logits[i].argmax()))
    return np.stack(keep_x), np.array(keep_y, np.int64)


def calibration_set(batch: int = 16) -> np.ndarray:
    rng = np.random.default_rng([SEED, CALIBRATION_STREAM])
    return np.concatenate([synthetic_images(rng, batch) for _ in range(N_CALIBRATION // batch)])


# ---- writing --------------------------------------------------------------------------------------


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like ``np.savez`` (np.load reads it), but byte-for-byte reproducible: stored, not deflated (zlib
    builds differ), fixed timestamps; written to a temporary file and renamed into place."""
    tmp = _tmp(path)
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system = 3
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)
    os.replace(tmp, path)


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = _tmp(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build(name: str, out_dir: Path) -> Path:
    """Write model.onnx, calibration.npz and eval.npz of ``name`` into ``out_dir``; -> ``out_dir``."""
    model_bytes = make_model(name).SerializeToString()
    out_dir.mkdir(parents=True, exist_ok=True)
    x_eval, labels = eval_set(model_bytes, name)
    write_npz(out_dir / "calibration.npz", {"input": calibration_set()})
    write_npz(out_dir / "eval.npz", {"input": x_eval, "labels": labels})
    _write_bytes(out_dir / "model.onnx", model_bytes)  # last: a model with the current hash marks a full build
    return out_dir


def is_current(model_dir: Path) -> bool:
    """All files exist and the model was built by this very script."""
    import onnx

    if not all((model_dir / f).is_file() for f in FILES):
        return False
    try:
        props = {p.key: p.value for p in onnx.load(str(model_dir / "model.onnx")).metadata_props}
    except Exception:  # a damaged file (onnx raises protobuf's DecodeError among others): rebuild
        return False
    return props.get("edgefleet.script_sha256") == script_sha256()


def ensure(name: str, root: Path | None = None) -> Path:
    """The folder holding ``name``'s model.onnx, calibration.npz and eval.npz (under ``root``, by default
    models/zoo/build/), built first if a file is missing or this script changed since the last build."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(NAMES)}")
    model_dir = (BUILD if root is None else root) / name
    if not is_current(model_dir):
        build(name, model_dir)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"models to build (default: all of {', '.join(NAMES)})")
    ap.add_argument("--out", type=Path, default=BUILD, help="root folder (default: models/zoo/build)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the files are current")
    a = ap.parse_args(argv)
    if unknown := [n for n in a.names if n not in NAMES]:
        ap.error(f"unknown model {', '.join(unknown)}; known: {', '.join(NAMES)}")
    for name in a.names or NAMES:
        model_dir = build(name, a.out / name) if a.force else ensure(name, a.out)
        for f in FILES:
            p = model_dir / f
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            print(f"{p}  {p.stat().st_size:>10,d} B  sha256 {digest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
