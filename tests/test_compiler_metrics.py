"""Metrics where the task's answer is (issue 29): a text detector's map is judged by the objects (boxes) it finds,
not by pixel IoU alone; an embedding by whether each one still finds itself among its neighbours, not by the worst
sample's cosine; a small evaluation set is grown so one changed sample does not decide."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.compiler.gate import GateSettings, evaluate_gate
from edgefleet.compiler.tasks import TaskSpec


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
