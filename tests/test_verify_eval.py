"""`edgefleet verify BUNDLE --eval DATA` judges the data it is given (issue 29): without labels, the gate's metric on
every sample of DATA, this CPU's engine against an fp32 engine run on the same samples (the bundle's own fp32
engine, or the source model given with --reference), or a refusal that says why. Before, it judged the bundle's
one self-test sample, ignored DATA and printed "holds"."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import DIGITS
from tests.test_compiler import run_cli

pytestmark = pytest.mark.timeout(600)

W = np.random.default_rng(11).normal(size=(8, 1)).astype(np.float32)


def _model(path: Path, w: np.ndarray) -> Path:
    """x [N, 8] -> sigmoid(x @ w) [N, 1]: a probability, judged by its decision at 0.5."""
    import onnx

    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["z"]), helper.make_node("Sigmoid", ["z"], ["p"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 1])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.save(m, str(path))
    return path


def _inputs(seed: int, n: int, margin: tuple[float, float]) -> np.ndarray:
    """Inputs whose logit x @ W lies at a distance in ``margin`` from 0 (the decision boundary), either side."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1.5, (n, 8))
    w = W[:, 0].astype(np.float64)
    x -= np.outer(x @ w, w) / (w @ w)  # on the boundary
    t = rng.uniform(*margin, n) * rng.choice([-1, 1], n)
    return (x + np.outer(t, w) / (w @ w)).astype(np.float32)


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("verify-eval")
    model = _model(d / "p.onnx", W)
    np.savez(d / "calib.npz", x=_inputs(1, 64, (0.0, 4.0)))
    np.savez(d / "eval.npz", x=_inputs(2, 64, (2.0, 4.0)))  # clear decisions: int8 keeps them all
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", str(d / "calib.npz"), "--eval",
                str(d / "eval.npz"), "--precision", "int8", "--task", "regression", "--task-args", "threshold=0.5",
                "--name", "p", "--out", str(d), "--no-benchmark", "--no-cache", "--json")
    assert r.returncode == 0, r.stderr
    return d / "p-1.0.0-x86-cpu.tar", model


def _verify(bundle: Path, data: Path, *extra: str) -> tuple[int, dict, str]:
    r = run_cli("verify", str(bundle), "--eval", str(data), "--json", *extra)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    return r.returncode, json.loads("\n".join(lines)) if lines else {}, r.stderr


def test_without_labels_and_without_an_fp32_reference_verify_refuses_saying_why(int8_bundle, tmp_path):
    bundle, _ = int8_bundle
    np.savez(tmp_path / "near.npz", x=_inputs(3, 200, (0.0, 0.02)))
    code, doc, err = _verify(bundle, tmp_path / "near.npz")
    assert code == 4 and not doc["ok"], (code, doc)
    assert "no fp32 engine" in err and "--reference" in err


def test_label_free_data_is_judged_sample_by_sample_against_the_fp32_source_model(int8_bundle, tmp_path):
    """Decisions far from the boundary hold on all 300 samples; inputs on the boundary (where 8-bit steps flip the
    decision) fail, judged on that data's 200 samples."""
    bundle, model = int8_bundle
    np.savez(tmp_path / "far.npz", x=_inputs(4, 300, (2.0, 4.0)))
    np.savez(tmp_path / "near.npz", x=_inputs(3, 200, (0.0, 0.02)))
    code, doc, err = _verify(bundle, tmp_path / "far.npz", "--reference", str(model))
    assert code == 0 and doc["gate"]["passed"], err
    assert doc["gate"]["eval_samples"] == 300 and "p.onnx" in doc["gate_reference"]
    code, doc, err = _verify(bundle, tmp_path / "near.npz", "--reference", str(model))
    assert code == 3 and not doc["gate"]["passed"] and doc["gate"]["eval_samples"] == 200, err
    decision = doc["gate"]["task"]["criteria"][0]
    assert decision["name"] == "decision_agreement" and decision["value"] < 0.99
    human = run_cli("verify", str(bundle), "--eval", str(tmp_path / "near.npz"), "--reference", str(model))
    assert "on 200 samples of" in human.stdout and "FAILS" in human.stdout


def test_a_reference_that_is_not_the_source_model_is_refused(int8_bundle, tmp_path):
    bundle, _ = int8_bundle
    other = _model(tmp_path / "other.onnx", -W)
    np.savez(tmp_path / "far.npz", x=_inputs(4, 50, (2.0, 4.0)))
    code, _, err = _verify(bundle, tmp_path / "far.npz", "--reference", str(other))
    assert code == 4 and "is not the model" in err


def test_a_bundle_that_carries_an_fp32_engine_is_judged_against_it(two_precision_bundle, tmp_path):
    x = np.load(DIGITS / "test.npz")
    key = next(k for k in x.files if k != "labels")
    np.savez(tmp_path / "nolabels.npz", **{key: x[key]})
    code, doc, err = _verify(two_precision_bundle, tmp_path / "nolabels.npz")
    assert code == 0 and doc["gate"]["passed"], err
    assert doc["gate"]["eval_samples"] == len(x[key]) and doc["gate_reference"] == "the bundle's fp32 engine"
