"""A PP-OCRv4 pipeline bundle (manifest version 7) assembled for tests from rapidocr-onnxruntime's real detector and
recognizer, FP32, without the compiler: each stage's manifest and self-test sample, the pipeline's own self-test
(its end answers as an independent FP32 run computes them) and the bundle's files, as protocol/manifest.py says a
pipeline bundle holds them. The accuracy figures are a test fixture's (each stage FP32 against itself; the end gate
the FP32 pipeline judged against itself), never a compiler's.

:func:`pages` draws synthetic text pages (a few lines of known words) as the pipeline's NCHW input, and
:func:`fp32_run` runs the same two ONNX files through judge.pipeline.Chain with onnxruntime directly: the
independent answers the agent's must match. ``ocr_bundle(drift_pages=...)`` records the FP32 pipeline's end answers on
those pages as the manifest's drift reference, with the function the compiler records it with
(judge.pipeline.drift_reference, on its evaluation set). :func:`body` and :func:`texts` are the two ends of a KServe v2
request to the pipeline served: pages in as a binary tensor, each page's strings out.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.judge.pipeline import Chain, drift_reference, end_specs, judge_pipeline
from edgefleet.protocol.bundle import sha256_file, write_bundle
from edgefleet.protocol.manifest import (
    PIPELINE_VERSION,
    AccuracyReport,
    FileEntry,
    Manifest,
    PipelineManifest,
    TensorSpec,
)
from edgefleet.protocol.pipeline import PipelineSpec
from edgefleet.protocol.preprocess import Preprocessing

__all__ = ["HEIGHT", "WIDTH", "WORDS", "body", "fp32_run", "models_dir", "ocr_bundle", "ocr_spec", "pages", "strings",
           "texts"]

HEIGHT, WIDTH = 320, 480
WORDS = ("edgefleet", "INVOICE 2026", "total 42.00", "ship it", "v1.0.0", "hello world", "ACME Corp")
DET_IN, DET_OUT = "x", "sigmoid_0.tmp_0"
REC_IN, REC_OUT = "x", "softmax_11.tmp_0"
NORM = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}


def models_dir() -> Path:
    """rapidocr-onnxruntime's models folder (found, not imported: the package imports Pillow)."""
    import importlib.util

    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("rapidocr-onnxruntime is not installed (its PP-OCRv4 models are the pipeline's)")
    return Path(spec.origin).parent / "models"


def charset() -> tuple[str, ...]:
    import onnx

    m = onnx.load(str(models_dir() / "ch_PP-OCRv4_rec_infer.onnx"), load_external_data=False)
    meta = {p.key: p.value for p in m.metadata_props}
    return (*meta["character"].splitlines(), " ")


def ocr_spec(upper: bool = False, **over: Any) -> PipelineSpec:
    """The PP-OCR detect-then-read steps (``upper``: the charset upper-cased, so the same models read every
    letter as a capital: a pipeline version that answers differently)."""
    chars = charset()
    if upper:
        chars = tuple(c.upper() if len(c.upper()) == 1 else c for c in chars)
    doc: dict[str, Any] = {
        "detector": "det", "reader": "rec",
        "boxes": {"format": "map", "threshold": 0.3, "box_threshold": 0.5, "unclip": 1.6, "max_boxes": 16},
        "crop": {"height": 48, "width": 320, "source": NORM, "target": NORM},
        "read": {"op": "ctc", "charset": chars}}
    doc.update(over)
    return PipelineSpec.model_validate(doc)


def pages(n: int, seed: int = 0, lines: int = 4) -> np.ndarray:
    """``n`` synthetic pages of ``lines`` lines of WORDS each, as the pipeline's input: [n, 3, 320, 480] FP32,
    (pixel / 255 - 0.5) / 0.5."""
    import cv2

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = np.full((HEIGHT, WIDTH, 3), 240, np.uint8)
        for k in range(lines):
            cv2.putText(img, str(rng.choice(WORDS)), (int(rng.integers(5, 200)), 40 + 70 * k), 0,
                        float(rng.uniform(0.8, 1.2)), (20, 20, 20), 2)
        out.append(((img.astype(np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1))
    return np.ascontiguousarray(np.stack(out))


def body(images: np.ndarray, outputs: tuple[str, ...] = ("count", "text")) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 binary-tensor request for ``images`` (FP32 NCHW), its ``outputs`` answered as JSON."""
    x = np.ascontiguousarray(images, np.float32)
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": n} for n in outputs]}).encode()
    return head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


def texts(doc: dict) -> list[list[str]]:
    """Each image's strings from a JSON answer holding 'count' and 'text'."""
    outs = {o["name"]: o for o in doc["outputs"]}
    count = outs["count"]["data"]
    t = np.asarray(outs["text"]["data"], np.uint8).reshape(outs["text"]["shape"])
    return [[bytes(row).rstrip(b"\0").decode() for row in t[i, :count[i]]] for i in range(len(count))]


def _sessions(threads: int = 2) -> tuple[Any, Any]:
    import onnxruntime as ort

    from edgefleet.engines.onnxruntime import session_options

    d = models_dir()
    return tuple(ort.InferenceSession(str(d / f), session_options(ort, threads), providers=["CPUExecutionProvider"])
                 for f in ("ch_PP-OCRv4_det_infer.onnx", "ch_PP-OCRv4_rec_infer.onnx"))  # type: ignore[return-value]


def fp32_run(spec: PipelineSpec, images: np.ndarray, sessions: tuple[Any, Any] | None = None,
             read_batch: int = 16) -> list[np.ndarray]:
    """The pipeline's end outputs computed directly: onnxruntime on the two ONNX files, Chain's steps between."""
    det, rec = sessions or _sessions()
    chain = Chain(spec, (images.shape[2], images.shape[3]), [DET_OUT], [REC_OUT])
    return chain.run(images, lambda b: det.run(None, {DET_IN: b}), lambda b: rec.run(None, {REC_IN: b}), read_batch)


def strings(ends: list[np.ndarray], i: int) -> list[str]:
    """Image ``i``'s decoded strings from end outputs (KServe's [N, K, B] text tensor)."""
    return [bytes(row).rstrip(b"\0").decode() for row in ends[3][i, : int(ends[2][i])]]


def _fixture_accuracy(n: int, task: Any = None) -> AccuracyReport:
    return AccuracyReport(metric="agreement", eval_samples=n, reference_precision="fp32", reference=1.0,
                          candidate_precision="fp32", candidate=1.0, drop=0.0, max_drop=0.02, passed=True, task=task)


def _entry(path: Path) -> FileEntry:
    return FileEntry(sha256=sha256_file(path), size_bytes=path.stat().st_size)


def _stage(name: str, version: str, model: Path, folder: Path, ins: TensorSpec, outs: TensorSpec,
           sample: np.ndarray, run: Any, created: str) -> Manifest:
    shutil.copyfile(model, folder / f"{name}-model.onnx")
    np.savez_compressed(folder / f"{name}-selftest.npz", **{f"input:{ins.name}": sample,
                                                             f"expected:{outs.name}": run(sample)[0]})
    files = {f: _entry(folder / f) for f in (f"{name}-model.onnx", f"{name}-selftest.npz")}
    return Manifest(manifest_version=PIPELINE_VERSION, name=name, version=version, profile="x86-cpu",
                    backend="onnxruntime", precision="fp32", created_at=created, engine=f"{name}-model.onnx",
                    selftest=f"{name}-selftest.npz", inputs=(ins,), outputs=(outs,), files=files,
                    accuracy=_fixture_accuracy(len(sample)), benchmark=None, toolchain={"fixture": "tests"})


def ocr_bundle(out: Path, version: str = "1.0.0", name: str = "ocr", spec: PipelineSpec | None = None,
               sample_images: int = 2, seed: int = 0, drift_pages: np.ndarray | None = None) -> Path:
    """A pipeline bundle of the PP-OCRv4 detector and recognizer (FP32) at ``out`` (a .tar path); with
    ``drift_pages``, its drift reference is the FP32 pipeline's end answers on them (the compiler's evaluation set)."""
    spec = spec or ocr_spec()
    folder = out.parent / f"{out.stem}-files"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    det, rec = _sessions()
    created = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
    images = pages(sample_images, seed)
    ends = fp32_run(spec, images, (det, rec))
    chain = Chain(spec, (HEIGHT, WIDTH), [DET_OUT], [REC_OUT])
    crops, _ = chain.crops(images, chain.boxes(det.run(None, {DET_IN: images})))
    d = models_dir()
    det_m = _stage("det", version, d / "ch_PP-OCRv4_det_infer.onnx", folder,
                   TensorSpec(name=DET_IN, datatype="FP32", shape=(-1, 3, -1, -1)),
                   TensorSpec(name=DET_OUT, datatype="FP32", shape=(-1, 1, -1, -1)), images[:1],
                   lambda b: det.run(None, {DET_IN: b}), created)
    rec_m = _stage("rec", version, d / "ch_PP-OCRv4_rec_infer.onnx", folder,
                   TensorSpec(name=REC_IN, datatype="FP32", shape=(-1, 3, 48, -1)),
                   TensorSpec(name=REC_OUT, datatype="FP32", shape=(-1, -1, 6625)), crops[:2],
                   lambda b: rec.run(None, {REC_IN: b}), created)
    sample: dict[str, Any] = {f"input:{DET_IN}": images}
    sample.update({f"expected:{o.name}": v for o, v in zip(end_specs(spec), ends, strict=True)})
    np.savez_compressed(folder / "selftest.npz", **sample)
    files = {**det_m.files, **rec_m.files, "selftest.npz": _entry(folder / "selftest.npz")}
    # the end gate as a fixture: the FP32 pipeline judged against itself on the sample (it must find >= 10 boxes)
    task = judge_pipeline(spec, ends, ends, min_boxes=1)
    manifest = Manifest(
        manifest_version=PIPELINE_VERSION, name=name, version=version, profile="x86-cpu", backend="onnxruntime",
        precision="fp32", created_at=created, engine=det_m.engine, selftest="selftest.npz", inputs=det_m.inputs,
        outputs=end_specs(spec), files=files, accuracy=_fixture_accuracy(len(images), task), benchmark=None,
        toolchain={"fixture": "tests", "pipeline": spec.kind},
        preprocessing=Preprocessing(input=DET_IN, height=HEIGHT, width=WIDTH, color="rgb", layout="nchw",
                                    mean=NORM["mean"], std=NORM["std"]),
        pipeline=PipelineManifest(spec=spec, stages=(det_m, rec_m)))
    if drift_pages is not None:  # as many pages a run as one request may hold
        step = max(1, spec.max_crops // spec.boxes.max_boxes)
        runs = [fp32_run(spec, drift_pages[i:i + step], (det, rec)) for i in range(0, len(drift_pages), step)]
        ref = drift_reference(spec, [np.concatenate(parts) for parts in zip(*runs, strict=True)])
        manifest = Manifest.model_validate({**manifest.model_dump(), "drift": ref})
    return write_bundle(manifest, folder, out)
