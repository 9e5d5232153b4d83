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
- **task**, when a task is given (:mod:`judge.tasks`: declared, from ``MODEL.task.yaml`` or inferred
  from the output shapes) and there are no labels for a classifier: the task's criteria decide (string
  agreement for CTC, box recall/precision for detection, ...); every output's tensor figures are
  still reported. The report's candidate is the score of the criterion with the least room, so
  ``drop <= max_drop`` holds exactly when every criterion does.

Outputs may be arrays with the samples on axis 0 or, when samples' shapes differ (dynamic spatial
dimensions evaluated one sample at a time), lists of per-sample arrays.

Pure functions of arrays: no I/O, no runtimes. The compiler's gate and ``edgefleet verify`` both decide here, so a
bundle is checked on a device exactly as it was gated at build time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..protocol.manifest import AccuracyReport, OutputAgreement
from .errors import InputError
from .tasks import Outputs, TaskSpec, judge, samples

__all__ = ["GateSettings", "evaluate_gate", "label_axis", "top1_hits", "uses_labels"]

GateKind = Literal["auto", "accuracy", "agreement"]
AgreementMetric = Literal["auto", "top1", "cosine"]


@dataclass(frozen=True)
class GateSettings:
    kind: GateKind = "auto"
    max_accuracy_drop: float = 0.01  # absolute top-1 drop vs fp32, with labels
    min_agreement: float = 0.99  # per output, without labels
    metric: AgreementMetric = "auto"
    # with a task: an output no task reads that changes by more than this (relative L2 against fp32) fails the gate;
    # None: measured and listed as not judged, not gated (the compiler sets it under --precision auto)
    max_unjudged_change: float | None = None


def label_axis(output_shape: tuple[int, ...], labels_shape: tuple[int, ...]) -> int | None:
    """The class axis of an output that ``labels`` index, or None if they do not fit."""
    if len(output_shape) == len(labels_shape) + 1:
        if output_shape[:1] + output_shape[2:] == labels_shape:
            return 1
        if output_shape[:-1] == labels_shape:
            return len(output_shape) - 1
    return None


def top1_hits(output: np.ndarray, labels: np.ndarray, axis: int) -> np.ndarray:
    """Per sample (rows) and position (columns): whether the arg-max along ``axis`` is the label."""
    return np.asarray(output.argmax(axis=axis) == labels).reshape(len(labels), -1)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    x, y = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    num = (x * y).sum(axis=1)
    den = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    both_zero = den == 0
    cos = np.where(both_zero, np.where(np.abs(x - y).max(axis=1) == 0, 1.0, 0.0), num / np.where(both_zero, 1, den))
    return float(cos.min(initial=1.0)) if len(cos) else 1.0


def _ragged_agreement(name: str, ref: list[np.ndarray], cand: list[np.ndarray]) -> OutputAgreement:
    """Per-sample figures of an output whose samples differ in shape (a sample whose shape changed counts
    as cosine 0 and is left out of the errors)."""
    if len(ref) != len(cand):
        raise InputError(f"output {name!r}: fp32 gave {len(ref)} samples, the candidate engine {len(cand)}")
    cos, errs, total = [], [], 0
    for r, c in zip(ref, cand, strict=True):
        if r.shape != c.shape:
            cos.append(0.0)
            continue
        cos.append(_cosine(r[None], c[None]))
        d = np.abs(r.astype(np.float64) - c.astype(np.float64))
        errs.append((float(d.max(initial=0.0)), float(d.sum())))
        total += d.size
    worst = min(cos) if cos else 1.0
    return OutputAgreement(name=name, metric="cosine", value=round(worst, 6), cosine=round(worst, 6),
                           max_abs_error=max((e[0] for e in errs), default=0.0),
                           mean_abs_error=sum(e[1] for e in errs) / total if total else 0.0)


def _agreement(name: str, ref: Outputs, cand: Outputs, metric: AgreementMetric) -> OutputAgreement:
    if isinstance(ref, list) or isinstance(cand, list):
        return _ragged_agreement(name, samples(ref), samples(cand))
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


def uses_labels(settings: GateSettings, labels: np.ndarray | None, task: TaskSpec | None) -> bool:
    """Whether the gate scores against labels (top-1 accuracy) rather than fp32's outputs."""
    if settings.kind != "auto":
        return settings.kind == "accuracy"
    return labels is not None and (task is None or task.name == "classification")


def evaluate_gate(output_names: list[str], reference: list[Outputs], candidate: list[Outputs],
                  labels: np.ndarray | None, candidate_precision: str, settings: GateSettings,
                  task: TaskSpec | None = None) -> AccuracyReport:
    """Gate ``candidate`` (the built engine's outputs on the evaluation set) against ``reference`` (fp32)."""
    outputs = tuple(_agreement(n, r, c, settings.metric) for n, r, c in zip(output_names, reference, candidate,
                                                                              strict=True))
    n = len(reference[0])
    if uses_labels(settings, labels, task):
        if labels is None:
            raise InputError("the accuracy gate needs a 'labels' array in the evaluation set; without labels the "
                             "build is gated by agreement with fp32 (--gate agreement)")
        ref0, cand0 = reference[0], candidate[0]
        if isinstance(ref0, list) or isinstance(cand0, list):
            raise InputError(f"output {output_names[0]!r} differs in shape from sample to sample: labels cannot be "
                             "scored against it; drop the labels to gate by agreement with fp32")
        axis = label_axis(ref0.shape, labels.shape)
        if axis is None:
            raise InputError(f"labels of shape {list(labels.shape)} do not fit output {output_names[0]!r} of shape "
                             f"{list(ref0.shape)} (expected [N] for [N, C], [N, T] for [N, T, C] or "
                             "[N, H, W] for [N, C, H, W]); drop the labels to gate by agreement with fp32")
        ref_hit = top1_hits(ref0, labels, axis)
        cand_hit = top1_hits(cand0, labels, axis)
        ref_acc, cand_acc = float(ref_hit.mean()), float(cand_hit.mean())
        drop = round(ref_acc - cand_acc, 6)  # the gate decides on exactly what the manifest records
        per_sample = ref_hit.shape[1] == 1
        return AccuracyReport(
            metric="top1", eval_samples=n, reference_precision="fp32", reference=ref_acc,
            candidate_precision=candidate_precision, candidate=cand_acc, drop=drop,  # type: ignore[arg-type]
            max_drop=settings.max_accuracy_drop, passed=drop <= settings.max_accuracy_drop + 1e-9,
            outputs=outputs, drop_ci95=_drop_ci95(ref_hit[:, 0], cand_hit[:, 0]) if per_sample else None,
            not_judged=tuple(output_names[1:]))
    if task is not None:
        return _task_gate(task, output_names, reference, candidate, candidate_precision, settings, outputs, n)
    worst = min(o.value for o in outputs)
    max_drop = round(1.0 - settings.min_agreement, 6)
    drop = round(1.0 - worst, 6)
    return AccuracyReport(
        metric="agreement", eval_samples=n, reference_precision="fp32", reference=1.0,
        candidate_precision=candidate_precision, candidate=1.0 - drop, drop=drop,  # type: ignore[arg-type]
        max_drop=max_drop, passed=drop <= max_drop + 1e-9, outputs=outputs)


def _task_gate(task: TaskSpec, output_names: list[str], reference: list[Outputs], candidate: list[Outputs],
               candidate_precision: str, settings: GateSettings, outputs: tuple[OutputAgreement, ...],
               n: int) -> AccuracyReport:
    i = output_names.index(task.output)
    report = judge(task, reference[i], candidate[i], settings.min_agreement,
                   dict(zip(output_names, zip(reference, candidate, strict=True), strict=True)),
                   settings.max_unjudged_change)

    def score(value: float, kind: str) -> float:  # every criterion as "higher is better" in [0, 1]
        return value if kind == "min" else round(1.0 - value, 6)

    deciding = min(report.criteria, key=lambda c: score(c.value, c.kind) - score(c.bound, c.kind))
    cand = score(deciding.value, deciding.kind)
    drop, max_drop = round(1.0 - cand, 6), round(1.0 - score(deciding.bound, deciding.kind), 6)
    return AccuracyReport(
        metric="agreement", eval_samples=n, reference_precision="fp32", reference=1.0,
        candidate_precision=candidate_precision, candidate=1.0 - drop, drop=drop,  # type: ignore[arg-type]
        max_drop=max_drop, passed=drop <= max_drop + 1e-9, outputs=outputs, task=report,
        not_judged=tuple(o for o in output_names if o not in task.reads()))
