"""`edgefleet verify BUNDLE --eval DATA` works on every model `compile` works on (issue 40, item 6): both read DATA
through one loader (judge.data.load_for_model), with the samples on the same axes. Before, verify read a model with
a scalar input as one sample per call with every input stacked on axis 0 and ended in an IndexError in
judge/data.py _fit_axes; compile, given the same data, built the bundle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.test_compiler import run_cli

pytestmark = pytest.mark.timeout(600)


def _save(path: Path, nodes: list, inputs: list, outputs: list, inits: list) -> Path:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _compile_and_verify(model: Path, data: Path, tmp: Path, *, labels: bool = False) -> dict:
    task = ["--task", "embedding"] if not labels else []
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--eval", str(data), "--precision", "fp32", *task,
                "--name", model.stem, "--out", str(tmp), "--no-benchmark", "--no-cache", "--json")
    assert r.returncode == 0, r.stderr
    v = run_cli("verify", str(tmp / f"{model.stem}-1.0.0-x86-cpu.tar"), "--eval", str(data), "--json")
    assert "Traceback" not in v.stderr, v.stderr
    assert v.returncode == 0, (v.stdout, v.stderr)
    return json.loads(v.stdout)


def test_a_model_with_a_scalar_input_verifies_on_the_data_it_compiled_with(tmp_path):
    """y = x * s: x [N, 8], s a scalar shared by the batch (no batch axis: the model is served one request at a
    time). Before: IndexError: tuple index out of range in _fit_axes."""
    model = _save(tmp_path / "scalar.onnx", [helper.make_node("Mul", ["x", "s"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
                   helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [])
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(40, 8)).astype(np.float32), s=np.float32(0.5))
    doc = _compile_and_verify(model, tmp_path / "d.npz", tmp_path)
    assert doc["ok"] and doc["gate"]["passed"] and doc["gate"]["eval_samples"] == 40, doc


def test_a_model_with_several_inputs_verifies(tmp_path):
    w = numpy_helper.from_array(np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32), "w")
    model = _save(tmp_path / "two.onnx", [helper.make_node("Add", ["a", "b"], ["c"]),
                                          helper.make_node("MatMul", ["c", "w"], ["y"])],
                  [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4]),
                   helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "d.npz", a=rng.normal(size=(30, 4)).astype(np.float32),
             b=rng.normal(size=(30, 4)).astype(np.float32), labels=rng.integers(0, 3, 30))
    doc = _compile_and_verify(model, tmp_path / "d.npz", tmp_path, labels=True)
    assert doc["ok"] and doc["eval_samples"] == 30 and doc["top1"] == doc["recorded_top1"], doc


def test_a_stateful_model_with_its_state_batched_on_axis_1_verifies(tmp_path):
    """h declared [?, ?, 8]: the data holds its 40 samples on axis 1 (compile finds it there); verify reads it there
    too, through the same loader."""
    w = numpy_helper.from_array(np.ones((4, 8), np.float32), "w")
    model = _save(tmp_path / "state.onnx", [helper.make_node("MatMul", ["x", "w"], ["xe"]),
                                            helper.make_node("Add", ["h", "xe"], ["h_out"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                   helper.make_tensor_value_info("h", TensorProto.FLOAT, ["L", "B", 8])],
                  [helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["L", "B", 8])], [w])
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(40, 4)).astype(np.float32),
             h=rng.normal(size=(2, 40, 8)).astype(np.float32))
    doc = _compile_and_verify(model, tmp_path / "d.npz", tmp_path)
    assert doc["ok"] and doc["gate"]["eval_samples"] == 40, doc
