"""Keypoints (face landmarks, a pose's joints): instances matched, then the share of points that stay put (PCK).

A keypoint output holds, per sample, one instance's points (``[2K]``, ``[K, 2]``, or ``[K, 3]`` with a score per
point) or several instances' (``[I, K, 2]``, ``[I, K, 3]``, ``[I, 2K]``). FP32's instances are matched one to one by
the candidate's: by box IoU >= ``iou`` when the task names the instances' boxes (``boxes=OUTPUT``: ``[4]`` or
``[I, 4]`` x0, y0, x1, y1 per sample), else by the model's own instance order (one instance per image, or the same
number in the same order). Each FP32 point then counts as kept when the candidate's lies within ``pck`` (default
0.05) of the instance's size: the longer side of FP32's box, or without boxes the longer side of the box around
FP32's points. A lost instance loses all its points. The gate's bound is ``min_pck`` (default 0.98) on the kept
share, and ``min_instances`` on the instances matched when boxes are named. A ``[2K]`` vector (or ``[I, 2K]`` rows)
lays its points out as ``layout`` says: ``xy`` (default: x0, y0, x1, y1, ...) or ``xxyy`` (x0..xK-1, then y0..yK-1,
as MTCNN's ONet does); undeclared, it is inferred only when the named boxes tell the two apart (one layout puts
>= 90% of the points inside their boxes, the other <= 50%), else xy, and the report's note says which and why.
Pure functions of arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..protocol.manifest import TaskCriterion
from .criteria import crit, match_boxes, mean_ci, wilson
from .errors import InputError

__all__ = ["KEYPOINT_LAYOUTS", "keypoints", "pck_criteria", "pck_hits"]

KEYPOINT_LAYOUTS = ("xy", "xxyy")  # a [2K] vector: x0, y0, x1, y1, ... or x0..xK-1 then y0..yK-1


def pck_hits(ref: np.ndarray, cand: np.ndarray | None, size: float, fraction: float) -> np.ndarray:
    """Per FP32 point [K, 2+]: whether the candidate's point lies within ``fraction`` of ``size`` (None: all lost)."""
    if cand is None:
        return np.zeros(len(ref), bool)
    d = np.linalg.norm(np.asarray(ref, np.float64)[:, :2] - np.asarray(cand, np.float64)[:, :2], axis=1)
    return d <= fraction * max(size, 1e-9)


def pck_criteria(hits: list[np.ndarray], bound: float, fraction: float,
                 size: str) -> tuple[list[TaskCriterion], dict[str, float]]:
    """The ``pck`` criterion from each instance's hits (the interval over instances' shares); ``size`` names the
    instance size the fraction is of (in the details' key)."""
    kept = int(sum(int(h.sum()) for h in hits))
    total = int(sum(len(h) for h in hits))
    per = [float(h.mean()) for h in hits if len(h)]
    moved = sum(1 for h in hits if len(h) and not h.all())
    return ([crit("pck", kept / total if total else 1.0, bound, "min", mean_ci(per))],
            {"fp32_points": float(total), "kept_points": float(kept), f"pck_fraction_of_{size}": float(fraction),
             "instances_with_moved_points": float(moved)})


def _instances(x: np.ndarray, where: str, layout: str = "xy") -> np.ndarray:
    """One sample's points as [I, K, 2+] (a [2K] vector or [I, 2K] rows as ``layout`` says)."""
    x = np.asarray(x, np.float64)
    if x.ndim == 1 and x.size % 2 == 0:
        return x.reshape(2, -1).T[None] if layout == "xxyy" else x.reshape(1, -1, 2)
    if x.ndim == 2 and x.shape[1] in (2, 3):
        return x[None]
    if x.ndim == 2 and x.shape[1] % 2 == 0:
        return x.reshape(len(x), 2, -1).transpose(0, 2, 1) if layout == "xxyy" else x.reshape(len(x), -1, 2)
    if x.ndim == 3 and x.shape[2] in (2, 3):
        return x
    raise InputError(f"keypoints: {where} has shape {list(x.shape)} per sample; points are [2K], [K, 2], [K, 3], "
                     "[I, K, 2], [I, K, 3] or [I, 2K]")


def _boxes(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64).reshape(-1)
    if x.size % 4:
        raise InputError(f"keypoints: boxes= needs [4] or [I, 4] (x0, y0, x1, y1) per sample; got {x.size} values")
    return x.reshape(-1, 4)


def choose_layout(task: Any, ref: list[np.ndarray], others: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] | None
                  ) -> tuple[str, bool, str]:
    """(layout, sure, why) of the task's [2K] points: as declared, else inferred only when the named boxes tell: one
    layout puts at least 90% of fp32's points inside their instance's box (grown by 10%) and the other at most half;
    otherwise the default xy, not sure."""
    if "layout" in task.args:
        return str(task.args["layout"]), True, "declared"
    name = task.arg("boxes")
    flat = all(np.ndim(r) == 1 or (np.ndim(r) == 2 and np.shape(r)[1] not in (2, 3)) for r in ref[:64])
    if not flat:
        return "xy", True, "points given as [.., K, 2]: no layout to choose"
    if name is None or name not in (others or {}):
        return "xy", False, "xy by default: without boxes= the values do not tell xy from xxyy (declare layout=)"
    inside = {}
    for layout in KEYPOINT_LAYOUTS:
        hit = total = 0
        for r, b in zip(ref[:64], (others or {})[name][0][:64], strict=False):
            pts, box = _instances(r, "fp32's output", layout), _boxes(b)
            if len(box) != len(pts):
                return "xy", False, "xy by default: boxes and instances differ in number"
            pad = 0.1 * (box[:, 2:] - box[:, :2])[:, None]
            ok = (pts[..., :2] >= box[:, None, :2] - pad) & (pts[..., :2] <= box[:, None, 2:] + pad)
            hit, total = hit + int(ok.all(axis=-1).sum()), total + ok.shape[0] * ok.shape[1]
        inside[layout] = hit / max(total, 1)
    best, other = sorted(KEYPOINT_LAYOUTS, key=lambda k: -inside[k])
    sure = inside[best] >= 0.9 and inside[other] <= 0.5
    shares = f"{inside['xy']:.0%} of points inside their boxes read xy, {inside['xxyy']:.0%} read xxyy"
    if not sure:
        return "xy", False, f"xy by default: the boxes do not tell ({shares}; declare layout=)"
    return best, True, f"{best} inferred from the boxes ({shares})"


def keypoints(task: Any, ref: list[np.ndarray], cand: list[np.ndarray], _min: float,
              others: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] | None = None
              ) -> tuple[list[TaskCriterion], dict[str, float]]:
    """``task``: a judge.tasks.TaskSpec of task keypoints; ``others``: every output's (fp32, candidate) samples."""
    name = task.arg("boxes")
    if name is not None and name not in (others or {}):
        raise InputError(f"keypoints: boxes={name!r} is not one of the model's outputs {sorted(others or {})}")
    boxes = (others or {}).get(name) if name is not None else None
    fraction, iou_t = task.arg("pck"), task.arg("iou")
    layout = choose_layout(task, ref, others)[0]
    hits: list[np.ndarray] = []
    n_ref = matched = 0
    ious: list[float] = []
    for s, (r, c) in enumerate(zip(ref, cand, strict=True)):
        rp, cp = _instances(r, "fp32's output", layout), _instances(c, "the candidate's output", layout)
        if boxes is not None:
            rb, cb = _boxes(boxes[0][s]), _boxes(boxes[1][s])
            if len(rb) != len(rp) or len(cb) != len(cp):
                raise InputError(f"keypoints: {len(rb)} boxes and {len(rp)} instances of points in sample {s}; "
                                 "boxes= must give one box per instance")
            pairs = {i: (j, u) for i, j, u in match_boxes(rb, cb, iou_t)}
            sizes = np.maximum(rb[:, 2] - rb[:, 0], rb[:, 3] - rb[:, 1])
        else:
            if len(rp) != len(cp):
                raise InputError(f"keypoints: fp32 gives {len(rp)} instances and the candidate {len(cp)} in sample "
                                 f"{s}, and no boxes= output matches them: name the instances' boxes")
            pairs = {i: (i, 1.0) for i in range(len(rp))}
            sizes = np.array([float(np.ptp(p[:, :2], axis=0).max()) for p in rp])
        for i in range(len(rp)):
            j, u = pairs.get(i, (None, 0.0))
            hits.append(pck_hits(rp[i], cp[j] if j is not None else None, float(sizes[i]), fraction))
            matched += j is not None
            ious.append(u)
        n_ref += len(rp)
    if not n_ref:
        raise InputError(f"keypoints: fp32 gives no instance on the {len(ref)} evaluation samples")
    size = "box_longer_side" if boxes is not None else "points_extent_longer_side"
    crits, details = pck_criteria(hits, task.arg("min_pck"), fraction, size)
    details.update({"fp32_instances": float(n_ref), "matched_instances": float(matched)})
    if boxes is not None:
        crits.append(crit("instance_recall", matched / n_ref, task.arg("min_instances"), "min",
                          wilson(matched, n_ref)))
        details["mean_box_iou"] = round(float(np.mean(ious)), 6)
    return crits, details
