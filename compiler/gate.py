"""The accuracy gate: does the built engine still compute what the FP32 model computes?

Two kinds, chosen by the data (``kind="auto"``):

- **accuracy**, when the evaluation set has labels that fit the first output: top-1 against the labels,
  for class scores ``[N, C]`` (axis 1), sequences ``[N, T, C]`` (per step, last axis) and dense maps
  ``[N, C, H, W]`` with ``[N, H, W]`` labels (per pixel, axis 1). The build passes when its drop
  against FP32 is within ``max_accuracy_drop``; the report carries a 95% interval for the drop from
  the paired samples, so a small evaluation set shows how little it proves.
- **agreement**, with no labels (detectors, embedders, anything): each output of the candidate is
  compared with FP32 on the same inputs. Rank-2 outputs are gated on top-1 agreement (per sample),
  rank-3 on per-step top-1 agreement along the last axis, other ranks on cosine similarity
  (``metric="cosine"`` forces cosine, e.g. for embeddings). Every output must reach
  ``min_agreement``; the report lists each output's top-1 agreement, max and mean absolute error and
  cosine similarity either way.

Pure functions of arrays: no I/O, no runtimes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from compiler.errors import InputError
from protocol.evaluation import label_axis, top1_hits
from protocol.manifest import AccuracyReport, OutputAgreement

__all__ = ["GateSettings", "evaluate_gate", "label_axis"]

GateKind = Literal["auto", "accuracy", "agreement"]
AgreementMetric = Literal["auto", "top1", "cosine"]


@dataclass(frozen=True)
class GateSettings:
    kind: GateKind = "auto"
    max_accuracy_drop: float = 0.01  # absolute top-1 drop vs fp32, with labels
    min_agreement: float = 0.99  # per output, without labels
    metric: AgreementMetric = "auto"


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    x, y = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    num = (x * y).sum(axis=1)
    den = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    both_zero = den == 0
    cos = np.where(both_zero, np.where(np.abs(x - y).max(axis=1) == 0, 1.0, 0.0), num / np.where(both_zero, 1, den))
    return float(cos.min(initial=1.0)) if len(cos) else 1.0


def _agreement(name: str, ref: np.ndarray, cand: np.ndarray, metric: AgreementMetric) -> OutputAgreement:
    if ref.shape != cand.shape:
        raise InputError(f"output {name!r}: the candidate engine returns shape {list(cand.shape)}, fp32 "
                         f"returns {list(ref.shape)}")
    diff = np.abs(ref.astype(np.float64) - cand.astype(np.float64))
    top1 = None
    if ref.ndim in (2, 3) and ref.shape[-1] > 1:
        top1 = float((ref.argmax(axis=-1) == cand.argmax(axis=-1)).mean())
    cos = _cosine(ref, cand)
    use: Literal["top1_agreement", "cosine"] = (
        "top1_agreement" if top1 is not None and metric in ("auto", "top1") else "cosine")
    if metric == "top1" and top1 is None:
        raise InputError(f"output {name!r} has shape {list(ref.shape)}: top-1 agreement needs class scores on "
                         "the last axis; gate it by cosine instead")
    value = top1 if use == "top1_agreement" and top1 is not None else cos
    return OutputAgreement(name=name, metric=use, value=round(value, 6),
                           top1_agreement=None if top1 is None else round(top1, 6), cosine=round(cos, 6),
                           max_abs_error=float(diff.max(initial=0.0)), mean_abs_error=float(diff.mean()) if diff.size
                           else 0.0)


def _drop_ci95(ref_hit: np.ndarray, cand_hit: np.ndarray) -> tuple[float, float]:
    """95% interval of the paired difference of two proportions (reference minus candidate)."""
    n = ref_hit.size
    b = int((ref_hit & ~cand_hit).sum())  # right before, wrong now
    c = int((~ref_hit & cand_hit).sum())
    d = (b - c) / n
    se = math.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n
    return (round(d - 1.96 * se, 6), round(d + 1.96 * se, 6))


def evaluate_gate(output_names: list[str], reference: list[np.ndarray], candidate: list[np.ndarray],
                  labels: np.ndarray | None, candidate_precision: str, settings: GateSettings) -> AccuracyReport:
    """Gate ``candidate`` (the built engine's outputs on the evaluation set) against ``reference`` (fp32)."""
    outputs = tuple(_agreement(n, r, c, settings.metric) for n, r, c in zip(output_names, reference, candidate,
                                                                              strict=True))
    n = len(reference[0])
    kind = settings.kind
    if kind == "auto":
        kind = "accuracy" if labels is not None else "agreement"
    if kind == "accuracy":
        if labels is None:
            raise InputError("the accuracy gate needs a 'labels' array in the evaluation set; without labels the "
                             "build is gated by agreement with fp32 (--gate agreement)")
        axis = label_axis(reference[0].shape, labels.shape)
        if axis is None:
            raise InputError(f"labels of shape {list(labels.shape)} do not fit output {output_names[0]!r} of shape "
                             f"{list(reference[0].shape)} (expected [N] for [N, C], [N, T] for [N, T, C] or "
                             "[N, H, W] for [N, C, H, W]); drop the labels to gate by agreement with fp32")
        ref_hit = top1_hits(reference[0], labels, axis)
        cand_hit = top1_hits(candidate[0], labels, axis)
        ref_acc, cand_acc = float(ref_hit.mean()), float(cand_hit.mean())
        drop = round(ref_acc - cand_acc, 6)  # the gate decides on exactly what the manifest records
        per_sample = ref_hit.shape[1] == 1
        return AccuracyReport(
            metric="top1", eval_samples=n, reference_precision="fp32", reference=ref_acc,
            candidate_precision=candidate_precision, candidate=cand_acc, drop=drop,  # type: ignore[arg-type]
            max_drop=settings.max_accuracy_drop, passed=drop <= settings.max_accuracy_drop + 1e-9,
            outputs=outputs, drop_ci95=_drop_ci95(ref_hit[:, 0], cand_hit[:, 0]) if per_sample else None)
    worst = min(o.value for o in outputs)
    max_drop = round(1.0 - settings.min_agreement, 6)
    drop = round(1.0 - worst, 6)
    return AccuracyReport(
        metric="agreement", eval_samples=n, reference_precision="fp32", reference=1.0,
        candidate_precision=candidate_precision, candidate=1.0 - drop, drop=drop,  # type: ignore[arg-type]
        max_drop=max_drop, passed=drop <= max_drop + 1e-9, outputs=outputs)
