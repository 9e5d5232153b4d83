"""compile: check -> build (quantize) -> accuracy gate -> benchmark -> bundle."""

from __future__ import annotations

import datetime as dt
import json
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
from compiler.errors import AccuracyGateFailed, InputError
from compiler.evaluate import benchmark_pair, top1
from compiler.graph import check_model
from compiler.targets import get_target
from protocol.bundle import sha256_file, write_bundle
from protocol.manifest import (
    MANIFEST_VERSION,
    AccuracyReport,
    BenchmarkPoint,
    BenchmarkReport,
    FileEntry,
    Manifest,
)
from protocol.profile import load_profile

__all__ = ["CompileOptions", "CompileResult", "compile_model"]

SELFTEST_SAMPLES = 8
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
    precision: str | None = None  # default: the profile's default_precision
    max_accuracy_drop: float | None = None  # default: the profile's accuracy.max_drop
    benchmark: bool = True


@dataclass(frozen=True)
class CompileResult:
    bundle: Path
    manifest: Manifest


def _noop(step: int, total: int, what: str) -> None:
    pass


def compile_model(opts: CompileOptions, progress: Progress = _noop) -> CompileResult:
    total = 7
    progress(1, total, f"loading profile {opts.profile}")
    profile = load_profile(opts.profile)
    precision = opts.precision or profile.default_precision
    if precision not in profile.precisions:
        raise InputError(f"profile {profile.name} supports {list(profile.precisions)}, not {precision!r}")
    max_drop = profile.accuracy.max_drop if opts.max_accuracy_drop is None else opts.max_accuracy_drop
    if not 0.0 <= max_drop <= 1.0:
        raise InputError(f"--max-accuracy-drop must be between 0 and 1, got {max_drop}")
    target = get_target(profile.backend)

    progress(2, total, f"checking graph {opts.model}")
    info = check_model(opts.model)
    eval_set = load_dataset(opts.eval, info.inputs, need_labels=True, what="evaluation set")
    calib: Dataset | None = None
    if precision == "int8":
        if opts.calibration is None:
            raise InputError("int8 needs a calibration set: pass --calibration FILE.npz")
        calib = load_dataset(opts.calibration, info.inputs, need_labels=False, what="calibration set")

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgefleet-build-", dir=opts.out_dir) as tmp:
        work = Path(tmp)
        engine = work / f"model{target.engine_suffix}"
        progress(3, total, f"building {profile.backend} {precision} engine")
        target.build(opts.model, info, precision, profile, calib, engine)

        progress(4, total, "measuring accuracy (reference fp32 vs candidate)")
        from compiler.targets.onnxruntime import OnnxRuntimeTarget

        reference = OnnxRuntimeTarget().runner(opts.model, profile)
        candidate = target.runner(engine, profile)
        ref_acc = top1(reference, eval_set)
        cand_acc = top1(candidate, eval_set)
        drop = round(ref_acc - cand_acc, 6)  # the gate decides on exactly what the manifest records
        report = AccuracyReport(
            metric="top1", eval_samples=len(eval_set), reference_precision="fp32", reference=ref_acc,
            candidate_precision=precision, candidate=cand_acc, drop=drop, max_drop=max_drop,
            passed=drop <= max_drop + 1e-9,
        )
        if not report.passed:
            raise AccuracyGateFailed(
                f"accuracy gate failed: {precision} top-1 {cand_acc:.4f} vs fp32 {ref_acc:.4f} "
                f"(drop {drop:.4f} > allowed {max_drop:.4f}); raise --max-accuracy-drop, give a more "
                "representative --calibration set, or compile with --precision fp32"
            )

        bench: BenchmarkReport | None = None
        if opts.benchmark:
            progress(5, total, "benchmarking (alternating reference and candidate)")
            pts = []
            for bs in profile.benchmark.batch_sizes:
                r, c = benchmark_pair(reference, candidate, eval_set, bs, profile.benchmark.iterations,
                                      profile.benchmark.warmup)
                pts.append(BenchmarkPoint(batch_size=bs, reference_ms_p50=round(r, 4), candidate_ms_p50=round(c, 4),
                                          speedup=round(r / c, 3) if c > 0 else 0.0))
            bench = BenchmarkReport(threads=profile.runtime.intra_op_threads,
                                    iterations=profile.benchmark.iterations, points=tuple(pts))
        else:
            progress(5, total, "benchmark skipped (--no-benchmark)")

        progress(6, total, "writing self-test sample")
        sample = eval_set.head(SELFTEST_SAMPLES)
        expected = candidate(sample.inputs)
        arrays: dict[str, Any] = {f"input:{k}": v for k, v in sample.inputs.items()}
        arrays.update({f"expected:{o.name}": e for o, e in zip(info.outputs, expected, strict=True)})
        np.savez(work / "selftest.npz", **arrays)

        progress(7, total, "writing bundle")
        files = {p.name: FileEntry(sha256=sha256_file(p), size_bytes=p.stat().st_size)
                 for p in (engine, work / "selftest.npz")}
        labels = info.metadata.get("edgefleet.labels")
        manifest = Manifest(
            manifest_version=MANIFEST_VERSION, name=opts.name, version=opts.version, profile=profile.name,
            backend=profile.backend, precision=precision,
            created_at=dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
            engine=engine.name, selftest="selftest.npz", inputs=info.inputs, outputs=info.outputs,
            files=files, accuracy=report, benchmark=bench,
            toolchain={"edgefleet": protocol.__version__, "python": sys.version.split()[0],
                       "platform": platform.machine(), **target.toolchain_versions()},
            labels=tuple(json.loads(labels)) if labels else None,
        )
        out = opts.out_dir / f"{opts.name}-{opts.version}-{profile.name}.tar"
        write_bundle(manifest, work, out)
    return CompileResult(bundle=out, manifest=manifest)
