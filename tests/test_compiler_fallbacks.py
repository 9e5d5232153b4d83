"""A model that onnxruntime runs in FP32 never makes the compiler exit 5 or print a traceback: every quantizer or
loader failure under ``--precision auto`` ships FP32 with a one-line reason, and under ``--precision int8`` is a
refusal (exit 4) that says what to do. Each test builds the graph shape that broke a real model (issue 29)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet.compiler.errors import CompilerError
from tests.test_compiler import run_cli

pytestmark = pytest.mark.timeout(300)


def _save(path: Path, nodes: list, inputs: list, outputs: list, inits: list, opset: int) -> Path:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


def _mlp(path: Path, batch: int | str, opset: int, bias_shape: tuple[int, ...] = (4,), depth: int = 1) -> Path:
    """x [batch, 16] -> ``depth`` x (Gemm 16x16 -> Relu) -> Gemm 16x4 (bias ``bias_shape``) -> y [batch, 4]."""
    rng = np.random.default_rng(3)
    inits, nodes, prev = [], [], "x"
    for i in range(depth):
        inits += [numpy_helper.from_array(rng.normal(0, 0.3, (16, 16)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.normal(0, 0.1, (16,)).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"h{i}"]),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}"])]
        prev = f"r{i}"
    inits += [numpy_helper.from_array(rng.normal(0, 0.5, (4, 16)).astype(np.float32), "wo"),
              numpy_helper.from_array(rng.normal(0, 0.1, bias_shape).astype(np.float32), "bo")]
    nodes.append(helper.make_node("Gemm", [prev, "wo", "bo"], ["y"], transB=1))
    return _save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])], inits, opset)


def _data(tmp_path: Path, n: int = 48) -> tuple[Path, Path]:
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "calib.npz", x=rng.normal(size=(n, 16)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(n, 16)).astype(np.float32))
    return tmp_path / "calib.npz", tmp_path / "eval.npz"


def _compile(tmp_path: Path, model: Path, *extra: str) -> tuple[int, dict, str]:
    calib, evals = _data(tmp_path)
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", str(calib), "--eval", str(evals),
                "--name", "m", "--out", str(tmp_path / "out"), "--no-benchmark", "--no-cache", "--json", *extra)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, r.stderr


def test_a_gemm_bias_the_quantizer_crashes_on_is_made_1d_and_quantized(tmp_path):
    """A Gemm bias of shape [1, 4] (TF/Keras exports) makes onnxruntime's int32-bias weight adjustment raise "The
    truth value of an array ... is ambiguous" (and, without that adjustment, a DequantizeLinear whose scale does not
    fit the bias: issue 40.5); the bias is made 1-D before quantizing, and the manifest's build notes say so (the
    retry itself: tests/test_compiler_build_notes.py)."""
    model = _mlp(tmp_path / "mlp.onnx", "N", 13, bias_shape=(1, 4))
    code, doc, err = _compile(tmp_path, model, "--precision", "int8", "--task", "classification",
                              "--task-args", "min_top1=0.5")
    assert code == 0, err[-2000:]
    q = doc["manifest"]["quantization"]
    assert doc["manifest"]["precision"] == "int8" and "QDQDisableWeightAdjustForInt32Bias" not in q["reason"]
    assert ("int8 pre-processing", "1 Gemm bias(es) made 1-D [N] (bo)") in [
        (n["step"], n["action"]) for n in doc["manifest"]["build_notes"]]


def _unloadable_quantize(prepared, profile, calibration, out_path, keep_float=()):
    """Stands in for a quantizer that writes a graph onnxruntime cannot load (a QDQ pair, then an op no runtime
    implements), as onnxruntime's did for a Transpose whose types it inferred wrongly."""
    from edgefleet.protocol.manifest import QuantizationInfo

    q = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"])
    dq = helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"])
    bad = helper.make_node("NoSuchOp", ["xd"], ["y"], domain="edgefleet.test")
    g = helper.make_graph([q, dq, bad], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                          [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                           numpy_helper.from_array(np.array(128, np.uint8), "z")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("edgefleet.test", 1)])
    m.ir_version = 7
    onnx.save(m, str(out_path))
    return QuantizationInfo(scheme="u8s8_reduced", activation_type="uint8", weight_type="int8", weight_bits=7,
                            per_channel=True, calibration_method="minmax", calibration_samples=len(calibration),
                            reason="stand-in", float_nodes=tuple(keep_float))


@pytest.mark.parametrize("precision", ["auto", "int8"])
def test_an_int8_engine_onnxruntime_cannot_load_ships_fp32_under_auto_and_is_exit_4_under_int8(
        tmp_path, monkeypatch, precision):
    import edgefleet.compiler.targets.onnxruntime as target
    from edgefleet.compiler.compile import CompileOptions, compile_model

    monkeypatch.setattr(target, "quantize", _unloadable_quantize)
    calib, evals = _data(tmp_path)
    opts = CompileOptions(model=_mlp(tmp_path / "mlp.onnx", "N", 13), profile="x86-cpu", calibration=calib,
                          eval=evals, out_dir=tmp_path / "out", name="m", version="1.0.0", precision=precision,
                          benchmark=False, task="classification")
    if precision == "auto":
        m = compile_model(opts).manifest
        assert m.precision == "fp32" and m.precision_choice is not None
        reason = m.precision_choice.reason
        assert "int8 not built: its build failed" in reason and "NoSuchOp" in reason and "\n" not in reason
    else:
        with pytest.raises(CompilerError) as err:
            compile_model(opts)
        assert err.value.exit_code == 4, err.value
        assert "cannot build int8 for this model" in str(err.value) and "--precision auto" in str(err.value)


def test_a_fixed_batch_1_model_below_opset_13_gets_an_int8_attempt(tmp_path):
    """The opset-13 conversion is checked on the model's own batch (one sample per call), not a batch of 16."""
    model = _mlp(tmp_path / "b1.onnx", 1, 12)
    code, doc, err = _compile(tmp_path, model, "--task", "classification", "--task-args", "min_top1=0.5")
    assert code == 0, err[-2000:]
    cands = {c["precision"]: c for c in doc["manifest"]["precision_choice"]["candidates"]}
    assert cands["int8"]["top1"] is not None, doc["manifest"]["precision_choice"]
    assert "could not be converted" not in doc["manifest"]["precision_choice"]["reason"]


@pytest.mark.parametrize("precision", ["auto", "int8"])
def test_the_float_fallback_of_a_fixed_batch_1_model_runs_to_its_end(tmp_path, precision):
    """A bound no int8 build meets (every output within 1e-7 of fp32) makes the float fallback try every step on a
    model that takes one sample per call: auto ships fp32 saying what was tried, int8 is refused (exit 3)."""
    model = _mlp(tmp_path / "b1.onnx", 1, 13, depth=12)  # more layers than the fallback may keep in float
    code, doc, err = _compile(tmp_path, model, "--precision", precision, "--task", "regression",
                              "--task-args", "tol=0.0000001,min_within=1")
    if precision == "auto":
        assert code == 0, err[-2000:]
        m = doc["manifest"]
        assert m["precision"] == "fp32"
        int8 = next(c for c in m["precision_choice"]["candidates"] if c["precision"] == "int8")
        assert not int8["passed"] and "float fallback tried" in int8["note"]
    else:
        assert code == 3 and "float fallback" in doc["error"], err[-2000:]


def _time_major(path: Path) -> Path:
    """x [1, T, 6] -> softmax -> transposed to y [T, 1, 6] (declared [1, T] as some exports do): a CTC recognizer
    with a fixed batch of 1 that puts time first."""
    nodes = [helper.make_node("Softmax", ["x"], ["p"], axis=-1), helper.make_node("Transpose", ["p"], ["y"],
                                                                                perm=[1, 0, 2])]
    return _save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 6])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T"])], [], 13)


def test_task_ctc_takes_a_time_major_output_of_a_batch_1_model(tmp_path):
    model = _time_major(tmp_path / "tm.onnx")
    rng = np.random.default_rng(2)
    x = rng.normal(0, 3, (24, 12, 6)).astype(np.float32)  # 24 samples of 12 steps, stacked on axis 0
    np.savez(tmp_path / "eval.npz", x=x)
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--eval", str(tmp_path / "eval.npz"), "--precision",
                "fp32", "--task", "ctc", "--name", "tm", "--out", str(tmp_path / "out"), "--no-benchmark",
                "--no-cache", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    task = json.loads(r.stdout)["manifest"]["accuracy"]["task"]
    assert task["task"] == "ctc" and task["details"]["strings"] == 24 and task["details"]["fp32_chars"] > 24
