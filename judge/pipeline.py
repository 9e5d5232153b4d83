"""A detect-then-read pipeline's steps that are not models, and the gate of its end answers.

The same code runs in the compiler (to gate the pipeline's end answers against the FP32 pipeline) and in the agent
(to serve it), so a pipeline answers on a device exactly as it was judged. :class:`Chain` holds the steps of one
:class:`~edgefleet.protocol.pipeline.PipelineSpec`:

    images -> detector -> :meth:`Chain.boxes` -> :meth:`Chain.crops` -> reader -> :meth:`Chain.answers`

Each step is bounded: boxes per image (``boxes.max_boxes``, found among at most :data:`MAX_REGIONS` regions of a
map), crops per request (``max_crops``; :meth:`Chain.check` refuses a request whose images could need more before
any work), bytes per string (``read.max_text_bytes``). :meth:`Chain.run` runs the whole chain with two callables
(the compiler's runners); the agent awaits its stages' batchers between the same steps. OpenCV (``[image]``) finds
a map's regions and resizes crops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocol.drift import DriftReference, build_reference
from ..protocol.manifest import TaskCriterion, TaskReport, TensorSpec
from ..protocol.pipeline import BoxesStep, PipelineSpec, ReadStep, end_output_names
from .errors import InputError
from .tasks import _boxes, _crit, _mean_ci, _wilson, edit_distance

__all__ = ["MAX_REGIONS", "Chain", "Found", "ImageAnswers", "compare_image", "decode_text", "drift_reference",
           "end_specs", "judge_pipeline"]

MAX_REGIONS = 10_000  # regions of one map looked at (a noisy map of single pixels is cut here)
Found = tuple[np.ndarray, np.ndarray]  # one image's boxes [K, 4] (x0, y0, x1, y1) and scores [K]


def _cv2() -> Any:
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - the [image] extra is installed wherever pipelines are tested
        raise InputError("a detect-then-read pipeline needs OpenCV: pip install 'edgefleet[image]'") from exc
    return cv2


def _reading_order(boxes: np.ndarray, scores: np.ndarray) -> Found:
    """Top to bottom by lines (boxes whose centres lie within half a median box height), then left to right."""
    if len(boxes) <= 1:
        return boxes, scores
    h = np.maximum(boxes[:, 3] - boxes[:, 1], 1.0)
    line = np.floor(((boxes[:, 1] + boxes[:, 3]) / 2) / max(float(np.median(h)) / 2, 1.0))
    order = np.lexsort((boxes[:, 0], line))
    return boxes[order], scores[order]


def _map_boxes(step: BoxesStep, m: np.ndarray, hw: tuple[int, int]) -> Found:
    cv2 = _cv2()
    prob = np.squeeze(m).astype(np.float32)
    if prob.ndim != 2:
        raise InputError(f"boxes.format map needs a [1, H, W] probability map per image; the detector gave "
                         f"{list(m.shape)}")
    n, labels, stats, _ = cv2.connectedComponentsWithStats((prob > step.threshold).astype(np.uint8), connectivity=4)
    if n <= 1:
        return np.zeros((0, 4), np.float32), np.zeros(0, np.float32)
    n = min(n, MAX_REGIONS + 1)
    sums = np.bincount(labels.ravel(), weights=prob.ravel(), minlength=n)[:n]
    score = (sums[1:] / np.maximum(stats[1:n, 4], 1)).astype(np.float32)
    x, y, w, h = (stats[1:n, i].astype(np.float64) for i in range(4))
    d = w * h * step.unclip / np.maximum(2 * (w + h), 1.0)  # DB's unclip: area * ratio / perimeter, every side
    sy, sx = hw[0] / prob.shape[0], hw[1] / prob.shape[1]
    boxes = np.stack([(x - d) * sx, (y - d) * sy, (x + w + d) * sx, (y + h + d) * sy], axis=1)
    keep = score >= step.box_threshold
    return boxes[keep].astype(np.float32), score[keep]


def decode_text(codes: Sequence[int], charset: Sequence[str], blank: int, limit: int) -> bytes:
    """Class indices (blank already dropped) as UTF-8, at most ``limit`` bytes, cut at a character's end."""
    offset = 1 if blank == 0 else 0
    out = bytearray()
    for k in codes:
        i = k - offset
        ch = charset[i] if 0 <= i < len(charset) else "\ufffd"
        b = ch.encode("utf-8")
        if len(out) + len(b) > limit:
            break
        out += b
    return bytes(out)


class Chain:
    """The steps of one pipeline; ``input_hw`` is the detector input's height and width (NCHW)."""

    def __init__(self, spec: PipelineSpec, input_hw: tuple[int, int], detector_outputs: Sequence[str],
                 reader_outputs: Sequence[str]):
        self.spec = spec
        self.input_hw = input_hw
        self.det_index = list(detector_outputs).index(spec.boxes.output) if spec.boxes.output else 0
        self.read_index = list(reader_outputs).index(spec.read.output) if spec.read.output else 0
        self.max_images = max(1, spec.max_crops // spec.boxes.max_boxes)

    def check(self, images: int) -> None:
        """Refuse, before any work, a request whose images could need more than ``max_crops`` crops."""
        if images > self.max_images:
            raise InputError(f"{images} images in one request: with up to {self.spec.boxes.max_boxes} boxes each "
                             f"they could need more than the pipeline's {self.spec.max_crops} crops per request; send "
                             f"at most {self.max_images} images per request")

    # -- steps ---------------------------------------------------------------------------------------------------
    def boxes(self, detector_out: Sequence[np.ndarray]) -> list[Found]:
        """Each image's boxes (at most ``max_boxes``, the best scores, in reading order), clipped to the image."""
        step, (h, w) = self.spec.boxes, self.input_hw
        out = []
        for sample in detector_out[self.det_index]:
            if step.format == "map":
                b, s = _map_boxes(step, sample, self.input_hw)
            else:
                xyxy, sc, _ = _boxes(np.squeeze(sample), step.format, step.threshold, step.nms_iou, h, w)
                b, s = xyxy.astype(np.float32), sc.astype(np.float32)
            if len(b):
                b = np.stack([b[:, 0].clip(0, w), b[:, 1].clip(0, h), b[:, 2].clip(0, w), b[:, 3].clip(0, h)], 1)
                big = ((b[:, 2] - b[:, 0]) >= step.min_size) & ((b[:, 3] - b[:, 1]) >= step.min_size)
                b, s = b[big], s[big]
                best = np.argsort(-s, kind="stable")[: step.max_boxes]
                b, s = _reading_order(b[best], s[best])
            out.append((b.astype(np.float32), s.astype(np.float32)))
        return out

    def crops(self, images: np.ndarray, found: Sequence[Found]) -> tuple[np.ndarray, list[int]]:
        """Every box cut from its image, resized and normalized for the reader: [M, c, h, w] and each crop's image."""
        cv2, step = _cv2(), self.spec.crop
        src, dst = step.source, step.target
        c_in = images.shape[1]
        s_mean = np.asarray(src.mean, np.float32).reshape(-1, 1, 1)
        s_std = np.asarray(src.std, np.float32).reshape(-1, 1, 1)
        t_mean = np.asarray(dst.mean, np.float32).reshape(1, 1, -1)
        t_std = np.asarray(dst.std, np.float32).reshape(1, 1, -1)
        crops, owners = [], []
        for i, (boxes, _) in enumerate(found):
            if not len(boxes):
                continue
            pixels = (images[i].astype(np.float32) * s_std + s_mean) / np.float32(src.scale)  # undo the input's
            if step.channels == 1 and c_in == 3:
                pixels = pixels.mean(axis=0, keepdims=True)
            elif step.channels == 3 and c_in == 1:
                pixels = np.repeat(pixels, 3, axis=0)
            hwc = np.ascontiguousarray(pixels.transpose(1, 2, 0))
            for x0, y0, x1, y1 in boxes:
                r0, r1 = int(np.floor(y0)), max(int(np.ceil(y1)), int(np.floor(y0)) + 1)
                c0, c1 = int(np.floor(x0)), max(int(np.ceil(x1)), int(np.floor(x0)) + 1)
                region = hwc[r0:r1, c0:c1]
                if step.keep_aspect:
                    tw = int(min(step.width, max(1, round(step.height * region.shape[1] / max(region.shape[0], 1)))))
                else:
                    tw = step.width
                resized = cv2.resize(region, (tw, step.height), interpolation=cv2.INTER_LINEAR)
                resized = resized.reshape(step.height, tw, step.channels)
                canvas = np.full((step.height, step.width, step.channels), step.pad_value, np.float32)
                canvas[:, :tw] = resized
                crops.append(((canvas * np.float32(dst.scale) - t_mean) / t_std).transpose(2, 0, 1))
                owners.append(i)
        if len(crops) > self.spec.max_crops:  # check() makes this unreachable; kept as the bound's last guard
            raise InputError(f"{len(crops)} crops exceed the pipeline's {self.spec.max_crops} per request")
        shape = (0, step.channels, step.height, step.width)
        return (np.ascontiguousarray(np.stack(crops), dtype=np.float32) if crops else np.zeros(shape, np.float32),
                owners)

    def read(self, reader_out: Sequence[np.ndarray]) -> list[tuple[Any, float]]:
        """Each crop's answer: (UTF-8 bytes, score) for ctc; (classes [k], scores [k]) for topk."""
        step: ReadStep = self.spec.read
        v = np.asarray(reader_out[self.read_index])
        if step.op == "ctc":
            if v.ndim != 3:
                raise InputError(f"read.op ctc needs [K, T, C] (or [T, K, C] with time_major) scores; the reader gave "
                                 f"{list(v.shape)}")
            v = v.transpose(1, 0, 2) if step.time_major else v
            best, p = v.argmax(axis=-1), v.max(axis=-1)
            out: list[tuple[Any, float]] = []
            for row, prow in zip(best, p, strict=True):
                keep = np.ones(len(row), bool)
                keep[1:] = row[1:] != row[:-1]
                keep &= row != step.blank
                codes = row[keep].tolist()
                text = decode_text(codes, step.charset or (), step.blank, step.max_text_bytes)
                out.append((text, float(prow[keep].mean()) if keep.any() else 0.0))
            return out
        if v.ndim != 2:
            v = v.reshape(len(v), -1)
        k = min(step.k, v.shape[1])
        top = np.argsort(-v, axis=1, kind="stable")[:, :k]
        return [(top[i].astype(np.int32), float(v[i, top[i][0]])) for i in range(len(v))]

    def answers(self, found: Sequence[Found], owners: Sequence[int], reader_out: Sequence[np.ndarray]
                ) -> list[np.ndarray]:
        """The end outputs for the request's images (see protocol/pipeline.py)."""
        spec, n = self.spec, len(found)
        kmax = spec.boxes.max_boxes
        boxes = np.zeros((n, kmax, 4), np.float32)
        scores = np.zeros((n, kmax), np.float32)
        count = np.zeros(n, np.int32)
        for i, (b, s) in enumerate(found):
            boxes[i, : len(b)], scores[i, : len(s)], count[i] = b, s, len(b)
        per_crop = self.read(reader_out) if owners else []
        slot = np.zeros(n, np.int64)
        if spec.read.op == "ctc":
            text = np.zeros((n, kmax, spec.read.max_text_bytes), np.uint8)
            text_scores = np.zeros((n, kmax), np.float32)
            for owner, (t, sc) in zip(owners, per_crop, strict=True):
                j = slot[owner]
                text[owner, j, : len(t)] = np.frombuffer(t, np.uint8)
                text_scores[owner, j] = sc
                slot[owner] += 1
            return [boxes, scores, count, text, text_scores]
        k = spec.read.k
        classes = np.zeros((n, kmax, k), np.int32)
        class_scores = np.zeros((n, kmax, k), np.float32)
        for owner, (top, _) in zip(owners, per_crop, strict=True):
            j = slot[owner]
            classes[owner, j, : len(top)] = top
            slot[owner] += 1
        if owners:  # the scores of the k best classes, crop by crop
            v = np.asarray(reader_out[self.read_index]).reshape(len(owners), -1)
            slot[:] = 0
            for m, owner in enumerate(owners):
                j = slot[owner]
                class_scores[owner, j, :k] = v[m, classes[owner, j, :k]]
                slot[owner] += 1
        return [boxes, scores, count, classes, class_scores]

    def run(self, images: np.ndarray, detect: Callable[[np.ndarray], Sequence[np.ndarray]],
            read: Callable[[np.ndarray], Sequence[np.ndarray]], read_batch: int = 64) -> list[np.ndarray]:
        """The whole chain, in-process: ``detect`` and ``read`` run a stage on a batch and return its outputs."""
        self.check(len(images))
        found = self.boxes(detect(images))
        crops, owners = self.crops(images, found)
        parts: list[list[np.ndarray]] = [list(read(crops[i: i + read_batch])) for i in range(0, len(crops),
                                                                                         max(1, read_batch))]
        reader_out = [np.concatenate([p[j] for p in parts]) for j in range(len(parts[0]))] if parts else []
        return self.answers(found, owners, reader_out)


def end_specs(spec: PipelineSpec) -> tuple[TensorSpec, ...]:
    """The pipeline's end outputs as tensor specs (what its manifest lists)."""
    k, names = spec.boxes.max_boxes, end_output_names(spec)
    tail = ([("UINT8", (-1, k, spec.read.max_text_bytes)), ("FP32", (-1, k))] if spec.read.op == "ctc"
            else [("INT32", (-1, k, spec.read.k)), ("FP32", (-1, k, spec.read.k))])
    shapes = [("FP32", (-1, k, 4)), ("FP32", (-1, k)), ("INT32", (-1,)), *tail]
    return tuple(TensorSpec(name=n, datatype=d, shape=s) for n, (d, s) in zip(names, shapes, strict=True))  # type: ignore[arg-type]


def drift_reference(spec: PipelineSpec, ends: Sequence[np.ndarray]) -> DriftReference:
    """The drift reference of a pipeline's end answers ``ends`` (its end outputs over the evaluation images, as
    :meth:`Chain.answers` gives them): task ``pipeline`` of protocol/drift.py, read as ``spec.read.op``. ValueError
    for answers it cannot read."""
    return build_reference("pipeline", end_output_names(spec)[3], ends, read=spec.read.op)


def _strings(ends: Sequence[np.ndarray], i: int) -> list[bytes]:
    return [bytes(row).rstrip(b"\0") for row in ends[3][i, : int(ends[2][i])]]


def _pairs(ref: Sequence[np.ndarray], cand: Sequence[np.ndarray], i: int) -> list[tuple[int, int]]:
    """FP32's boxes of image ``i`` matched one to one with the candidate's at IoU >= 0.5, largest IoU first."""
    a, b = ref[0][i, : int(ref[2][i])], cand[0][i, : int(cand[2][i])]
    pairs: list[tuple[int, int]] = []
    if not len(a) or not len(b):
        return pairs
    lt, rb = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), axis=-1)  # noqa: E731
    iou = inter / np.maximum(area(a)[:, None] + area(b)[None] - inter, 1e-9)
    used_a: set[int] = set()
    used_b: set[int] = set()
    for flat in np.argsort(-iou, axis=None, kind="stable"):
        r, c = divmod(int(flat), iou.shape[1])
        if iou[r, c] < 0.5:
            break
        if r not in used_a and c not in used_b:
            used_a.add(r)
            used_b.add(c)
            pairs.append((r, c))
    return pairs


@dataclass(frozen=True)
class ImageAnswers:
    """One image's end answers, a candidate pipeline's against a reference's (:func:`compare_image`)."""

    answers: int  # the reference's boxes, each an answer
    kept: int  # of them, read the same by the candidate on a box matched at IoU >= 0.5 (a lost box: changed)
    matched: int  # reference boxes matched one to one with the candidate's
    found: int  # the candidate's boxes
    edits: int  # ctc: characters to edit, summed over the reference's strings (0 for topk)
    chars: int  # ctc: the reference's characters
    cers: tuple[float, ...]  # ctc: each reference string's character error rate
    score_diff: float | None  # the largest |box score| or |answer score| difference on matched boxes


def compare_image(spec: PipelineSpec, ref: Sequence[np.ndarray], cand: Sequence[np.ndarray], i: int
                  ) -> ImageAnswers:
    """Image ``i``'s end answers, ``cand``'s against ``ref``'s (both end outputs as protocol/pipeline.py lists
    them): boxes matched at IoU 0.5, and on the reference's boxes the strings equal (ctc) or the top class (topk).
    The compiler's end gate (:func:`judge_pipeline`) sums these over its images; the agent's shadow per request."""
    pairs = _pairs(ref, cand, i)
    got = dict(pairs)
    same = edits = chars = 0
    cers: list[float] = []
    if spec.read.op == "ctc":
        rs, cs = _strings(ref, i), _strings(cand, i)
        for r_i, r_text in enumerate(rs):
            c_text = cs[got[r_i]] if r_i in got else b""
            a, b = list(r_text.decode("utf-8", "replace")), list(c_text.decode("utf-8", "replace"))
            same += a == b
            d = edit_distance(a, b)  # type: ignore[arg-type]
            edits += d
            chars += len(a)
            cers.append(d / max(len(a), 1))
    else:
        same = sum(int(ref[3][i, r, 0] == cand[3][i, c, 0]) for r, c in pairs)
    diff: float | None = None
    for r, c in pairs:
        a_ref, a_cand = np.asarray(ref[4][i, r]).reshape(-1)[:1], np.asarray(cand[4][i, c]).reshape(-1)[:1]
        gap = max(abs(float(ref[1][i, r]) - float(cand[1][i, c])), abs(float(a_ref[0]) - float(a_cand[0])))
        diff = gap if diff is None else max(diff, gap)
    return ImageAnswers(answers=int(ref[2][i]), kept=int(same), matched=len(pairs), found=int(cand[2][i]),
                        edits=edits, chars=chars, cers=tuple(cers), score_diff=diff)


def judge_pipeline(spec: PipelineSpec, ref: Sequence[np.ndarray], cand: Sequence[np.ndarray], *,
                   min_answers: float = 0.98, max_cer: float = 0.02, min_boxes: int = 10) -> TaskReport:
    """The candidate pipeline's end answers against FP32's on the same images: boxes kept and added (IoU 0.5), and
    on FP32's boxes the reader's answers -- exact strings and CER for ctc, the top class for topk. A box the
    candidate lost counts as a changed answer. Fewer than ``min_boxes`` FP32 boxes: no verdict (InputError)."""
    n = len(ref[2])
    n_ref, n_cand = int(np.sum(ref[2])), int(np.sum(cand[2]))
    if n_ref < min_boxes:
        raise InputError(f"the FP32 pipeline found {n_ref} boxes on the {n} evaluation images; a verdict needs at "
                         f"least {min_boxes}: give images where the detector finds what the pipeline reads")
    matched = same = edits = chars = 0
    cers: list[float] = []
    for i in range(n):
        one = compare_image(spec, ref, cand, i)
        matched += one.matched
        same += one.kept
        edits += one.edits
        chars += one.chars
        cers.extend(one.cers)
    crits: list[TaskCriterion] = [
        _crit("end_answer_agreement", same / n_ref, min_answers, "min", _wilson(same, n_ref)),
        _crit("box_recall", matched / n_ref, min_answers, "min", _wilson(matched, n_ref)),
        _crit("box_precision", matched / n_cand if n_cand else 1.0, min_answers, "min", _wilson(matched, n_cand)),
    ]
    if spec.read.op == "ctc":
        cer = edits / chars if chars else float(edits > 0)
        crits.append(_crit("char_error_rate", cer, max_cer, "max", _mean_ci(cers)))
    details = {"images": float(n), "fp32_boxes": float(n_ref), "candidate_boxes": float(n_cand),
               "matched_boxes": float(matched), "same_answers": float(same)}
    first = crits[0]
    return TaskReport(task="pipeline", source="declared", output=end_output_names(spec)[3], metric=first.name,
                      value=first.value, ci95=first.ci95, criteria=tuple(crits), passed=all(c.passed for c in crits),
                      args={"read": spec.read.op, "boxes": spec.boxes.format}, details=details)

