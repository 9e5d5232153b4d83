"""The compiler, through its library API and its command line (exit codes are part of the contract)."""

import json
import subprocess

import numpy as np
import onnx
import pytest

from edgefleet.compiler.errors import InputError
from edgefleet.compiler.graph import check_model
from edgefleet.protocol.bundle import extract_bundle
from tests.conftest import DIGITS
from tests.emulation import python_argv


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*python_argv(), "-m", "edgefleet.cli", *args], capture_output=True, text=True,
                          timeout=900)


def test_bundle_holds_a_static_int8_qdq_model(digits_bundle, tmp_path):
    m = extract_bundle(digits_bundle, tmp_path)
    graph = onnx.load(str(tmp_path / m.engine)).graph
    ops = {n.op_type for n in graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops, ops
    assert "DynamicQuantizeLinear" not in ops  # dynamic quantization is never chosen for conv nets
    assert m.precision == "int8" and m.profile == "x86-cpu"
    assert m.accuracy.passed and m.accuracy.eval_samples == 359
    assert m.accuracy.reference >= 0.97 and m.accuracy.drop <= m.accuracy.max_drop
    assert m.labels == tuple(str(i) for i in range(10))


def test_cli_compile_json(tmp_path):
    r = run_cli("compile", str(DIGITS / "model.onnx"), "--profile", "x86-cpu", "--calibration",
                str(DIGITS / "calibration.npz"), "--eval", str(DIGITS / "test.npz"), "--out", str(tmp_path),
                "--name", "digits", "--version", "2.0.0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["manifest"]["version"] == "2.0.0"
    assert doc["manifest"]["benchmark"]["points"][0]["batch_size"] == 1
    assert (tmp_path / "digits-2.0.0-x86-cpu.tar").exists()


def test_accuracy_gate_fails_the_build(tmp_path):
    # a calibration set of blank images sets activation ranges that cannot represent real digits
    np.savez(tmp_path / "blank.npz", input=np.zeros((16, 1, 8, 8), np.float32))
    r = run_cli("compile", str(DIGITS / "model.onnx"), "--profile", "x86-cpu", "--calibration",
                str(tmp_path / "blank.npz"), "--eval", str(DIGITS / "test.npz"), "--out", str(tmp_path),
                "--name", "digits", "--max-accuracy-drop", "0.01", "--json", "--no-benchmark", "--precision", "int8")
    assert r.returncode == 3, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert not doc["ok"] and "accuracy gate failed" in doc["error"]
    assert not list(tmp_path.glob("*.tar")), "a failed gate must not leave a bundle behind"


def test_missing_model_is_exit_4(tmp_path):
    r = run_cli("compile", str(tmp_path / "nope.onnx"), "--profile", "x86-cpu", "--eval", str(DIGITS / "test.npz"))
    assert r.returncode == 4 and "model file not found" in r.stderr


def test_accuracy_gate_without_labels_is_exit_4(tmp_path):
    r = run_cli("compile", str(DIGITS / "model.onnx"), "--profile", "x86-cpu", "--eval",
                str(DIGITS / "calibration.npz"), "--calibration", str(DIGITS / "calibration.npz"), "--gate",
                "accuracy", "--out", str(tmp_path))
    assert r.returncode == 4 and "needs a 'labels' array" in r.stderr
    assert not list(tmp_path.glob("*.tar"))


def test_wrong_input_shape_in_data_is_exit_4(tmp_path):
    np.savez(tmp_path / "bad.npz", input=np.zeros((4, 1, 9, 9), np.float32), labels=np.zeros(4))
    r = run_cli("compile", str(DIGITS / "model.onnx"), "--profile", "x86-cpu", "--eval", str(tmp_path / "bad.npz"),
                "--precision", "fp32")
    assert r.returncode == 4 and "dimension 2 is 9, the model wants 8" in r.stderr


def test_unknown_profile_is_exit_4():
    r = run_cli("compile", str(DIGITS / "model.onnx"), "--profile", "cray-1", "--eval", str(DIGITS / "test.npz"))
    assert r.returncode == 4 and "known profiles" in r.stderr


def test_tensorrt_without_toolchain_is_exit_5(tmp_path):
    r = run_cli("compile", str(DIGITS / "model.onnx"), "--profile", "jetson-orin-nano", "--eval",
                str(DIGITS / "test.npz"), "--out", str(tmp_path), "--no-cpu-fallback")  # else: arm64-cpu is built
    assert r.returncode == 5 and "TensorRT" in r.stderr


def test_fixed_batch_model_is_read_at_its_batch(tmp_path):
    """A batch fixed at 4 by the export is read as that batch: dynamic as callers see it, the engine padding up to 4
    (issue 40.3: compiler.batch makes it dynamic first where the graph allows; tests/test_compiler_fixed_batch.py)."""
    model = onnx.load(str(DIGITS / "model.onnx"))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    onnx.save(model, tmp_path / "fixed.onnx")
    info = check_model(tmp_path / "fixed.onnx")
    assert info.fixed_batch == 4 and info.inputs[0].shape[0] == -1 and info.inputs[0].batch_axis == 0


def test_garbage_model_is_refused(tmp_path):
    (tmp_path / "x.onnx").write_bytes(b"not a model")
    with pytest.raises(InputError, match="not a valid ONNX model"):
        check_model(tmp_path / "x.onnx")


@pytest.mark.parametrize("argv", [[], ["compile"], ["keys", "init"], ["fleet", "serve"], ["fleet", "rollout"],
                                  ["agent"], ["demo"]])
def test_help_explains_every_command(argv):
    r = run_cli(*argv, "--help")
    assert r.returncode == 0 and "usage: edgefleet" in r.stdout
    assert len(r.stdout) > 300
