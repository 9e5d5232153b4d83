"""Metrics where the task's answer is (issue 29): a text detector's map is judged by the objects (boxes) it finds,
not by pixel IoU alone; an embedding by whether each one still finds itself among its neighbours, not by the worst
sample's cosine; a map whose fp32 masks say nothing judges nothing."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.judge.gate import GateSettings, evaluate_gate
from edgefleet.judge.tasks import TaskSpec


def _gate(task: str, ref: np.ndarray, cand: np.ndarray, **args):
    spec = TaskSpec(task, "y", dict(args), "declared", f"task {task} (--task)")
    return evaluate_gate(["y"], [ref], [cand], None, "int8", GateSettings(), spec)


def _text_map(rng: np.random.Generator, boxes: list[tuple[int, int, int, int]], size: int = 160) -> np.ndarray:
    """A text detector's probability map [1, H, W]: ~0.9 inside each line's box, ~0.05 elsewhere."""
    m = rng.uniform(0.0, 0.1, (size, size))
    for x0, y0, x1, y1 in boxes:
        m[y0:y1, x0:x1] = rng.uniform(0.8, 1.0, (y1 - y0, x1 - x0))
    return m[None].astype(np.float32)


def test_a_text_detector_that_loses_and_adds_lines_is_refused_although_its_mask_iou_passes():
    """Pixel IoU 0.9 passed an engine that lost 4% and added 7% of the text boxes; the boxes decide now."""
    rng = np.random.default_rng(0)
    ref, cand = [], []
    for _ in range(6):  # 6 pages, 5 text lines each
        lines = [(10, 8 + 30 * k, 150, 26 + 30 * k) for k in range(5)]
        ref.append(_text_map(rng, lines))
        cand.append(_text_map(rng, lines))
    cand[0][0, 8 + 30 * 4:26 + 30 * 4, 10:150] = 0.05  # a line lost
    for page in (1, 2):  # two lines split in two by a gap of low probability (two boxes where fp32 has one)
        cand[page][0, 8:26, 78:82] = 0.05
    r, c = np.stack(ref), np.stack(cand)
    gate = _gate("segmentation", r, c)
    crit = {k.name: k for k in gate.task.criteria}
    assert crit["mask_iou"].passed and crit["mask_iou"].value > 0.95  # pixels alone would pass it
    assert not gate.passed and not crit["instance_recall"].passed and not crit["instance_precision"].passed
    assert gate.task.details["fp32_instances"] == 30 and gate.task.details["candidate_instances"] == 31
    assert gate.task.details["matched_instances"] == 27
    same = _gate("segmentation", r, r + rng.normal(0, 0.01, r.shape).astype(np.float32))
    assert same.passed and {k.name: k.value for k in same.task.criteria}["instance_recall"] == 1.0


def test_an_embedding_whose_neighbours_are_unchanged_passes_though_its_worst_cosine_is_0_97():
    """Quantization noise far below the gap between inputs: every embedding still finds itself; one noisy sample
    (cosine 0.97) no longer refuses the engine. A damaged one (60% noise, or two inputs' embeddings swapped) is
    refused."""
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(48, 96)).astype(np.float32)
    cand = ref + rng.normal(0, 0.02, ref.shape).astype(np.float32)
    cand[5] = ref[5] + rng.normal(0, 0.25, 96).astype(np.float32)  # cosine ~0.97
    cos5 = float(ref[5] @ cand[5] / np.linalg.norm(ref[5]) / np.linalg.norm(cand[5]))
    assert 0.95 < cos5 < 0.99
    gate = _gate("embedding", ref, cand)
    assert gate.passed, gate.task
    assert gate.task.metric == "neighbour_retrieval" and gate.task.value == 1.0
    assert gate.task.details["worst_cosine"] == pytest.approx(cos5, abs=1e-4)
    noisy = _gate("embedding", ref, ref + rng.normal(0, 0.6, ref.shape).astype(np.float32))
    assert not noisy.passed
    swapped = cand.copy()
    swapped[[3, 4]] = cand[[4, 3]]
    bad = _gate("embedding", ref, swapped)
    assert not bad.passed and bad.task.value == pytest.approx(46 / 48)


def test_a_map_whose_fp32_masks_are_all_foreground_cannot_judge_an_engine():
    """A log-mel spectrogram [N, 1, T, 32] (values 60..85) looks like a dense map; at threshold 0 every mask is whole
    and any engine scored IoU 1.0 (an int8 spectrogram that changed every downstream embedding shipped)."""
    from edgefleet.judge.errors import InputError

    rng = np.random.default_rng(4)
    ref = rng.uniform(60, 85, (8, 1, 97, 32)).astype(np.float32)
    with pytest.raises(InputError, match="empty or whole"):
        _gate("segmentation", ref, ref + 3)


@pytest.mark.parametrize("precision", ["auto", "int8"])
def test_a_task_that_cannot_read_fp32s_outputs_gates_no_int8(tmp_path, precision):
    """Declared segmentation on a spectrogram-like map (every value far above any mask threshold): auto ships fp32
    and says why; --precision int8 is refused (exit 4) with the same reason, not judged by a metric that says 1.0."""
    import json

    import onnx
    from onnx import TensorProto, helper

    from tests.test_compiler import run_cli

    g = helper.make_graph([helper.make_node("Softplus", ["x"], ["s"]),
                           helper.make_node("Add", ["s", "c"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 12, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 12, 16])],
                          [helper.make_tensor("c", TensorProto.FLOAT, [], [60.0])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.save(m, str(tmp_path / "mel.onnx"))
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "d.npz", x=rng.normal(0, 3, (32, 1, 12, 16)).astype(np.float32))
    r = run_cli("compile", str(tmp_path / "mel.onnx"), "--profile", "x86-cpu", "--calibration", str(tmp_path / "d.npz"),
                "--eval", str(tmp_path / "d.npz"), "--task", "segmentation", "--precision", precision, "--name", "mel",
                "--out", str(tmp_path), "--no-benchmark", "--no-cache", "--json")
    assert "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    if precision == "auto":
        assert r.returncode == 0 and doc["manifest"]["precision"] == "fp32"
        assert "cannot judge" in doc["manifest"]["precision_choice"]["reason"]
    else:
        assert r.returncode == 4 and "cannot gate int8" in doc["error"] and "empty or whole" in doc["error"]


def test_a_detector_whose_fp32_finds_no_boxes_on_the_eval_data_cannot_judge_an_engine():
    """The corpus's YOLOX captcha detector shipped int8 on evaluation images where fp32 found 0 boxes: 0 of 0 kept
    scored recall 1.0. A box gate with fewer than 10 fp32 boxes to keep judges nothing and says so; with enough
    boxes the same engine is judged."""
    from edgefleet.judge.errors import InputError

    rng = np.random.default_rng(5)
    ref = np.zeros((8, 4 + 3, 200), np.float32)
    ref[:, 0:2] = rng.uniform(0, 320, (8, 2, 200))
    ref[:, 2:4] = rng.uniform(4, 40, (8, 2, 200))
    ref[:, 4:] = rng.uniform(0, 0.05, (8, 3, 200))  # every class score under the 0.25 threshold: no boxes
    with pytest.raises(InputError, match="finds 0 box"):
        _gate("detection", ref, ref.copy())
    ref[:, 4, :3] = 0.9  # three confident boxes a sample: 24 to keep
    assert _gate("detection", ref, ref.copy()).passed
