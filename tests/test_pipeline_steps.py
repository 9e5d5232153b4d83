"""The pipeline contract and its steps, from the outside: what pipeline.yaml admits, what each step does to a known
map, image and reader answer, the bounds a request cannot pass, and the end-answer gate's verdicts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefleet.judge.errors import InputError
from edgefleet.judge.pipeline import Chain, compare_image, decode_text, end_specs, judge_pipeline
from edgefleet.protocol.errors import SchemaError
from edgefleet.protocol.pipeline import PipelineSpec, load_pipeline_file

pytest.importorskip("cv2", reason="pipelines crop with OpenCV (the [image] extra)")

CHARS = tuple("abcdefghij")  # class i (1..10) is CHARS[i - 1]; 0 is the blank


def spec(**over: object) -> PipelineSpec:
    base: dict[str, object] = {
        "detector": "det", "reader": "rec",
        "boxes": {"format": "map", "threshold": 0.3, "box_threshold": 0.5, "unclip": 0.0, "max_boxes": 4,
                  "min_size": 2},
        "crop": {"height": 8, "width": 32, "channels": 1},
        "read": {"op": "ctc", "charset": CHARS, "max_text_bytes": 8},
        "max_crops": 8,
    }
    base.update(over)
    return PipelineSpec.model_validate(base)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pipeline.yaml"
    p.write_text(text, encoding="utf-8")
    return p


GOOD = """
name: ocr
version: 1.0.0
stages:
  - {name: det, model: det.onnx, task: segmentation}
  - {name: rec, model: rec.onnx, precision: int8, task: ctc}
pipeline:
  detector: det
  reader: rec
  boxes: {format: map}
  crop: {height: 48, width: 320}
  read: {op: ctc, charset_from: "model:character"}
"""


def test_pipeline_file_parses_and_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    f = load_pipeline_file(write(tmp_path, GOOD))
    assert f.pipeline.boxes.max_boxes == 32 and f.stage("rec").precision == "int8"
    assert f.model_path(f.stage("det"), tmp_path) == tmp_path / "det.onnx"
    bad = {
        "unknown key": GOOD.replace("max_crops", "x").replace("crop: {height", "crop: {heigth"),
        "three stages": GOOD.replace("  - {name: rec", "  - {name: cls, model: c.onnx}\n  - {name: rec"),
        "a stage that is not there": GOOD.replace("reader: rec", "reader: cls"),
        "a range": GOOD.replace("boxes: {format: map}", "boxes: {format: map, max_boxes: 100000}"),
        "a charset from nowhere": GOOD.replace('charset_from: "model:character"', 'charset_from: "http://x/y"'),
        "no charset": GOOD.replace(', charset_from: "model:character"', ""),
        "a NaN": GOOD.replace("boxes: {format: map}", "boxes: {format: map, threshold: .nan}"),
    }
    for why, text in bad.items():
        with pytest.raises(SchemaError):
            load_pipeline_file(write(tmp_path, text))
        assert why  # each case names what it refuses
    big = write(tmp_path, GOOD + "#" * 70_000)
    with pytest.raises(SchemaError, match="at most"):
        load_pipeline_file(big)


def map_with(*rects: tuple[int, int, int, int], h: int = 32, w: int = 64, p: float = 0.9) -> np.ndarray:
    m = np.zeros((1, h, w), np.float32)
    for y0, x0, y1, x1 in rects:
        m[0, y0:y1, x0:x1] = p
    return m


def test_boxes_from_a_map_in_reading_order_bounded_and_scored() -> None:
    ch = Chain(spec(), (32, 64), ["map"], ["probs"])
    two_lines = map_with((20, 5, 26, 30), (4, 40, 10, 60), (4, 2, 10, 20))
    (b, s), = ch.boxes([two_lines[None]])
    # the top line first, left to right, then the line below
    assert [list(map(int, x)) for x in b] == [[2, 4, 20, 10], [40, 4, 60, 10], [5, 20, 30, 26]]
    assert np.allclose(s, 0.9)
    faint = map_with((4, 2, 10, 20), p=0.4)  # above threshold, mean below box_threshold: not a box
    assert len(ch.boxes([faint[None]])[0][0]) == 0
    many = map_with(*[(1 + 3 * i, 1, 3 + 3 * i, 60) for i in range(9)])
    assert len(ch.boxes([many[None]])[0][0]) == 4  # max_boxes
    # the map may be smaller than the input: boxes come back in the input's pixels
    half = Chain(spec(), (64, 128), ["map"], ["probs"])
    (b2, _), = half.boxes([map_with((4, 2, 10, 20))[None]])
    assert [int(v) for v in b2[0]] == [4, 8, 40, 20]


def test_crop_undoes_the_input_normalization_and_applies_the_readers() -> None:
    s = spec(crop={"height": 8, "width": 32, "channels": 1, "keep_aspect": True, "pad_value": 255,
                   "source": {"mean": [0.5], "std": [0.5]}, "target": {"scale": 1.0, "mean": [0.0], "std": [255.0]}})
    ch = Chain(s, (32, 64), ["map"], ["probs"])
    img = np.full((1, 1, 32, 64), 1.0, np.float32)  # white, normalized as (x/255 - 0.5) / 0.5
    img[0, 0, 8:16, 8:24] = -1.0  # a black 16 x 8 block
    crops, owners = ch.crops(img, [(np.array([[8, 8, 24, 16]], np.float32), np.ones(1, np.float32))])
    assert crops.shape == (1, 1, 8, 32) and owners == [0]
    assert np.allclose(crops[0, 0, :, :16], 0.0)  # the block, resized to 8 high keeping 2:1
    assert np.allclose(crops[0, 0, :, 16:], 1.0)  # padded with white (255 / 255)


def test_ctc_read_decodes_bounded_utf8() -> None:
    assert decode_text([1, 2, 3], CHARS, 0, 8) == b"abc"
    assert decode_text([99], CHARS, 0, 8) == "\ufffd".encode()  # a class past the charset is never an IndexError
    assert decode_text([1] * 20, CHARS, 0, 8) == b"a" * 8
    assert decode_text([1, 2], ("é", "ü"), 0, 3) == "é".encode()  # cut at a character's end, not inside it
    ch = Chain(spec(), (32, 64), ["map"], ["probs"])
    steps = np.zeros((1, 6, 11), np.float32)
    for t, k in enumerate([1, 1, 0, 1, 2, 0]):  # a a _ a b _ -> "aab"
        steps[0, t, k] = 1.0
    (text, score), = ch.read([steps])
    assert text == b"aab" and score == 1.0


def test_a_request_that_could_exceed_its_crops_is_refused_before_any_work() -> None:
    ch = Chain(spec(), (32, 64), ["map"], ["probs"])  # 8 crops / 4 boxes: 2 images
    calls: list[int] = []
    with pytest.raises(InputError, match="at most 2 images"):
        ch.run(np.zeros((3, 1, 32, 64), np.float32), lambda b: calls.append(1) or [b], lambda b: [b])
    assert calls == []


def fake_stages(text_of: dict[int, list[int]]):
    """A detector that marks one box per image and a reader that answers ``text_of[image]`` for it."""
    def detect(images: np.ndarray) -> list[np.ndarray]:
        return [np.stack([map_with((4, 4, 12, 40)) for _ in images])]

    def read(crops: np.ndarray) -> list[np.ndarray]:
        out = np.zeros((len(crops), 6, 11), np.float32)
        for i in range(len(crops)):
            codes = text_of.get(i, [1])
            for t in range(6):
                out[i, t, codes[t] if t < len(codes) else 0] = 1.0
        return [out]
    return detect, read


def test_the_end_gate_counts_changed_strings_and_lost_boxes() -> None:
    s = spec()
    ch = Chain(s, (32, 64), ["map"], ["probs"])
    images = np.zeros((2, 1, 32, 64), np.float32)
    ref = ch.run(images, *fake_stages({0: [1, 0, 2], 1: [3]}))
    assert [bytes(r).rstrip(b"\0") for r in ref[3][:, 0]] == [b"ab", b"c"]
    same = judge_pipeline(s, ref, ref, min_boxes=2)
    assert same.passed and same.value == 1.0
    changed = ch.run(images, *fake_stages({0: [1, 0, 2], 1: [4]}))
    verdict = judge_pipeline(s, ref, changed, min_boxes=2)
    assert not verdict.passed and verdict.value == 0.5
    lost = [x.copy() for x in ref]
    lost[2][1] = 0  # the candidate found no box on image 1
    v = judge_pipeline(s, ref, lost, min_boxes=2)
    assert {c.name: c.value for c in v.criteria}["box_recall"] == 0.5 and not v.passed
    # one image at a time (the agent's shadow compares each mirrored request so)
    kept = compare_image(s, ref, changed, 0)
    assert (kept.answers, kept.kept, kept.matched, kept.edits, kept.score_diff) == (1, 1, 1, 0, 0.0)
    read = compare_image(s, ref, changed, 1)
    assert (read.answers, read.kept, read.matched, read.edits, read.chars) == (1, 0, 1, 1, 1)
    gone = compare_image(s, ref, lost, 1)
    assert (gone.answers, gone.kept, gone.matched, gone.found, gone.score_diff) == (1, 0, 0, 0, None)
    with pytest.raises(InputError, match="needs at least 10"):
        judge_pipeline(s, ref, ref)


def test_end_specs_are_what_the_chain_returns() -> None:
    s = spec()
    ch = Chain(s, (32, 64), ["map"], ["probs"])
    ends = ch.run(np.zeros((2, 1, 32, 64), np.float32), *fake_stages({}))
    for t, arr in zip(end_specs(s), ends, strict=True):
        assert arr.dtype == {"FP32": np.float32, "INT32": np.int32, "UINT8": np.uint8}[t.datatype]
        assert list(arr.shape[1:]) == list(t.shape[1:])
    topk = spec(read={"op": "topk", "k": 2})
    assert [t.name for t in end_specs(topk)] == ["boxes", "box_scores", "count", "classes", "class_scores"]
