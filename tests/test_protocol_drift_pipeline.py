"""Output drift of a pipeline's END answers (protocol/drift.py, task ``pipeline``), from the outside: the end outputs
are built by judge.pipeline.Chain.answers, the step that makes them on a device and in the compiler, from known
boxes and reader answers; the features read from them (boxes per image, each string's length in characters, each
string's score), their bins, a stable and a shifted distribution scored, and the bounds of what a hostile answer can
make the sketch read."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from edgefleet.judge.pipeline import Chain
from edgefleet.protocol import drift as D
from edgefleet.protocol.pipeline import PipelineSpec

CHARS = (*"abcdefghij", "é")  # class i (1..11) is CHARS[i - 1], 0 the blank; é is 2 bytes in UTF-8
K = 16  # boxes.max_boxes


def spec(op: str = "ctc") -> PipelineSpec:
    read = {"op": "ctc", "charset": CHARS, "max_text_bytes": 64} if op == "ctc" else {"op": "topk", "k": 2}
    return PipelineSpec.model_validate({
        "detector": "det", "reader": "rec", "boxes": {"format": "map", "max_boxes": K},
        "crop": {"height": 8, "width": 32, "channels": 1}, "read": read, "max_crops": 64})


def ends(pages: list[list[str]], scores: list[list[float]] | None = None, sp: PipelineSpec | None = None
         ) -> list[np.ndarray]:
    """The end outputs of images whose boxes read ``pages[i]`` (one string per box), each string read with its
    ``scores[i][j]`` as the best class's probability on its kept steps (0.9 unless given)."""
    sp = sp or spec()
    chain = Chain(sp, (64, 64), ["map"], ["probs"])
    found = [(np.tile(np.array([[1, 1, 20, 9]], np.float32), (len(p), 1)), np.full(len(p), 0.8, np.float32))
             for p in pages]
    owners = [i for i, p in enumerate(pages) for _ in p]
    flat = [s for p in pages for s in p]
    flat_scores = [s for i, p in enumerate(pages) for s in (scores[i] if scores else [0.9] * len(p))]
    if sp.read.op == "topk":  # each "string" is the top class's index as text
        probs = np.full((len(flat), 12), 0.01, np.float32)
        for m, (s, sc) in enumerate(zip(flat, flat_scores, strict=True)):
            probs[m, int(s)] = sc
        return chain.answers(found, owners, [probs] if flat else [])
    steps = 2 * max((len(s) for s in flat), default=1) + 1
    probs = np.full((len(flat), steps, len(CHARS) + 1), 0.0, np.float32)
    for m, (s, sc) in enumerate(zip(flat, flat_scores, strict=True)):
        rest = (1 - sc) / len(CHARS)
        probs[m, :, :] = rest
        probs[m, :, 0] = sc  # blank between characters (repeats survive)
        for t, ch in enumerate(s):
            probs[m, 2 * t, :] = rest
            probs[m, 2 * t, 1 + CHARS.index(ch)] = sc
    return chain.answers(found, owners, [probs] if flat else [])


def counted(ref: D.DriftReference, batch: list[np.ndarray]) -> D.DriftCounts:
    acc = D.DriftAccumulator(ref, "ocr", "1.0.0")
    acc.add(batch)
    msg = acc.take()
    assert msg is not None
    return msg


def scored(ref: D.DriftReference, batch: list[np.ndarray]) -> D.DriftScore:
    msg = counted(ref, batch)
    assert msg.matches(ref) is None  # what the fleet checks before it scores (fleet/drift.py)
    return D.score(ref, {f.name: f.counts for f in msg.features}, msg.samples)


def pages(rng: np.random.Generator, n: int, boxes: tuple[int, int], length: tuple[int, int],
          score: tuple[float, float] = (0.8, 0.99)) -> tuple[list[list[str]], list[list[float]]]:
    """``n`` images with ``boxes`` (low, high inclusive) strings each, of ``length`` characters each."""
    out, sc = [], []
    for _ in range(n):
        k = int(rng.integers(boxes[0], boxes[1] + 1))
        out.append(["".join(rng.choice(list(CHARS[:10]), int(rng.integers(length[0], length[1] + 1))))
                    for _ in range(k)])
        sc.append([float(x) for x in rng.uniform(*score, k)])
    return out, sc


def test_feature_values_of_end_answers_one_per_image_and_one_per_string():
    e = ends([["ab", "é"], [], ["abcdefghij", "", "aa"]], [[0.9, 0.7], [], [0.6, 0.5, 0.95]])
    assert [a.dtype for a in e] == [np.float32, np.float32, np.int32, np.uint8, np.float32]  # as served
    v = D.feature_values("pipeline", e, read="ctc")
    assert set(v) == {"boxes", "length", "score"}
    assert v["boxes"].tolist() == [2, 0, 3]  # the `count` output
    assert v["length"].tolist() == [2, 1, 10, 0, 2]  # characters, not bytes: 'é' is 1; a box read as '' is 0
    assert v["score"] == pytest.approx([0.9, 0.7, 0.6, 0.0, 0.95], abs=1e-6)  # text_scores, per string (none kept: 0)
    # one answer per image: the sketch's samples are images, not strings and not outputs
    ref = D.build_reference("pipeline", "text", e, read="ctc")
    assert ref.samples == 3 and counted(ref, e).samples == 3

    t = ends([["1", "3"], ["7"]], [[0.6, 0.8], [0.9]], sp=spec("topk"))
    v = D.feature_values("pipeline", t, read="topk")
    assert set(v) == {"boxes", "class", "score"}
    assert v["boxes"].tolist() == [2, 1] and v["class"].tolist() == [1, 3, 7]
    assert v["score"] == pytest.approx([0.6, 0.8, 0.9])


def test_a_reference_bins_boxes_and_lengths_at_half_integers():
    rng = np.random.default_rng(5)
    p, s = pages(rng, 300, (1, 3), (3, 8))
    ref = D.build_reference("pipeline", "text", ends(p, s), read="ctc")
    assert (ref.read_as, ref.output, ref.read, ref.samples) == ("pipeline", "text", "ctc", 300)
    assert [f.name for f in ref.features] == ["boxes", "length", "score"]
    for name in ("boxes", "length"):
        f = ref.feature(name)
        assert f is not None and f.kind == "histogram"
        assert all(x - np.floor(x) == 0.5 for x in f.edges)  # integer features on half-integers
    boxes = ref.feature("boxes")
    assert boxes is not None
    assert boxes.edges[-1] > 3  # more boxes than the eval set ever had land in a bin of their own
    # each bin's share is the share of the eval set's values in it
    v = D.feature_values("pipeline", ends(p, s), read="ctc")
    for f in ref.features:
        assert list(f.shares) == pytest.approx(list(D.bin_counts(f, v[f.name]) / len(v[f.name])), abs=1e-6)
    assert sum(counted(ref, ends(p, s)).features[1].counts) == sum(len(x) for x in p)  # one count per string


def test_more_boxes_or_longer_strings_score_as_drift_and_the_same_pages_as_stable():
    rng = np.random.default_rng(6)
    ref = D.build_reference("pipeline", "text", ends(*pages(rng, 400, (1, 3), (3, 8))), read="ctc")
    same = scored(ref, ends(*pages(rng, 300, (1, 3), (3, 8))))
    crowded = scored(ref, ends(*pages(rng, 300, (5, 9), (3, 8))))  # pages with many more text lines
    longer = scored(ref, ends(*pages(rng, 300, (1, 3), (12, 20))))  # longer lines
    unsure = scored(ref, ends(*pages(rng, 300, (1, 3), (3, 8), score=(0.3, 0.6))))  # a blurred camera
    print(f"\nPSI stable {same.features}, crowded {crowded.features}, longer {longer.features}, "
          f"unsure {unsure.features}")
    assert same.level == "stable" and same.samples == 300
    assert crowded.level == "drift" and crowded.feature == "boxes"
    assert longer.level == "drift" and longer.feature == "length" and longer.features["boxes"] < D.WATCH_PSI
    assert unsure.level == "drift" and unsure.feature == "score"
    few = scored(ref, ends(*pages(rng, 100, (5, 9), (3, 8))))
    assert few.level == "insufficient" and few.psi is not None and few.psi > D.DRIFT_PSI  # shown, not a verdict


def test_a_per_string_feature_of_few_strings_does_not_decide():
    """300 pages, almost all blank as in the eval set: their boxes per image decide; the 12 strings on them are
    shown but are no verdict, however their lengths fall."""
    rng = np.random.default_rng(7)
    ref_pages = [["abcd" * int(rng.integers(1, 3))] if i % 10 == 0 else [] for i in range(400)]
    ref = D.build_reference("pipeline", "text", ends(ref_pages), read="ctc")
    live = [["abcdefgh"] if i % 25 == 0 else [] for i in range(300)]  # 12 strings, all of one length
    sc = scored(ref, ends(live))
    assert sc.features["length"] > D.DRIFT_PSI  # 12 values in one bin: a large PSI, of nothing much
    assert sc.feature == "boxes" and sc.level == "stable", sc


def test_hostile_end_answers_are_clipped_or_refused():
    rng = np.random.default_rng(8)
    ref = D.build_reference("pipeline", "text", ends(*pages(rng, 50, (1, 3), (3, 8))), read="ctc")
    e = ends([["ab"], ["abc"], ["a"]])
    e[2] = np.array([-7, 10**9, 1], np.int32)  # a count below zero, one past the K rows there are
    v = D.feature_values("pipeline", e, read="ctc")
    assert v["boxes"].tolist() == [0, K, 1]  # clipped to [0, K]
    assert len(v["length"]) == 0 + K + 1 and len(v["score"]) == K + 1  # only rows under the clipped count
    nan_count = [*e[:2], np.array([np.nan, np.inf, 2.0]), *e[3:]]
    assert D.feature_values("pipeline", nan_count, read="ctc")["boxes"].tolist() == [0, K, 2]
    # a huge string: at most MAX_TEXT_BYTES bytes of it are read, so its length is at most that
    huge: list[np.ndarray] = [np.zeros((1, 1, 4)), np.zeros((1, 1)), np.array([1], np.int32),
            np.full((1, 1, 3 * D.MAX_TEXT_BYTES), ord("a"), np.uint8), np.array([[np.nan]], np.float32)]
    v = D.feature_values("pipeline", huge, read="ctc")
    assert v["length"].tolist() == [D.MAX_TEXT_BYTES] and v["score"].tolist() == [0.0]  # NaN read as 0
    acc = D.DriftAccumulator(ref, "ocr", "1.0.0")
    acc.add(huge)  # lands in the open top bin
    msg = acc.take()
    assert msg is not None and msg.features[1].counts[-1] == 1
    # answers that are not a pipeline's end outputs are refused, not guessed at
    good = ends([["ab"]])
    for bad in (good[:4],  # four outputs
                np.zeros((3, 5)),  # one array
                [*good[:3], good[3].astype(np.float32), good[4]],  # text not UTF-8 bytes
                [*good[:2], np.zeros((1, 1), np.int32), *good[3:]],  # count not [N]
                [*good[:3], good[3][:, :, 0], good[4]],  # text not [N, K, bytes]
                [*good[:2], np.array([1, 1], np.int32), *good[3:]]):  # a count for an image the text has not
        with pytest.raises(ValueError):
            D.feature_values("pipeline", bad, read="ctc")
    with pytest.raises(ValueError, match="read"):
        D.feature_values("pipeline", good, read=None)


def test_a_pipeline_reference_is_validated():
    rng = np.random.default_rng(9)
    ref = D.build_reference("pipeline", "text", ends(*pages(rng, 50, (1, 3), (3, 8))), read="ctc")
    doc = ref.model_dump()
    D.DriftReference.model_validate(doc)
    with pytest.raises(ValidationError, match="read"):
        D.DriftReference.model_validate({**doc, "read": None})  # how its answers are decoded
    class_f = {"name": "class", "kind": "categorical", "categories": [1], "shares": [1.0, 0.0]}
    with pytest.raises(ValidationError, match="features"):  # a ctc pipeline has lengths, not classes
        D.DriftReference.model_validate({**doc, "features": [*doc["features"][:2], class_f]})
    with pytest.raises(ValidationError):  # MAX_FEATURES (4) whatever the task
        D.DriftReference.model_validate({**doc, "features": doc["features"] * 2})
    with pytest.raises(ValidationError, match="read"):  # `read` is a pipeline's only
        D.DriftReference.model_validate({**D.build_reference("ctc", "x", np.eye(5, dtype=np.float32)[None])
                                        .model_dump(), "read": "ctc"})
    assert D.MAX_FEATURES == 4 and len(ref.features) <= D.MAX_FEATURES
