"""Models with several outputs are judged on every answer they give (issue 40, item 2; finding 6).

Small models built here, each with a twin whose landmarks (only) move: a CenterNet-style face detector (heat map,
sizes, offsets, five landmarks), a classifier with landmark and box heads, and a regression of coordinates in [0, 1].
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet.compiler.graph import check_model
from edgefleet.compiler.targets.onnxruntime import OnnxRuntimeTarget
from edgefleet.judge.data import Dataset
from edgefleet.judge.errors import InputError
from edgefleet.judge.gate import GateSettings, evaluate_gate
from edgefleet.judge.tasks import TaskSpec, infer_task, resolve_task
from edgefleet.protocol.bundle import extract_bundle
from edgefleet.protocol.profile import load_profile
from tests.test_compiler import run_cli

LMS = np.array([-1.0, -0.8, 1.0, -0.8, 0.0, 0.0, -0.7, 1.0, 0.7, 1.0], np.float32)  # five points from the peak


def _save(nodes, inits, inputs, outputs, path: Path) -> Path:
    g = helper.make_graph(nodes, path.stem, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, path)
    return path


def _conv1x1(name: str, w: np.ndarray, b: np.ndarray, inp: str, out: str) -> tuple[list, list]:
    inits = [numpy_helper.from_array(w.reshape(len(w), -1, 1, 1).astype(np.float32), f"{name}_w"),
             numpy_helper.from_array(b.astype(np.float32), f"{name}_b")]
    return [helper.make_node("Conv", [inp, f"{name}_w", f"{name}_b"], [out], name=name)], inits


def centerface(path: Path, moved: float = 0.0, log_sizes: bool = False, batch: int | str = "N") -> Path:
    """[N, 1, 32, 32] images -> hm [N, 1, 8, 8] (sigmoid), wh [N, 2, 8, 8], reg [N, 2, 8, 8], lms [N, 10, 8, 8]
    on the stride-4 grid: a bright 4x4 block is a face centred in its cell. ``moved``: the landmark head's weights
    shifted by that many cells (the boxes and heat map stay exactly the same); ``log_sizes``: CenterFace's layout
    (log sizes (h, w), one of them below 0 at every face)."""
    nodes = [helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[4, 4], strides=[4, 4], name="pool")]
    inits: list = []
    for name, w, b, out in (("hm_conv", np.array([20.0]), np.array([-8.0]), "hm_logit"),
                            ("wh_conv", np.array([1.2, 0.0] if log_sizes else [3.0, 2.0]),
                             np.array([-0.5, -0.5] if log_sizes else [1.0, 1.0]), "wh"),
                            ("reg_conv", np.array([1.0, -1.0]), np.array([0.0, 0.0]), "reg_logit"),
                            ("lms_conv", LMS + moved, np.zeros(10), "lms")):
        n, i = _conv1x1(name, w, b, "p", out)
        nodes += n
        inits += i
    nodes += [helper.make_node("Sigmoid", ["hm_logit"], ["hm"], name="hm_sig"),
              helper.make_node("Sigmoid", ["reg_logit"], ["reg"], name="reg_sig")]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, c, 8, 8])
           for n, c in (("hm", 1), ("wh", 2), ("reg", 2), ("lms", 10))]
    return _save(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 1, 32, 32])], out, path)


def faces(n: int, seed: int) -> np.ndarray:
    """Images with two or three faces each, in cells apart from each other (one peak per face)."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, 1, 32, 32), np.float32)
    for i in range(n):
        cells = rng.choice(16, size=int(rng.integers(2, 4)), replace=False)  # of a 4x4 lattice of every other cell
        for c in cells:
            r, q = 2 * (c // 4), 2 * (c % 4)
            x[i, 0, 4 * r:4 * r + 4, 4 * q:4 * q + 4] = 1.0
    return x


def _run(path: Path, x: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)


def test_a_centernet_face_detector_is_inferred_as_detection_and_judged_on_its_landmarks(tmp_path):
    """Before: inferred segmentation of its heat map (sure), and a twin whose landmarks all moved passed."""
    model, moved = centerface(tmp_path / "face.onnx"), centerface(tmp_path / "moved.onnx", moved=0.5)
    info = check_model(model)
    x = {"x": faces(24, 1)}
    ref, bad = _run(model, x), _run(moved, x)
    task = infer_task(info.outputs, ref[0], ref)
    assert (task.name, task.output, task.sure, task.arg("format")) == ("detection", "hm", True, "centernet"), task
    assert (task.arg("wh"), task.arg("offset"), task.arg("landmarks")) == ("wh", "reg", "lms")
    names = [o.name for o in info.outputs]
    r = evaluate_gate(names, ref, bad, None, "int8", GateSettings(), task)
    assert r.task is not None and not r.passed, r.task
    crit = {c.name: c for c in r.task.criteria}
    assert crit["box_recall"].passed and crit["box_precision"].passed  # the boxes did not move
    assert crit["pck"].value == 0.0 and not crit["pck"].passed  # every point moved 0.5 cell, over 5% of the box
    assert r.task.details["fp32_boxes"] >= 48 and r.not_judged == ()
    same = evaluate_gate(names, ref, _run(model, x), None, "int8", GateSettings(), task)
    assert same.passed and same.task is not None and {c.name for c in same.task.criteria} >= {"pck", "box_recall"}


def test_centerface_log_sizes_are_read_in_its_own_layout(tmp_path):
    model = centerface(tmp_path / "cf.onnx", log_sizes=True)
    moved = centerface(tmp_path / "cf-moved.onnx", moved=0.1, log_sizes=True)
    info = check_model(model)
    x = {"x": faces(24, 5)}
    ref = _run(model, x)
    task = infer_task(info.outputs, ref[0], ref)
    assert (task.arg("format"), task.sure) == ("centerface", True) and "log sizes" in task.note, task.note
    names = [o.name for o in info.outputs]
    assert evaluate_gate(names, ref, _run(model, x), None, "int8", GateSettings(), task).passed
    bad = evaluate_gate(names, ref, _run(moved, x), None, "int8", GateSettings(), task)
    crit = {c.name: c for c in bad.task.criteria} if bad.task else {}
    assert crit["box_recall"].passed and not crit["pck"].passed, bad.task  # 0.1 of a box of 0.6 x 2 cells moved


def test_a_centernet_head_without_values_or_names_is_a_guess_that_gates_no_int8(tmp_path):
    model = centerface(tmp_path / "face.onnx")
    info = check_model(model)
    unsure = infer_task(info.outputs)  # shapes alone: the names tell wh from reg, the values are not seen
    assert unsure.name == "detection" and not unsure.sure and "UNSURE" in unsure.note
    declared = resolve_task("detection", "format=centernet", model, info.outputs)  # roles from the names
    assert (declared.output, declared.arg("wh"), declared.arg("offset")) == ("hm", "wh", "reg")
    with pytest.raises(InputError, match="not one of the model's outputs"):
        resolve_task("detection", "format=centernet,wh=nope", model, info.outputs)
    # exported at a fixed batch of 1 (as CenterFace's 800 x 480 is): inferred segmentation of its heat map before
    fixed = centerface(tmp_path / "fixed.onnx", log_sizes=True, batch=1)
    one = check_model(fixed)
    x = faces(12, 7)
    runs = [_run(fixed, {"x": x[i:i + 1]}) for i in range(len(x))]
    ref = [np.concatenate([r[k] for r in runs]) for k in range(4)]
    task = infer_task(one.outputs, ref[0], ref)
    assert (task.name, task.arg("format"), task.sure) == ("detection", "centerface", True), task.note


def test_the_int8_build_of_the_face_detector_passes_its_boxes_and_landmarks(tmp_path):
    model = centerface(tmp_path / "face.onnx")
    info = check_model(model)
    calib = faces(32, 2)
    OnnxRuntimeTarget().build(model, info, "int8", load_profile("x86-cpu"), Dataset({"x": calib}, None, {"x": 0}),
                              tmp_path / "int8.onnx")
    x = {"x": faces(24, 3)}
    ref = _run(model, x)
    task = infer_task(info.outputs, ref[0], ref)
    r = evaluate_gate([o.name for o in info.outputs], ref, _run(tmp_path / "int8.onnx", x), None, "int8",
                      GateSettings(), task)
    assert r.passed and r.task is not None and {c.name for c in r.task.criteria} >= {"pck", "mean_iou"}, r.task


# -- a classifier with landmark and box heads --------------------------------------------------------------------
def multihead(path: Path, moved: float = 0.0, outlier: bool = False) -> Path:
    """x [N, 16] -> prob [N, 3] (softmax), lms [N, 10] (five points inside the box), box [N, 4] (x0, y0, x1, y1).
    ``moved``: the landmark head's weights shifted; ``outlier``: the landmark head reads a hidden layer with one
    huge channel it ignores, which swamps that layer's 8-bit range (int8 then moves the landmarks, not the class)."""
    rng = np.random.default_rng(7)
    wc = rng.normal(size=(16, 3)).astype(np.float32)
    wh = (rng.normal(size=(16, 16)) / 4).astype(np.float32)
    bh = np.zeros(16, np.float32)
    if outlier:
        bh[3] = 1000.0
    wl = (rng.normal(size=(16, 10)) / 4 + moved).astype(np.float32)
    wl[3] = 0.0
    wb = (rng.normal(size=(16, 4)) / 8).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in (
        (wc, "wc"), (wh, "wh"), (bh, "bh"), (wl, "wl"), (wb, "wb"),
        (np.array([10, 10, 10, 10, 10, 10, 10, 10, 10, 10], np.float32), "lb"),
        (np.array([0, 0, 20, 20], np.float32), "bb"))]
    nodes = [helper.make_node("MatMul", ["x", "wc"], ["logits"], name="cls"),
             helper.make_node("Softmax", ["logits"], ["prob"], axis=1, name="softmax"),
             helper.make_node("MatMul", ["x", "wh"], ["h0"], name="hidden"),
             helper.make_node("Add", ["h0", "bh"], ["h1"], name="hidden_bias"),
             helper.make_node("Relu", ["h1"], ["h"], name="hidden_relu"),
             helper.make_node("MatMul", ["h", "wl"], ["l0"], name="lms_mm"),
             helper.make_node("Add", ["l0", "lb"], ["lms"], name="lms_add"),
             helper.make_node("MatMul", ["x", "wb"], ["b0"], name="box_mm"),
             helper.make_node("Add", ["b0", "bb"], ["box"], name="box_add")]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", c]) for n, c in (("prob", 3), ("lms", 10),
                                                                                      ("box", 4))]
    return _save(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])], out, path)


TASK_LIST = "classification:output=prob;keypoints:output=lms,boxes=box"


def test_a_task_list_judges_the_landmarks_and_boxes_beside_the_class(tmp_path):
    """Before: --task read one output; a classifier whose landmarks moved passed on its class alone."""
    model, moved = multihead(tmp_path / "m.onnx"), multihead(tmp_path / "moved.onnx", moved=0.3)
    info = check_model(model)
    x = {"x": np.random.default_rng(1).normal(size=(64, 16)).astype(np.float32)}
    ref, bad = _run(model, x), _run(moved, x)
    names = [o.name for o in info.outputs]
    spec = resolve_task(TASK_LIST, None, model, info.outputs)
    assert spec.name == "classification" and spec.reads() == ("prob", "lms", "box")
    r = evaluate_gate(names, ref, bad, None, "int8", GateSettings(), spec)
    crit = {c.name: c for c in r.task.criteria} if r.task else {}
    assert crit["top1_agreement"].passed and not crit["lms.pck"].passed and crit["lms.instance_recall"].passed
    assert not r.passed and r.not_judged == ()
    assert "pck_fraction_of_box_longer_side" in "".join(r.task.details)  # says what the 5% is of
    # the old syntax still works, and lists what it did not judge; the compiler's auto gate refuses a change there
    alone = resolve_task("classification", "output=prob", model, info.outputs)
    loose = evaluate_gate(names, ref, bad, None, "int8", GateSettings(), alone)
    assert loose.passed and loose.not_judged == ("lms", "box")
    strict = evaluate_gate(names, ref, bad, None, "int8", GateSettings(max_unjudged_change=1e-2), alone)
    assert not strict.passed and strict.task is not None
    assert strict.task.details["unjudged_rel_l2.lms"] > 1e-2 and strict.task.details["unjudged_rel_l2.box"] == 0.0
    # the manifest's record judges again as it was gated (edgefleet verify)
    again = evaluate_gate(names, ref, bad, None, "int8", GateSettings(), TaskSpec.from_report(r.task))
    assert [c.name for c in again.task.criteria] == [c.name for c in r.task.criteria]  # type: ignore[union-attr]
    with pytest.raises(InputError, match="name it"):
        resolve_task("classification;keypoints", None, model, info.outputs)


def test_auto_ships_fp32_when_int8_changes_an_output_no_task_reads(tmp_path):
    model = multihead(tmp_path / "m.onnx", outlier=True)
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "calib.npz", x=rng.normal(size=(64, 16)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(64, 16)).astype(np.float32))
    args = ["compile", str(model), "--profile", "x86-cpu", "--calibration", str(tmp_path / "calib.npz"), "--eval",
            str(tmp_path / "eval.npz"), "--name", "multi", "--json", "--no-fallback", "--no-benchmark",
            "--min-agreement", "0.95"]  # the class survives int8 (0.98 here): only the landmarks move
    r = run_cli(*args, "--task", "classification", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads(r.stdout)["manifest"]
    assert m["precision"] == "fp32", m["precision_choice"]["reason"]
    reason = m["precision_choice"]["reason"]
    assert "top1 agreement" in reason and "FAILS >= 0.95" not in reason, reason
    assert "unjudged outputs unchanged 0.5000" in reason and "FAILS >= 1.0000" in reason, reason
    assert m["accuracy"]["not_judged"] == ["lms", "box"] and m["manifest_version"] == 8
    both = run_cli(*args, "--task", TASK_LIST, "--out", str(tmp_path / "b"))
    assert both.returncode == 0, both.stdout + both.stderr
    mb = json.loads(both.stdout)["manifest"]
    assert "lms.pck" in mb["precision_choice"]["reason"] and "unjudged" not in mb["precision_choice"]["reason"]
    assert not mb["accuracy"]["not_judged"]  # every output judged
    bundle = extract_bundle(next((tmp_path / "b").glob("*.tar")), tmp_path / "x")
    assert bundle.accuracy.task is not None and bundle.accuracy.task.args["also"] == "keypoints:output=lms,boxes=box"


# -- finding 6: coordinates in [0, 1] judged by a tolerance ------------------------------------------------------
def test_regression_with_tol_on_values_in_0_1_makes_no_decisions_at_0_5(tmp_path):
    """Before: 'decision agreement at 0.5' was added to a coordinate regression given tol (meant for probabilities)."""
    w = numpy_helper.from_array(np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32), "w")
    model = _save([helper.make_node("MatMul", ["x", "w"], ["z"]), helper.make_node("Sigmoid", ["z"], ["xy"])], [w],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                  [helper.make_tensor_value_info("xy", TensorProto.FLOAT, ["N", 4])], tmp_path / "xy.onnx")
    info = check_model(model)
    x = {"x": np.random.default_rng(4).normal(size=(32, 8)).astype(np.float32)}
    ref = _run(model, x)[0]
    near = ref + 0.01  # within tol everywhere; decisions at 0.5 would flip for values just below it
    spec = resolve_task("regression", "tol=0.02", model, info.outputs)
    r = evaluate_gate(["xy"], [ref], [near], None, "int8", GateSettings(), spec)
    assert r.task is not None and [c.name for c in r.task.criteria] == ["within_tolerance"] and r.passed
    prob = resolve_task("probabilities", "tol=0.02", model, info.outputs)  # declared probabilities: decisions too
    p = evaluate_gate(["xy"], [ref], [near], None, "int8", GateSettings(), prob)
    assert p.task is not None and [c.name for c in p.task.criteria] == ["decision_agreement", "within_tolerance"]


def test_a_keypoints_model_compiles_with_its_task_in_a_version_8_manifest(tmp_path):
    """Before: 'keypoints' was no task (exit 4); the drift reference, which does not read keypoints, raised KeyError
    through compile (a traceback) until with_drift caught it as it catches other answers it cannot read."""
    model = multihead(tmp_path / "m.onnx")
    np.savez(tmp_path / "eval.npz", x=np.random.default_rng(6).normal(size=(32, 16)).astype(np.float32))
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--eval", str(tmp_path / "eval.npz"), "--precision",
                "fp32", "--task", "landmarks", "--task-args", "output=lms,boxes=box", "--name", "kp", "--json",
                "--no-benchmark", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads(r.stdout)["manifest"]
    task = m["accuracy"]["task"]
    assert (task["task"], task["metric"], m["manifest_version"]) == ("keypoints", "pck", 8)
    # drift since 40's follow-up
    assert m["accuracy"]["not_judged"] == ["prob"] and m["drift"]["read_as"] == "keypoints"
