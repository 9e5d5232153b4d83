"""The figures every task judge reports: a criterion with its bound and 95% interval, and the samples of an output."""

from __future__ import annotations

import math

import numpy as np

from ..protocol.manifest import TaskCriterion

__all__ = ["Outputs", "crit", "in_unit", "match_boxes", "mean_ci", "samples", "wilson"]

# an output over the evaluation set: samples on axis 0, or one array per sample when their shapes differ
Outputs = np.ndarray | list[np.ndarray]


def samples(out: Outputs) -> list[np.ndarray]:
    return list(out) if isinstance(out, list) else [out[i] for i in range(len(out))]


def wilson(hits: int, n: int) -> tuple[float, float] | None:
    if n == 0:
        return None
    p, z = hits / n, 1.96
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (round(max(0.0, mid - half), 6), round(min(1.0, mid + half), 6))


def mean_ci(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    v = np.asarray(values, np.float64)
    half = 1.96 * float(v.std(ddof=1)) / math.sqrt(len(v)) if len(v) > 1 else 0.0
    m = float(v.mean())
    return (round(max(0.0, m - half), 6), round(min(1.0, m + half), 6))


def crit(name: str, value: float, bound: float, kind: str, ci: tuple[float, float] | None) -> TaskCriterion:
    value, bound = round(min(max(value, 0.0), 1.0), 6), round(bound, 6)
    ok = value >= bound - 1e-9 if kind == "min" else value <= bound + 1e-9
    return TaskCriterion(name=name, value=value, bound=bound, kind=kind, ci95=ci, passed=ok)  # type: ignore[arg-type]

def in_unit(v: np.ndarray) -> bool:
    return bool(v.size and v.min() >= 0 and v.max() <= 1)


def match_boxes(rb: np.ndarray, cb: np.ndarray, iou_t: float) -> list[tuple[int, int, float]]:
    """FP32's boxes matched one to one by the candidate's, largest IoU first, at IoU >= ``iou_t``."""
    if not len(rb) or not len(cb):
        return []
    lt, br = np.maximum(rb[:, None, :2], cb[None, :, :2]), np.minimum(rb[:, None, 2:], cb[None, :, 2:])
    inter = np.prod(np.clip(br - lt, 0, None), axis=-1)
    area = lambda b: np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=-1)  # noqa: E731
    iou = inter / np.maximum(area(rb)[:, None] + area(cb)[None] - inter, 1e-9)
    used_r: set[int] = set()
    used_c: set[int] = set()
    out = []
    for flat in np.argsort(-iou, axis=None, kind="stable"):
        i, j = divmod(int(flat), iou.shape[1])
        if iou[i, j] < iou_t:
            break
        if i not in used_r and j not in used_c:
            used_r.add(i)
            used_c.add(j)
            out.append((i, j, float(iou[i, j])))
    return out
