"""A model that is already quantized (onnxruntime's quantize_dynamic or a static QDQ export) is recognised before
any INT8 attempt (issue 29): under ``--precision auto`` it is built and gated as given and labelled int8, saying
"already quantized (...)" with its node types and counts and that no FP32 original is there to judge its
quantization against; an explicit ``--precision int8`` (or fp32) is a refusal (exit 4) that asks for the original
float model. Before, the compiler tried a static INT8 build on it, onnxruntime's quantizer failed (ddddocr's
common_old.onnx: ``KeyError: '140_scale'``) and the file shipped labelled fp32 with that KeyError as the reason."""

from __future__ import annotations

import importlib.util
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.test_compiler import run_cli

pytestmark = pytest.mark.timeout(300)

QUANT_TYPES = ("DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "QuantizeLinear", "DequantizeLinear",
               "DynamicQuantizeLSTM")


def _float_model(path: Path) -> Path:
    """x [N, 16] -> MatMul 16x16 -> Add -> Relu -> MatMul 16x4 -> Add -> y [N, 4], float, opset 13."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (16, 16)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.1, (16,)).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (16, 4)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.normal(0, 0.1, (4,)).astype(np.float32), "b2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["r1"]), helper.make_node("MatMul", ["r1", "w2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


class _Reader:
    def __init__(self, x: np.ndarray):
        self.feeds = iter([{"x": x[i:i + 8]} for i in range(0, len(x), 8)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def _quantized(tmp_path: Path, how: str) -> Path:
    """The float model quantized by onnxruntime: ``dynamic`` (quantize_dynamic) or ``qdq`` (quantize_static, QDQ)."""
    from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static

    src = _float_model(tmp_path / "float.onnx")
    out = tmp_path / f"{how}.onnx"
    if how == "dynamic":
        quantize_dynamic(str(src), str(out))
    else:
        x = np.random.default_rng(7).normal(size=(32, 16)).astype(np.float32)
        quantize_static(str(src), str(out), _Reader(x), quant_format=QuantFormat.QDQ)
    return out


def _counts(path: Path) -> dict[str, int]:
    """The quantized node types of ``path`` and how many of each, counted here, independently of the compiler."""
    c = Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    return {op: c[op] for op in QUANT_TYPES if c[op]}


def _data(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "calib.npz", x=rng.normal(size=(48, 16)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(48, 16)).astype(np.float32))
    return tmp_path / "calib.npz", tmp_path / "eval.npz"


def _compile(tmp_path: Path, model: Path, *extra: str, as_json: bool = True):
    calib, evals = _data(tmp_path)
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", str(calib), "--eval", str(evals),
                "--name", "m", "--out", str(tmp_path / "out"), "--no-cache", *(["--json"] if as_json else []),
                *extra)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


def _bundled_manifest(bundle: Path) -> dict:
    with tarfile.open(bundle) as tar:
        f = tar.extractfile("manifest.json")
        assert f is not None
        return json.load(f)


@pytest.mark.parametrize("how,task", [("dynamic", "classification"), ("qdq", "classification"), ("dynamic", None)])
def test_auto_builds_an_already_quantized_model_as_given_and_says_so(tmp_path, how, task):
    """With the task declared, a static INT8 build of these was tried before and failed (dynamic: onnxruntime's
    quantizer raised KeyError: 'r1_scale'; qdq: it wrote two nodes named m1_DequantizeLinear), and fp32 shipped."""
    model = _quantized(tmp_path, how)
    counts = _counts(model)
    assert counts, "onnxruntime's quantizer wrote no quantized node"
    r = _compile(tmp_path, model, "--precision", "auto", *(["--task", task] if task else []))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    m = doc["manifest"]
    # it computes with the quantized kernels it was given: labelled int8, never fp32; no int8 build of ours
    assert m["precision"] == "int8" and m["quantization"] is None
    reason = m["precision_choice"]["reason"]
    assert "\n" not in reason and reason.startswith("int8: already quantized ("), reason
    for op, n in counts.items():
        assert f"{n} {op}" in reason, (op, n, reason)
    assert "no int8 build tried" in reason and "no FP32 original" in reason, reason
    assert "KeyError" not in reason and "its build failed" not in reason
    acc = m["accuracy"]
    assert acc["passed"] and acc["candidate_precision"] == "int8" and acc["reference_precision"] == "int8"
    [cand] = [c for c in m["precision_choice"]["candidates"] if c["precision"] == "int8"]
    assert cand["passed"] and "already quantized (" in cand["note"]
    assert not [c for c in m["precision_choice"]["candidates"] if c["precision"] == "fp32"]
    assert m["benchmark"] is None  # nothing to compare it with: the reference is the model itself
    on_disk = _bundled_manifest(Path(doc["bundle"]))
    assert on_disk["precision"] == "int8" and on_disk["precision_choice"]["reason"] == reason


def test_the_summary_names_the_quantized_input_and_compares_it_with_itself(tmp_path):
    model = _quantized(tmp_path, "dynamic")
    r = _compile(tmp_path, model, "--precision", "auto", "--no-benchmark", "--quiet", as_json=False)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert any(line.startswith("chose     int8: already quantized (") for line in lines), r.stdout
    assert any("onnxruntime int8" in line for line in lines if line.startswith("model ")), r.stdout
    assert "with fp32" not in r.stdout and "against fp32" not in r.stdout, r.stdout


@pytest.mark.parametrize("how,precision", [("dynamic", "int8"), ("qdq", "int8"), ("dynamic", "fp32")])
def test_an_explicit_precision_for_an_already_quantized_model_is_exit_4_asking_for_the_float_original(
        tmp_path, how, precision):
    model = _quantized(tmp_path, how)
    counts = _counts(model)
    r = _compile(tmp_path, model, "--precision", precision)
    assert r.returncode == 4, (r.returncode, r.stderr[-2000:])
    error = json.loads(r.stdout)["error"]
    assert "\n" not in error and "already quantized (" in error, error
    for op, n in counts.items():
        assert f"{n} {op}" in error, (op, n, error)
    assert "original float model" in error and "--precision auto" in error, error
    assert "KeyError" not in error
    assert not list((tmp_path / "out").glob("*.tar"))
    plain = _compile(tmp_path, model, "--precision", precision, as_json=False)
    assert plain.returncode == 4 and [ln for ln in plain.stderr.splitlines() if ln.startswith("error: ")] == [
        f"error: {error}"], plain.stderr[-2000:]


def test_no_int8_build_is_tried_on_an_already_quantized_model(tmp_path, monkeypatch):
    import edgefleet.compiler.targets.onnxruntime as target
    from edgefleet.compiler.compile import CompileOptions, compile_model

    def refuse(*_a, **_k):
        raise AssertionError("an int8 build was tried on an already quantized model")

    monkeypatch.setattr(target, "prepare_or_raw", refuse)
    monkeypatch.setattr(target, "quantize", refuse)
    calib, evals = _data(tmp_path)
    m = compile_model(CompileOptions(model=_quantized(tmp_path, "qdq"), profile="x86-cpu", calibration=calib,
                                     eval=evals, out_dir=tmp_path / "out", name="m", version="1.0.0",
                                     benchmark=False)).manifest
    assert m.precision == "int8" and m.precision_choice is not None
    assert m.precision_choice.reason.startswith("int8: already quantized (")


def test_the_quantized_node_types_are_counted_inside_subgraphs_and_contrib_ops(tmp_path):
    """DynamicQuantizeLSTM (com.microsoft, ddddocr's recogniser) and QLinear* inside an If branch count."""
    from edgefleet.compiler.graph import quantized_ops, quantized_phrase
    from edgefleet.compiler.targets.onnxruntime import count_quantized_ops

    branch = helper.make_graph([helper.make_node("QLinearMatMul", list("abcdefgh"), ["o"])], "b", [],
                               [helper.make_tensor_value_info("o", TensorProto.UINT8, None)])
    nodes = [helper.make_node("DynamicQuantizeLSTM", ["x"], ["h"], domain="com.microsoft"),
             helper.make_node("If", ["c"], ["o"], then_branch=branch, else_branch=branch),
             helper.make_node("QuickGelu", ["x"], ["q"], domain="com.microsoft")]  # a Q that quantizes nothing
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("o", TensorProto.UINT8, None)])
    onnx.save(helper.make_model(g), str(tmp_path / "g.onnx"))
    counts = quantized_ops(tmp_path / "g.onnx")
    assert counts == {"QLinearMatMul": 2, "DynamicQuantizeLSTM": 1}
    assert quantized_phrase(counts) == "already quantized (2 QLinearMatMul, 1 DynamicQuantizeLSTM)"
    assert count_quantized_ops(tmp_path / "g.onnx")[0] == 3


def _ddddocr_old() -> Path | None:
    spec = importlib.util.find_spec("ddddocr")  # finding it imports nothing (ddddocr's own import needs PIL)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "common_old.onnx"
    return path if path.is_file() else None


@pytest.mark.skipif(_ddddocr_old() is None, reason="ddddocr (make venv) is not installed")
def test_ddddocr_common_old_ships_as_given_naming_its_quantized_nodes(tmp_path):
    """The corpus's model that shipped labelled fp32 with "KeyError: '140_scale'" as its reason."""
    rng = np.random.default_rng(0)
    for name in ("calib", "eval"):
        np.savez(tmp_path / f"{name}.npz", input1=rng.uniform(-1, 1, (16, 1, 64, 160)).astype(np.float32))
    model = _ddddocr_old()
    assert model is not None
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", str(tmp_path / "calib.npz"),
                "--eval", str(tmp_path / "eval.npz"), "--task", "ctc", "--name", "old", "--out", str(tmp_path / "out"),
                "--no-benchmark", "--no-cache", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    m = json.loads(r.stdout)["manifest"]
    assert m["precision"] == "int8"
    assert m["precision_choice"]["reason"].startswith(
        "int8: already quantized (22 DynamicQuantizeLinear, 21 ConvInteger, 1 DynamicQuantizeLSTM, 1 MatMulInteger)")
    assert "KeyError" not in m["precision_choice"]["reason"]
    assert m["accuracy"]["task"]["task"] == "ctc" and m["accuracy"]["passed"]
