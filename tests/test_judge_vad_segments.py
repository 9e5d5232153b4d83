"""A VAD is judged by its decisions and by its speech segments (issue 29.3): with ``min_segments`` the evaluation
samples in order are one stream, its segments the runs of positive decisions (merged across samples), FP32's matched
one to one by the candidate's at interval IoU >= 0.5. Per-chunk agreement alone passes an engine that splits a
segment with one flipped chunk; the segment criterion does not."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.judge.errors import InputError
from edgefleet.judge.tasks import TaskSpec, judge, parse_task_args


def _task(args: str) -> TaskSpec:
    return TaskSpec("regression", "p", parse_task_args("regression", args))  # as --task-args gives it


def _stream(n: int, speech: list[tuple[int, int]]) -> np.ndarray:
    """[n, 1] speech probabilities per chunk: 0.9 inside the [start, end) chunk ranges, 0.1 elsewhere."""
    p = np.full((n, 1), 0.1, np.float32)
    for s, e in speech:
        p[s:e] = 0.9
    return p


def _crits(report) -> dict[str, float]:
    return {c.name: c.value for c in report.criteria}


def test_one_flipped_chunk_that_splits_a_segment_passes_decisions_and_fails_segments():
    fp32 = _stream(400, [(20, 60), (100, 180), (250, 290)])
    split = fp32.copy()
    split[130] = 0.3  # one chunk inside the second segment: two pieces, 30 and 49 chunks long
    decisions_only = judge(_task("threshold=0.5,min_decision=0.98"), fp32, split, 0.99)
    assert decisions_only.passed and _crits(decisions_only)["decision_agreement"] == pytest.approx(399 / 400)
    both = judge(_task("threshold=0.5,min_decision=0.98,min_segments=0.98"), fp32, split, 0.99)
    got = _crits(both)
    assert not both.passed and got["decision_agreement"] == pytest.approx(399 / 400)
    # the longer piece still overlaps FP32's segment at IoU 49/80 >= 0.5: all three are kept, one is added
    assert got["segment_recall"] == 1.0 and got["segment_precision"] == pytest.approx(3 / 4), got
    assert both.details["fp32_segments"] == 3 and both.details["candidate_segments"] == 4


def test_a_boundary_moved_by_a_chunk_keeps_every_segment_and_passes():
    fp32 = _stream(400, [(20, 60), (100, 180), (250, 290)])
    moved = _stream(400, [(21, 60), (100, 181), (250, 290)])
    moved[300:320] = 0.45  # values move, decisions do not
    report = judge(_task("threshold=0.5,min_segments=0.98"), fp32, moved, 0.99)
    got = _crits(report)
    assert report.passed and got["segment_recall"] == 1.0 and got["segment_precision"] == 1.0, got
    assert got["decision_agreement"] == pytest.approx(398 / 400)


def test_segments_run_across_samples_and_a_lost_or_merged_one_fails():
    frames = np.full((6, 10), 0.1, np.float32)  # 6 samples of 10 frames each: one stream of 60
    frames[0, 7:] = frames[1, :4] = 0.8  # one segment across the first two samples
    frames[3, 2:6] = 0.8
    frames[4, 1:8] = 0.8
    report = judge(_task("threshold=0.5,min_segments=0.98"), frames, frames.copy(), 0.99)
    assert report.passed and report.details["fp32_segments"] == 3, report.details
    merged = frames.copy()
    merged[3, 6:] = merged[4, :1] = 0.8  # the gap of 5 frames between the last two closes: one long segment
    got = judge(_task("threshold=0.5,min_segments=0.98"), frames, merged, 0.99)
    # the merged run (32..48) overlaps FP32's 32..36 at IoU 4/16 and 41..48 at 7/16: both lost, one added
    assert not got.passed and got.details["candidate_segments"] == 2 and got.details["matched_segments"] == 1
    gone = frames.copy()
    gone[3] = 0.2
    assert _crits(judge(_task("threshold=0.5,min_segments=0.98"), frames, gone, 0.99))["segment_recall"] == \
        pytest.approx(2 / 3)


def test_without_min_segments_nothing_changes_and_a_stream_without_speech_cannot_judge_segments():
    fp32 = _stream(100, [(10, 30)])
    plain = judge(_task("threshold=0.5"), fp32, fp32, 0.99)
    assert [c.name for c in plain.criteria] == ["decision_agreement"]
    with pytest.raises(InputError, match="decides no positive"):
        judge(_task("threshold=0.5,min_segments=0.98"), _stream(100, []), _stream(100, []), 0.99)
    logits = np.linspace(-3, 3, 50, dtype=np.float32)[:, None]  # not probabilities, no threshold given
    with pytest.raises(InputError, match="give the decision threshold"):
        judge(_task("min_segments=0.98"), logits, logits, 0.99)
