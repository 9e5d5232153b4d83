"""What to do when int8 fails the accuracy gate (the gate itself is :mod:`edgefleet.judge.gate`, shared with
``edgefleet verify``): the cause the compiler measured, and the step for that cause, in the compiler's own flags.

The causes (:func:`measure_causes`, each measured on this build, none assumed):

- **collapse**: int8's answers fall on at most half of the distinct classes fp32's do on the evaluation set (a
  structurally broken quantization: no calibration or bound brings the classes back);
- **uncovered range**: the evaluation inputs reach beyond the calibration inputs' range, so int8 clips them;
- **a few layers**: the sensitivity analysis (:mod:`compiler.sensitivity`) finds the loss in a few layers, which the
  float fallback keeps in float (advised only when it was turned off);
- **calibration size**: a second int8 build on half the calibration set, judged by the same gate; more samples are
  advised only when the full set's figure was clearly better than the half's (more samples moved it);
- **too few samples to judge**: the deciding figure's 95% interval holds the bound, so the evaluation set cannot tell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..judge.data import Dataset
from ..judge.gate import GateSettings, uses_labels
from ..judge.tasks import Outputs, TaskSpec, samples
from ..protocol.manifest import AccuracyReport

__all__ = ["Causes", "advice", "measure_causes"]

COLLAPSE_MIN_CLASSES = 4  # fp32 answering fewer distinct classes than this says nothing about a collapse
RANGE_SLACK = 0.1  # evaluation inputs beyond the calibration range by more than this share of its span: uncovered
MIN_CALIBRATION_GAIN = 0.005  # the full calibration set's figure over the half set's, at least (and a quarter of the
# shortfall): less is within what one build differs from another


@dataclass(frozen=True)
class Causes:
    """What the compiler measured about a failed int8 build (empty where nothing was measured or found)."""

    collapsed: tuple[int, int] | None = None  # distinct classes fp32 answers, int8 answers (int8 at most half)
    uncovered: str = ""  # the inputs whose evaluation values the calibration range does not cover
    layers: tuple[tuple[str, float], ...] = ()  # the layers that lose most to quantization (name, dB), worst first
    calibration: tuple[int, float, int, float] | None = None  # (half n, its shortfall, full n, its shortfall)
    undecided: str = ""  # why the evaluation set cannot tell (the deciding figure's interval holds its bound)


def _classes(out: Outputs) -> int:
    return len({int(np.asarray(x).reshape(-1, np.asarray(x).shape[-1]).argmax(axis=-1)[0]) for x in samples(out)})


def _uncovered(calib: Dataset, eval_set: Dataset) -> str:
    parts = []
    for name, c in calib.inputs.items():
        e = eval_set.inputs.get(name)
        if e is None or not np.issubdtype(c.dtype, np.floating) or not c.size or not e.size:
            continue
        lo, hi = float(c.min()), float(c.max())
        slack = RANGE_SLACK * max(hi - lo, 1e-12)
        if float(e.min()) < lo - slack or float(e.max()) > hi + slack:
            parts.append(f"input {name!r}: evaluation values {float(e.min()):.4g}..{float(e.max()):.4g}, calibration "
                         f"only {lo:.4g}..{hi:.4g}")
    return "; ".join(parts)


def _undecided(acc: AccuracyReport) -> str:
    if acc.task is not None:
        for c in acc.task.criteria:
            if not c.passed and c.ci95 is not None and c.ci95[0] - 1e-9 <= c.bound <= c.ci95[1] + 1e-9:
                return (f"{c.name.replace('_', ' ')} {c.value:.4f} has a 95% interval {c.ci95[0]:.4f}..{c.ci95[1]:.4f} "
                        f"that holds its bound {c.bound:.4f} on {acc.eval_samples} samples")
        return ""
    if acc.drop_ci95 is not None and acc.drop_ci95[0] <= acc.max_drop + 1e-9:
        return (f"the drop's 95% interval {acc.drop_ci95[0]:+.4f}..{acc.drop_ci95[1]:+.4f} holds the allowed "
                f"{acc.max_drop:.4f} on {acc.eval_samples} samples")
    return ""


def measure_causes(acc: AccuracyReport, task: TaskSpec | None, output: int, reference: list[Outputs],
                   candidate: list[Outputs], calib: Dataset | None, eval_set: Dataset,
                   rank: Callable[[], list[tuple[tuple[str, ...], float]]] | None,
                   rebuild: Callable[[Dataset], AccuracyReport] | None) -> Causes:
    """The causes of ``acc`` (a failed int8 gate) this build shows: ``output`` indexes the output the answers are in,
    ``reference``/``candidate`` every output of fp32 and of the int8 engine on ``eval_set``; ``rank`` runs the
    sensitivity analysis (None: not asked for, the float fallback ran); ``rebuild`` builds and gates int8 again on a
    calibration set (None: no trial)."""
    collapsed = None
    classification = (task is not None and task.name == "classification") or acc.metric == "top1"
    if classification:
        ref, cand = _classes(reference[output]), _classes(candidate[output])
        if ref >= COLLAPSE_MIN_CLASSES and cand * 2 <= ref:
            collapsed = (ref, cand)
    uncovered = _uncovered(calib, eval_set) if calib is not None else ""
    layers: tuple[tuple[str, float], ...] = ()
    if rank is not None and collapsed is None:
        try:
            layers = tuple((", ".join(group[:2]), db) for group, db in rank()[:3] if db > 0)
        except Exception:  # onnxruntime and onnx raise assorted types; the cause is then unknown
            layers = ()
    trial = None
    if rebuild is not None and calib is not None and collapsed is None and len(calib) >= 4:
        half = rebuild(calib.head(len(calib) // 2))
        trial = (len(calib) // 2, half.drop - half.max_drop, len(calib), acc.drop - acc.max_drop)
    return Causes(collapsed, uncovered, layers, trial, _undecided(acc))


def advice(acc: AccuracyReport, task: TaskSpec | None, fallback: str, per_channel: bool = True,
           causes: Causes | None = None) -> str:
    """What to do when int8 failed the gate: the cause measured and the step for it, never a bound loosened to the
    figure just measured (that ships the damage the gate found). ``fallback`` is "off" (--no-fallback), "tried" or
    "n/a" (not an onnxruntime target). When nothing is left to try, it says plainly that no int8 engine keeps the
    answers."""
    c = causes or Causes()
    what = "the task's answers" if acc.task is not None else "fp32's accuracy" if acc.metric == "top1" else \
        "fp32's outputs"
    plain = (f"no int8 engine keeps {what}: ship fp32 (--precision fp32, or --precision auto, which ships fp32 "
             "and says why)")
    steps = []
    if task is not None and task.source == "inferred" and not uses_labels(GateSettings(), None, task):
        steps.append(f"if the model is not a {task.name} model, declare its task (--task NAME; the gate judged it "
                     f"as {task.name}, inferred)")
    if c.collapsed is not None:
        ref, cand = c.collapsed
        broken = (f"int8's answers collapse to {cand} distinct classes where fp32 gives {ref} on the evaluation set, a "
                  "structurally broken quantization that more calibration samples do not mend")
        if fallback != "off":
            return f"{broken}; {plain}"
        steps.append(f"{broken}: drop --no-fallback (the compiler then keeps the layers that lose most to "
                     "quantization in float until the gate passes)")
    elif fallback == "off":
        named = ", ".join(f"{n} ({db:.1f} dB)" for n, db in c.layers)
        steps.append("drop --no-fallback (" + (f"the layers that lose most to quantization: {named}; " if named
                                               else "") + "the compiler then keeps the layers that lose most to "
                     "quantization in float until the gate passes)")
    if c.uncovered:
        steps.append(f"calibrate on inputs that cover the range the model is served ({c.uncovered}): --calibration "
                     "with samples drawn like the evaluation set's")
    if c.calibration is not None:
        half_n, half_gap, n, gap = c.calibration
        if half_gap - gap >= max(MIN_CALIBRATION_GAIN, 0.25 * gap):
            steps.append(f"calibrate on more samples (--calibration with at least {2 * n} samples: a trial on {half_n} "
                         f"fell short of the bound by {half_gap:.4f}, the {n} given by {gap:.4f})")
    if c.undecided:
        steps.append(f"judge on more samples (--eval with at least {4 * acc.eval_samples} samples: {c.undecided}, so "
                     "this evaluation set cannot tell)")
    if not per_channel:
        steps.append("use a profile with quantization.per_channel: true (a range per output channel of each weight)")
    if not steps:
        return plain
    return "; ".join(steps) + f"; if none of that passes, {plain}"
