"""Benchmark the passing candidates against fp32 and choose the precision that ships (:func:`choose_precision`
is the pure decision)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...judge.data import Dataset
from ...judge.predict import Runner
from ...protocol.cpu import cpu_arch, cpu_features
from ...protocol.manifest import BenchmarkPoint, PrecisionCandidate, PrecisionChoice
from ...protocol.profile import HardwareProfile
from ..advice import advice
from ..benchmark import benchmark_pair
from ..errors import AccuracyGateFailed
from .candidates import Built
from .plan import Plan
from .report import fallback_note, gate_summary, per_output_report


@dataclass(frozen=True)
class Measured:
    """What the precision choice looks at, per candidate."""

    precision: str
    passed: bool
    gate_note: str
    points: tuple[BenchmarkPoint, ...] = ()  # vs fp32; empty for fp32 itself or when not benchmarked


def geomean(points: tuple[BenchmarkPoint, ...]) -> float:
    return math.exp(sum(math.log(max(p.speedup, 1e-9)) for p in points) / len(points)) if points else 1.0


def _speed_phrase(precision: str, points: tuple[BenchmarkPoint, ...]) -> str:
    return (f"{precision} is " + " and ".join(f"{p.speedup:.2f}x at batch {p.batch_size}" for p in points)
            + " of fp32 on this model")


def choose_precision(measured: list[Measured], benchmarked: bool) -> tuple[str, str] | None:
    """Pure decision for ``--precision auto``: (chosen, reason), or None when nothing passed.

    ``measured`` is in order of preference (the profile's default precision first). With a benchmark
    the fastest passing candidate wins (fp32 counts as 1.0x, the geometric mean over the profile's
    batch sizes for the others; a tie keeps fp32); without one, the first that passes.
    """
    passing = [m for m in measured if m.passed]
    if not passing:
        return None
    if benchmarked:
        best = max(passing, key=lambda m: (1.0 if m.precision == "fp32" else geomean(m.points),
                                           m.precision == "fp32"))
    else:
        best = passing[0]
    others = []
    for m in measured:
        if m is best:
            continue
        if not m.passed:
            others.append(f"{m.precision} failed the accuracy gate ({m.gate_note})")
        elif benchmarked and m.precision != "fp32":
            others.append(_speed_phrase(m.precision, m.points))
    if best.precision == "fp32" and others:
        tail = ", though it passes the gate" if any(m.passed and m is not best for m in measured) else ""
        return "fp32", f"fp32: {'; '.join(others)}{tail}"
    why = f"passes the gate ({best.gate_note})"
    if benchmarked and best.precision != "fp32":
        why += f" and {_speed_phrase(best.precision, best.points)}"
    elif not benchmarked:
        why += "; not benchmarked" + (" (--no-benchmark)" if len(measured) > 1 else "")
    return best.precision, f"{best.precision}: {why}" + (f"; {'; '.join(others)}" if others else "")


def choose(plan: Plan, built: dict[str, Built], reference: Runner) -> tuple[PrecisionChoice, list[Built]]:
    """Benchmark the candidates against fp32 (CPU profiles this host can time) and choose: the precision choice
    the manifest records, and the passing candidates that ship beside the chosen one for the device to time."""
    opts, profile, notes = plan.opts, plan.profile, plan.notes
    if plan.given:
        return _as_given_choice(plan, built["int8"]), []
    cannot_time = _host_cannot_time(profile)
    benchmarked = opts.benchmark and profile.accelerator == "cpu" and cannot_time is None
    fp32_runner = built["fp32"].runner if "fp32" in built else reference
    to_bench = [b for b in built.values() if b.precision != "fp32" and (b.accuracy.passed or not plan.auto)]
    if benchmarked and to_bench:
        plan.progress(5, plan.total, f"benchmarking fp32 vs {' and '.join(b.precision for b in to_bench)} "
                                     "(alternating)")
        for b in to_bench:
            b.points = benchmark_points(fp32_runner, b.runner, plan.eval_set, profile)
    elif cannot_time is not None and opts.benchmark:
        plan.progress(5, plan.total, f"benchmark skipped: {cannot_time}")
    else:
        plan.progress(5, plan.total, "benchmark skipped" if not benchmarked else "fp32 only: nothing to compare")
    measured = [Measured(p, b.accuracy.passed, gate_summary(b.accuracy), b.points) for p, b in built.items()]
    first = plan.wanted[0]
    decided = choose_precision(measured, benchmarked) if plan.auto else (
        (first, f"{first}: asked for with --precision") if built[first].accuracy.passed else None)
    if decided is None:
        failed = "; ".join(gate_summary(b.accuracy) for b in built.values())
        raise AccuracyGateFailed(
            f"accuracy gate failed: {failed}; "
            + advice(built["int8"].accuracy if "int8" in built else next(iter(built.values())).accuracy,
                     plan.task, "n/a" if plan.target.qdq_int8_min_opset is None or "int8" not in built
                     else "tried" if opts.fallback else "off", profile.quantization.per_channel,
                     plan.causes() if plan.causes is not None else None)
            + per_output_report(built))
    chosen, reason = decided
    # the build host cannot time this profile's CPUs: every passing precision ships, the device times them
    passing = [b for b in built.values() if b.accuracy.passed]
    variants = passing[1:] if plan.auto and cannot_time is not None and len(passing) > 1 else []
    if variants:
        chosen = passing[0].precision
        reason = (f"device: {' and '.join(b.precision for b in passing)} pass the gate and {cannot_time}, so "
                  f"each device times them at install and serves the faster; {chosen} (the profile's "
                  f"default first) for an agent that does not time them; "
                  + "; ".join(gate_summary(b.accuracy) for b in passing))
    if notes:  # precisions the profile allows that could not be built here, and why
        why_not = "; ".join(f"{p} {n}" for p, n in notes.items())
        reason = f"{chosen}: {why_not}" if len(built) == 1 else f"{reason}; {why_not}"
    if plan.info.batching_note:  # how the model is served follows from its layout: say why
        reason = f"{reason}; {plan.info.batching_note}"
    choice = PrecisionChoice(
        mode="device" if variants else "auto" if plan.auto else "fixed", chosen=chosen, reason=reason,  # type: ignore[arg-type]
        candidates=tuple(
            [PrecisionCandidate(precision=p, top1=b.accuracy.candidate, drop=b.accuracy.drop,  # type: ignore[arg-type]
                                passed=b.accuracy.passed, speedup=b.points, metric=b.accuracy.metric,
                                note=fallback_note(b))
             for p, b in built.items()]
            + [PrecisionCandidate(precision=p, note=n) for p, n in notes.items()]))  # type: ignore[arg-type]
    return choice, variants


def _as_given_choice(plan: Plan, b: Built) -> PrecisionChoice:
    """The precision choice of a model that came quantized (``plan.given``): built as given, labelled int8, gated
    against the model itself and not benchmarked (nothing else was built to compare it with)."""
    gate_note = gate_summary(b.accuracy)
    if not b.accuracy.passed:
        raise AccuracyGateFailed(f"accuracy gate failed: {gate_note}; the model is {plan.given}, built as given and "
                                 "gated against itself" + per_output_report({"int8": b}))
    plan.progress(5, plan.total, "benchmark skipped: nothing to compare (the model is built as given)")
    reason = (f"int8: {plan.given}: built as given, no int8 build tried; gated against the model itself, as no FP32 "
              f"original is available to judge its quantization against ({gate_note}); not benchmarked (nothing "
              "else was built to compare it with)")
    if plan.notes:
        reason += "; " + "; ".join(f"{p} {n}" for p, n in plan.notes.items())
    if plan.info.batching_note:
        reason += f"; {plan.info.batching_note}"
    acc = b.accuracy
    return PrecisionChoice(
        mode="auto", chosen="int8", reason=reason, candidates=(
            PrecisionCandidate(precision="int8", top1=acc.candidate, drop=acc.drop, passed=acc.passed,
                               metric=acc.metric, note=f"{plan.given}: built as given, gated against itself"),
            *(PrecisionCandidate(precision=p, note=n) for p, n in plan.notes.items())))  # type: ignore[arg-type]


def _host_cannot_time(profile: HardwareProfile) -> str | None:
    """Why this host's timings say nothing about the profile's CPUs (None: they do): another architecture, or CPU
    features the profile promises that this host lacks (its kernels would not be the devices'). GPU profiles are
    not timed on the CPU at all."""
    if profile.accelerator != "cpu":
        return None
    if profile.arch != cpu_arch():
        return f"the build host is {cpu_arch()} while {profile.name} devices are {profile.arch}"
    missing = sorted(set(profile.cpu_features) - set(cpu_features()))
    if missing:
        return f"the build host lacks {', '.join(missing)}, which {profile.name} devices have"
    return None


def benchmark_points(reference: Runner, candidate: Runner, data: Dataset,
               profile: HardwareProfile) -> tuple[BenchmarkPoint, ...]:
    pts = []
    for bs in (1,) if data.per_sample else profile.benchmark.batch_sizes:
        (r50, r99), (c50, c99) = benchmark_pair(reference, candidate, data, bs, profile.benchmark.iterations,
                                                profile.benchmark.warmup)
        pts.append(BenchmarkPoint(batch_size=bs, reference_ms_p50=round(r50, 4), candidate_ms_p50=round(c50, 4),
                                  speedup=round(r50 / c50, 3) if c50 > 0 else 0.0, reference_ms_p99=round(r99, 4),
                                  candidate_ms_p99=round(c99, 4),
                                  candidate_items_per_s=round(bs * 1000 / c50, 1) if c50 > 0 else None))
    return tuple(pts)
