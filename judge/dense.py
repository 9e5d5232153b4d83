"""The judges of tasks whose answers are values rather than labels or boxes: segmentation maps (mask IoU and the map's
objects), regression values (decisions, tolerance, a VAD's segments) and embeddings (neighbour rank, cosine). The
criteria are described in :mod:`judge.tasks`'s table. Pure functions of arrays; ``task`` is a judge.tasks.TaskSpec.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..protocol.manifest import TaskCriterion
from .criteria import crit as _crit
from .criteria import match_boxes
from .criteria import mean_ci as _mean_ci
from .criteria import wilson as _wilson
from .errors import InputError

__all__ = ["embedding", "regression", "segmentation"]


def segmentation(task: Any, ref: list[np.ndarray], cand: list[np.ndarray],
                  _min: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    thr = task.arg("threshold")
    if thr is None:  # probabilities are cut at 0.5, logits at 0
        lo = min(float(r.min(initial=0.0)) for r in ref)
        hi = max(float(r.max(initial=0.0)) for r in ref)
        thr = 0.5 if lo >= 0 and hi <= 1 else 0.0
    ious: list[float] = []
    n_ref = n_cand = matched = 0
    one_channel = True
    for r, c in zip(ref, cand, strict=True):
        if r.ndim == 3 and r.shape[0] > 1:
            one_channel = False
            rl, cl = r.argmax(axis=0), c.argmax(axis=0)
            per = [(np.sum((rl == k) & (cl == k)), np.sum((rl == k) | (cl == k))) for k in np.union1d(rl, cl)]
            ious.append(float(np.mean([i / u for i, u in per if u])) if per else 1.0)
        else:
            rm, cm = r > thr, c > thr
            union = int((rm | cm).sum())
            ious.append(float((rm & cm).sum() / union) if union else 1.0)
            rb, cb = _instances(rm, task.arg("min_area")), _instances(cm, task.arg("min_area"))
            n_ref, n_cand, matched = n_ref + len(rb), n_cand + len(cb), matched + _match_boxes(rb, cb, 0.5)
    if one_channel and all(bool((r > thr).all()) or not bool((r > thr).any()) for r in ref):
        side = "above" if bool((ref[0] > thr).all()) else "below"
        raise InputError(f"segmentation: every value of fp32's output is {side} the threshold {thr:g} on every sample, "
                         "so its masks are empty or whole and say nothing about an engine; declare the task this "
                         "output is for with --task (or --task-args threshold=T)")
    crits = [_crit("mask_iou", float(np.mean(ious)), task.arg("min_iou"), "min", _mean_ci(ious))]
    details = {"worst_mask_iou": round(min(ious), 6), "threshold": float(thr)}
    if one_channel:  # the objects the map is for (a text detector's lines): FP32's kept, none added
        bound = task.arg("min_instances")
        crits += [_crit("instance_recall", matched / n_ref if n_ref else 1.0, bound, "min", _wilson(matched, n_ref)),
                  _crit("instance_precision", matched / n_cand if n_cand else 1.0, bound, "min",
                        _wilson(matched, n_cand))]
        details.update({"fp32_instances": float(n_ref), "candidate_instances": float(n_cand),
                        "matched_instances": float(matched)})
    return crits, details


MAX_INSTANCES = 10_000  # per map: work bound on matching (a noisy map of single pixels is cut here)


def _instances(mask: np.ndarray, min_area: float) -> np.ndarray:
    """Bounding boxes [K, 4] (x0, y0, x1, y1) of the 4-connected components of a 2-D mask with at least ``min_area``
    pixels (squeezed to 2-D; a map of more dimensions is judged per pixel only)."""
    m = np.squeeze(mask)
    if m.ndim != 2:
        return np.zeros((0, 4))
    try:
        import cv2
    except ImportError as exc:
        raise InputError("judging a segmentation map's objects needs OpenCV: pip install 'edgefleet[image]'") from exc
    _, _, stats, _ = cv2.connectedComponentsWithStats(m.astype(np.uint8), connectivity=4)
    keep = stats[1:][stats[1:, 4] >= min_area][:MAX_INSTANCES]
    return np.stack([keep[:, 0], keep[:, 1], keep[:, 0] + keep[:, 2], keep[:, 1] + keep[:, 3]], axis=1).astype(
        np.float64) if len(keep) else np.zeros((0, 4))


def _match_boxes(ref: np.ndarray, cand: np.ndarray, iou_t: float) -> int:
    """How many of FP32's boxes the candidate's match one to one, largest IoU first, at IoU >= ``iou_t``."""
    return len(match_boxes(ref, cand, iou_t))


def regression(task: Any, ref: list[np.ndarray], cand: list[np.ndarray],
                min_agreement: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    r = np.concatenate([x.reshape(-1) for x in ref]).astype(np.float64)
    c = np.concatenate([x.reshape(-1) for x in cand]).astype(np.float64)
    err = np.abs(r - c)
    details = {"max_abs_error": float(err.max(initial=0.0)), "mean_abs_error": float(err.mean()) if err.size else 0.0}
    thr = task.arg("threshold")
    if thr is None and "tol" not in task.args and r.size and r.min() >= 0 and r.max() <= 1:
        thr = 0.5  # probabilities; values in [0, 1] judged by a tolerance (coordinates, scores) make no decisions
    crits = []
    if thr is not None:
        same = int(((r > thr) == (c > thr)).sum())
        bound = task.arg("min_decision")
        crits.append(_crit("decision_agreement", same / max(r.size, 1), min_agreement if bound is None else bound,
                           "min", _wilson(same, r.size)))
        details["threshold"] = float(thr)
        if task.arg("min_segments") is not None:
            seg_crits, seg_details = _segments(r > thr, c > thr, task.arg("min_segments"))
            crits += seg_crits
            details.update(seg_details)
    elif task.arg("min_segments") is not None:
        raise InputError("regression: min_segments judges the runs of decisions, and this output's values are not "
                         "probabilities: give the decision threshold too (--task-args threshold=T,min_segments=...)")
    if thr is None or "tol" in task.args:
        tol = task.arg("tol")
        if tol is None:
            tol = 0.01 * float(r.max() - r.min()) if r.size else 0.0
        within = sum(float(np.abs(a.astype(np.float64) - b).max(initial=0.0)) <= tol + 1e-12
                     for a, b in zip(ref, cand, strict=True))
        crits.append(_crit("within_tolerance", within / len(ref), task.arg("min_within"), "min",
                           _wilson(within, len(ref))))
        details["tol"] = float(tol)
    return crits, details


def _runs(decisions: np.ndarray) -> np.ndarray:
    """[K, 2]: start and end (exclusive) of each maximal run of True in a 1-D stream of decisions."""
    edges = np.diff(np.concatenate([[0], decisions.astype(np.int8), [0]]))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1)


def _segments(ref: np.ndarray, cand: np.ndarray, bound: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    """A VAD's answer is its speech segments: the runs of positive decisions over the stream (the evaluation samples
    in order, so a segment spans as many samples as it lasts). FP32's segments are matched one to one by the
    candidate's, largest overlap first, at interval IoU >= 0.5: a segment split in two, merged with its neighbour,
    cut to less than half or gone is lost; a segment FP32 does not have is added."""
    a, b = _runs(ref), _runs(cand)
    if not len(a):
        raise InputError(f"regression: min_segments judges segments (runs of positive decisions), and fp32 decides "
                         f"no positive on the {len(ref)} values of the evaluation stream: give evaluation data with "
                         "the events the model detects (speech for a VAD), in stream order")
    pairs = []
    j = 0
    for i, (s0, e0) in enumerate(a):  # both lists are sorted and each is disjoint: a sweep finds the overlaps
        while j < len(b) and b[j, 1] <= s0:
            j += 1
        k = j
        while k < len(b) and b[k, 0] < e0:
            inter = min(e0, b[k, 1]) - max(s0, b[k, 0])
            iou = inter / (max(e0, b[k, 1]) - min(s0, b[k, 0]))
            if iou >= 0.5:
                pairs.append((iou, i, k))
            k += 1
    used_a: set[int] = set()
    used_b: set[int] = set()
    for _, i, k in sorted(pairs, reverse=True):
        if i not in used_a and k not in used_b:
            used_a.add(i)
            used_b.add(k)
    hits = len(used_a)
    crits = [_crit("segment_recall", hits / len(a), bound, "min", _wilson(hits, len(a))),
             _crit("segment_precision", hits / len(b) if len(b) else 0.0, bound, "min", _wilson(hits, len(b)))]
    return crits, {"fp32_segments": float(len(a)), "candidate_segments": float(len(b)), "matched_segments": float(hits)}


def embedding(task: Any, ref: list[np.ndarray], cand: list[np.ndarray],
               min_agreement: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    """What an embedding is used for is finding its neighbours: each candidate embedding must have its own FP32
    embedding as its nearest among the evaluation set's FP32 embeddings (quantization noise smaller than the gap to
    any other input), and the cosine with FP32 stays high for all but the worst 5% (one outlier does not decide)."""
    shape = ref[0].shape
    if any(r.shape != shape or c.shape != shape for r, c in zip(ref, cand, strict=True)):
        raise InputError(f"embedding: the samples' outputs differ in shape (first {list(shape)}); declare another task")
    x = np.stack([r.reshape(-1) for r in ref]).astype(np.float64)
    y = np.stack([c.reshape(-1) for c in cand]).astype(np.float64)
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    den = nx * ny
    cos = np.where(den > 0, (x * y).sum(axis=1) / np.where(den > 0, den, 1), (np.abs(x - y).max(axis=1) == 0) * 1.0)
    xn, yn = x / np.maximum(nx, 1e-30)[:, None], y / np.maximum(ny, 1e-30)[:, None]
    hits = 0
    for s in range(0, len(x), 1024):  # [1024, N] similarities at a time
        sim = yn[s:s + 1024] @ xn.T
        own = sim[np.arange(len(sim)), np.arange(s, s + len(sim))]
        hits += int((own >= sim.max(axis=1) - 1e-9).sum())  # a tie with an identical input counts as found
    bound = task.arg("min_cosine")
    p05 = float(np.percentile(cos, 5))
    crits = [_crit("neighbour_retrieval", hits / len(x), task.arg("min_retrieval"), "min", _wilson(hits, len(x))),
             _crit("cosine_p05", p05, 0.95 if bound is None else bound, "min", None)]
    return crits, {"mean_cosine": round(float(np.mean(cos)), 6), "worst_cosine": round(float(cos.min()), 6)}
