"""Gates that judge the model's task, any axis layout, truthful manifests, early errors, verify without labels.

The stand-in models come from models/tasks/make_tasks.py (one per task, each with a damaged twin); the real
one is the PP-OCRv4 recognizer inside the rapidocr-onnxruntime wheel, loaded from the installed package.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet.compiler.graph import check_model
from edgefleet.compiler.targets.onnxruntime import OnnxRuntimeTarget, count_quantized_ops
from edgefleet.judge.data import Dataset
from edgefleet.judge.errors import InputError
from edgefleet.judge.gate import GateSettings, evaluate_gate
from edgefleet.judge.predict import predict_all
from edgefleet.judge.tasks import TaskSpec, infer_task, parse_task_args, resolve_task
from edgefleet.protocol.bundle import extract_bundle
from edgefleet.protocol.manifest import parse_manifest
from edgefleet.protocol.profile import load_profile
from tests.conftest import REPO
from tests.test_compiler import run_cli


def _make_tasks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tasks", REPO / "models" / "tasks" / "make_tasks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MT = _make_tasks()


def _run(path: Path, feeds: dict[str, np.ndarray], per_sample: bool) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    if per_sample:
        n = len(next(iter(feeds.values())))
        return np.concatenate([sess.run(None, {k: v[i:i + 1] for k, v in feeds.items()})[0] for i in range(n)])
    return sess.run(None, feeds)[0]


# -- 1. each task: a damaged engine refused, a faithful (INT8) engine passed ------------------------------
@pytest.mark.parametrize("task", MT.TASKS)
def test_the_task_gate_refuses_a_damaged_engine_and_passes_the_int8_build(task, tmp_path):
    model, damaged = MT.build(task, tmp_path), MT.build(task, tmp_path, damaged=True)
    info = check_model(model)
    calib = MT.data(task, 32, 1)
    evals = MT.data(task, 32, 2)
    OnnxRuntimeTarget().build(model, info, "int8", load_profile("x86-cpu"),
                              Dataset(calib, None, {k: 0 for k in calib}, info.per_sample), tmp_path / "int8.onnx")
    spec = resolve_task(task, None, model, info.outputs)
    ref = _run(model, evals, info.per_sample)
    out = info.outputs[0].name
    faithful = evaluate_gate([out], [ref], [_run(tmp_path / "int8.onnx", evals, info.per_sample)], None, "int8",
                             GateSettings(), spec)
    bad = evaluate_gate([out], [ref], [_run(damaged, evals, info.per_sample)], None, "int8", GateSettings(), spec)
    assert faithful.passed and faithful.task is not None and faithful.task.passed, faithful.task
    assert not bad.passed and bad.task is not None and not bad.task.passed, bad.task
    assert (bad.task.task == task and bad.task.ci95 is not None) or task == "embedding"
    assert bad.drop > bad.max_drop  # the report's figure is the criterion that failed


def test_tensor_agreement_would_have_passed_the_damaged_probabilities(tmp_path):
    """Cosine of an [N, 1] probability is 1.0 whatever the decisions: the task gate counts decisions."""
    model, damaged = MT.build("regression", tmp_path), MT.build("regression", tmp_path, damaged=True)
    x = MT.data("regression", 32, 2)
    ref, bad = _run(model, x, False), _run(damaged, x, False)
    tensor = evaluate_gate(["prob"], [ref], [bad], None, "int8", GateSettings())
    task = evaluate_gate(["prob"], [ref], [bad], None, "int8", GateSettings(), infer_task(check_model(model).outputs))
    assert tensor.passed and tensor.outputs[0].cosine == 1.0
    assert not task.passed and task.task is not None and task.task.metric == "decision_agreement"


def test_the_task_is_inferred_from_the_output_shape_and_fp32_values_and_says_how_sure(tmp_path):
    got = {}
    for t in MT.TASKS:
        model = MT.build(t, tmp_path)
        info = check_model(model)
        got[t] = infer_task(info.outputs, _run(model, MT.data(t, 8, 3), info.per_sample))
    assert {t: (s.name, s.sure) for t, s in got.items()} == {
        "classification": ("classification", False), "detection": ("detection", True), "ctc": ("ctc", True),
        "segmentation": ("segmentation", True), "regression": ("regression", True),
        "embedding": ("classification", False)}  # [N, D] logits or an embedding: unsure, declare it
    assert all(s.source == "inferred" and "--task" in s.note for s in got.values())
    assert all(("UNSURE" in s.note) != s.sure for s in got.values())


def test_task_arguments_and_task_files_are_checked(tmp_path):
    assert parse_task_args("detection", "format=yolov8,score=0.3") == {"format": "yolov8", "score": 0.3}
    for text, msg in (("colour=red", "takes no argument 'colour'"), ("score", "not key=value"),
                      ("format=ssd", "not one of yolov8"), ("min_recall=2", "fraction between 0 and 1")):
        with pytest.raises(InputError, match=msg):
            parse_task_args("detection", text)
    model = MT.build("ctc", tmp_path)
    info = check_model(model)
    (tmp_path / "ctc.task.yaml").write_text("task: sequence\nargs: {blank: 0, min_exact: 0.9}\n")
    spec = resolve_task(None, None, model, info.outputs)
    assert (spec.name, spec.source, spec.args) == ("ctc", "file", {"blank": 0, "min_exact": 0.9})
    (tmp_path / "ctc.task.yaml").write_text("task: ctc\nblank: 0\n")
    with pytest.raises(InputError, match="unknown key 'blank'"):
        resolve_task(None, None, model, info.outputs)
    with pytest.raises(InputError, match="not one of the model's outputs"):
        resolve_task("ctc", "output=nope", model, info.outputs)


# -- 3. any axis layout -----------------------------------------------------------------------------------
def test_fixed_batch_1_with_dynamic_width_compiles_sample_by_sample_and_verifies_without_labels(tmp_path):
    """[1, T, C] (like an OCR recognizer's [1, 1, 64, W]): evaluated one sample at a time, not batchable, the task
    recorded in a version-3 manifest; `verify --eval` without labels reruns the ctc metric on this CPU."""
    model = MT.build("ctc", tmp_path)
    np.savez(tmp_path / "d.npz", **MT.data("ctc", 32, 1))
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", str(tmp_path / "d.npz"), "--eval",
                str(tmp_path / "d.npz"), "--task", "ctc", "--task-args", "blank=0", "--precision", "int8",
                "--name", "ctc", "--out", str(tmp_path), "--no-benchmark", "--no-cache", "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["manifest"]
    # v6: the task gate (v3) and, since issue 34, the drift reference every bundle carries
    assert m["manifest_version"] == 6 and [i["batch_axis"] for i in m["inputs"]] == [None]
    task = m["accuracy"]["task"]
    assert task["task"] == "ctc" and task["metric"] == "exact_string_agreement" and task["value"] == 1.0
    assert task["ci95"][0] < 1.0 and {c["name"] for c in task["criteria"]} == {"exact_string_agreement",
                                                                                "char_error_rate"}
    assert "quantize/dequantize ops" in m["quantization"]["reason"]
    bundle = tmp_path / "ctc-1.0.0-x86-cpu.tar"
    v = run_cli("verify", str(bundle), "--eval", str(tmp_path / "d.npz"), "--reference", str(model), "--json")
    assert v.returncode == 0, v.stderr
    gate = json.loads(v.stdout)["gate"]
    assert gate["passed"] and gate["task"]["task"] == "ctc" and gate["eval_samples"] == 32  # every sample of d.npz


def test_predict_all_keeps_samples_of_different_shapes_apart():
    data = Dataset({"x": np.arange(4, dtype=np.float32).reshape(4, 1)}, None, {"x": 0}, per_sample=True)
    out = predict_all(lambda f: [np.zeros((1, int(f["x"][0, 0]) + 1, 3), np.float32)], data)[0]
    assert isinstance(out, list) and [o.shape for o in out] == [(1, 3), (2, 3), (3, 3), (4, 3)]
    r = evaluate_gate(["y"], [out], [out], None, "int8", GateSettings())
    assert r.passed and r.outputs[0].cosine == 1.0


def _save(g: onnx.GraphProto, path: Path) -> Path:
    """``g`` as an opset-13, IR-8 model at ``path``."""
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def _folding(path: Path) -> Path:
    """x [N, 4] -> boxes [N*4, 1]: the batch folded into the box axis (declared [M, 1])."""
    shape = numpy_helper.from_array(np.array([-1, 1], np.int64), "shape")
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["boxes"])], "fold",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["M", 1])], [shape])
    return _save(g, path)


def test_a_model_whose_outputs_do_not_keep_the_batch_is_refused_batching(tmp_path):
    model = _folding(tmp_path / "fold.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--eval", str(tmp_path / "d.npz"), "--precision",
                "fp32", "--task", "regression", "--name", "fold", "--out", str(tmp_path), "--no-benchmark",
                "--no-cache", "--json")
    assert r.returncode == 0, r.stderr
    m = parse_manifest(json.dumps(json.loads(r.stdout)["manifest"]))
    assert not m.batchable and m.inputs[0].shape == (1, 4) and m.outputs[0].batch_axis is None
    assert m.precision_choice is not None and "batching refused" in m.precision_choice.reason
    assert "does not keep a batch axis" in m.precision_choice.reason


def test_state_exported_with_two_dynamic_axes_takes_its_batch_axis_from_data_and_behaviour(tmp_path):
    """h declared [?, ?, 8] (dynamic layers and batch): the data holds 40 samples on axis 1, the model grows
    h_out on axis 1 too; both are recorded so."""
    w = numpy_helper.from_array(np.ones((4, 8), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xe"]), helper.make_node("Add", ["h", "xe"], ["h_out"])]
    g = helper.make_graph(nodes, "state", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                           helper.make_tensor_value_info("h", TensorProto.FLOAT, ["L", "B", 8])],
                          [helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["L", "B", 8])], [w])
    _save(g, tmp_path / "state.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(40, 4)).astype(np.float32),
             h=rng.normal(size=(2, 40, 8)).astype(np.float32))
    r = run_cli("compile", str(tmp_path / "state.onnx"), "--profile", "x86-cpu", "--eval", str(tmp_path / "d.npz"),
                "--precision", "fp32", "--task", "embedding", "--name", "state", "--out", str(tmp_path),
                "--no-benchmark", "--no-cache", "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["manifest"]
    assert {i["name"]: i["batch_axis"] for i in m["inputs"]} == {"x": 0, "h": 1}
    assert m["outputs"][0]["batch_axis"] == 1


# -- 2. the manifest tells the truth -------------------------------------------------------------------------
def _if_model(path: Path) -> Path:
    """The whole computation (a MatMul) inside both branches of an If."""
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32), "w")
    branch = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y_b"])], "b", [],
                               [helper.make_tensor_value_info("y_b", TensorProto.FLOAT, ["N", 8])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0), helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)]
    g = helper.make_graph(nodes, "iff", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
                          [w, numpy_helper.from_array(np.array(0, np.float32), "zero")])
    return _save(g, path)


def test_an_int8_build_with_no_quantized_op_is_never_called_int8(tmp_path):
    model = _if_model(tmp_path / "iff.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).normal(size=(32, 8)).astype(np.float32))
    args = ["compile", str(model), "--profile", "x86-cpu", "--calibration", str(tmp_path / "d.npz"), "--eval",
            str(tmp_path / "d.npz"), "--task", "embedding", "--name", "iff", "--out", str(tmp_path), "--no-benchmark",
            "--no-cache"]
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["manifest"]
    assert m["precision"] == "fp32" and m["quantization"] is None
    reason = m["precision_choice"]["reason"]
    assert "no quantized op" in reason and "inside If/Loop/Scan" in reason
    forced = run_cli(*args, "--precision", "int8")
    # the fp32 model runs: not a toolchain failure (exit 5) but this model's limit, exit 4 with the way out
    assert forced.returncode == 4 and "Traceback" not in forced.stderr and "--precision fp32" in forced.stderr
    assert count_quantized_ops(model) == (0, 2, 4)  # (quantized, inside subgraphs: a MatMul per branch, all)


def test_when_quant_pre_process_fails_the_raw_graph_is_quantized_and_the_manifest_says_so(tmp_path, monkeypatch):
    import onnxruntime.quantization.shape_inference as si

    def broken(*_a, **_k):
        raise ValueError("The truth value of an array with more than one element is ambiguous")

    monkeypatch.setattr(si, "quant_pre_process", broken)
    model = MT.build("classification", tmp_path)
    calib = MT.data("classification", 32, 1)
    q = OnnxRuntimeTarget().build(model, check_model(model), "int8", load_profile("x86-cpu"),
                                  Dataset(calib, None, {"x": 0}), tmp_path / "int8.onnx")
    assert q is not None and "quantized from the raw graph" in q.reason and "truth value" in q.reason
    assert count_quantized_ops(tmp_path / "int8.onnx")[0] > 0


def test_a_damaged_engine_is_refused_with_advice_that_never_loosens_a_bound(tmp_path):
    """The gate's refusal never suggests the bound the damage just measured (followed, that ships the damage); for
    an inferred task it says to declare the task, and it ends with the plain statement that no int8 engine keeps the
    task's answers (tests/test_compiler_detection follows every advice literally)."""
    model, damaged = MT.build("segmentation", tmp_path), MT.build("segmentation", tmp_path, damaged=True)
    x = MT.data("segmentation", 24, 2)
    ref, bad = _run(model, x, False), _run(damaged, x, False)
    spec = infer_task(check_model(model).outputs, ref)
    r = evaluate_gate(["mask"], [ref], [bad], None, "int8", GateSettings(), spec)
    from edgefleet.compiler.advice import advice

    assert not r.passed and spec.sure
    text = advice(r, spec, "tried")
    assert "min_iou" not in text and "loosen" not in text and "--task-args" not in text, text
    assert "declare its task (--task NAME" in text and text.endswith("ships fp32 and says why)")
    declared = TaskSpec("segmentation", "mask", {}, "declared")
    assert advice(r, declared, "tried").startswith("no int8 engine keeps the task's answers")


# -- 4. errors before work ------------------------------------------------------------------------------------
def test_a_bad_name_is_refused_before_any_work_with_a_name_that_works(tmp_path):
    model = MT.build("classification", tmp_path)
    np.savez(tmp_path / "d.npz", **MT.data("classification", 32, 1))
    base = ["compile", str(model), "--profile", "x86-cpu", "--eval", str(tmp_path / "d.npz"), "--out", str(tmp_path),
            "--precision", "fp32", "--no-benchmark", "--no-cache", "--quiet"]
    t0 = time.monotonic()
    r = run_cli(*base, "--name", "PPOCR-Cls")
    assert r.returncode == 4 and "Traceback" not in r.stderr and "try --name ppocr-cls" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20 and not list(tmp_path.glob("*.tar"))
    assert run_cli(*base, "--name", "ppocr-cls").returncode == 0
    for extra, msg in ((["--name", "x", "--task", "yolo"], "unknown task 'yolo'"),
                       (["--name", "x", "--task-args", "score=1"], "--task-args needs --task"),
                       (["--name", "x", "--calibration", str(tmp_path / "none.npz")], "--calibration file not found"),
                       (["--name", "x", "--version", "1.0"], "not MAJOR.MINOR.PATCH")):
        r = run_cli(*base, *extra)
        assert r.returncode == 4 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- 5. self-test samples are bounded ---------------------------------------------------------------------------
def test_the_self_test_sample_stays_within_1_mib_with_large_outputs(tmp_path):
    """[N, 64] in, [N, 64, 1024] noise-like out: 64 samples would be ~32 MiB with the fp32 reference; the bundle
    keeps what fits in 1 MiB."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(1, 1024)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    g = helper.make_graph([helper.make_node("Unsqueeze", ["x", "axes"], ["xu"]),
                           helper.make_node("MatMul", ["xu", "w"], ["y"])], "big",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64, 1024])], [w, axes])
    _save(g, tmp_path / "big.onnx")
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(64, 64)).astype(np.float32))
    r = run_cli("compile", str(tmp_path / "big.onnx"), "--profile", "x86-cpu", "--eval", str(tmp_path / "d.npz"),
                "--precision", "fp32", "--task", "embedding", "--name", "big", "--out", str(tmp_path),
                "--no-benchmark", "--no-cache", "--json")
    assert r.returncode == 0, r.stderr
    man = extract_bundle(tmp_path / "big-1.0.0-x86-cpu.tar", tmp_path / "x")
    assert man.files["selftest.npz"].size_bytes <= 1 << 20 and man.selftest_summary is not None
    assert 1 <= man.selftest_summary.samples < 64


# -- 6. a real model: the PP-OCRv4 recognizer, task ctc ----------------------------------------------------------
def _ppocr_rec() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.fail("rapidocr-onnxruntime (a dev dependency that ships PP-OCRv4) is not installed: make venv")
    return Path(spec.origin).parent / "models" / "ch_PP-OCRv4_rec_infer.onnx"


def _text_lines(seed: int, n: int) -> np.ndarray:
    """Printed text lines as PaddleOCR's recognizer takes them: [n, 3, 48, 320], (x / 255 - 0.5) / 0.5."""
    import cv2

    rng = np.random.default_rng(seed)
    words = ["edgefleet", "INVOICE 2026", "total 42.00", "ship it", "v1.0.0", "AVX2 Jetson", "hello world",
             "Orin Nano 8GB", "batch 16", "qemu Haswell"]
    out = []
    for _ in range(n):
        img = np.full((48, 320, 3), int(rng.integers(200, 256)), np.uint8)
        cv2.putText(img, str(rng.choice(words)), (int(rng.integers(2, 20)), 34), int(rng.choice([0, 2])),
                    float(rng.uniform(0.8, 1.0)), (int(rng.integers(0, 60)),) * 3, 2)
        out.append(((img.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1))
    return np.stack(out)


@pytest.mark.timeout(600)
def test_the_pp_ocrv4_recognizer_is_judged_by_its_decoded_strings(tmp_path):
    """The gate's ctc verdict on INT8 agrees with the string agreement this test measures itself with the model's
    own dictionary; the compile with the task declared ships what that verdict allows, with no traceback."""
    from edgefleet.judge.tasks import ctc_decode

    model = _ppocr_rec()
    np.savez(tmp_path / "calib.npz", x=_text_lines(1, 16))
    np.savez(tmp_path / "eval.npz", x=_text_lines(2, 16))
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", str(tmp_path / "calib.npz"),
                "--eval", str(tmp_path / "eval.npz"), "--task", "ctc", "--precision", "int8", "--no-fallback",
                "--name", "ppocr-rec", "--out", str(tmp_path), "--no-benchmark", "--no-cache", "--json")
    assert "Traceback" not in r.stderr and r.returncode in (0, 3), r.stderr[-2000:]

    # the same INT8 engine, built again in-process, decoded with the model's dictionary by this test
    from edgefleet.compiler.graph import ensure_opset

    info = check_model(model)
    calib = Dataset({"x": np.load(tmp_path / "calib.npz")["x"]}, None, {"x": 0})
    source = ensure_opset(model, 13, tmp_path / "opset13.onnx", calib.head(2))  # as the compiler does (opset 12)
    OnnxRuntimeTarget().build(source, info, "int8", load_profile("x86-cpu"), calib, tmp_path / "int8.onnx")
    x = np.load(tmp_path / "eval.npz")["x"]
    ref, cand = _run(model, {"x": x}, False), _run(tmp_path / "int8.onnx", {"x": x}, False)
    meta = {p.key: p.value for p in onnx.load(str(model), load_external_data=False).metadata_props}
    alphabet = ["", *meta["character"].splitlines(), " "]
    strings = [("".join(alphabet[k] for k in ctc_decode(a)), "".join(alphabet[k] for k in ctc_decode(b)))
               for a, b in zip(ref, cand, strict=True)]
    measured = sum(a == b for a, b in strings) / len(strings)
    assert any(len(a) >= 4 for a, _ in strings), strings  # the model reads text in these images
    spec = resolve_task("ctc", None, model, info.outputs)
    gate = evaluate_gate([info.outputs[0].name], [ref], [cand], None, "int8", GateSettings(), spec)
    assert gate.task is not None and gate.task.value == pytest.approx(measured, abs=1e-6)
    assert gate.task.criteria[0].passed == (measured >= 0.98)
    if r.returncode == 3:  # the CLI refused the int8 build: it measured what this test measured
        assert not gate.passed and f"exact string agreement {measured:.4f}" in json.loads(r.stdout)["error"]
    else:
        assert gate.passed and json.loads(r.stdout)["manifest"]["accuracy"]["task"]["value"] == pytest.approx(measured)
