"""``edgefleet verify``: run a bundle on this machine's CPU exactly as an agent would, and compare.

A bundle is compiled once and runs on many CPUs. This loads it through the agent's own backend,
runs the agent's self-test on the bundle's sample (the figure an install report carries) and, given
a labelled evaluation set, measures top-1 on this CPU against the figure the compiler recorded. Without
labels, it reruns the gate's own metric (the task's, e.g. decoded-string agreement for CTC, or output
agreement) on every sample of that set (up to MAX_EVAL_SAMPLES), this CPU's engine against an fp32 reference
computed on the same samples: the bundle's fp32 engine (its own when it is fp32, or its fp32 variant), else the
fp32 source model given with ``reference`` (checked against the fp32 outputs the bundle recorded); with
neither it refuses, saying why, rather than judge on anything but the data it was given.
Run it on a target box, or under emulation (``as-cpu Haswell edgefleet verify ...``) to see what an
AVX2-only CPU computes. Nothing is installed and nothing leaves the machine.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...engines import Engine, load_bundle_engine
from ...judge.data import Dataset
from ...judge.gate import label_axis, top1_hits
from ...protocol import mqtt as proto
from ...protocol.bundle import extract_bundle, sha256_file
from ...protocol.cpu import cpu_arch, cpu_features
from ...protocol.errors import ConfigError
from ...protocol.manifest import AccuracyReport, Manifest
from ..errors import SelfTestFailed
from .selftest import self_test
from .store import StagedModel
from .trusted import check_cpu

__all__ = ["MAX_EVAL_SAMPLES", "VerifyResult", "verify_bundle"]

MAX_EVAL_SAMPLES = 4096  # samples of a label-free --eval set judged (the rest are left out, and the result says so)


@dataclass(frozen=True)
class VerifyResult:
    manifest: Manifest
    arch: str
    cpu_features: tuple[str, ...]
    cpu_ok: bool
    cpu_reason: str
    selftest: proto.SelfTestResult | None
    selftest_error: str | None
    top1: float | None  # on --eval, this CPU
    eval_samples: int | None
    gate: AccuracyReport | None = None  # --eval without labels: the gate's metric on it here vs an fp32 reference
    gate_reference: str | None = None  # what the gate compared with, e.g. "the bundle's fp32 engine"
    gate_note: str | None = None  # e.g. how many samples of the set were left out

    @property
    def recorded_top1(self) -> float:
        return self.manifest.accuracy.candidate

    @property
    def drop_vs_fp32(self) -> float | None:
        """Top-1 drop on this CPU against the build's fp32 figure; None unless the bundle was gated on
        labels (a bundle gated by agreement with fp32 has no labelled figure to compare with: its
        self-test compares every output with the build's instead)."""
        if self.top1 is None or self.manifest.accuracy.metric != "top1":
            return None
        return round(self.manifest.accuracy.reference - self.top1, 6)

    @property
    def computes_as_gated(self) -> bool:
        """This CPU computes what the bundle was gated on: self-test passes, top-1 stays in the gate."""
        if self.selftest is None:
            return False
        if self.gate is not None and not self.gate.passed:
            return False
        drop = self.drop_vs_fp32
        return drop is None or drop <= self.manifest.accuracy.max_drop + 1e-9

    @property
    def holds(self) -> bool:
        """The profile admits this CPU and the bundle computes here what it was gated on."""
        return self.cpu_ok and self.computes_as_gated

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.holds, "computes_as_gated": self.computes_as_gated,
            "bundle": f"{self.manifest.name} {self.manifest.version} {self.manifest.profile}",
            "precision": self.manifest.precision, "arch": self.arch, "cpu_features": list(self.cpu_features),
            "cpu_ok": self.cpu_ok, "cpu_reason": self.cpu_reason,
            "selftest": None if self.selftest is None else self.selftest.model_dump(mode="json"),
            "selftest_error": self.selftest_error, "top1": self.top1, "eval_samples": self.eval_samples,
            "recorded_top1": self.recorded_top1, "fp32_top1": self.manifest.accuracy.reference,
            "drop_vs_fp32": self.drop_vs_fp32, "max_drop": self.manifest.accuracy.max_drop,
            "gate": None if self.gate is None else self.gate.model_dump(mode="json"),
            "gate_reference": self.gate_reference, "gate_note": self.gate_note,
            "not_judged": list(self.manifest.accuracy.not_judged),
        }


def _load_eval(path: Path, manifest: Manifest) -> Dataset:
    """``--eval`` read as the compiler read its evaluation set (judge.data.load_for_model: one loader for both), the
    samples on the axes the compiler put them; with labels when it has a 'labels' array."""
    from ...judge.data import load_for_model
    from ...judge.errors import JudgeError

    try:
        with np.load(path, allow_pickle=False) as npz:
            has_labels = "labels" in npz.files
    except Exception:  # a folder of images, or a file load_for_model names the fault of
        has_labels = False
    try:
        return load_for_model(path, manifest.inputs, per_sample(manifest), need_labels=has_labels, what="--eval set",
                              preprocessing=manifest.preprocessing)
    except JudgeError as exc:
        raise ConfigError(str(exc)) from exc


def per_sample(manifest: Manifest) -> bool:
    """The engine takes one sample per call (no input has a batch axis): what the compiler's evaluation did."""
    return all(s.batch_axis is None for s in manifest.inputs)


def _top1(backend: Engine, manifest: Manifest, data: Dataset, batch: int) -> tuple[float, int]:
    """Top-1 of the first output against the data's labels, scored as the compiler's gate scores it."""
    from ...judge.predict import predict_all

    assert data.labels is not None
    labels = data.labels
    try:
        out = predict_all(backend.infer, data, batch, output_axes=[o.batch_axis for o in manifest.outputs])[0]
    except Exception as exc:  # the runtime's own error types: a shape the engine does not take
        raise ConfigError(f"the engine refused the evaluation set: {exc}") from exc
    axis = label_axis(out.shape, labels.shape) if isinstance(out, np.ndarray) else None
    if axis is None:
        raise ConfigError(f"labels of shape {list(labels.shape)} do not fit output {manifest.outputs[0].name!r} "
                          f"(expected [N] for [N, C], [N, T] for [N, T, C] or [N, H, W] for [N, C, H, W])")
    assert isinstance(out, np.ndarray)
    return float(top1_hits(out, labels, axis).mean()), len(labels)


def verify_bundle(bundle: Path, eval_path: Path | None = None, threads: int = 2,
                  batch: int = 64, skip_cpu_check: bool = False, precision: str | None = None,
                  reference: Path | None = None) -> VerifyResult:
    """``skip_cpu_check`` runs the bundle even on a CPU its profile does not admit (diagnostics: what
    would such a CPU compute?); the result still says the CPU check failed. ``precision``: which of the
    bundle's engines (its own, or a variant the device may choose) to verify; None: its own. ``reference``: the
    fp32 source model, to judge a label-free ``eval_path`` against when the bundle carries no fp32 engine."""
    feats = cpu_features()
    with tempfile.TemporaryDirectory(prefix="edgefleet-verify-") as tmp:
        manifest = whole = extract_bundle(bundle, Path(tmp))
        if precision is not None:
            try:
                manifest = manifest.as_variant(precision)
            except ValueError as exc:
                raise ConfigError(f"--precision {precision}: {exc}") from exc
        cpu = check_cpu(manifest.profile, manifest.cpu_features, feats)

        def result(st: proto.SelfTestResult | None = None, st_err: str | None = None, top1: float | None = None,
                   n: int | None = None) -> VerifyResult:
            return VerifyResult(manifest, cpu_arch(), tuple(sorted(feats)), cpu.action != "refuse", cpu.reason,
                                st, st_err, top1, n)

        if cpu.action == "refuse" and not skip_cpu_check:
            return result()
        backend = load_bundle_engine(manifest, Path(tmp) / manifest.engine, threads)
        gate: AccuracyReport | None = None
        against = note = None
        try:
            try:
                st, st_err = self_test(backend, StagedModel(manifest, Path(tmp), sha256_file(bundle))), None
            except SelfTestFailed as exc:
                st, st_err = None, str(exc)
            top1: float | None = None
            n: int | None = None
            if eval_path is not None:
                data = _load_eval(eval_path, manifest)
                if data.labels is None:
                    gate, against, note = _gate_on_data(backend, manifest, whole, Path(tmp), data, reference,
                                                        threads)
                else:
                    top1, n = _top1(backend, manifest, data, batch)
        finally:
            backend.close()
    return VerifyResult(manifest, cpu_arch(), tuple(sorted(feats)), cpu.action != "refuse", cpu.reason, st, st_err,
                        top1, n, gate, against, note)


def _recorded_reference(manifest: Manifest, selftest: Path) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The self-test sample's inputs and the fp32 source model's outputs on them (``reference:NAME``)."""
    try:
        with np.load(selftest, allow_pickle=False) as npz:
            if not all(f"reference:{s.name}" in npz.files for s in manifest.outputs):
                raise ConfigError(f"{manifest.name} {manifest.version}: the bundle carries no fp32 reference outputs "
                                  "(built by an older compiler), so --reference cannot be checked against it; give "
                                  "--eval an .npz with a 'labels' array, or rebuild the bundle")
            return ({s.name: npz[f"input:{s.name}"] for s in manifest.inputs},
                    [npz[f"reference:{s.name}"] for s in manifest.outputs])
    except (KeyError, ValueError, OSError) as exc:
        raise ConfigError(f"self-test sample {selftest.name} is unreadable: {exc}") from exc


def _fp32_reference(manifest: Manifest, whole: Manifest, folder: Path, reference: Path | None,
                    threads: int) -> tuple[Engine | None, str]:
    """The fp32 engine to judge ``engine`` against, and what it is: the engine itself when it is fp32 (None), the
    bundle's fp32 variant, or the source model ``reference`` once it reproduces the fp32 outputs the bundle
    recorded. Refuses (ConfigError) when there is none."""
    from ...engines import EngineError, EngineSpec
    from ...engines import load as load_engine

    if manifest.precision == "fp32":
        return None, "itself (the engine is fp32: the fp32 reference)"
    if "fp32" in whole.precisions and reference is None:
        fp32 = whole.as_variant("fp32")
        return load_bundle_engine(fp32, folder / fp32.engine, threads), "the bundle's fp32 engine"
    if reference is None:
        raise ConfigError(f"--eval has no 'labels' array, and the bundle ({manifest.precision}) carries no fp32 engine "
                          "to judge it against on those inputs: give --reference MODEL.onnx (the fp32 model it was "
                          "compiled from), or an --eval .npz with labels")
    if not reference.is_file():
        raise ConfigError(f"--reference {reference}: no such model file")
    spec = EngineSpec(manifest.inputs, manifest.outputs, "fp32", manifest.profile, f"the fp32 reference {reference}",
                      fixed_batch=manifest.fixed_batch)  # a source model fixed at that batch (compiler.batch)
    try:
        ref = load_engine("onnxruntime", reference, spec, threads)
    except EngineError as exc:
        raise ConfigError(f"--reference {reference}: {exc}") from exc
    feeds, recorded = _recorded_reference(manifest, folder / manifest.selftest)
    try:
        got = ref.infer(feeds)
    except EngineError as exc:
        ref.close()
        raise ConfigError(f"--reference {reference} does not take the bundle's inputs: {exc}") from exc
    for spec_out, a, b in zip(manifest.outputs, recorded, got, strict=True):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        tol = 1e-3 * (1.0 + float(np.abs(a64).max(initial=0.0)))
        if a.shape != b.shape or float(np.abs(a64 - b64).max(initial=0.0)) > tol:
            ref.close()
            raise ConfigError(f"--reference {reference} is not the model {manifest.name} {manifest.version} was "
                              f"compiled from: its output {spec_out.name!r} differs from the fp32 outputs the bundle "
                              "recorded on its self-test sample")
    return ref, f"the fp32 source model {reference.name}"


def _gate_on_data(engine: Engine, manifest: Manifest, whole: Manifest, folder: Path, data: Dataset,
                  reference: Path | None, threads: int) -> tuple[AccuracyReport, str, str | None]:
    """The gate's own metric on the samples of ``eval_path``: this CPU's engine against an fp32 reference computed on
    the same samples (:func:`_fp32_reference`), judged by the recorded task, or by output agreement with the recorded
    budget. The judge (the compiler's gate too) is numpy only: it imports no toolchain."""
    from ...engines import EngineError
    from ...judge.errors import JudgeError
    from ...judge.gate import GateSettings, evaluate_gate
    from ...judge.predict import predict_all
    from ...judge.tasks import TaskSpec

    note = None
    if len(data) > MAX_EVAL_SAMPLES:
        note = f"the first {MAX_EVAL_SAMPLES} of its {len(data)} samples judged"
        data = data.head(MAX_EVAL_SAMPLES)
    ref, against = _fp32_reference(manifest, whole, folder, reference, threads)
    out_axes = [o.batch_axis for o in manifest.outputs]
    try:
        try:
            got = predict_all(engine.infer, data, output_axes=out_axes)
            want = got if ref is None else predict_all(ref.infer, data, output_axes=out_axes)
        except EngineError as exc:
            raise ConfigError(f"the engines refused the --eval set: {exc}") from exc
    finally:
        if ref is not None:
            ref.close()
    acc = manifest.accuracy
    task = TaskSpec.from_report(acc.task) if acc.task is not None else None
    settings = GateSettings(kind="agreement", min_agreement=1.0 - acc.max_drop if acc.metric == "agreement" else 0.99)
    try:
        report = evaluate_gate([s.name for s in manifest.outputs], want, got, None, manifest.precision, settings, task)
    except JudgeError as exc:
        raise ConfigError(f"cannot judge the engine's outputs here: {exc}") from exc
    return report, against, note
