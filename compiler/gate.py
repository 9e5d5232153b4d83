"""What to do when int8 fails the accuracy gate (the gate itself is :mod:`edgefleet.judge.gate`, shared with
``edgefleet verify``): advice in the compiler's own flags."""

from __future__ import annotations

from edgefleet.judge.gate import GateSettings, uses_labels
from edgefleet.judge.tasks import TaskSpec
from edgefleet.protocol.manifest import AccuracyReport

__all__ = ["MIN_ADVISED_CALIBRATION", "advice"]


MIN_ADVISED_CALIBRATION = 128  # fewer calibration samples than this: more is advice that can help


def advice(acc: AccuracyReport, task: TaskSpec | None, calibration_samples: int | None, fallback: str,
           per_channel: bool = True) -> str:
    """What to do when int8 failed the gate: only steps that can help, never a bound loosened to the figure just
    measured (that ships the damage the gate found). ``fallback`` is "off" (--no-fallback), "tried" or "n/a" (not an
    onnxruntime target). When nothing is left to try, it says plainly that no int8 engine keeps the answers."""
    steps = []
    if task is not None and task.source == "inferred" and not uses_labels(GateSettings(), None, task):
        steps.append(f"if the model is not a {task.name} model, declare its task (--task NAME; the gate judged it "
                     f"as {task.name}, inferred)")
    if calibration_samples is not None and calibration_samples < MIN_ADVISED_CALIBRATION:
        steps.append(f"calibrate on more representative inputs (--calibration with at least "
                     f"{MIN_ADVISED_CALIBRATION} samples; this build had {calibration_samples})")
    if fallback == "off":
        steps.append("drop --no-fallback (the compiler then keeps the layers that lose most to quantization in "
                     "float until the gate passes)")
    if not per_channel:
        steps.append("use a profile with quantization.per_channel: true (a range per output channel of each weight)")
    what = "the task's answers" if acc.task is not None else "fp32's accuracy" if acc.metric == "top1" else \
        "fp32's outputs"
    plain = (f"no int8 engine keeps {what}: ship fp32 (--precision fp32, or --precision auto, which ships fp32 "
             "and says why)")
    if not steps:
        return plain
    return "; ".join(steps) + f"; if none of that passes, {plain}"
