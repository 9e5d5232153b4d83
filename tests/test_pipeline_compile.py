"""edgefleet compile-pipeline (issue 34): the real PP-OCRv4 text detector and recognizer from the rapidocr-onnxruntime
wheel, built as one bundle for x86-cpu on synthetic pages, through the command line.

What the bundle says the pipeline reads is checked by a decode of this file's own (onnxruntime on the ORIGINAL
ONNX files, boxes, crops and greedy CTC written here, not judge.pipeline.Chain): the self-test's expected strings
are what the FP32 models read.
"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgefleet import demo_ocr
from edgefleet.protocol.bundle import check_bundle
from edgefleet.protocol.drift import DriftAccumulator
from edgefleet.protocol.pipeline import end_output_names
from tests.emulation import python_argv

H, W = demo_ocr.H, demo_ocr.W
WORDS = ["edgefleet", "INVOICE 2026", "total 42.00", "ship it", "v1.0.0", "hello world", "ACME Corp", "Order 7731",
         "paid", "Room 12B"]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*python_argv(), "-m", "edgefleet.cli", *args], capture_output=True, text=True,
                          timeout=900, cwd=cwd)


def _models() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        pytest.fail("rapidocr-onnxruntime (a dev dependency that ships PP-OCRv4) is not installed: make venv")
    return Path(spec.origin).parent / "models"


def pages(n: int, seed: int) -> np.ndarray:
    """``n`` pages of three printed lines of WORDS (drawn as the demo draws its own), [n, 3, H, W], (x / 255 - 0.5) /
    0.5 as PP-OCR's detector takes them."""
    return demo_ocr.detector_input(demo_ocr.pages(n, seed, WORDS))


def write_pipeline(folder: Path, det: Path, rec: Path, precision: str = "fp32", charset: str = "model:character",
                   max_boxes: int = 8, rec_precision: str | None = None) -> Path:
    path = folder / "pipeline.yaml"
    path.write_text(f"""name: ocr
version: 1.0.0
stages:
  - {{name: det, model: {det}, precision: {precision}}}
  - {{name: rec, model: {rec}, precision: {rec_precision or precision}}}
pipeline:
  detector: det
  reader: rec
  boxes: {{format: map, threshold: 0.3, box_threshold: 0.5, unclip: 1.6, max_boxes: {max_boxes}}}
  crop:
    height: 48
    width: 320
    source: {{mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5]}}
    target: {{mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5]}}
  read: {{op: ctc, charset_from: "{charset}"}}
""")
    return path


def write_prep(folder: Path) -> Path:
    p = folder / "preprocess.yaml"
    p.write_text(f"input: x\nheight: {H}\nwidth: {W}\ncolor: bgr\nmean: [0.5, 0.5, 0.5]\nstd: [0.5, 0.5, 0.5]\n")
    return p


# -- the independent decode --------------------------------------------------------------------------------------
def independent_read(det: Path, rec: Path, images: np.ndarray) -> list[list[str]]:
    """Each page's strings as the FP32 models read them: threshold the map at 0.3, 4-connected regions whose mean
    probability is >= 0.5, each grown by area * 1.6 / perimeter, cut from the page, resized to height 48 (aspect
    kept, padded with black to 320), greedy CTC (blank 0, the charset from the model's metadata and a space)."""
    import cv2
    import onnx
    import onnxruntime as ort

    meta = {p.key: p.value for p in onnx.load(str(rec), load_external_data=False).metadata_props}
    charset = [*meta["character"].split("\n"), " "]
    d = ort.InferenceSession(str(det), providers=["CPUExecutionProvider"])
    r = ort.InferenceSession(str(rec), providers=["CPUExecutionProvider"])
    out = []
    for img in images:
        prob = d.run(None, {"x": img[None]})[0][0, 0]
        n, labels, stats, _ = cv2.connectedComponentsWithStats((prob > 0.3).astype(np.uint8), connectivity=4)
        pixels = ((img * 0.5 + 0.5) * 255).transpose(1, 2, 0)
        strings = []
        for k in range(1, n):
            if prob[labels == k].mean() < 0.5:
                continue
            x, y, w, h = (float(v) for v in stats[k, :4])
            grow = w * h * 1.6 / (2 * (w + h))
            x0, y0 = max(0.0, x - grow), max(0.0, y - grow)
            x1, y1 = min(float(W), x + w + grow), min(float(H), y + h + grow)
            region = pixels[int(np.floor(y0)):int(np.ceil(y1)), int(np.floor(x0)):int(np.ceil(x1))]
            tw = min(320, max(1, round(48 * region.shape[1] / region.shape[0])))
            canvas = np.zeros((48, 320, 3), np.float32)
            canvas[:, :tw] = cv2.resize(region, (tw, 48), interpolation=cv2.INTER_LINEAR)
            feed = ((canvas / 255 - 0.5) / 0.5).transpose(2, 0, 1)[None].astype(np.float32)
            best = r.run(None, {"x": feed})[0][0].argmax(-1)
            text, prev = "", -1
            for c in best:
                if c != prev and c != 0:
                    text += charset[c - 1]
                prev = c
            strings.append(text)
        out.append(sorted(strings))
    return out


def selftest_arrays(bundle: Path) -> dict[str, np.ndarray]:
    with tarfile.open(bundle) as tar:
        f = tar.extractfile("selftest.npz")
        assert f is not None
        with np.load(io.BytesIO(f.read())) as z:
            return {k: z[k] for k in z.files}


def strings_of(arrays: dict[str, np.ndarray], key: str = "expected") -> list[list[str]]:
    count, text = arrays[f"{key}:count"], arrays[f"{key}:text"]
    return [sorted(bytes(row).rstrip(b"\0").decode() for row in text[i, : count[i]]) for i in range(len(count))]


def compile_ocr(folder: Path, eval_npz: Path, *options: str, profile: str = "x86-cpu", out: str = "ocr.bundle",
                **pipeline: Any) -> tuple[subprocess.CompletedProcess, Path]:
    """``edgefleet compile-pipeline`` of the PP-OCRv4 pair (its pipeline.yaml written into ``folder`` by
    :func:`write_pipeline` with ``pipeline``'s options) for ``profile`` on ``eval_npz``, the bundle to ``folder /
    out``, with ``options``: what the command did, and the bundle's path."""
    models = _models()
    pipe = write_pipeline(folder, models / "ch_PP-OCRv4_det_infer.onnx", models / "ch_PP-OCRv4_rec_infer.onnx",
                          **pipeline)
    return run_cli("compile-pipeline", str(pipe), "--profile", profile, "--eval", str(eval_npz), "-o",
                   str(folder / out), *options), folder / out


# -- the tests -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp32_bundle(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ocr")
    np.savez(folder / "eval.npz", x=pages(12, seed=0))
    r, out = compile_ocr(folder, folder / "eval.npz", "--preprocess", str(write_prep(folder)), "--no-cache", "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout), _models()


def test_a_pipeline_compiles_into_one_bundle_that_describes_the_whole(fp32_bundle):
    out, doc, _ = fp32_bundle
    assert doc["ok"] and doc["bundle"] == str(out)
    m = check_bundle(out)
    assert m.manifest_version == 7 and m.name == "ocr" and m.profile == "x86-cpu" and m.precision == "fp32"
    assert m.pipeline is not None
    assert [s.name for s in m.pipeline.stages] == ["det", "rec"]
    assert set(m.files) == {"det-model.onnx", "det-selftest.npz", "rec-model.onnx", "rec-selftest.npz",
                            "selftest.npz"}
    assert m.engine == "det-model.onnx" and m.selftest == "selftest.npz"
    assert m.pipeline.detector.engine == "det-model.onnx" and m.pipeline.reader.selftest == "rec-selftest.npz"
    assert [o.name for o in m.outputs] == list(end_output_names(m.pipeline.spec))
    assert m.inputs == m.pipeline.detector.inputs
    # the charset came from the reader's metadata, with PaddleOCR's space: 6,623 lines + blank + space = 6,625
    charset = m.pipeline.spec.read.charset
    assert charset is not None and len(charset) == 6624 and charset[-1] == " "
    assert m.pipeline.spec.read.charset_from is None
    # the stages were gated on their own tasks, the pipeline on its end answers
    assert m.pipeline.detector.accuracy.task is not None and m.pipeline.detector.accuracy.task.task == "segmentation"
    assert m.pipeline.reader.accuracy.task is not None and m.pipeline.reader.accuracy.task.task == "ctc"
    task = m.accuracy.task
    assert task is not None and task.task == "pipeline" and task.passed and m.accuracy.passed
    assert task.details["fp32_boxes"] == 36 and task.details["same_answers"] == 36  # 12 pages of 3 lines
    # the agent's /infer/image feeds the pipeline as the compiler did
    assert m.preprocessing is not None and (m.preprocessing.height, m.preprocessing.width) == (H, W)
    # the drift reference of the end answers (issue 34.4): the FP32 pipeline's on the 12 evaluation pages, 3 lines
    # each; the self-test's reference answers (some of those pages) fall only in bins the evaluation set filled
    ref = m.drift
    assert ref is not None and (ref.read_as, ref.output, ref.read, ref.source, ref.samples) == (
        "pipeline", "text", "ctc", "fp32", 12)
    assert [f.name for f in ref.features] == ["boxes", "length", "score"]
    arrays = selftest_arrays(out)
    acc = DriftAccumulator(ref, "ocr", "1.0.0")
    acc.add([arrays[f"reference:{o.name}"] for o in m.outputs])
    counts = acc.take()
    assert counts is not None and counts.samples == len(arrays["input:x"])
    for f, c in zip(ref.features, counts.features, strict=True):
        assert all(share > 0 for share, n in zip(f.shares, c.counts, strict=True) if n), (f, c)
    boxes = ref.feature("boxes")
    assert boxes is not None and max(boxes.shares) == 1.0  # 3 boxes on every page


def test_the_self_test_holds_what_the_fp32_models_read(fp32_bundle):
    out, _, models = fp32_bundle
    arrays = selftest_arrays(out)
    images = arrays["input:x"]
    assert 1 <= len(images) <= 8 and images.shape[1:] == (3, H, W)
    np.testing.assert_array_equal(images, pages(12, seed=0)[: len(images)])
    want = independent_read(models / "ch_PP-OCRv4_det_infer.onnx", models / "ch_PP-OCRv4_rec_infer.onnx", images)
    assert strings_of(arrays) == want
    assert strings_of(arrays, "reference") == want
    assert all(len(s) == 3 for s in want) and sum(w in WORDS for s in want for w in s) >= len(images) * 2


def test_a_charset_that_does_not_fit_the_readers_classes_is_refused(tmp_path):
    (tmp_path / "chars.txt").write_text("a\nb\nc\n")
    np.savez(tmp_path / "eval.npz", x=pages(2, seed=1))
    r, _ = compile_ocr(tmp_path, tmp_path / "eval.npz", "--no-cache", out="x.bundle", charset="file:chars.txt")
    assert r.returncode == 4, r.stderr
    assert "3 entries" in r.stderr and "6625 classes" in r.stderr
    assert not (tmp_path / "x.bundle").exists()


def test_a_preprocessing_that_is_not_the_crops_source_is_refused(tmp_path):
    np.savez(tmp_path / "eval.npz", x=pages(2, seed=1))
    prep = tmp_path / "prep.yaml"
    prep.write_text(f"input: x\nheight: {H}\nwidth: {W}\n")  # [0, 1]: the crops would be cut from wrong pixels
    r, _ = compile_ocr(tmp_path, tmp_path / "eval.npz", "--preprocess", str(prep), "--no-cache", "--json",
                       out="x.bundle")
    assert r.returncode == 4, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and "crop.source" in doc["error"]


# -- the end-answer gate: a stage that passes its own gate but changes the pipeline's answers -------------------------
# Measured here: PP-OCRv4's detector at int8 (calibrated on these 16 pages) passes its own segmentation gate (mask IoU
# 0.95, every text region found), yet its slightly moved boxes change 7 of the 48 strings the FP32 pipeline reads.
@pytest.fixture(scope="module")
def sixteen_pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ocr16")
    np.savez(folder / "eval.npz", x=pages(16, seed=0))
    return folder


def test_an_explicit_int8_stage_whose_end_answers_change_is_refused_with_the_combination_that_passes(sixteen_pages,
                                                                                                     tmp_path):
    r, out = compile_ocr(tmp_path, sixteen_pages / "eval.npz", "--no-cache", "--no-benchmark", "--json",
                         precision="int8", rec_precision="fp32")
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 3
    err = doc["error"]
    assert "end answers changed beyond its gate with det int8 and rec fp32" in err
    assert "FAILS end answer agreement" in err
    assert "with det fp32 and rec fp32 (measured): 48 of 48 fp32 answers kept: passes" in err
    assert "set precision: auto (or fp32) for stage 'det'" in err
    assert not out.exists()


def test_under_auto_the_stage_falls_back_to_fp32_and_the_bundle_records_the_gate(sixteen_pages, tmp_path):
    r, out = compile_ocr(tmp_path, sixteen_pages / "eval.npz", "--no-cache", "--no-benchmark", "--json",
                         precision="auto", rec_precision="fp32")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(g["stages"], g["how"], g["passed"], g["kept"], g["of"]) for g in doc["gate"]] == [
        ({"det": "int8", "rec": "fp32"}, "built", False, 41, 48),
        ({"det": "fp32", "rec": "fp32"}, "measured", True, 48, 48),
        ({"det": "fp32", "rec": "fp32"}, "built", True, 48, 48)]
    assert any(n.startswith("det falls back to fp32: the pipeline's end answers with det int8") for n in doc["notes"])
    m = check_bundle(out)
    assert m.pipeline is not None and m.precision == "fp32" and m.accuracy.passed
    det = m.pipeline.detector
    assert det.precision == "fp32" and det.precision_choice is not None
    assert det.precision_choice.reason.startswith("fp32: the pipeline's end answers with det int8 and rec fp32 changed")
    # the detector's own int8 build passed its own gate: the pipeline's gate is what refused it
    own = {c.precision: c for c in det.precision_choice.candidates}
    assert own["int8"].passed is True
    assert m.precision_choice is not None and len(m.precision_choice.candidates) == 3
    assert [c.passed for c in m.precision_choice.candidates] == [False, True, True]
    assert "det fell back to fp32" in m.precision_choice.reason


def test_the_pipeline_builds_for_arm64_on_onnxruntime_and_reads_as_on_x86(fp32_bundle, tmp_path):
    """arm64-cpu-onnx (onnxruntime on aarch64): the PP-OCRv4 pair does not convert to LiteRT with onnx2tf (see
    compiler/pipeline_bundle.py), so ARM64 boxes get the pipeline as ONNX files; same pages, same strings."""
    x86, _, _ = fp32_bundle
    np.savez(tmp_path / "eval.npz", x=pages(12, seed=0))
    r, out = compile_ocr(tmp_path, tmp_path / "eval.npz", "--preprocess", str(write_prep(tmp_path)), "--no-cache",
                         "--json", profile="arm64-cpu-onnx", out="ocr-arm64.bundle")
    assert r.returncode == 0, r.stderr
    m = check_bundle(out)
    assert m.profile == "arm64-cpu-onnx" and m.backend == "onnxruntime" and m.cpu_features == ("neon",)
    assert m.pipeline is not None and all(not s.variants for s in m.pipeline.stages)
    assert strings_of(selftest_arrays(out)) == strings_of(selftest_arrays(x86))
