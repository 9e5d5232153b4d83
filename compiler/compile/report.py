"""The words a compile writes: the gate's verdict in one line, per-output figures, fallback notes, errors as one
line."""

from __future__ import annotations

from typing import Any

from ...protocol.manifest import AccuracyReport
from .candidates import Built


def fallback_note(b: Built) -> str | None:
    steps = b.quantization.fallback_steps if b.quantization is not None else ()
    if not steps:
        return None
    kept = len(b.quantization.float_nodes) if b.quantization is not None else 0
    if not b.accuracy.passed:
        return f"float fallback tried {len(steps) - 1} step(s): {steps[-1]}"
    wide = (next((s.split(": ", 1)[0] for s in steps[1:] if s.startswith("8-bit weights")), None)
            if b.quantization is not None and b.quantization.weight_bits == 8 else None)
    if wide is not None and steps[-1].startswith("8-bit weights"):
        return f"fallback: {wide}"
    return f"float fallback: {kept} layers kept in float" + (f", {wide.split(',')[0]}" if wide else "")


def task_figures(task: Any) -> str:
    """'exact_string_agreement 0.9688 (95% CI 0.84..0.99, needs >= 0.95), char_error_rate ...'"""
    parts = []
    for c in task.criteria:
        ci = f"95% CI {c.ci95[0]:.4f}..{c.ci95[1]:.4f}, " if c.ci95 else ""
        parts.append(f"{c.name.replace('_', ' ')} {c.value:.4f} ({ci}{'needs' if c.passed else 'FAILS'} "
                     f"{'>=' if c.kind == 'min' else '<='} {c.bound:.4f})")
    return ", ".join(parts)


def gate_summary(acc: AccuracyReport) -> str:
    rel = "<=" if acc.passed else ">"
    if acc.task is not None:
        return f"{acc.candidate_precision} judged as {acc.task.task} on {acc.task.output!r}: {task_figures(acc.task)}"
    if acc.metric == "agreement":
        worst = min(acc.outputs, key=lambda o: o.value)
        return (f"{acc.candidate_precision} agrees with {acc.reference_precision} at {acc.candidate:.4f} (worst "
                f"output {worst.name!r}, "
                f"{worst.metric.replace('_', ' ')}), shortfall {acc.drop:.4f} {rel} {acc.max_drop:.4f}")
    ci = f", 95% CI {acc.drop_ci95[0]:+.4f}..{acc.drop_ci95[1]:+.4f}" if acc.drop_ci95 else ""
    return (f"{acc.candidate_precision} top-1 {acc.candidate:.4f} vs {acc.reference_precision} {acc.reference:.4f}, "
            f"drop {acc.drop:.4f} {rel} {acc.max_drop:.4f} on {acc.eval_samples} samples{ci}")


def per_output_report(built: dict[str, Built]) -> str:
    lines = []
    for p, b in built.items():
        if b.quantization is not None and b.quantization.fallback_steps:
            lines += [f"\n  float fallback: {step}" for step in b.quantization.fallback_steps]
        for o in b.accuracy.outputs:
            t1 = "–" if o.top1_agreement is None else f"{o.top1_agreement:.4f}"
            lines.append(f"\n  {p} output {o.name!r}: top-1 agreement {t1}, cosine {o.cosine:.4f}, "
                         f"max abs error {o.max_abs_error:.4g}, mean abs error {o.mean_abs_error:.4g}")
    return "".join(lines)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An error as one line for a reason or a note: its type when the text does not say it (a KeyError's text is
    only the key), whitespace folded, at most ``limit`` characters."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (KeyError, IndexError, AssertionError)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
