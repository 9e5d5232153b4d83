"""The truth of bench/corpus.py's models: each task's answers decoded from FP32's and INT8's outputs with this file's
own decoders (nothing from compiler/ or judge/), and the share of them INT8 changes. Boxes after NMS matched one to
one at IoU 0.5 (detectors; connected components of the probability map for the text detector), greedy CTC strings
(recognizers), arg-max decisions (classifiers), decisions at 0.5 and VAD speech segments over a stream with the
state carried (probabilities, VAD), the nearest neighbour and a wake-word head's decision on the embeddings
(embedder), downstream embeddings of the features (mel spectrogram). Each returns (share changed, what it counted).
The face models' truth is in bench/corpus_faces.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from bench.corpus_faces import session as _session
from bench.corpus_inputs import speech, vad_stream


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


def truth_wake_heads(oww: Mapping[str, Path]) -> Callable[[list[np.ndarray], list[np.ndarray]], tuple[float, str]]:
    """The embeddings as openWakeWord uses them: 16 in a row (one clip) into the FP32 'alexa' and 'hey mycroft'
    heads. An answer changes when a head's decision at 0.5 flips or its score moves by more than 0.05; the nearest
    neighbour of each embedding among the others is reported beside it."""
    def judge(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
        heads = [_session(oww[k]) for k in ("alexa_v0.1", "hey_mycroft_v0.1")]
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


def truth_mel(oww: Mapping[str, Path]) -> Callable[[list[np.ndarray], list[np.ndarray]], tuple[float, str]]:
    """The features as openWakeWord uses them: the FP32 embedding model on each 76-frame window of both."""
    def judge(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
        emb = _session(oww["embedding_model"])

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
        wav = speech(np.random.default_rng(7), 30.0)

        def stream(path: Path) -> np.ndarray:
            return vad_stream(path, wav)[0] > 0.5

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
