"""Output drift: what a model's answers looked like at compile time, what they look like on a box, and how far apart.

The compiler records a **reference** in the manifest (``Manifest.drift``): for the task the gate judged (or the
one inferred), a few *features* of each answer on the evaluation set, each binned:

================  ===========================================================================================
task              features (one value per answer unless said)
================  ===========================================================================================
classification    ``class`` (arg-max; categorical: the reference's 63 most common classes, the rest "other"),
                  ``score`` (top-1 probability; softmax first when the row is not one)
detection         ``boxes`` (anchors whose best class score >= ``score_threshold``, before NMS: moves with the
                  number of objects in view), ``score`` (the best box score of the image); a CenterNet or
                  CenterFace head's: its heat map's peaks (3x3 local maxima >= ``score_threshold``) and the best peak;
                  a detector whose boxes are another output (format ``scores``): read from its class scores
keypoints         ``instances`` (instances of points in the answer), ``spread`` (per instance: the longer side of the
                  box around its points, ``layout`` xy interleaved or xxyy: all x then all y)
ctc               ``length`` (greedy-decoded string length), ``score`` (mean top probability per step)
regression        ``positive_share`` (share of values >= ``threshold`` in the answer: a VAD's speech share),
                  ``value`` (the answer's values, at most 4,096 per answer)
segmentation      ``foreground_share`` (share of pixels above ``threshold``, or not arg-max 0 with channels)
embedding/other   ``norm`` (L2 norm of the answer), ``value`` (its values, at most 4,096 per answer)
pipeline          a detect-then-read pipeline's end answers (protocol/pipeline.py), one answer per image:
                  ``boxes`` (its ``count``, clipped to [0, K]); then *one value per string* (per box under
                  ``count``): ``length`` (``read: ctc``: the ``text`` row's length in characters, its UTF-8 lead
                  bytes among its first 4,096), or ``class`` (``read: topk``: the top class in ``classes``,
                  categorical as above), and ``score`` (the reader's: ``text_scores``, or the top class's
                  ``class_scores``)
================  ===========================================================================================

A histogram feature's bins are fixed at compile time from the reference's deciles (integer features at
half-integers; features in [0, 1] never with fewer than 3 edges), so an agent's **sketch** is a fixed array of
counts per feature (:class:`DriftAccumulator`: bounded memory, no input kept, mergeable by adding). The agent sends
the counts of each telemetry interval (:class:`DriftCounts`); the fleet scores them against the reference.

A pipeline's answers are its end outputs as the manifest lists them (``boxes``, ``box_scores``, ``count``, ``text``
or ``classes``, ``text_scores`` or ``class_scores``: a list of five arrays, images on axis 0); its samples are its
images, and its per-string features hold as many values as the images had boxes, which may be fewer or more.

**Score**: the population stability index of each feature, ``PSI = sum_i (a_i - e_i) * ln(a_i / e_i)`` over the
bins, with ``e`` the expected (reference) shares and ``a`` the actual (live) ones, each share at least
``PSI_EPSILON`` (1e-4: an empty bin counts as 1e-4, so one bin never makes it infinite; the largest possible value
over any bins is then below :data:`MAX_PSI`). The drift score is the largest feature PSI. Sampling alone gives an
expected PSI of about ``(bins - 1) * (1/n + 1/N)`` for n live and N reference values (reported as ``noise``): 0.045
for 10 bins at n = 200 against a large reference, but 0.23 against a 48-image one, so the **level** is read from
what a feature's PSI exceeds its own noise by: below ``WATCH_PSI`` (0.1) stable, below ``DRIFT_PSI`` (0.25) watch,
else drift; fewer than ``MIN_SAMPLES`` (200) answers is **insufficient** (the figure shown, never called drift). The
score itself stays the raw PSI (a rollout's ``max_drift_psi`` compares that, as the operator wrote it). For the same
reason, once there are ``MIN_SAMPLES`` answers, a feature counted from fewer than ``MIN_SAMPLES`` values (a
pipeline's strings on mostly blank pages) is shown in ``features`` but neither the score nor the level rests on it.

Two sketches of different versions (a rollout's drift gate) are compared after :func:`align` puts both on the same
bins: categories both references name, the rest "other"; histogram counts moved onto the newer version's edges as
if spread evenly within each bin (the open outer bins as if at their edge).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from ._strict import StrictModel

__all__ = [
    "DRIFT_PSI",
    "MAX_BINS",
    "MAX_FEATURES",
    "MAX_PSI",
    "MAX_TEXT_BYTES",
    "MIN_SAMPLES",
    "PSI_EPSILON",
    "WATCH_PSI",
    "DriftAccumulator",
    "DriftCounts",
    "DriftReference",
    "DriftScore",
    "FeatureCounts",
    "FeatureReference",
    "align",
    "build_reference",
    "compare",
    "feature_values",
    "level",
    "psi",
    "reference_args",
    "samples_of",
    "score",
]

PSI_EPSILON = 1e-4  # the least share a bin counts with
WATCH_PSI = 0.1
DRIFT_PSI = 0.25
MIN_SAMPLES = 200  # answers before a level is more than "insufficient"
MAX_BINS = 64  # per feature
MAX_FEATURES = 4
MAX_CATEGORIES = MAX_BINS - 1  # classes with a bin of their own; the rest share "other"
MAX_VALUES_PER_ANSWER = 4096  # work bound of the ``value`` feature: at most this many values of one answer, strided
MAX_TEXT_BYTES = 4096  # a pipeline string's bytes read (protocol.pipeline.ReadStep.max_text_bytes's bound)
MAX_BOXES = 256  # a pipeline image's boxes read (protocol.pipeline.BoxesStep.max_boxes's bound)
MAX_ROWS = 1 << 16  # answers (rows) one call looks at
MAX_COUNT = 2**40  # any count in a sketch (protocol.mqtt.MAX_COUNT)
MAX_PSI = 2 * (1 - PSI_EPSILON) * math.log(1 / PSI_EPSILON) + 1e-6  # two bins swapping all their mass: the most
DECILES = tuple(i / 10 for i in range(1, 10))
UNIT_GRID = DECILES  # edges added to a [0, 1] feature whose deciles collapse

Task = Literal["classification", "detection", "ctc", "segmentation", "regression", "embedding", "keypoints", "pipeline"]
FeatureName = Literal["class", "score", "boxes", "length", "positive_share", "foreground_share", "value", "norm",
                      "instances", "spread"]
Level = Literal["insufficient", "stable", "watch", "drift"]
TASK_FEATURES: dict[str, tuple[str, ...]] = {
    "classification": ("class", "score"),
    "detection": ("boxes", "score"),
    "ctc": ("length", "score"),
    "regression": ("positive_share", "value"),
    "segmentation": ("foreground_share",),
    "embedding": ("norm", "value"),
    "keypoints": ("instances", "spread"),
    "pipeline": ("boxes", "length", "class", "score"),  # length with read ctc, class with read topk
}
PIPELINE_FEATURES: dict[str, tuple[str, ...]] = {"ctc": ("boxes", "length", "score"),  # by the pipeline's read op
                                                 "topk": ("boxes", "class", "score")}
INTEGER_FEATURES = frozenset({"boxes", "length", "instances"})
UNIT_FEATURES = frozenset({"positive_share", "foreground_share"})  # always in [0, 1]


# -- the data model (manifest and telemetry) ---------------------------------------------------------------------
class FeatureReference(StrictModel):
    """One feature's bins and the reference's share in each. Categorical: one bin per class of ``categories``
    (ascending class ids) and a last one for every other class. Histogram: ``edges`` ascending, the bins
    (-inf, e0], (e0, e1], ..., (e_last, inf)."""

    name: FeatureName
    kind: Literal["categorical", "histogram"]
    categories: tuple[int, ...] = Field(default=(), max_length=MAX_CATEGORIES)
    edges: tuple[float, ...] = Field(default=(), max_length=MAX_BINS - 1)
    shares: tuple[float, ...] = Field(min_length=1, max_length=MAX_BINS)

    @model_validator(mode="after")
    def _bins(self) -> FeatureReference:
        if self.kind == "categorical":
            if self.edges or len(self.shares) != len(self.categories) + 1:
                raise ValueError("a categorical feature has one share per category and one for 'other', no edges")
            if any(c < 0 or c >= 2**31 for c in self.categories) or list(self.categories) != sorted(
                    set(self.categories)):
                raise ValueError("categories are distinct class ids in [0, 2**31), ascending")
        else:
            if self.categories or len(self.shares) != len(self.edges) + 1:
                raise ValueError("a histogram has one share more than it has edges, no categories")
            e = self.edges
            if any(abs(x) > 1e30 for x in e) or any(b <= a for a, b in itertools.pairwise(e)):
                raise ValueError("edges are ascending, distinct and within +-1e30")
        if any(not 0.0 <= s <= 1.0 for s in self.shares) or abs(sum(self.shares) - 1.0) > 1e-6:
            raise ValueError("shares are in [0, 1] and sum to 1")
        return self

    @property
    def bins(self) -> int:
        return len(self.shares)


class DriftReference(StrictModel):
    """The answers of the fp32 model on the evaluation set, as features (manifest version 5)."""

    read_as: Task  # the task whose features it holds (the gate's task; not named 'task': that is accuracy.task's)
    output: str = Field(min_length=1, max_length=256)  # the output it reads
    source: Literal["fp32"] = "fp32"
    # False: the task was inferred and not for sure (protocol's TaskReport note says why); the answers are read as
    # that task's all the same, and the fleet says the score rests on a guessed task
    sure: bool = True
    samples: int = Field(gt=0, lt=MAX_COUNT)  # answers it was made from
    # how answers are read (each only where its task uses it)
    blank: int | None = Field(default=None, ge=0, lt=2**31)  # ctc
    score_threshold: float | None = Field(default=None, ge=0.0, le=1.0)  # detection
    # scores: a detector whose boxes are another output (its class scores [A, C], [C, A] or [A] read)
    detection_format: Literal["yolov8", "yolov5", "yolox", "centernet", "centerface", "scores"] | None = None
    layout: Literal["xy", "xxyy"] | None = None  # keypoints: how a [2K] vector lays out its points
    threshold: float | None = Field(default=None, ge=-1e30, le=1e30)  # regression, segmentation
    read: Literal["ctc", "topk"] | None = None  # pipeline: how its reader's answers were decoded (spec.read.op)
    features: tuple[FeatureReference, ...] = Field(min_length=1, max_length=MAX_FEATURES)

    @model_validator(mode="after")
    def _names(self) -> DriftReference:
        names = [f.name for f in self.features]
        if len(set(names)) != len(names) or not set(names) <= set(TASK_FEATURES[self.read_as]):
            raise ValueError(f"task {self.read_as} has the features {list(TASK_FEATURES[self.read_as])}, each "
                             f"once; got {names}")
        if self.read_as == "detection" and (self.score_threshold is None or self.detection_format is None):
            raise ValueError("a detection reference names its score_threshold and detection_format")
        if (self.read_as == "keypoints") != (self.layout is not None):
            raise ValueError("a keypoints reference names its points' layout (xy or xxyy); no other task has one")
        if (self.read_as == "pipeline") != (self.read is not None):
            raise ValueError("a pipeline reference names how its reader's answers were read (read: ctc or topk); "
                             "no other task has read")
        if self.read is not None and not set(names) <= set(PIPELINE_FEATURES[self.read]):
            raise ValueError(f"a pipeline read as {self.read} has the features {list(PIPELINE_FEATURES[self.read])}; "
                             f"got {names}")
        return self

    def feature(self, name: str) -> FeatureReference | None:
        return next((f for f in self.features if f.name == name), None)


class FeatureCounts(StrictModel):
    name: FeatureName
    counts: tuple[int, ...] = Field(min_length=1, max_length=MAX_BINS)

    @model_validator(mode="after")
    def _range(self) -> FeatureCounts:
        if any(c < 0 or c >= MAX_COUNT for c in self.counts) or sum(self.counts) >= MAX_COUNT:
            raise ValueError(f"counts are in [0, {MAX_COUNT}) and so is their sum")
        return self


class DriftCounts(StrictModel):
    """A device's answers of one telemetry interval, binned as its model's manifest says (``Telemetry.drift``)."""

    model: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    version: str = Field(pattern=r"^[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}$")
    samples: int = Field(ge=0, lt=MAX_COUNT)  # answers counted
    skipped: int = Field(default=0, ge=0, lt=MAX_COUNT)  # answers not counted (the sketch thread was behind)
    features: tuple[FeatureCounts, ...] = Field(min_length=1, max_length=MAX_FEATURES)

    @model_validator(mode="after")
    def _once(self) -> DriftCounts:
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError("each feature once")
        return self

    def matches(self, ref: DriftReference) -> str | None:
        """Why these counts do not fit ``ref``'s bins, or None."""
        for f in self.features:
            r = ref.feature(f.name)
            if r is None:
                return f"feature {f.name!r} is not in the reference ({[x.name for x in ref.features]})"
            if len(f.counts) != r.bins:
                return f"feature {f.name!r} has {len(f.counts)} bins, the reference {r.bins}"
        return None


# -- reading answers ------------------------------------------------------------------------------------------------
Batch = np.ndarray | Sequence[np.ndarray]


def _answers(batch: Batch) -> list[np.ndarray]:
    """Each answer (samples on axis 0) with its size-1 axes dropped, at most MAX_ROWS."""
    items = [batch[i] for i in range(min(len(batch), MAX_ROWS))]
    return [np.asarray(x).reshape([d for d in np.shape(x) if d != 1]) for x in items]


def _probabilities(rows: np.ndarray) -> np.ndarray:
    """Rows of class scores as probabilities: as they are when they already are, else softmax."""
    if rows.size and rows.min() >= -1e-6 and rows.max() <= 1 + 1e-6 and float(np.abs(rows.sum(-1) - 1.0).max()) <= 1e-3:
        return rows
    z = rows - rows.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid_if_logits(v: np.ndarray) -> np.ndarray:
    return v if v.size == 0 or (v.min() >= 0 and v.max() <= 1) else 1 / (1 + np.exp(-np.clip(v, -60, 60)))


def _strided(v: np.ndarray) -> np.ndarray:
    flat = v.reshape(-1)
    step = -(-flat.size // MAX_VALUES_PER_ANSWER)
    return flat[::step] if step > 1 else flat


def _pipeline_values(batch: Batch, read: str | None) -> dict[str, list[np.ndarray]]:
    """A pipeline's end outputs -> boxes per image and, per string (box under its image's count), its length or top
    class and its score. Counts are clipped to the K rows there are (and MAX_BOXES), strings read to MAX_TEXT_BYTES."""
    if read not in PIPELINE_FEATURES:
        raise ValueError(f"a pipeline's answers are read as its read step says (read: ctc or topk); got {read!r}")
    if isinstance(batch, np.ndarray) or len(batch) != 5:
        raise ValueError("a pipeline's answers are its five end outputs (boxes, box_scores, count, text or classes, "
                         "text_scores or class_scores), images on axis 0")
    count, answer, scores = (np.asarray(batch[i]) for i in (2, 3, 4))
    n = min(len(count), MAX_ROWS) if count.ndim == 1 else -1
    if n < 0 or answer.ndim != 3 or scores.ndim not in (2, 3) or min(len(answer), len(scores)) < n \
            or scores.shape[1] != answer.shape[1]:
        raise ValueError(f"a pipeline's end outputs are count [N], {'text' if read == 'ctc' else 'classes'} "
                         f"[N, K, ...] and their scores [N, K (, k)]; got count {list(count.shape)}, "
                         f"{list(answer.shape)} and {list(scores.shape)}")
    if read == "ctc" and answer.dtype != np.uint8:
        raise ValueError(f"a pipeline's text is UTF-8 bytes (uint8); got {answer.dtype}")
    k = min(answer.shape[1], MAX_BOXES)
    c = np.clip(np.nan_to_num(count[:n].astype(np.float64), nan=0.0, posinf=k, neginf=0.0), 0, k).astype(np.int64)
    rows = np.arange(k)[None, :] < c[:, None]  # [n, k]: the boxes each image found
    sc = scores[:n, :k] if scores.ndim == 2 else scores[:n, :k, 0]
    out: dict[str, list[np.ndarray]] = {"boxes": [c.astype(np.float64)], "score": [sc[rows].astype(np.float64)]}
    if read == "ctc":
        t = answer[:n, :k, :MAX_TEXT_BYTES][rows]  # [strings, bytes]
        out["length"] = [((t != 0) & ((t & 0xC0) != 0x80)).sum(axis=1).astype(np.float64)]  # UTF-8 lead bytes
    else:
        out["class"] = [answer[:n, :k, 0][rows].astype(np.float64)]
    return out


def _heat_peaks(a: np.ndarray) -> np.ndarray:
    """A CenterNet heat map's ([C, H, W] or [H, W]; logits through a sigmoid) peak scores: the cells that are the
    largest of their 3x3 neighbourhood."""
    p = _sigmoid_if_logits(a.reshape((1, *a.shape) if a.ndim == 2 else a).astype(np.float64))
    q = np.pad(p, [(0, 0), (1, 1), (1, 1)], constant_values=-np.inf)
    h, w = p.shape[1:]
    pooled = np.max(np.stack([q[:, i:i + h, j:j + w] for i in range(3) for j in range(3)]), axis=0)
    return p[p >= pooled]


def _points(a: np.ndarray, layout: str | None) -> np.ndarray:
    """One answer's points as [I, K, 2] (judge.keypoints' shapes; a [2K] vector as ``layout`` says), at most
    MAX_BOXES instances."""
    if a.ndim == 1 and a.size % 2 == 0:
        p = a.reshape(2, -1).T[None] if layout == "xxyy" else a.reshape(1, -1, 2)
    elif a.ndim == 2 and a.shape[1] in (2, 3):
        p = a[None, :, :2]
    elif a.ndim == 2 and a.shape[1] % 2 == 0:
        p = a.reshape(len(a), 2, -1).transpose(0, 2, 1) if layout == "xxyy" else a.reshape(len(a), -1, 2)
    elif a.ndim == 3 and a.shape[2] in (2, 3):
        p = a[..., :2]
    else:
        raise ValueError(f"keypoints answers are [2K], [K, 2|3], [I, 2K] or [I, K, 2|3]; got shape {list(a.shape)}")
    return p[:MAX_BOXES]


def feature_values(task: str, batch: Batch, *, blank: int | None = None, score_threshold: float | None = None,
                   detection_format: str | None = None, threshold: float | None = None,
                   read: str | None = None, layout: str | None = None) -> dict[str, np.ndarray]:
    """Each feature's values (float64, 1-D, finite) over ``batch``: the answers, samples on axis 0 (an array, or a
    list of per-answer arrays; a pipeline's: its five end outputs). Raises ValueError for answers its task cannot
    read."""
    if task == "pipeline":
        out = _pipeline_values(batch, read)
        return {n: _finite(np.concatenate(out[n])) for n in PIPELINE_FEATURES[str(read)]}
    out = {n: [] for n in TASK_FEATURES[task]}
    if task == "classification" and isinstance(batch, np.ndarray) and batch.ndim >= 2:
        rows = [batch[:MAX_ROWS].reshape(-1, batch.shape[-1])]  # vectorised: [N, C] (or [N, ..., C]) at once
    elif task == "classification":
        rows = [a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1) for a in _answers(batch)]
    else:
        rows = []
    for r in rows:
        r = r.astype(np.float64, copy=False)
        out["class"].append(r.argmax(axis=-1).astype(np.float64))
        out["score"].append(_probabilities(r).max(axis=-1))
    if task != "classification":
        for a in _answers(batch):
            if a.dtype.kind != "f":  # integer or boolean answers: read as floats (float32 ones stay as they are)
                a = a.astype(np.float64)
            if task == "detection" and detection_format in ("centernet", "centerface"):
                if a.ndim not in (2, 3) or min(a.shape[-2:]) < 2:
                    raise ValueError(f"a CenterNet heat map is [C, H, W] or [H, W] per image; got {list(a.shape)}")
                s = _heat_peaks(a)
                out["boxes"].append(np.array([float(np.sum(s >= (score_threshold or 0.0)))]))
                out["score"].append(np.array([float(s.max()) if s.size else 0.0]))
            elif task == "detection" and detection_format == "scores":
                p = _sigmoid_if_logits(a)  # [A, C], [C, A] (the fewer are the classes) or [A]
                s = p.reshape(-1) if p.ndim < 2 else p.max(axis=0 if p.shape[0] < p.shape[1] else 1)
                out["boxes"].append(np.array([float(np.sum(s >= (score_threshold or 0.0)))]))
                out["score"].append(np.array([float(s.max()) if s.size else 0.0]))
            elif task == "keypoints":
                p = _points(a, layout)
                out["instances"].append(np.array([float(len(p))]))
                out["spread"].append(np.ptp(p, axis=1).max(axis=-1) if p.size else np.zeros(0))
            elif task == "detection":
                if a.ndim != 2:
                    raise ValueError(f"detection answers are 2-D per image; got shape {list(a.shape)}")
                if detection_format == "yolov8":
                    s = a[4:].max(axis=0) if a.shape[0] > 4 else np.zeros(0)
                elif detection_format == "yolox":
                    s = (_sigmoid_if_logits(a[:, 5:]) * _sigmoid_if_logits(a[:, 4:5])).max(axis=1) \
                        if a.shape[1] > 5 else np.zeros(0)
                else:
                    s = (a[:, 5:] * a[:, 4:5]).max(axis=1) if a.shape[1] > 5 else np.zeros(0)
                out["boxes"].append(np.array([float(np.sum(s >= (score_threshold or 0.0)))]))
                out["score"].append(np.array([float(s.max()) if s.size else 0.0]))
            elif task == "ctc":
                if a.ndim != 2:
                    raise ValueError(f"ctc answers are [steps, classes]; got shape {list(a.shape)}")
                best = a.argmax(axis=-1)
                keep = (best != (blank or 0)) & np.concatenate([[True], best[1:] != best[:-1]])
                out["length"].append(np.array([float(keep.sum())]))
                out["score"].append(np.array([float(_probabilities(a).max(axis=-1).mean()) if a.size else 0.0]))
            elif task == "regression":
                thr = 0.5 if threshold is None else threshold
                out["positive_share"].append(np.array([float(np.mean(a >= thr)) if a.size else 0.0]))
                out["value"].append(_strided(a))
            elif task == "segmentation":
                if a.ndim == 3 and a.shape[0] > 1:  # channels: foreground is any class but 0
                    share = float(np.mean(a.argmax(axis=0) != 0))
                else:
                    thr = threshold if threshold is not None else (0.5 if a.size and a.min() >= 0 and a.max() <= 1
                                                                   else 0.0)
                    share = float(np.mean(a > thr)) if a.size else 0.0
                out["foreground_share"].append(np.array([share]))
            else:  # embedding and anything else: the generic sketch
                flat = a.reshape(-1)
                out["norm"].append(np.array([math.sqrt(max(float(np.dot(flat, flat)), 0.0))]))
                out["value"].append(_strided(a))
    return {name: _finite(np.concatenate(parts) if parts else np.zeros(0)) for name, parts in out.items()}


def _finite(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float64, copy=False)
    return np.clip(np.nan_to_num(v, nan=0.0, posinf=1e30, neginf=-1e30), -1e30, 1e30)


def samples_of(task: str, batch: Batch) -> int:
    """The answers ``batch`` holds (a pipeline's: its images), at most MAX_ROWS."""
    if task == "pipeline":
        return min(len(batch[2]), MAX_ROWS) if not isinstance(batch, np.ndarray) and len(batch) == 5 else 0
    return min(len(batch), MAX_ROWS)


def _kwargs(ref: DriftReference) -> dict[str, Any]:
    return {"blank": ref.blank, "score_threshold": ref.score_threshold, "detection_format": ref.detection_format,
            "threshold": ref.threshold, "read": ref.read, "layout": ref.layout}


def bin_counts(f: FeatureReference, values: np.ndarray) -> np.ndarray:
    """``values`` counted into ``f``'s bins (int64)."""
    if f.kind == "categorical":
        cats = np.asarray(f.categories, np.float64)
        idx = np.searchsorted(cats, values)
        hit = (idx < len(cats)) & (cats[np.minimum(idx, max(len(cats) - 1, 0))] == values) if len(cats) else \
            np.zeros(len(values), bool)
        idx = np.where(hit, idx, len(cats))
    else:
        idx = np.searchsorted(np.asarray(f.edges, np.float64), values, side="left")
    return np.bincount(idx, minlength=f.bins).astype(np.int64)


# -- the reference (compile time) ------------------------------------------------------------------------------------
def _edges(values: np.ndarray, name: str) -> tuple[float, ...]:
    if values.size == 0:
        return (0.5,) if name in INTEGER_FEATURES else UNIT_GRID if name in UNIT_FEATURES else ()
    q = np.quantile(values, DECILES)
    if name in INTEGER_FEATURES:
        q = np.floor(q) + 0.5
    edges = sorted({float(f"{x:.6g}") for x in q})
    if name in UNIT_FEATURES or (name == "score" and values.min() >= 0 and values.max() <= 1):
        if len(edges) < 3:
            edges = sorted(set(edges) | set(UNIT_GRID))
    elif name in INTEGER_FEATURES and len(edges) < 3:  # concentrated counts: a bin below and two above them
        extra = {edges[0] - 1, edges[-1] + 1, edges[-1] + 2}
        edges = sorted(set(edges) | {e for e in extra if e > 0 or values.min() < 0})
    return tuple(edges)


def reference_args(task: str, arg: Callable[[str], Any]) -> dict[str, Any]:
    """How ``task``'s answers are read, from its arguments (``arg(name)``: the compiler's TaskSpec.arg)."""
    if task == "ctc":
        return {"blank": int(arg("blank"))}
    if task == "detection":
        separate = arg("format") not in ("centernet", "centerface") and arg("boxes") is not None
        fmt = "scores" if separate else str(arg("format"))
        return {"score_threshold": float(arg("score")), "detection_format": fmt}
    if task in ("regression", "segmentation"):
        thr = arg("threshold")
        return {"threshold": None if thr is None else float(thr)}
    if task == "pipeline":
        return {"read": str(arg("read"))}
    if task == "keypoints":
        return {"layout": str(arg("layout"))}
    return {}


def build_reference(task: str, output: str, batch: Batch, *, blank: int | None = None,
                    score_threshold: float | None = None, detection_format: str | None = None,
                    threshold: float | None = None, read: str | None = None, layout: str | None = None,
                    sure: bool = True) -> DriftReference:
    """The reference of ``task`` from the answers ``batch`` (samples on axis 0) of output ``output`` (a pipeline's:
    its five end outputs, ``output`` the one its reader's answers are in, ``read`` its read step's op)."""
    kw: dict[str, Any] = {"blank": blank, "score_threshold": score_threshold, "detection_format": detection_format,
          "threshold": threshold, "read": read, "layout": layout}
    if task == "detection":
        kw["score_threshold"] = 0.25 if score_threshold is None else score_threshold
        kw["detection_format"] = detection_format or "yolov8"
    if task == "ctc":
        kw["blank"] = blank or 0
    if task == "keypoints":
        kw["layout"] = layout or "xy"
    values = feature_values(task, batch, **kw)
    n = samples_of(task, batch)
    feats = []
    for name, v in values.items():
        if name == "class":
            ids, counts = np.unique(v.astype(np.int64), return_counts=True)
            top = sorted(int(i) for i in ids[np.argsort(-counts, kind="stable")[:MAX_CATEGORIES]])
            f = FeatureReference(name="class", kind="categorical", categories=tuple(top),
                                 shares=(1.0,) + (0.0,) * len(top))
        else:
            edges = _edges(v, name)
            f = FeatureReference(name=name, kind="histogram", edges=edges,  # type: ignore[arg-type]
                                 shares=(1.0,) + (0.0,) * len(edges))
        c = bin_counts(f, v)
        shares = _shares(c)
        feats.append(f.model_copy(update={"shares": shares}))
    return DriftReference(read_as=task, output=output, samples=max(n, 1), features=tuple(feats),  # type: ignore[arg-type]
                          sure=sure, **kw)


def _shares(c: np.ndarray) -> tuple[float, ...]:
    total = int(c.sum())
    if total == 0:
        return (1.0,) + (0.0,) * (len(c) - 1)  # nothing seen: a reference that anything departs from
    s = [round(float(x) / total, 9) for x in c]
    s[int(np.argmax(c))] += 1.0 - sum(s)  # exactly 1 after rounding
    return tuple(max(0.0, x) for x in s)


# -- the sketch (on the device) ---------------------------------------------------------------------------------------
class DriftAccumulator:
    """Counts of answers in the reference's bins: a fixed array per feature, whatever the traffic (not thread-safe;
    agent.core.drift runs it on one thread)."""

    def __init__(self, ref: DriftReference, model: str, version: str):
        self.ref, self.model, self.version = ref, model, version
        self._counts = {f.name: np.zeros(f.bins, np.int64) for f in ref.features}
        self.samples = 0
        self.skipped = 0

    def add(self, batch: Batch) -> None:
        """Count the answers ``batch`` (the reference's output, samples on axis 0)."""
        values = feature_values(self.ref.read_as, batch, **_kwargs(self.ref))
        for f in self.ref.features:
            self._counts[f.name] += bin_counts(f, values[f.name])
        self.samples += samples_of(self.ref.read_as, batch)

    def take(self) -> DriftCounts | None:
        """The counts since the last take (None when nothing was counted), and start again from zero."""
        if self.samples == 0 and self.skipped == 0:
            return None
        cap = MAX_COUNT // (MAX_BINS + 1)  # each count and the sum stay in range, whatever one interval holds
        msg = DriftCounts(model=self.model, version=self.version, samples=min(self.samples, cap),
                          skipped=min(self.skipped, cap),
                          features=tuple(FeatureCounts(name=n, counts=tuple(min(int(x), cap) for x in c))  # type: ignore[arg-type]
                                         for n, c in self._counts.items()))
        for c in self._counts.values():
            c[:] = 0
        self.samples = self.skipped = 0
        return msg


# -- scores -----------------------------------------------------------------------------------------------------------
def _as_shares(x: Sequence[float] | np.ndarray) -> np.ndarray:
    a = np.asarray(x, np.float64)
    total = a.sum()
    return a / total if total > 0 else np.full(len(a), 1.0 / max(len(a), 1))


def psi(expected: Sequence[float] | np.ndarray, actual: Sequence[float] | np.ndarray) -> float:
    """The population stability index of ``actual`` against ``expected`` (counts or shares, same bins)."""
    e, a = _as_shares(expected), _as_shares(actual)
    if e.shape != a.shape:
        raise ValueError(f"{len(e)} expected bins against {len(a)} actual ones")
    e, a = np.maximum(e, PSI_EPSILON), np.maximum(a, PSI_EPSILON)
    return float(min(max(np.sum((a - e) * np.log(a / e)), 0.0), MAX_PSI))


def level(value: float | None, samples: int, noise: float = 0.0) -> Level:
    """The level of a PSI ``value`` over ``samples`` answers, judged by what it exceeds its sampling ``noise`` by: a
    PSI that sampling alone would give is no verdict on the answers."""
    if value is None or samples < MIN_SAMPLES:
        return "insufficient"
    excess = value - max(noise, 0.0)
    return "drift" if excess >= DRIFT_PSI else "watch" if excess >= WATCH_PSI else "stable"


@dataclass(frozen=True)
class DriftScore:
    psi: float | None  # the largest feature PSI (None: no feature could be compared)
    feature: str | None  # the feature that has it
    features: dict[str, float]  # every feature's PSI
    samples: int  # answers the actual side holds (the smaller side when two sketches are compared)
    noise: float  # PSI expected from sampling alone, the largest over the features
    level: Level

    def as_json(self) -> dict[str, Any]:
        return {"psi": self.psi, "feature": self.feature, "features": self.features, "samples": self.samples,
                "noise": self.noise, "level": self.level}


def _result(per: dict[str, float], noise: dict[str, float], values: dict[str, float], samples: int) -> DriftScore:
    """The score of features ``per`` (their PSI), each counted from ``values[name]`` values: once ``samples`` reach
    MIN_SAMPLES, only features of at least MIN_SAMPLES values decide (every feature, when none has that many)."""
    decide = [k for k in per if values[k] >= MIN_SAMPLES] if samples >= MIN_SAMPLES else []
    decide = decide or list(per)
    worst = max(decide, key=lambda k: per[k]) if decide else None
    value = round(per[worst], 6) if worst is not None else None
    # the level: the deciding feature that most exceeds its own noise (the largest PSI may be a noisy feature's)
    excess = max(decide, key=lambda k: per[k] - noise[k]) if decide else None
    return DriftScore(value, worst, {k: round(v, 6) for k, v in per.items()}, samples,
                      round(max((noise[k] for k in decide), default=0.0), 6),
                      level(per[excess] if excess is not None else None, samples,
                            noise[excess] if excess is not None else 0.0))


def score(ref: DriftReference, counts: Mapping[str, Sequence[int]], samples: int) -> DriftScore:
    """Live ``counts`` (feature -> counts in the reference's bins) against the reference."""
    per: dict[str, float] = {}
    noise: dict[str, float] = {}
    values: dict[str, float] = {}
    for f in ref.features:
        c = counts.get(f.name)
        if c is None or len(c) != f.bins or sum(c) == 0:
            continue
        per[f.name] = psi(f.shares, c)
        values[f.name] = float(sum(c))
        noise[f.name] = (f.bins - 1) * (1 / max(sum(c), 1) + 1 / ref.samples)
    return _result(per, noise, values, samples)


def _rebin(f: FeatureReference, counts: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """Histogram ``counts`` on ``f``'s edges moved onto ``edges``: spread evenly within each bin, the open outer bins
    at their edge."""
    o = np.asarray(f.edges, np.float64)
    if not len(o):
        raise ValueError("a histogram with one bin cannot be moved onto other bins")
    target = np.asarray(edges, np.float64)

    def below(x: float) -> float:  # the mass at or below x
        m = counts[0] * (x >= o[0]) + counts[-1] * (x > o[-1])
        for i in range(1, len(o)):
            lo, hi = o[i - 1], o[i]
            m += counts[i] * min(max((x - lo) / (hi - lo), 0.0), 1.0)
        return float(m)

    cum = [0.0, *(below(x) for x in target), float(counts.sum())]
    return np.diff(np.asarray(cum))


def align(a: FeatureReference, ca: Sequence[int], b: FeatureReference,
          cb: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Counts of one feature of two versions on common bins (``b``'s for histograms), or None if they cannot be."""
    xa, xb = np.asarray(ca, np.float64), np.asarray(cb, np.float64)
    if a.name != b.name or a.kind != b.kind or len(xa) != a.bins or len(xb) != b.bins:
        return None
    if a.kind == "categorical":
        common = sorted(set(a.categories) & set(b.categories))

        def fold(f: FeatureReference, x: np.ndarray) -> np.ndarray:
            pos = {c: i for i, c in enumerate(f.categories)}
            out = np.array([x[pos[c]] for c in common] + [0.0])
            out[-1] = x.sum() - out[:-1].sum()
            return out

        return fold(a, xa), fold(b, xb)
    if a.edges == b.edges:
        return xa, xb
    if not a.edges or not b.edges:
        return None
    return _rebin(a, xa, b.edges), xb


def compare(old: DriftReference, old_counts: Mapping[str, Sequence[int]], new: DriftReference,
            new_counts: Mapping[str, Sequence[int]], old_samples: int, new_samples: int) -> DriftScore:
    """The new version's answers against the old version's (the expected side), feature by feature on common bins."""
    per: dict[str, float] = {}
    noise: dict[str, float] = {}
    values: dict[str, float] = {}
    for fn in new.features:
        fo = old.feature(fn.name)
        co, cn = old_counts.get(fn.name), new_counts.get(fn.name)
        if fo is None or co is None or cn is None:
            continue
        pair = align(fo, co, fn, cn)
        if pair is None or pair[0].sum() == 0 or pair[1].sum() == 0:
            continue
        per[fn.name] = psi(pair[0], pair[1])
        values[fn.name] = float(min(pair[0].sum(), pair[1].sum()))
        noise[fn.name] = (len(pair[1]) - 1) * (1 / pair[0].sum() + 1 / pair[1].sum())
    return _result(per, noise, values, min(old_samples, new_samples))
