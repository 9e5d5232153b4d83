"""Issue 40's follow-ups from the corpus (models as they are shipped): drift references for CenterNet heads and
keypoints, a layout that cannot be told apart said to be unsure, a multi-output model judged on the output that
holds probabilities, landmarks laid out x0..x4, y0..y4, a detector whose boxes and scores are separate outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet.agent.core.drift import DriftRecorder
from edgefleet.compiler.graph import check_model
from edgefleet.judge.gate import GateSettings, evaluate_gate
from edgefleet.judge.tasks import resolve_task
from edgefleet.protocol.bundle import extract_bundle
from tests.test_compiler import run_cli
from tests.test_compiler_heads import _run, _save, centerface, faces, multihead


def _compile_fp32(tmp_path, model, x, *task):
    np.savez(tmp_path / "eval.npz", **x)
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--eval", str(tmp_path / "eval.npz"), "--precision",
                "fp32", *task, "--name", "m", "--json", "--no-benchmark", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)["manifest"], extract_bundle(next((tmp_path / "o").glob("*.tar")), tmp_path / "x")


def _fp32_and_moved(model, moved, x):
    """``model``'s outputs (check_model's), their names, and what ``model`` and its ``moved`` copy answer on ``x``."""
    info = check_model(model)
    return info, [o.name for o in info.outputs], _run(model, x), _run(moved, x)


def _agent_counts(manifest, outputs):
    """The agent's sketch of ``outputs`` (one answer's outputs per call), as telemetry would send it."""
    rec = DriftRecorder(drain_every_s=0.01)
    try:
        for outs in outputs:
            rec.offer(manifest, outs)
        assert rec.wait_idle(30.0)
        counts = rec.take(manifest.name, manifest.version)
    finally:
        rec.close()
    assert counts is not None and rec.errors == 0
    return {f.name: f.counts for f in counts.features}, counts.samples


def test_a_centernet_detector_ships_a_drift_reference_the_agent_counts(tmp_path):
    """Before: 'no drift reference: ... input_value='centernet'' (the reference knew only the YOLO formats)."""
    model = centerface(tmp_path / "face.onnx")
    x = faces(24, 11)
    m, manifest = _compile_fp32(tmp_path, model, {"x": x})
    drift = m["drift"]
    assert drift is not None and (drift["read_as"], drift["detection_format"], drift["output"]) == (
        "detection", "centernet", "hm"), m.get("build_notes")
    assert [f["name"] for f in drift["features"]] == ["boxes", "score"]
    outs = _run(model, {"x": x[:6]})
    counts, n = _agent_counts(manifest, [[o[i:i + 1] for o in outs] for i in range(6)])
    assert n == 6 and sum(counts["boxes"]) == 6 and sum(counts["score"]) == 6
    # the faces in view are what the boxes feature counts: 2 or 3 per image, at the reference's bins
    ref = manifest.drift.feature("boxes")
    assert ref is not None and ref.edges and min(ref.edges) < 2 < max(ref.edges) + 1


def test_a_keypoints_task_ships_a_drift_reference_of_instances_and_spread(tmp_path):
    """Before: compiled with no drift (keypoints was no task drift read)."""
    model = multihead(tmp_path / "m.onnx")
    x = np.random.default_rng(6).normal(size=(32, 16)).astype(np.float32)
    m, manifest = _compile_fp32(tmp_path, model, {"x": x}, "--task", "landmarks", "--task-args",
                                "output=lms,boxes=box,layout=xy")
    drift = m["drift"]
    assert drift is not None and (drift["read_as"], drift["output"], drift["layout"]) == ("keypoints", "lms", "xy")
    assert [f["name"] for f in drift["features"]] == ["instances", "spread"]
    outs = _run(model, {"x": x[:5]})
    counts, n = _agent_counts(manifest, [outs] * 2)  # two answers of 5 samples each
    assert n == 10 and sum(counts["instances"]) == 10 and sum(counts["spread"]) == 10


# -- 4: landmarks laid out x0..x4, y0..y4 ------------------------------------------------------------------------
def xxyy_landmarks(path, moved_y: float = 0.0):
    """x [N, 4] (a box's x0, y0, size w, size h) -> box [N, 4] xyxy, lms [N, 10] = five points inside the box laid
    out x0..x4, y0..y4 (MTCNN's ONet). ``moved_y``: every y moved by that share of the box's height."""
    fx = np.array([0.3, 0.7, 0.5, 0.35, 0.65], np.float32)
    fy = np.array([0.35, 0.35, 0.55, 0.8, 0.8], np.float32) + moved_y
    w = np.zeros((4, 10), np.float32)
    w[0, :5], w[2, :5] = 1.0, fx  # x = x0 + fx * w
    w[1, 5:], w[3, 5:] = 1.0, fy  # y = y0 + fy * h
    wb = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 1, 0], [0, 0, 0, 1]], np.float32)
    nodes = [helper.make_node("MatMul", ["x", "wl"], ["lms"]), helper.make_node("MatMul", ["x", "wb"], ["box"])]
    inits = [numpy_helper.from_array(w, "wl"), numpy_helper.from_array(wb, "wb")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", c]) for n, c in (("lms", 10), ("box", 4))]
    return _save(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])], outs, path)


def _boxes_in(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)  # boxes apart from the diagonal, so reading xy pairs wrongly leaves them
    return np.stack([rng.uniform(0, 40, n), rng.uniform(100, 140, n), rng.uniform(20, 30, n),
                     rng.uniform(20, 30, n)], axis=1).astype(np.float32)


def test_landmarks_laid_out_xxyy_are_judged_as_such_and_inferred_from_the_boxes(tmp_path):
    """Before: a [10] vector was read as interleaved (x, y) pairs, so ONet's y's moving by 30% of the face passed
    half-judged: (x0, x1), (x2, x3), (x4, y0) ... are points of nonsense."""
    model, moved = xxyy_landmarks(tmp_path / "l.onnx"), xxyy_landmarks(tmp_path / "m.onnx", moved_y=0.3)
    info, names, ref, bad = _fp32_and_moved(model, moved, {"x": _boxes_in(40, 1)})
    declared = resolve_task("keypoints", "output=lms,boxes=box,layout=xxyy", model, info.outputs)
    r = evaluate_gate(names, ref, bad, None, "int8", GateSettings(), declared)
    assert r.task is not None and r.task.value == 0.0, r.task  # every point moved 30% of the face
    wrong = evaluate_gate(names, ref, bad, None, "int8", GateSettings(),
                          resolve_task("keypoints", "output=lms,boxes=box,layout=xy", model, info.outputs))
    assert wrong.task is not None and wrong.task.value == pytest.approx(0.4)  # (x0, x1), (x2, x3) "kept"
    inferred = resolve_task("keypoints", "output=lms,boxes=box", model, info.outputs)
    ri = evaluate_gate(names, ref, bad, None, "int8", GateSettings(), inferred)
    assert ri.task is not None and ri.task.value == r.task.value
    assert "xxyy inferred from the boxes" in ri.task.note, ri.task.note
    # without boxes the values cannot tell: the default, and the note says so
    alone = resolve_task("keypoints", "output=lms", model, info.outputs)
    ra = evaluate_gate(names, ref, ref, None, "int8", GateSettings(), alone)
    assert "xy by default" in ra.task.note and "declare layout=" in ra.task.note  # type: ignore[union-attr]
    with pytest.raises(Exception, match="layout='yx' is not one of xy, xxyy"):
        resolve_task("keypoints", "output=lms,layout=yx", model, info.outputs)


# -- 2: CenterFace's log sizes that never go below 0 ------------------------------------------------------------
def _head(sizes_as: str, sigma_follows_size: bool = True, n: int = 12, seed: int = 3):
    """fp32 outputs of a CenterNet face head on a 48 x 64 grid: Gaussian heat blobs (sigma 0.15 of the face's size
    in cells, or 0.6 whatever the size), sizes 2.3..6.5 cells written ``sizes_as`` linear or log (0.83..1.87: above
    0 everywhere, as CenterFace's own at the corpus's faces), offsets 0, ten landmark channels."""
    rng = np.random.default_rng(seed)
    hm, wh = np.zeros((n, 1, 48, 64), np.float32), np.zeros((n, 2, 48, 64), np.float32)
    yy, xx = np.mgrid[0:48, 0:64]
    for i in range(n):
        for k in range(3):
            cy, cx, size = 8 + 16 * k, int(rng.integers(8, 56)), float(rng.uniform(2.3, 6.5))
            sigma = (0.15 * size if sigma_follows_size else 0.6) * float(rng.lognormal(0, 0.02))
            hm[i, 0] = np.maximum(hm[i, 0], np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma ** 2)))
            near = (abs(yy - cy) <= 3) & (abs(xx - cx) <= 3)
            wh[i, :, near] = np.log(size) if sizes_as == "log" else size
    lms = rng.uniform(0.2, 0.8, size=(n, 10, 48, 64)).astype(np.float32)
    values = [hm, wh, np.zeros((n, 2, 48, 64), np.float32), lms]
    from edgefleet.protocol.manifest import TensorSpec

    specs = tuple(TensorSpec(name=k, datatype="FP32", shape=(-1, c, 48, 64))
                  for k, c in (("537", 1), ("538", 2), ("539", 2), ("540", 10)))
    return specs, values


def test_centerface_log_sizes_above_0_are_told_by_the_heat_spread_or_said_unsure():
    """Before: sizes never below 0 were read as linear sizes, sure: CenterFace 800 x 480 was inferred centernet (its
    log sizes 0.85..1.87 at the peaks) and its INT8 gated on that guess."""
    from edgefleet.judge.tasks import infer_task

    specs, values = _head("log")
    face = infer_task(specs, values[0], values)
    assert (face.arg("format"), face.sure) == ("centerface", True), face.note
    assert "log(size / heat sigma)" in face.note
    specs, values = _head("linear")
    net = infer_task(specs, values[0], values)
    assert (net.arg("format"), net.sure) == ("centernet", True), net.note
    specs, values = _head("log", sigma_follows_size=False)  # the heat spread says nothing of the size
    unsure = infer_task(specs, values[0], values)
    assert not unsure.sure and "cannot be told apart" in unsure.note, unsure.note
    assert "format=centernet" in unsure.note and "format=centerface" in unsure.note  # both candidates named


# -- 3: a multi-output stage judged on the output that holds probabilities ----------------------------------------
def onet_like(path, moved: float = 0.0):
    """MTCNN's ONet's outputs: x [N, 16] -> dense_5 [N, 4] box regression, dense_6 [N, 10] landmarks, softmax_2
    [N, 2] face probability (in that order, as the wheel's onet.onnx lists them). ``moved``: the box head shifted."""
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array((rng.normal(size=(16, c)) / 4 + (moved if n == "wb" else 0)).astype(np.float32),
                                     n) for n, c in (("wb", 4), ("wl", 10), ("wc", 2))]
    nodes = [helper.make_node("MatMul", ["x", "wb"], ["dense_5"]), helper.make_node("MatMul", ["x", "wl"], ["dense_6"]),
             helper.make_node("MatMul", ["x", "wc"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["softmax_2"], axis=1)]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", c])
            for n, c in (("dense_5", 4), ("dense_6", 10), ("softmax_2", 2))]
    return _save(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])], outs, path)


def test_a_multi_output_stage_is_judged_on_its_probabilities_and_lists_the_others(tmp_path):
    """Before: inferred classification of its first output, the box regression dense_5 (unnormalised scores)."""
    from edgefleet.judge.tasks import infer_task

    model, moved = onet_like(tmp_path / "onet.onnx"), onet_like(tmp_path / "moved.onnx", moved=0.2)
    x = {"x": np.random.default_rng(2).normal(size=(64, 16)).astype(np.float32)}
    info, names, ref, bad = _fp32_and_moved(model, moved, x)
    task = infer_task(info.outputs, ref[0], ref)
    assert (task.name, task.output, task.sure) == ("classification", "softmax_2", True), task.note
    assert "not judged: 'dense_5', 'dense_6'" in task.note, task.note
    auto = evaluate_gate(names, ref, bad, None, "int8", GateSettings(max_unjudged_change=1e-2), task)
    assert auto.not_judged == ("dense_5", "dense_6") and not auto.passed  # the box regression moved
    assert auto.task is not None and auto.task.criteria[0].passed  # the probabilities did not


# -- 6: edgefleet verify names the outputs no task reads ---------------------------------------------------------
def test_verify_prints_the_outputs_not_judged(tmp_path):
    """Before: the manifest listed them, verify's text and --json did not."""
    model = multihead(tmp_path / "m.onnx")
    x = np.random.default_rng(6).normal(size=(32, 16)).astype(np.float32)
    m, _ = _compile_fp32(tmp_path, model, {"x": x}, "--task", "classification", "--task-args", "output=prob")
    assert m["accuracy"]["not_judged"] == ["lms", "box"]
    bundle = str(next((tmp_path / "o").glob("*.tar")))
    doc = run_cli("verify", bundle, "--json")
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert json.loads(doc.stdout)["not_judged"] == ["lms", "box"]
    text = run_cli("verify", bundle)
    assert "not judged lms, box" in text.stdout, text.stdout


# -- 5: a detector whose boxes and scores are separate outputs ----------------------------------------------------
def split_detector(path, shift: float = 0.0):
    """x [N, 200, 6] (per anchor: x0, y0, x1, y1 and 2 class logits) -> bboxes [N, 200, 4] xyxy (shifted right by
    ``shift`` pixels) and scores [N, 200, 2] (sigmoid)."""
    shift_w = numpy_helper.from_array(np.array([shift, 0, shift, 0], np.float32), "shift")
    nodes = [helper.make_node("Slice", ["x", "s0", "s4", "ax"], ["b0"]), helper.make_node("Add", ["b0", "shift"],
                                                                                          ["bboxes"]),
             helper.make_node("Slice", ["x", "s4", "s6", "ax"], ["logits"]),
             helper.make_node("Sigmoid", ["logits"], ["scores"])]
    inits = [shift_w] + [numpy_helper.from_array(np.array([v], np.int64), n)
                         for n, v in (("s0", 0), ("s4", 4), ("s6", 6), ("ax", 2))]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 200, c]) for n, c in (("bboxes", 4),
                                                                                           ("scores", 2))]
    return _save(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 200, 6])], outs, path)


def _anchors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.zeros((n, 200, 6), np.float32)
    xy = rng.uniform(0, 600, size=(n, 200, 2))
    x[..., :2], x[..., 2:4] = xy, xy + rng.uniform(20, 60, size=(n, 200, 2))
    x[..., 4:] = -6.0
    x[:, :4, 4] = 6.0  # four objects of class 0 per image
    return x


def test_a_detector_with_separate_boxes_and_scores_outputs_is_judged_on_both(tmp_path):
    """Before: detection read one output ([N, 4+C, A] or [N, A, 5+C]); boxes= was no detection argument."""
    model, moved = split_detector(tmp_path / "d.onnx"), split_detector(tmp_path / "m.onnx", shift=30.0)
    x = {"x": _anchors(8, 4)}
    info, names, ref, bad = _fp32_and_moved(model, moved, x)
    task = resolve_task("detection", "boxes=bboxes,scores=scores", model, info.outputs)
    assert task.output == "scores" and task.reads() == ("scores", "bboxes")
    same = evaluate_gate(names, ref, _run(model, x), None, "int8", GateSettings(), task)
    assert same.passed and same.task is not None and same.task.details["fp32_boxes"] == 32 and same.not_judged == ()
    r = evaluate_gate(names, ref, bad, None, "int8", GateSettings(), task)
    crit = {c.name: c for c in r.task.criteria} if r.task else {}
    assert not r.passed and crit["box_recall"].value < 0.5, r.task  # 30 px right on 20..60 px boxes
    cx = resolve_task("detection", "boxes=bboxes,scores=scores,box_format=cxcywh", model, info.outputs)
    assert cx.arg("box_format") == "cxcywh"
    m, manifest = _compile_fp32(tmp_path, model, {"x": x["x"]}, "--task", "detection", "--task-args",
                                "boxes=bboxes,scores=scores")
    assert (m["drift"]["detection_format"], m["drift"]["output"]) == ("scores", "scores"), m.get("build_notes")
    counts, n = _agent_counts(manifest, [[o[i:i + 1] for o in ref] for i in range(4)])
    assert n == 4 and sum(counts["boxes"]) == 4
