"""Output drift, pure functions (protocol/drift.py): PSI on known distributions, references and sketches per task,
bounds of what a device may send, and two versions' sketches put on common bins."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from edgefleet.protocol import drift as D


def test_psi_of_known_distributions():
    assert D.psi([0.5, 0.5], [0.5, 0.5]) == 0.0
    # sum (a - e) ln(a / e): 0.4 ln 1.8 + (-0.4) ln 0.2
    assert D.psi([0.5, 0.5], [0.9, 0.1]) == pytest.approx(0.4 * math.log(1.8) + 0.4 * math.log(5), rel=1e-9)
    # counts or shares alike
    assert D.psi([50, 50], [900, 100]) == pytest.approx(D.psi([0.5, 0.5], [0.9, 0.1]))
    # an empty bin counts as epsilon: finite, and the documented formula
    e = D.PSI_EPSILON
    want = (0.5 - 1.0) * math.log(0.5 / 1.0) + (0.5 - e) * math.log(0.5 / e)
    assert D.psi([1.0, 0.0], [0.5, 0.5]) == pytest.approx(want, rel=1e-9)
    assert D.psi([1.0, 0.0], [0.0, 1.0]) <= D.MAX_PSI
    with pytest.raises(ValueError, match="bins"):
        D.psi([1, 1], [1, 1, 1])


def test_levels_and_the_sample_floor():
    assert D.level(0.05, 1000) == "stable"
    assert D.level(0.1, 1000) == "watch"
    assert D.level(0.3, 1000) == "drift"
    assert D.level(3.0, D.MIN_SAMPLES - 1) == "insufficient"  # a small sample's figure is never a verdict
    assert D.level(None, 10**6) == "insufficient"


def test_a_psi_within_its_sampling_noise_is_no_verdict():
    assert D.level(0.26, 200, noise=0.23) == "stable"  # what 200 unchanged answers score against a 48-answer reference
    assert D.level(0.40, 200, noise=0.23) == "watch"
    assert D.level(0.50, 200, noise=0.23) == "drift"
    assert D.level(0.26, 10**6, noise=0.0) == "drift"


def test_unchanged_answers_against_a_small_reference_are_not_called_drift():
    """A reference from a small evaluation set (48 answers: a pipeline's pages) against 200 live answers drawn the same
    way: sampling alone gives PSI about 0.26 on a 10-class feature (noise 0.26), which the raw thresholds called
    drift in 5 of these 40 draws. None is drift now, while answers that did change still are."""
    rng = np.random.default_rng(7)
    ref = D.build_reference("classification", "out", _logits(rng, 48, rng.integers(0, 10, 48)))
    same = [_score(ref, _logits(rng, 200, rng.integers(0, 10, 200))) for _ in range(40)]
    assert [s for s in same if D.level(s.psi, s.samples) == "drift"]  # the raw PSI alone flags some
    assert not [s for s in same if s.level == "drift"], [(s.psi, s.noise) for s in same if s.level == "drift"]
    moved = _score(ref, _logits(rng, 200, rng.integers(0, 3, 200)))  # the camera sees three classes only
    assert moved.level == "drift", moved


def _logits(rng: np.random.Generator, n: int, classes: np.ndarray) -> np.ndarray:
    x = rng.normal(size=(n, 10)).astype(np.float32)
    x[np.arange(n), classes] += 5.0
    return x


def _score(ref: D.DriftReference, batch: np.ndarray | list[np.ndarray]) -> D.DriftScore:
    acc = D.DriftAccumulator(ref, "m", "1.0.0")
    acc.add(batch)
    msg = acc.take()
    assert msg is not None
    return D.score(ref, {f.name: f.counts for f in msg.features}, msg.samples)


def test_classification_same_answers_stable_shifted_and_inverted_drift():
    rng = np.random.default_rng(1)
    ref = D.build_reference("classification", "out", _logits(rng, 2000, rng.integers(0, 10, 2000)))
    assert [f.name for f in ref.features] == ["class", "score"]
    assert _score(ref, _logits(rng, 1000, rng.integers(0, 10, 1000))).level == "stable"
    skewed = _score(ref, _logits(rng, 1000, rng.integers(0, 3, 1000)))  # the camera sees three classes only
    assert skewed.level == "drift" and skewed.feature == "class"
    inverted = _score(ref, -_logits(rng, 1000, rng.integers(0, 10, 1000)))  # unsure answers
    assert inverted.level == "drift" and inverted.features["score"] > D.DRIFT_PSI


def test_detection_ctc_regression_segmentation_embedding():
    rng = np.random.default_rng(2)

    def det(n: int, objects: int) -> list[np.ndarray]:  # yolov8 [4+C, A]: boxes and class scores
        out = []
        for _ in range(n):
            x = np.zeros((4 + 3, 200), np.float32)
            x[:4] = rng.uniform(10, 100, size=(4, 200))
            x[4:] = rng.uniform(0, 0.1, size=(3, 200))
            x[4, rng.choice(200, objects, replace=False)] = rng.uniform(0.5, 1.0, objects)
            out.append(x)
        return out

    ref = D.build_reference("detection", "boxes", det(300, 2), detection_format="yolov8", score_threshold=0.25)
    assert _score(ref, det(300, 2)).level == "stable"
    crowded = _score(ref, det(300, 8))
    assert crowded.level == "drift" and crowded.feature == "boxes"

    def ctc(n: int, length: int) -> np.ndarray:  # [N, T, C] distributions, `length` characters each
        x = np.full((n, 40, 20), 0.01, np.float32)
        x[:, :, 0] = 0.81  # blank
        for i in range(n):
            for t in range(length):
                x[i, 2 * t, 0], x[i, 2 * t, 1 + (t % 19)] = 0.01, 0.81
        return x

    ref = D.build_reference("ctc", "logits", ctc(300, 5), blank=0)
    assert _score(ref, ctc(300, 5)).level == "stable"
    longer = _score(ref, ctc(300, 12))
    assert longer.level == "drift" and longer.feature == "length"

    def vad(n: int, speech: float) -> np.ndarray:  # [N, frames] speech probabilities
        return (rng.uniform(size=(n, 100)) < speech).astype(np.float32) * 0.9 + 0.05

    ref = D.build_reference("regression", "prob", vad(400, 0.3))
    assert _score(ref, vad(400, 0.3)).level == "stable"
    assert _score(ref, vad(400, 0.8)).features["positive_share"] > D.DRIFT_PSI

    def masks(n: int, side: int) -> np.ndarray:
        x = np.zeros((n, 1, 32, 32), np.float32)
        for i in range(n):
            s = int(rng.integers(side - 2, side + 3))
            x[i, 0, :s, :s] = 0.9
        return x

    ref = D.build_reference("segmentation", "map", masks(300, 10))
    assert _score(ref, masks(300, 10)).level == "stable"
    assert _score(ref, masks(300, 25)).level == "drift"

    ref = D.build_reference("embedding", "emb", rng.normal(size=(500, 64)).astype(np.float32))
    assert _score(ref, rng.normal(size=(500, 64)).astype(np.float32)).level == "stable"
    assert _score(ref, 3 * rng.normal(size=(500, 64)).astype(np.float32)).level == "drift"


def test_sketch_memory_is_fixed_and_counts_reset():
    rng = np.random.default_rng(3)
    batch = rng.normal(size=(50, 20_000)).astype(np.float32)
    ref = D.build_reference("embedding", "emb", batch)
    acc = D.DriftAccumulator(ref, "m", "1.0.0")
    sizes = {k: v.nbytes for k, v in acc._counts.items()}
    for _ in range(20):
        acc.add(batch)
    assert {k: v.nbytes for k, v in acc._counts.items()} == sizes  # no answer is kept, whatever the traffic
    msg = acc.take()
    assert msg is not None and msg.samples == 1000
    value = next(f for f in msg.features if f.name == "value")
    assert sum(value.counts) <= 1000 * D.MAX_VALUES_PER_ANSWER  # the work bound per answer
    assert acc.take() is None  # counts start again from zero


def test_what_a_device_sends_is_bounded():
    ok = {"model": "digits", "version": "1.0.0", "samples": 5, "features": [{"name": "class", "counts": [1, 4]}]}
    D.DriftCounts.model_validate(ok)
    for bad in ({"counts": [-1, 2]}, {"counts": [2**40, 0]}, {"counts": [2**39, 2**39]}, {"counts": [0] * 65},
                {"counts": []}, {"counts": [1.5, 2]}, {"name": "password", "counts": [1]}):
        with pytest.raises(ValidationError):
            D.DriftCounts.model_validate({**ok, "features": [{"name": "class", "counts": [1]} | bad]})
    with pytest.raises(ValidationError):
        D.DriftCounts.model_validate({**ok, "features": [{"name": "class", "counts": [1]}] * 2})
    with pytest.raises(ValidationError):
        D.DriftCounts.model_validate({**ok, "samples": float("nan")})
    ref = D.build_reference("classification", "out", np.eye(10, dtype=np.float32))
    assert D.DriftCounts.model_validate(ok).matches(ref) is not None  # 2 bins where the reference has 11


def test_a_reference_is_validated():
    good = {"name": "score", "kind": "histogram", "edges": [0.1, 0.5], "shares": [0.2, 0.3, 0.5]}
    D.FeatureReference.model_validate(good)
    for bad in ({"edges": [0.5, 0.1]}, {"edges": [0.1, 0.1]}, {"shares": [0.2, 0.3, 0.6]}, {"shares": [0.5, 0.5]},
                {"edges": [float("inf"), 2.0]}, {"categories": [1]}):
        with pytest.raises(ValidationError):
            D.FeatureReference.model_validate(good | bad)
    with pytest.raises(ValidationError, match="features"):
        D.DriftReference.model_validate({"read_as": "ctc", "output": "x", "samples": 3, "features": [good | {
            "name": "class"}]})


def test_two_versions_on_common_bins():
    rng = np.random.default_rng(4)
    v1 = D.build_reference("classification", "out", _logits(rng, 1500, rng.integers(0, 10, 1500)))
    perm = np.array([3, 7, 0, 9, 1, 8, 2, 5, 4, 6])
    v2 = D.build_reference("classification", "out", _logits(rng, 1500, rng.integers(0, 10, 1500))[:, perm])

    def counts(ref: D.DriftReference, batch: np.ndarray) -> tuple[dict[str, tuple[int, ...]], int]:
        acc = D.DriftAccumulator(ref, "digits", "1.0.0")
        acc.add(batch)
        msg = acc.take()
        assert msg is not None
        return {f.name: f.counts for f in msg.features}, msg.samples

    seen = rng.integers(0, 4, 800)  # a box whose camera sees mostly four digits
    old, n_old = counts(v1, _logits(rng, 800, seen))
    same, n_same = counts(v2, _logits(rng, 800, rng.integers(0, 4, 800)))
    moved, n_moved = counts(v2, _logits(rng, 800, rng.integers(0, 4, 800))[:, perm])
    assert D.compare(v1, old, v2, same, n_old, n_same).level == "stable"
    gate = D.compare(v1, old, v2, moved, n_old, n_moved)  # answers permuted: the same boxes, other classes
    assert gate.level == "drift" and gate.feature == "class"


def test_rebinning_keeps_the_mass_and_is_exact_on_the_same_edges():
    a = D.FeatureReference(name="score", kind="histogram", edges=(0.2, 0.4, 0.6), shares=(0.25,) * 4)
    b = D.FeatureReference(name="score", kind="histogram", edges=(0.3, 0.5), shares=(0.3, 0.3, 0.4))
    pair = D.align(a, [10, 20, 30, 40], b, [1, 2, 3])
    assert pair is not None
    moved, kept = pair
    assert moved.sum() == pytest.approx(100) and list(kept) == [1, 2, 3]
    # (-inf, .2] -> first; (.2, .4] split at .3; (.4, .6] split at .5; (.6, inf) -> last
    assert list(moved) == pytest.approx([10 + 10, 10 + 15, 15 + 40])
    same = D.align(a, [1, 2, 3, 4], a, [4, 3, 2, 1])
    assert same is not None and list(same[0]) == [1, 2, 3, 4]
    c1 = D.FeatureReference(name="class", kind="categorical", categories=(1, 2, 5), shares=(0.25,) * 4)
    c2 = D.FeatureReference(name="class", kind="categorical", categories=(2, 5, 7), shares=(0.25,) * 4)
    pair = D.align(c1, [1, 2, 3, 4], c2, [10, 20, 30, 40])
    assert pair is not None
    assert list(pair[0]) == [2, 3, 5] and list(pair[1]) == [10, 20, 70]  # 2, 5, then everything else


def test_the_drift_gate_is_a_pure_function_of_recorded_figures():
    from edgefleet.fleet.rollout import Gates, WaveFigures, evaluate_gates

    gates = Gates(max_drift_psi=0.25)
    base = dict(size=2, installed=2, failed=0, requests=10, errors=0, p99_before_ms=None, p99_after_ms=None,
                p99_devices=0)
    moved = next(g for g in evaluate_gates(WaveFigures(**base, drift_psi=1.3, drift_detail="class"), gates)
                 if g.name == "drift_psi")
    assert not moved.passed and moved.value == 1.3 and "class" in moved.detail
    held = next(g for g in evaluate_gates(WaveFigures(**base, drift_psi=0.02), gates) if g.name == "drift_psi")
    assert held.passed
    unjudged = next(g for g in evaluate_gates(WaveFigures(**base), gates) if g.name == "drift_psi")
    assert unjudged.value is None and unjudged.passed  # like the other telemetry gates; require_telemetry waits
    for bad in (0.0, -1.0, 21.0, float("inf"), float("nan")):
        with pytest.raises(ValidationError):
            Gates(max_drift_psi=bad)
