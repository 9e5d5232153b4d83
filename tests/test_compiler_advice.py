"""The refusal's advice names the cause it measured and the step for that cause (issue 40, item 4).

Each test builds a small model whose int8 fails for one cause, compiles it with --precision int8, checks that the
refusal names that cause, then follows every step the advice names literally until a good int8 engine is built or
the advice says plainly that no int8 engine exists. "Calibrate on more samples" appears only when the compiler's
own trial (half the calibration set against all of it) showed more samples moving the figure.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.test_compiler import run_cli
from tests.test_compiler_detection import _fragile


def _mlp(path: Path, collapse: bool = False) -> Path:
    """x [N, 16] -> 10 class logits. ``collapse``: every logit carries the same offset of 1000, so one 8-bit range
    over the logits has steps larger than the gaps between classes (int8 answers collapse onto a few classes)."""
    rng = np.random.default_rng(40)
    w1 = (rng.normal(size=(16, 32)) / 4).astype(np.float32)
    w2 = (rng.normal(size=(32, 10)) / 4).astype(np.float32)
    b2 = np.full(10, 1000.0 if collapse else 0.0, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["z0"]), helper.make_node("Add", ["z0", "b2"], ["logits"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
                          [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (b2, "b2"))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _data(path: Path, n: int, scale: float = 1.0, seed: int = 0) -> Path:
    np.savez(path, x=(np.random.default_rng(seed).normal(size=(n, 16)) * scale).astype(np.float32))
    return path


def _args(model: Path, calib: Path, evals: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["compile", str(model), "--profile", "x86-cpu", "--calibration", str(calib), "--eval", str(evals),
            "--precision", "int8", "--task", "classification", "--name", "m", "--out", str(tmp_path / "o"),
            "--no-benchmark", "--no-cache", "--json", *extra]


def _follow(advice: str, args: list[str], tmp_path: Path) -> list[str]:
    """The command line after doing literally each step ``advice`` names."""
    out = list(args)
    assert "min_" not in advice and "--min-agreement" not in advice and "loosen" not in advice, advice
    if "drop --no-fallback" in advice:
        out.remove("--no-fallback")
    m = re.search(r"--calibration with at least (\d+) samples", advice)
    if m or "--calibration with samples drawn like the evaluation set's" in advice:
        n = max(int(m.group(1)) if m else 0, 256)
        out[out.index("--calibration") + 1] = str(_data(tmp_path / f"calib-{n}.npz", n, seed=11))
    m = re.search(r"--eval with at least (\d+) samples", advice)
    if m:
        n = int(m.group(1))
        out[out.index("--eval") + 1] = str(_data(tmp_path / f"eval-{n}.npz", n, seed=12))
    assert out != args, f"the advice names no step to follow: {advice}"
    return out


def _converges(first: str, args: list[str], tmp_path: Path) -> str:
    """Follow the advice until a good int8 engine is built ("built") or the advice says plainly that no int8 engine
    exists ("none"), at most three rounds."""
    error = first
    for _ in range(3):
        args = _follow(error, args, tmp_path)
        again = run_cli(*args)
        if again.returncode == 0:
            m = json.loads(again.stdout)["manifest"]
            assert m["precision"] == "int8" and m["accuracy"]["passed"], m["accuracy"]
            return "built"
        assert again.returncode == 3, again.stdout + again.stderr
        error = json.loads(again.stdout)["error"]
        if _plain(error):
            return "none"
    raise AssertionError(f"advice did not converge: {error}")


def _plain(error: str) -> bool:
    """The advice is only the plain statement that no int8 engine exists (no step left to follow)."""
    advice = error.split("accuracy gate failed: ")[-1]
    return "if none of that passes" not in advice and "; no int8 engine keeps" in advice


def test_answers_collapsed_to_a_few_classes_are_called_structural_and_no_calibration_is_advised(tmp_path):
    model = _mlp(tmp_path / "collapse.onnx", collapse=True)
    args = _args(model, _data(tmp_path / "c.npz", 64, seed=1), _data(tmp_path / "e.npz", 200, seed=2), tmp_path,
                 "--no-fallback")
    r = run_cli(*args)
    assert r.returncode == 3, r.stdout + r.stderr
    error = json.loads(r.stdout)["error"]
    assert re.search(r"collapse to [0-9] distinct classes where fp32 gives 10", error), error
    assert "structurally broken" in error and "calibrate on more samples" not in error, error
    assert _converges(error, args, tmp_path) in ("built", "none")
    tried = run_cli(*[a for a in args if a != "--no-fallback"])  # the float fallback ran: nothing left to try
    if tried.returncode == 3:
        assert _plain(json.loads(tried.stdout)["error"]), tried.stdout


def test_a_calibration_range_that_does_not_cover_the_inputs_is_named_and_covering_it_builds_int8(tmp_path):
    model = _mlp(tmp_path / "mlp.onnx")
    narrow = _data(tmp_path / "narrow.npz", 64, scale=0.05, seed=3)  # the served inputs are 20 times wider
    args = _args(model, narrow, _data(tmp_path / "e.npz", 200, seed=4), tmp_path, "--no-fallback")
    r = run_cli(*args)
    assert r.returncode == 3, r.stdout + r.stderr
    error = json.loads(r.stdout)["error"]
    assert "calibrate on inputs that cover the range the model is served (input 'x': evaluation values" in error
    assert _converges(error, args, tmp_path) == "built"


def test_more_calibration_samples_are_advised_only_when_the_trial_showed_them_moving_the_figure(tmp_path):
    """The fragile MLP on 16 samples: the trial on 8 moves nothing, so no 'more samples' (the old advice said 'at
    least 128' whatever it measured; followed, it moved nothing on such models); its few damaging layers are named."""
    model = _fragile(tmp_path)
    args = _args(model, tmp_path / "c16.npz", tmp_path / "e.npz", tmp_path, "--no-fallback")
    r = run_cli(*args)
    assert r.returncode == 3, r.stdout + r.stderr
    error = json.loads(r.stdout)["error"]
    assert "drop --no-fallback (the layers that lose most to quantization: " in error and " dB)" in error, error
    assert "at least 128 samples" not in error
    trial = re.search(r"a trial on (\d+) fell short of the bound by ([0-9.]+), the (\d+) given by ([0-9.]+)", error)
    if trial:  # advised: the half set's shortfall was clearly larger
        assert float(trial.group(2)) > float(trial.group(4)), error
    assert _converges(error, args, tmp_path) in ("built", "none")


def test_too_few_samples_to_judge_asks_for_more_evaluation_samples(tmp_path):
    """8 evaluation samples: the top-1 agreement's 95% interval is wider than the bound's distance to it."""
    model = _mlp(tmp_path / "mlp.onnx")
    half = _data(tmp_path / "half.npz", 64, scale=0.5, seed=3)
    args = _args(model, half, _data(tmp_path / "e8.npz", 8, seed=4), tmp_path, "--no-fallback", "--min-agreement",
                 "0.8")
    r = run_cli(*args)
    assert r.returncode == 3, r.stdout + r.stderr
    error = json.loads(r.stdout)["error"]
    m = re.search(r"judge on more samples \(--eval with at least 32 samples: top1 agreement ([0-9.]+) has a 95% "
                  r"interval ([0-9.]+)\.\.([0-9.]+) that holds its bound 0\.8000 on 8 samples", error)
    assert m and float(m.group(2)) <= 0.8 <= float(m.group(3)) and float(m.group(1)) < 0.8, error
    assert _converges(error, args, tmp_path) in ("built", "none")


def test_more_calibration_samples_are_advised_when_the_half_set_trial_fell_further_short(tmp_path):
    """A calibration set whose first half is narrow: the compiler's trial on that half falls far shorter than the
    whole set, so more samples moved the figure and are advised (with the number the trial used)."""
    model = _mlp(tmp_path / "mlp.onnx")
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(size=(32, 16)) * 0.05, rng.normal(size=(32, 16)) * 0.5]).astype(np.float32)
    np.savez(tmp_path / "mixed.npz", x=x)
    args = _args(model, tmp_path / "mixed.npz", _data(tmp_path / "e.npz", 200, seed=4), tmp_path, "--no-fallback")
    r = run_cli(*args)
    assert r.returncode == 3, r.stdout + r.stderr
    error = json.loads(r.stdout)["error"]
    m = re.search(r"calibrate on more samples \(--calibration with at least 128 samples: a trial on 32 fell short of "
                  r"the bound by ([0-9.]+), the 64 given by ([0-9.]+)\)", error)
    assert m and float(m.group(1)) > float(m.group(2)), error
    assert _converges(error, args, tmp_path) == "built"
