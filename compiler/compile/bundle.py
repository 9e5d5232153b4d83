"""Writing the bundle: the self-test samples and the manifest (with its drift reference and build notes), packed
with the chosen engine and its variants."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ... import protocol
from ...judge.data import Dataset
from ...judge.predict import Runner
from ...protocol.bundle import sha256_file, write_bundle
from ...protocol.cpu import cpu_arch, cpu_features
from ...protocol.drift import DriftReference, build_reference, reference_args
from ...protocol.manifest import (
    DRIFT_VERSION,
    JUDGED_VERSION,
    TASK_GATE_VERSION,
    VARIANTS_VERSION,
    BenchmarkReport,
    BuildHost,
    EngineVariant,
    FileEntry,
    Manifest,
    SelfTestSummary,
)
from .. import bf16 as _bf16
from ..buildnotes import with_build_notes
from ..graph import GraphInfo
from .candidates import Built, CompileEngines
from .choose import choose
from .options import SELFTEST_MAX_BYTES, SELFTEST_MAX_INPUT_BYTES, SELFTEST_MAX_SAMPLES
from .plan import Plan
from .report import one_line


def make_bundle(plan: Plan, engines: CompileEngines, work: Path, built: dict[str, Built], reference: Runner,
            ref_out: list[Any]) -> Manifest:
    """Choose, write the self-test samples and the manifest, and pack the bundle at ``plan.out``."""
    opts, profile, info, target, task = plan.opts, plan.profile, plan.info, plan.target, plan.task
    choice, variants = choose(plan, built, reference)
    chosen = choice.chosen
    best = built[chosen]
    bench: BenchmarkReport | None = None
    compared = best if best.points else next((b for b in built.values() if b.points), None)
    if compared is not None:
        bench = BenchmarkReport(threads=profile.runtime.intra_op_threads, iterations=profile.benchmark.iterations,
                                points=compared.points, candidate_precision=compared.precision)  # type: ignore[arg-type]

    plan.progress(6, plan.total, "writing self-test sample")
    sample, expected = _write_selftest(plan.eval_set, best.runner, reference, info, work / "selftest.npz")
    sample_top1 = _sample_top1(sample, expected)

    plan.progress(7, plan.total, "writing bundle")
    suffix = engines.runtime.suffix
    engine = best.engine.rename(work / f"model{suffix}")  # a stable name in every bundle
    shipped = [engine, work / "selftest.npz"]
    variant_entries = []
    for b in variants:  # each with its own engine and self-test sample (its outputs differ from the others')
        v_engine = b.engine.rename(work / f"model-{b.precision}{suffix}")
        v_sample, v_expected = _write_selftest(plan.eval_set, b.runner, reference, info,
                                               work / f"selftest-{b.precision}.npz")
        shipped += [v_engine, work / f"selftest-{b.precision}.npz"]
        variant_entries.append(EngineVariant(
            precision=b.precision, engine=v_engine.name, selftest=f"selftest-{b.precision}.npz",  # type: ignore[arg-type]
            accuracy=b.accuracy, quantization=b.quantization,
            selftest_summary=SelfTestSummary(samples=len(v_sample), top1=_sample_top1(v_sample, v_expected))))
    files = {p.name: FileEntry(sha256=sha256_file(p), size_bytes=p.stat().st_size) for p in shipped}
    labels = info.metadata.get("edgefleet.labels")
    manifest = Manifest(
        manifest_version=_bf16.manifest_version(  # the lowest that carries it
            JUDGED_VERSION if any(b.accuracy.not_judged or (b.accuracy.task is not None and b.accuracy.task.task ==
                                  "keypoints") for b in (best, *variants))
            else VARIANTS_VERSION if variants else TASK_GATE_VERSION if best.accuracy.task is not None else 2,
            [chosen, *(b.precision for b in variants)]),
        name=opts.name, version=opts.version, profile=profile.name,
        backend=profile.backend, precision=chosen,  # type: ignore[arg-type]
        created_at=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        engine=engine.name, selftest="selftest.npz", inputs=info.inputs, outputs=info.outputs,
        files=files, accuracy=best.accuracy, benchmark=bench,
        toolchain={"edgefleet": protocol.__version__, "python": sys.version.split()[0],
                   "platform": platform.machine(), "source_opset": str(info.opset),
                   **target.toolchain_versions(),
                   **_bf16.toolchain_versions([chosen, *(b.precision for b in variants)], profile)},
        labels=tuple(json.loads(labels)) if labels else None,
        cpu_features=profile.cpu_features, quantization=best.quantization,
        build_host=BuildHost(arch=cpu_arch(), cpu_features=tuple(sorted(cpu_features()))),
        precision_choice=choice,
        selftest_summary=SelfTestSummary(samples=len(sample), top1=sample_top1),
        engine_compatibility=target.engine_compatibility(),
        preprocessing=plan.prep,
        variants=tuple(variant_entries),
    )
    manifest = with_drift(manifest, lambda: build_reference(
        task.name, task.output, ref_out[[o.name for o in info.outputs].index(task.output)], sure=task.sure,
        **reference_args(task.name, task.arg)), lambda why: plan.progress(7, plan.total, f"note: {why}"))
    manifest = with_build_notes(manifest, info.fixed_batch)  # every retry, fallback and workaround, named
    write_bundle(manifest, work, plan.out)
    return manifest


def with_drift(manifest: Manifest, reference: Callable[[], DriftReference], note: Callable[[str], None]) -> Manifest:
    """``manifest`` carrying the drift reference ``reference()`` makes from the fp32 answers on the evaluation set
    (for the agents' sketches and the fleet's drift score, protocol.drift), its version raised to carry it; answers
    its task cannot read: ``manifest`` as it was, and ``note`` says why (the bundle ships without drift)."""
    try:
        drift = reference()
        return Manifest.model_validate({**manifest.model_dump(), "drift": drift,
                                        "manifest_version": max(manifest.manifest_version, DRIFT_VERSION)})
    except (ValueError, LookupError) as exc:  # KeyError: a task drift does not read (keypoints)
        note(f"no drift reference: {one_line(exc)}")
        return manifest


def _write_selftest(data: Dataset, runner: Runner, reference: Runner, info: GraphInfo,
                    path: Path) -> tuple[Dataset, list[np.ndarray]]:
    """The self-test sample: up to 64 evaluation samples with the engine's outputs (``expected:NAME``) and the
    fp32 source model's (``reference:NAME``, which ``edgefleet verify`` judges the engine against with the gate's
    own metric), compressed, halved until the file is at most SELFTEST_MAX_BYTES (one sample for a model that
    takes one per call; one sample is kept even if it alone is larger)."""
    n = 1 if data.per_sample else len(_selftest_sample(data))
    with_reference = True
    while True:
        sample = data.head(n)
        expected = runner(sample.inputs)
        arrays: dict[str, Any] = {f"input:{k}": v for k, v in sample.inputs.items()}
        arrays.update({f"expected:{o.name}": e for o, e in zip(info.outputs, expected, strict=True)})
        if with_reference:
            arrays.update({f"reference:{o.name}": r for o, r in zip(info.outputs, reference(sample.inputs),
                                                                     strict=True)})
        if sample.labels is not None:
            arrays["labels"] = sample.labels
        np.savez_compressed(path, **arrays)
        if path.stat().st_size <= SELFTEST_MAX_BYTES or (n == 1 and not with_reference):
            return sample, expected
        if n == 1:  # one sample with its fp32 reference is too big: keep the sample, drop the reference
            with_reference = False
        n = max(1, n // 2)


def _sample_top1(sample: Dataset, expected: list[np.ndarray]) -> float | None:
    if sample.labels is not None and expected[0].ndim == 2 and sample.labels.shape == expected[0].shape[:1]:
        return float((expected[0].argmax(axis=1) == sample.labels).mean())
    return None


def _selftest_sample(data: Dataset) -> Dataset:
    """Up to 64 evaluation samples, fewer when the inputs are big (at least one)."""
    per_sample = sum(v.nbytes for v in data.take(0, 1).values()) or 1
    return data.head(max(1, min(SELFTEST_MAX_SAMPLES, SELFTEST_MAX_INPUT_BYTES // per_sample)))
