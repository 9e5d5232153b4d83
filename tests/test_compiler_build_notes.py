"""Honest build records (issue 40, item 5): every quantizer retry, float fallback and workaround is named in the
manifest (``build_notes``: step, action, reason) and in the report's "build" lines.

Before, a quantizer retry with QDQDisableWeightAdjustForInt32Bias appeared only inside the quantization reason (and
not at all when fp32 shipped), and on a model with Gemm biases laid out [1, N] (weights transposed, per-channel) the
retried engine's DequantizeLinear failed at run time ("For per axis quantization, scale must be 1D tensor with size
1"), so the float fallback failed and int8 was refused. Such biases are now made 1-D before quantizing, and that
edit is itself a build note.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.test_compiler import run_cli

pytestmark = pytest.mark.timeout(600)


def _gemm_model(folder: Path) -> Path:
    """Two Gemms with transposed weights ([out, in]: per-channel on axis 0) and biases [1, N], as many exporters
    write a Linear layer; 64 samples of data."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(32, 16)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(size=(1, 32)).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.normal(size=(10, 32)) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.normal(size=(1, 10)).astype(np.float32), "b2")]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(folder / "gemm.onnx"))
    np.savez(folder / "d.npz", x=np.random.default_rng(1).normal(size=(64, 16)).astype(np.float32))
    return folder / "gemm.onnx"


def test_gemm_biases_laid_out_1xn_quantize_and_the_edit_is_named(tmp_path):
    """Before: the float fallback's builds failed to run ("For per axis quantization, scale must be 1D tensor with
    size 1") and the compile exited 6 (gate failed)."""
    model = _gemm_model(tmp_path)
    d = str(tmp_path / "d.npz")
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", d, "--eval", d, "--precision", "int8",
                "--task", "classification", "--name", "gemm", "--out", str(tmp_path), "--no-benchmark", "--no-cache",
                "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "per axis quantization" not in r.stdout + r.stderr
    m = json.loads(r.stdout)["manifest"]
    actions = [(n["step"], n["action"]) for n in m["build_notes"]]
    assert ("int8 pre-processing", "2 Gemm bias(es) made 1-D [N] (b1, b2)") in actions, actions
    assert not any("QDQDisableWeightAdjustForInt32Bias" in a for _, a in actions)  # no retry needed any more
    for step in m["quantization"]["fallback_steps"]:
        assert "build failed" not in step, step
    if m["quantization"]["fallback_steps"]:  # a float fallback that shipped is a build note too
        assert any(s == "int8 float fallback" for s, _ in actions), actions


def test_a_forced_quantizer_retry_is_named_in_the_manifest_and_the_report(tmp_path, monkeypatch):
    """The bias edit turned off, the default quantization of a [1, N] bias crashes and the retry with
    QDQDisableWeightAdjustForInt32Bias builds it: whichever precision ships, the manifest and the report name the
    retry with onnxruntime's reason."""
    from edgefleet.cli.compile import _compile_summary
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.compiler.targets import onnxruntime as ort_target

    monkeypatch.setattr(ort_target, "gemm_biases_1d", lambda path: [])
    model = _gemm_model(tmp_path)
    opts = CompileOptions(model=model, profile="x86-cpu", calibration=tmp_path / "d.npz", eval=tmp_path / "d.npz",
                          out_dir=tmp_path / "out", name="gemm", version="1.0.0", benchmark=False,
                          task="classification")
    result = compile_model(opts)
    notes = [(n.step, n.action) for n in result.manifest.build_notes]
    assert ("int8 quantizer", "retried with QDQDisableWeightAdjustForInt32Bias") in notes, notes
    retry = next(n for n in result.manifest.build_notes if n.step == "int8 quantizer")
    assert "ambiguous" in retry.reason
    report = _compile_summary(result.bundle, result.manifest, False)
    assert "build     int8 quantizer: retried with QDQDisableWeightAdjustForInt32Bias (the default quantization " \
           "failed: ValueError: The truth value" in report, report


def test_a_quantizer_retry_is_a_build_note(tmp_path):
    """quantize() itself, on the raw graph (its [1, N] biases as written): the default run crashes in onnxruntime's
    int32-bias weight adjustment, the retry builds, and the compile under way records it."""
    from edgefleet.compiler.buildnotes import collecting
    from edgefleet.compiler.graph import name_nodes
    from edgefleet.compiler.targets.onnxruntime import quantize
    from edgefleet.judge.data import Dataset
    from edgefleet.protocol.profile import load_profile

    model = name_nodes(_gemm_model(tmp_path), tmp_path / "named.onnx")
    calib = Dataset({"x": np.load(tmp_path / "d.npz")["x"]}, None)
    with collecting() as notes:
        q = quantize(model, load_profile("x86-cpu"), calib, tmp_path / "q.onnx")
    assert "QDQDisableWeightAdjustForInt32Bias" in q.reason
    assert [(n.step, n.action) for n in notes] == [("int8 quantizer",
                                                    "retried with QDQDisableWeightAdjustForInt32Bias")]
    assert "ambiguous" in notes[0].reason  # onnxruntime's own failure, kept as the reason
