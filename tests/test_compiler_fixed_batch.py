"""A model exported with a fixed batch larger than 1 ([10, 3, 32, 32]) compiles (issue 40, item 3).

Before, both models below were refused with exit 4 ("export the model with a dynamic first dimension"). Now the
first dimension is made dynamic where the graph allows it, checked against the original at its batch (compiler.batch),
and said in the build notes; where it does not (a Reshape to [10, -1] keeps the batch), the bundle is served at the
fixed batch: manifest fixed_batch, and the engine pads a smaller batch up to it, runs a larger one in pieces, and
slices the outputs (engines.base.Engine.infer), through an agent as through the compiler's own gate.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet.engines import load_bundle_engine
from edgefleet.protocol.bundle import extract_bundle
from tests.agent_harness import installed_agent
from tests.test_compiler import run_cli

pytestmark = pytest.mark.timeout(600)
B = 10


def _model(path: Path, reshape: list[int]) -> Path:
    """x [10, 3, 32, 32] -> Conv 3x3 -> Relu -> Reshape ``reshape`` -> MatMul -> y [10, 5], every shape recorded."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.normal(size=(4, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.normal(size=(4 * 30 * 30, 5)) * 0.05).astype(np.float32), "fc"),
             numpy_helper.from_array(np.array(reshape, np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]), helper.make_node("MatMul", ["f", "fc"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, 3, 32, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, 5])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(onnx.shape_inference.infer_shapes(m), str(path))  # value_info holds [10, ...] shapes too
    return path


def _compile(model: Path, out: Path) -> dict:
    np.savez(model.parent / "d.npz", x=np.random.default_rng(1).normal(size=(40, 3, 32, 32)).astype(np.float32))
    d = str(model.parent / "d.npz")
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", d, "--eval", d, "--precision", "fp32",
                "--task", "classification", "--name", model.stem, "--out", str(out), "--no-benchmark", "--no-cache",
                "--json")
    assert r.returncode == 0, r.stdout + r.stderr  # before: 4, "export the model with a dynamic first dimension"
    return json.loads(r.stdout)["manifest"]


def _original(model: Path, x: np.ndarray) -> np.ndarray:
    """The source model's answers for ``x`` (any count), run at its fixed batch: padded with the last sample."""
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    outs = []
    for s in range(0, len(x), B):
        part = x[s:s + B]
        full = np.concatenate([part, np.repeat(part[-1:], B - len(part), axis=0)])
        outs.append(sess.run(None, {"x": full})[0][:len(part)])
    return np.concatenate(outs)


def test_a_graph_that_allows_it_gets_a_dynamic_batch_checked_against_the_original(tmp_path):
    model = _model(tmp_path / "flat.onnx", [B, 4 * 30 * 30])  # the batch baked into a Reshape: given -1
    m = _compile(model, tmp_path)
    assert m["inputs"][0]["shape"] == [-1, 3, 32, 32] and m["inputs"][0]["batch_axis"] == 0
    assert m.get("fixed_batch") is None
    n = next(n for n in m["build_notes"] if n["action"] == "fixed batch made dynamic")
    assert "fixed at 10" in n["reason"] and "1 Reshape(s)" in n["reason"]
    assert "max abs difference 0 at batch 10" in n["reason"], n["reason"]
    man = extract_bundle(tmp_path / "flat-1.0.0-x86-cpu.tar", tmp_path / "x")
    x = np.random.default_rng(2).normal(size=(3, 3, 32, 32)).astype(np.float32)
    sess = ort.InferenceSession(str(tmp_path / "x" / man.engine), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _original(model, x), rtol=1e-5, atol=1e-5)


def test_a_graph_that_keeps_its_batch_is_served_at_it_padded_and_sliced(tmp_path):
    model = _model(tmp_path / "kept.onnx", [B, -1])  # [10, -1]: made dynamic it computes other shapes
    m = _compile(model, tmp_path)
    assert m["fixed_batch"] == B and m["manifest_version"] >= 8
    assert m["inputs"][0]["shape"] == [-1, 3, 32, 32]  # as callers see it
    n = next(n for n in m["build_notes"] if n["action"].startswith("served at its fixed batch"))
    assert "cannot be made dynamic" in n["reason"]
    bundle = tmp_path / "kept-1.0.0-x86-cpu.tar"
    man = extract_bundle(bundle, tmp_path / "x")
    engine = load_bundle_engine(man, tmp_path / "x" / man.engine, 1)
    try:
        for count in (1, 3, 10, 13, 25):  # smaller, equal, larger than the fixed batch
            x = np.random.default_rng(count).normal(size=(count, 3, 32, 32)).astype(np.float32)
            np.testing.assert_allclose(engine.infer({"x": x})[0], _original(model, x), rtol=1e-5, atol=1e-5)
    finally:
        engine.close()
    x = np.random.default_rng(7).normal(size=(3, 3, 32, 32)).astype(np.float32)
    with installed_agent(tmp_path / "agent", bundle) as (_, url):
        r = httpx.post(f"{url}/v2/models/kept/infer", timeout=30, json={"inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]})
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(3, 5)
    np.testing.assert_allclose(got, _original(model, x), rtol=1e-4, atol=1e-4)
    v = run_cli("verify", str(bundle), "--eval", str(tmp_path / "d.npz"), "--reference", str(model), "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["gate"]["eval_samples"] == 40, v.stdout + v.stderr
