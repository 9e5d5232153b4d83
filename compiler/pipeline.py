"""compile: check -> build each candidate precision -> accuracy gate -> benchmark -> choose -> bundle.

``precision="auto"`` (the default) builds the profile's quantized precision and fp32, gates the
quantized one, benchmarks both alternating in one run on the profile's batch sizes, and keeps the
fastest that passes the gate. A quantized engine that is slower than fp32 (small models, where
quantize/dequantize costs more than the integer arithmetic saves) is not shipped by default.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import protocol
from compiler.data import Dataset, load_dataset
from compiler.errors import AccuracyGateFailed, InputError, ToolchainError
from compiler.evaluate import benchmark_pair, top1
from compiler.graph import GraphInfo, check_model
from compiler.targets import get_target
from compiler.targets.base import BuildTarget, Runner
from protocol.bundle import sha256_file, write_bundle
from protocol.cpu import cpu_arch, cpu_features, u8s8_saturates
from protocol.manifest import (
    MANIFEST_VERSION,
    AccuracyReport,
    BenchmarkPoint,
    BenchmarkReport,
    BuildHost,
    FileEntry,
    Manifest,
    PrecisionCandidate,
    PrecisionChoice,
    QuantizationInfo,
    SelfTestSummary,
)
from protocol.profile import HardwareProfile, load_profile

__all__ = ["CompileOptions", "CompileResult", "choose_precision", "compile_model"]

SELFTEST_MAX_SAMPLES = 64
SELFTEST_MAX_INPUT_BYTES = 1 << 20  # the sample travels in every bundle: keep it small for big inputs
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class CompileOptions:
    model: Path
    profile: str
    calibration: Path | None
    eval: Path
    out_dir: Path
    name: str
    version: str
    precision: str = "auto"  # "auto", or one of the profile's precisions
    max_accuracy_drop: float | None = None  # default: the profile's accuracy.max_drop
    benchmark: bool = True


@dataclass(frozen=True)
class CompileResult:
    bundle: Path
    manifest: Manifest


@dataclass
class _Built:
    precision: str
    engine: Path
    runner: Runner
    quantization: QuantizationInfo | None
    accuracy: AccuracyReport
    points: tuple[BenchmarkPoint, ...] = ()


def _noop(step: int, total: int, what: str) -> None:
    pass


def _geomean(points: tuple[BenchmarkPoint, ...]) -> float:
    return math.exp(sum(math.log(max(p.speedup, 1e-9)) for p in points) / len(points))


def _speed_phrase(precision: str, points: tuple[BenchmarkPoint, ...]) -> str:
    return f"{precision} is " + " and ".join(f"{p.speedup:.2f}x at batch {p.batch_size}" for p in points) \
        + " of fp32 on this model"


def choose_precision(quantized: str, passed: bool, gate_note: str,
                     points: tuple[BenchmarkPoint, ...] | None) -> tuple[str, str]:
    """Pure decision for ``--precision auto``: (chosen, reason).

    ``points`` are the quantized engine's speedups over fp32 (None: not benchmarked). The quantized
    engine is kept when it passes the gate and is faster than fp32 (geometric mean over the
    profile's batch sizes); without a benchmark it is kept when it passes the gate.
    """
    if not passed:
        return "fp32", f"fp32: {quantized} failed the accuracy gate ({gate_note})"
    if points is None:
        return quantized, f"{quantized}: passes the gate ({gate_note}); not benchmarked (--no-benchmark)"
    if _geomean(points) > 1.0:
        return quantized, f"{quantized}: passes the gate ({gate_note}) and {_speed_phrase(quantized, points)}"
    return "fp32", f"fp32: {_speed_phrase(quantized, points)}, though it passes the gate ({gate_note})"


def compile_model(opts: CompileOptions, progress: Progress = _noop) -> CompileResult:
    total = 7
    progress(1, total, f"loading profile {opts.profile}")
    profile = load_profile(opts.profile)
    auto = opts.precision == "auto"
    if not auto and opts.precision not in profile.precisions:
        raise InputError(f"profile {profile.name} supports {list(profile.precisions)} or 'auto', "
                         f"not {opts.precision!r}")
    max_drop = profile.accuracy.max_drop if opts.max_accuracy_drop is None else opts.max_accuracy_drop
    if not 0.0 <= max_drop <= 1.0:
        raise InputError(f"--max-accuracy-drop must be between 0 and 1, got {max_drop}")
    target = get_target(profile.backend)

    progress(2, total, f"checking graph {opts.model}")
    info = check_model(opts.model)
    eval_set = load_dataset(opts.eval, info.inputs, need_labels=True, what="evaluation set")
    # auto: the profile's quantized precision against fp32, when the profile has both
    quantized = next((p for p in profile.precisions if p != "fp32"), None)
    if auto:
        wanted = [p for p in (quantized, "fp32") if p is not None and p in profile.precisions]
    else:
        wanted = [opts.precision]
    notes: dict[str, str] = {}
    calib: Dataset | None = None
    if "int8" in wanted and (why_not := _host_cannot_gate_int8(profile)):
        if not (auto and len(wanted) > 1):
            raise ToolchainError(f"cannot build int8 for {profile.name} here: {why_not}")
        wanted.remove("int8")
        notes["int8"] = f"not built: {why_not}"
    if "int8" in wanted:
        if opts.calibration is not None:
            calib = load_dataset(opts.calibration, info.inputs, need_labels=False, what="calibration set")
        elif auto and len(wanted) > 1:
            wanted.remove("int8")
            notes["int8"] = "not built: no --calibration set given"
        else:
            raise InputError("int8 needs a calibration set: pass --calibration FILE.npz")

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgefleet-build-", dir=opts.out_dir) as tmp:
        work = Path(tmp)
        progress(3, total, "measuring the fp32 reference accuracy")
        from compiler.targets.onnxruntime import OnnxRuntimeTarget

        reference = OnnxRuntimeTarget().runner(opts.model, profile)
        ref_acc = top1(reference, eval_set)
        progress(4, total, f"building and gating {profile.backend} {' and '.join(wanted)}")
        built: dict[str, _Built] = {}
        for precision in wanted:
            built[precision] = _build_and_gate(target, opts.model, info, precision, profile, calib, work,
                                               eval_set, reference, ref_acc, max_drop)

        if auto and quantized in built and "fp32" in built:
            q = built[quantized]
            if opts.benchmark and q.accuracy.passed:
                progress(5, total, f"benchmarking fp32 vs {quantized} (alternating)")
                q.points = _benchmark(reference, q.runner, eval_set, profile)
            else:
                progress(5, total, "benchmark skipped")
            chosen, reason = choose_precision(quantized, q.accuracy.passed, _gate_note(q.accuracy),
                                              q.points if opts.benchmark else None)
        else:
            chosen = wanted[0]
            b = built[chosen]
            if not b.accuracy.passed:
                raise AccuracyGateFailed(
                    f"accuracy gate failed: {_gate_note(b.accuracy)}; raise --max-accuracy-drop, give a more "
                    "representative --calibration set, or compile with --precision fp32 (or auto)")
            reason = (f"{chosen}: the only precision the profile allows" if auto
                      else f"{chosen}: asked for with --precision")
            if auto and quantized is not None and quantized not in built:
                reason = f"{chosen}: {quantized} {notes.get(quantized, 'not built')}"
            if opts.benchmark and chosen != "fp32":
                progress(5, total, f"benchmarking fp32 vs {chosen} (alternating)")
                b.points = _benchmark(reference, b.runner, eval_set, profile)
            else:
                progress(5, total, "benchmark skipped" if not opts.benchmark else "fp32: nothing to compare")
        best = built[chosen]
        choice = PrecisionChoice(
            mode="auto" if auto else "fixed", chosen=chosen, reason=reason,  # type: ignore[arg-type]
            candidates=tuple(
                [PrecisionCandidate(precision=p, top1=b.accuracy.candidate, drop=b.accuracy.drop,  # type: ignore[arg-type]
                                    passed=b.accuracy.passed, speedup=b.points) for p, b in built.items()]
                + [PrecisionCandidate(precision=p, note=n) for p, n in notes.items()]))  # type: ignore[arg-type]

        bench: BenchmarkReport | None = None
        compared = next((b for b in built.values() if b.points), None)
        if compared is not None:
            bench = BenchmarkReport(threads=profile.runtime.intra_op_threads, iterations=profile.benchmark.iterations,
                                    points=compared.points, candidate_precision=compared.precision)  # type: ignore[arg-type]

        progress(6, total, "writing self-test sample")
        sample = _selftest_sample(eval_set)
        expected = best.runner(sample.inputs)
        arrays: dict[str, Any] = {f"input:{k}": v for k, v in sample.inputs.items()}
        arrays.update({f"expected:{o.name}": e for o, e in zip(info.outputs, expected, strict=True)})
        sample_top1 = None
        if sample.labels is not None:
            arrays["labels"] = sample.labels
            if expected[0].ndim == 2:
                sample_top1 = float((expected[0].argmax(axis=1) == sample.labels).mean())
        np.savez_compressed(work / "selftest.npz", **arrays)

        progress(7, total, "writing bundle")
        engine = best.engine.rename(work / f"model{target.engine_suffix}")  # a stable name in every bundle
        files = {p.name: FileEntry(sha256=sha256_file(p), size_bytes=p.stat().st_size)
                 for p in (engine, work / "selftest.npz")}
        labels = info.metadata.get("edgefleet.labels")
        manifest = Manifest(
            manifest_version=MANIFEST_VERSION, name=opts.name, version=opts.version, profile=profile.name,
            backend=profile.backend, precision=chosen,  # type: ignore[arg-type]
            created_at=dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
            engine=engine.name, selftest="selftest.npz", inputs=info.inputs, outputs=info.outputs,
            files=files, accuracy=best.accuracy, benchmark=bench,
            toolchain={"edgefleet": protocol.__version__, "python": sys.version.split()[0],
                       "platform": platform.machine(), **target.toolchain_versions()},
            labels=tuple(json.loads(labels)) if labels else None,
            cpu_features=profile.cpu_features, quantization=best.quantization,
            build_host=BuildHost(arch=cpu_arch(), cpu_features=tuple(sorted(cpu_features()))),
            precision_choice=choice,
            selftest_summary=SelfTestSummary(samples=len(sample), top1=sample_top1),
            engine_compatibility=target.engine_compatibility(),
        )
        out = opts.out_dir / f"{opts.name}-{opts.version}-{profile.name}.tar"
        write_bundle(manifest, work, out)
    return CompileResult(bundle=out, manifest=manifest)


def _host_cannot_gate_int8(profile: HardwareProfile) -> str | None:
    """The gate runs the engine on the build host, so the host must compute what the profile's CPUs
    compute. Reduced-range and u8u8 engines compute exactly everywhere; full-range u8s8 (VNNI
    profiles) saturates on an AVX2 host without VNNI, which would gate numbers no device computes."""
    if profile.arch != "x86_64" or cpu_arch() != "x86_64" or profile.backend != "onnxruntime":
        return None
    if profile.int8_scheme()[0] in ("u8s8", "s8s8") and u8s8_saturates():
        return (f"the build host has AVX2 without VNNI, where full-range int8 saturates, so the accuracy gate "
                f"would measure numbers no {profile.name} device computes; build {profile.name} on a CPU "
                "with avx512_vnni (or one without AVX2)")
    return None


def _gate_note(acc: AccuracyReport) -> str:
    rel = "<=" if acc.passed else ">"
    return (f"{acc.candidate_precision} top-1 {acc.candidate:.4f} vs fp32 {acc.reference:.4f}, "
            f"drop {acc.drop:.4f} {rel} {acc.max_drop:.4f}")


def _build_and_gate(target: BuildTarget, model: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
                    calib: Dataset | None, work: Path, eval_set: Dataset, reference: Runner, ref_acc: float,
                    max_drop: float) -> _Built:
    engine = work / f"model-{precision}{target.engine_suffix}"
    quant = target.build(model, info, precision, profile, calib if precision == "int8" else None, engine)
    runner = target.runner(engine, profile)
    acc = ref_acc if precision == "fp32" and target.backend == "onnxruntime" else top1(runner, eval_set)
    drop = round(ref_acc - acc, 6)  # the gate decides on exactly what the manifest records
    report = AccuracyReport(
        metric="top1", eval_samples=len(eval_set), reference_precision="fp32", reference=ref_acc,
        candidate_precision=precision, candidate=acc, drop=drop, max_drop=max_drop,  # type: ignore[arg-type]
        passed=drop <= max_drop + 1e-9)
    return _Built(precision, engine, runner, quant, report)


def _benchmark(reference: Runner, candidate: Runner, data: Dataset,
               profile: HardwareProfile) -> tuple[BenchmarkPoint, ...]:
    pts = []
    for bs in profile.benchmark.batch_sizes:
        r, c = benchmark_pair(reference, candidate, data, bs, profile.benchmark.iterations, profile.benchmark.warmup)
        pts.append(BenchmarkPoint(batch_size=bs, reference_ms_p50=round(r, 4), candidate_ms_p50=round(c, 4),
                                  speedup=round(r / c, 3) if c > 0 else 0.0))
    return tuple(pts)


def _selftest_sample(data: Dataset) -> Dataset:
    """Up to 64 evaluation samples, fewer when the inputs are big (at least one)."""
    per_sample = sum(v[:1].nbytes for v in data.inputs.values()) or 1
    return data.head(max(1, min(SELFTEST_MAX_SAMPLES, SELFTEST_MAX_INPUT_BYTES // per_sample)))
