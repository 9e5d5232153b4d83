"""compile: check -> build each candidate precision -> gate -> benchmark -> choose -> bundle.

``precision="auto"`` (the default) builds every precision the profile allows, gates each against
FP32 (accuracy with labels, output agreement without; see :mod:`judge.gate`), benchmarks each
against FP32 alternating in one run on the profile's batch sizes (CPU profiles), and keeps the
fastest that passes the gate. A quantized engine that is slower than FP32 (small models, where
quantize/dequantize costs more than the integer arithmetic saves) is not shipped by default.

A model that is quantized already (:func:`graph.quantized_ops`: QDQ pairs, QLinear* ops, onnxruntime's dynamic
quantization) is never quantized again: ``auto`` builds it as given (the target's float build, which leaves its
quantized nodes as they are), labelled int8 since it computes with integer kernels, and gates it against the model
itself; no FP32 original is there to judge its quantization against, and every note says so. An explicit
precision is refused (exit 4): the original float model is what to give.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet import protocol
from edgefleet.compiler import bf16 as _bf16
from edgefleet.compiler.buildnotes import collecting, note, with_build_notes
from edgefleet.compiler.cache import BuildCache
from edgefleet.compiler.errors import AccuracyGateFailed, CompilerError, InputError, ToolchainError
from edgefleet.compiler.evaluate import benchmark_pair
from edgefleet.compiler.gate import Causes, advice, measure_causes
from edgefleet.compiler.graph import (
    GraphInfo,
    check_model,
    ensure_opset,
    probe_batching,
    quantized_ops,
    quantized_phrase,
)
from edgefleet.compiler.source import source_model
from edgefleet.compiler.targets import get_target
from edgefleet.compiler.targets.base import BuildTarget
from edgefleet.engines import Engine, EngineError, EngineInputError, EngineSpec, Runtime, record
from edgefleet.engines import load as load_engine
from edgefleet.engines.onnxruntime import CPU
from edgefleet.judge.data import Dataset, load_for_model
from edgefleet.judge.errors import InputError as JudgeInputError
from edgefleet.judge.errors import JudgeError
from edgefleet.judge.gate import GateSettings, evaluate_gate, uses_labels
from edgefleet.judge.predict import Runner, predict_all
from edgefleet.judge.tasks import TaskSpec, infer_task, judge, parse_tasks, resolve_task
from edgefleet.protocol.bundle import sha256_file, write_bundle
from edgefleet.protocol.cpu import cpu_arch, cpu_features, u8s8_saturates
from edgefleet.protocol.drift import DriftReference, build_reference, reference_args
from edgefleet.protocol.manifest import (
    DRIFT_VERSION,
    JUDGED_VERSION,
    MANIFEST_VERSION,
    NAME_RE,
    TASK_GATE_VERSION,
    VARIANTS_VERSION,
    VERSION_RE,
    AccuracyReport,
    BenchmarkPoint,
    BenchmarkReport,
    BuildHost,
    EngineVariant,
    FileEntry,
    Int8Scheme,
    Manifest,
    PrecisionCandidate,
    PrecisionChoice,
    QuantizationInfo,
    SelfTestSummary,
)
from edgefleet.protocol.preprocess import Preprocessing, default_preprocessing, load_preprocessing
from edgefleet.protocol.profile import HardwareProfile, load_profile, resolve_profile_path

__all__ = ["CompileOptions", "CompileResult", "Measured", "choose_precision", "compile_model", "with_drift"]

SELFTEST_MAX_SAMPLES = 64
SELFTEST_MAX_INPUT_BYTES = 1 << 20  # the sample travels in every bundle: keep it small for big inputs
SELFTEST_MAX_BYTES = 1 << 20  # the compressed self-test file, inputs and expected outputs together
MIN_CALIBRATION_SAMPLES = 16  # fewer gives activation ranges from a handful of inputs
# auto: an int8 engine whose output no task reads ships only when that output keeps to this relative L2 against fp32
# (40 dB SQNR: about one 8-bit step of a range twice the output's RMS); nothing judges what a larger change does
UNJUDGED_MAX_REL_L2 = 1e-2
REFERENCE_RUNTIME = "onnxruntime"  # runs the fp32 source model (ONNX) on the build host's CPU: the reference
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
    gate: str = "auto"  # "auto" (accuracy with labels, agreement without), "accuracy", "agreement"
    min_agreement: float | None = None  # default: the profile's accuracy.min_agreement
    agreement_metric: str = "auto"  # "auto", "top1" or "cosine" (embeddings)
    cache_dir: Path | None = None  # reuse a bundle built from identical inputs (compiler.cache); None: always build
    preprocess: Path | None = None  # preprocess.yaml: how images become the input (default: from the input shape)
    fallback: bool = True  # int8 over budget: keep the most sensitive layers in float until it passes (onnxruntime)
    task: str | None = None  # what the model is for (judge.tasks); None: MODEL.task.yaml, else inferred
    task_args: str | None = None  # 'k=v,...' for the task (e.g. 'format=yolov8,score=0.25')
    keep_engines: Path | None = None  # copy every candidate engine built (passed or not) here: bench/corpus.py


@dataclass(frozen=True)
class CompileResult:
    bundle: Path
    manifest: Manifest
    cached: bool = False


@dataclass
class _Built:
    precision: str
    engine: Path
    runner: Runner
    quantization: QuantizationInfo | None
    accuracy: AccuracyReport
    points: tuple[BenchmarkPoint, ...] = ()


class _Engines:
    """The engines a compile runs (the fp32 reference, each candidate), loaded through :func:`engines.load` as
    the agent loads them, with the profile's threads; all closed when the compile ends."""

    def __init__(self, info: GraphInfo, profile: HardwareProfile):
        self.info = info
        self.profile = profile
        self.runtime: Runtime = record(profile.backend)  # what the profile's engines are: name, file suffix
        self.opened: list[Engine] = []

    def open(self, kind: str, path: Path, precision: str, label: str,
             providers: tuple[str, ...] | None = None) -> Runner:
        spec = EngineSpec(self.info.inputs, self.info.outputs, precision, self.profile.name, label,
                          fixed_batch=self.info.fixed_batch)
        engine = load_engine(kind, path, spec, self.profile.runtime.intra_op_threads, providers)
        self.opened.append(engine)
        return engine.infer

    def close(self) -> None:
        for engine in self.opened:
            engine.close()
        self.opened.clear()


@dataclass(frozen=True)
class Measured:
    """What the precision choice looks at, per candidate."""

    precision: str
    passed: bool
    gate_note: str
    points: tuple[BenchmarkPoint, ...] = ()  # vs fp32; empty for fp32 itself or when not benchmarked


def _noop(step: int, total: int, what: str) -> None:
    pass


def _geomean(points: tuple[BenchmarkPoint, ...]) -> float:
    return math.exp(sum(math.log(max(p.speedup, 1e-9)) for p in points) / len(points)) if points else 1.0


def _speed_phrase(precision: str, points: tuple[BenchmarkPoint, ...]) -> str:
    return f"{precision} is " + " and ".join(f"{p.speedup:.2f}x at batch {p.batch_size}" for p in points) \
        + " of fp32 on this model"


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
        best = max(passing, key=lambda m: (1.0 if m.precision == "fp32" else _geomean(m.points),
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


def compile_model(opts: CompileOptions, progress: Progress = _noop) -> CompileResult:
    """Build, gate, benchmark and bundle; errors of the engines it runs and of the judge it gates with are
    translated here: a feed the engine refuses, or data the judge cannot judge, is the data's fault (InputError),
    any other engine failure the toolchain's."""
    with compiler_errors(), collecting(), tempfile.TemporaryDirectory(prefix="edgefleet-model-") as tmp:
        # external data embedded, a fixed batch made dynamic (compiler.source): one self-contained file from here on
        return _compile(dataclasses.replace(opts, model=source_model(opts.model, Path(tmp), progress)), progress)


@contextlib.contextmanager
def compiler_errors() -> Iterator[None]:
    """Engine and judge errors as the compiler's (a refused feed or unjudgeable data: InputError; any other engine
    failure: ToolchainError); compile_model and compile_pipeline translate the same way."""
    try:
        yield
    except CompilerError:
        raise
    except (EngineInputError, JudgeInputError) as exc:
        raise InputError(str(exc)) from exc
    except EngineError as exc:
        raise ToolchainError(str(exc)) from exc
    except JudgeError as exc:
        raise CompilerError(str(exc)) from exc


def _validate(opts: CompileOptions) -> None:
    """Everything that can be checked before any work: names, version, paths, task."""
    if not NAME_RE.fullmatch(opts.name):
        fixed = re.sub(r"[^a-z0-9._-]+", "-", opts.name.lower()).strip("-._")[:63] or "model"
        raise InputError(f"--name {opts.name!r}: names are 1-63 of [a-z0-9._-], starting with a letter or digit "
                         f"(try --name {fixed})")
    if not VERSION_RE.fullmatch(opts.version):
        raise InputError(f"--version {opts.version!r} is not MAJOR.MINOR.PATCH (e.g. 1.0.0)")
    for flag, path in (("model", opts.model), ("--eval", opts.eval), ("--calibration", opts.calibration),
                       ("--preprocess", opts.preprocess)):
        if path is not None and not path.exists():
            raise InputError(f"{path}: {flag} file not found")
    if opts.task:
        parse_tasks(opts.task, opts.task_args)
    elif opts.task_args:
        raise InputError("--task-args needs --task NAME")
    if opts.out_dir.exists() and not opts.out_dir.is_dir():
        raise InputError(f"--out {opts.out_dir}: not a folder")


@dataclass
class _Plan:
    """What the steps of one compile share: fixed before any build, except ``wanted``, ``notes`` and ``task``, which
    narrow as candidates are dropped (each with the reason the manifest records) and the task is inferred."""

    opts: CompileOptions
    progress: Progress
    profile: HardwareProfile
    gate: GateSettings
    target: BuildTarget
    info: GraphInfo
    out: Path
    prep: Preprocessing | None
    eval_set: Dataset
    task: TaskSpec
    wanted: list[str]  # the precisions still to build, the profile's default first
    notes: dict[str, str] = field(default_factory=dict)  # precision -> why it was not built
    calib: Dataset | None = None
    total: int = 7  # progress steps
    # "already quantized (N Op, ...)" when the model came quantized: built as given (its float build path, no
    # quantizer), labelled int8 and gated against itself; "" for a float model
    given: str = ""
    causes: Callable[[], Causes] | None = None  # why int8 failed, measured when a refusal needs advice

    @property
    def auto(self) -> bool:
        return self.opts.precision == "auto"

    def drop(self, precision: str, why: str) -> None:
        """Leave ``precision`` out, saying why; an error when it was the one asked for (or the only one left)."""
        if not self.auto or len(self.wanted) == 1:
            raise (ToolchainError if "build host" in why else InputError)(f"cannot build {precision}: {why}")
        self.wanted.remove(precision)
        self.notes[precision] = f"not built: {why}"


def _compile(opts: CompileOptions, progress: Progress = _noop) -> CompileResult:
    total = 7
    _validate(opts)
    progress(1, total, f"loading profile {opts.profile}")
    profile = load_profile(opts.profile)
    gate = _gate_settings(opts, profile)
    target = get_target(profile.backend)

    progress(2, total, f"checking graph {opts.model}")
    info = check_model(opts.model)
    given = _quantized_input(opts, profile, target)
    out = opts.out_dir / f"{opts.name}-{opts.version}-{profile.name}.tar"
    cache = cache_key = None
    if opts.cache_dir is not None:
        cache = BuildCache(opts.cache_dir)
        params = {k: v for k, v in vars(opts).items() if k not in ("model", "calibration", "eval", "out_dir",
                                                                   "cache_dir", "profile", "preprocess",
                                                                   "keep_engines")}
        cache_key = cache.key([opts.model, resolve_profile_path(opts.profile), opts.preprocess,
                               *_data_files(opts.calibration), *_data_files(opts.eval)], {
            **params, "edgefleet": protocol.__version__, "manifest_version": MANIFEST_VERSION,
            "toolchain": target.toolchain_versions(), "host": sorted(cpu_features()),
            **_bf16.cache_key(profile), **({"as_given": given} if given else {})})
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        hit = cache.get(cache_key, out)
        if hit is not None:
            progress(total, total, f"unchanged inputs: reused the bundle built {hit.created_at}")
            return CompileResult(bundle=out, manifest=hit, cached=True)
    plan = _plan(opts, progress, profile, gate, target, info, out, given)

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    engines = _Engines(plan.info, profile)
    with tempfile.TemporaryDirectory(prefix="edgefleet-build-", dir=opts.out_dir) as tmp, \
            contextlib.closing(engines):
        work = Path(tmp)
        progress(3, total, "running the fp32 reference")
        reference = engines.open(REFERENCE_RUNTIME, opts.model, "fp32", "the fp32 reference (source model)", (CPU,))
        ref_out = predict_all(reference, plan.eval_set, output_axes=[o.batch_axis for o in plan.info.outputs])
        built = _build_candidates(plan, engines, work, ref_out)
        manifest = _bundle(plan, engines, work, built, reference, ref_out)
    if cache is not None and cache_key is not None:
        cache.put(cache_key, out)
    return CompileResult(bundle=out, manifest=manifest)


def _gate_settings(opts: CompileOptions, profile: HardwareProfile) -> GateSettings:
    """The gate's bounds: the flags, else the profile's; and the precision asked for, checked against the profile."""
    if opts.precision != "auto" and opts.precision not in profile.precisions:
        raise InputError(f"profile {profile.name} supports {list(profile.precisions)} or 'auto', "
                         f"not {opts.precision!r}")
    gate = GateSettings(
        kind=opts.gate,  # type: ignore[arg-type]
        max_accuracy_drop=profile.accuracy.max_drop if opts.max_accuracy_drop is None else opts.max_accuracy_drop,
        min_agreement=profile.accuracy.min_agreement if opts.min_agreement is None else opts.min_agreement,
        metric=opts.agreement_metric,  # type: ignore[arg-type]
        max_unjudged_change=UNJUDGED_MAX_REL_L2 if opts.precision == "auto" else None)
    if not 0.0 <= gate.max_accuracy_drop <= 1.0:
        raise InputError(f"--max-accuracy-drop must be between 0 and 1, got {gate.max_accuracy_drop}")
    if not 0.0 <= gate.min_agreement <= 1.0:
        raise InputError(f"--min-agreement must be between 0 and 1, got {gate.min_agreement}")
    return gate


def _plan(opts: CompileOptions, progress: Progress, profile: HardwareProfile, gate: GateSettings,
          target: BuildTarget, info: GraphInfo, out: Path, given: str = "") -> _Plan:
    """The data, the task and the precisions to build, each left out with its reason when this host cannot build or
    gate it; a model ``given`` quantized (:func:`_quantized_input`) is built once, as given."""
    total = 7
    prep = _preprocessing(opts, info)
    class_names = tuple(json.loads(info.metadata["edgefleet.labels"])) if "edgefleet.labels" in info.metadata else None
    eval_set = load_for_model(opts.eval, info.inputs, info.per_sample, need_labels=gate.kind == "accuracy",
                              what="evaluation set", preprocessing=prep, class_names=class_names,
                              data_axes=info.data_axes)
    info = _fit_layout(opts.model, info, eval_set, progress, total)
    eval_set = Dataset(eval_set.inputs, eval_set.labels, info.sample_axes(), info.per_sample)
    task = resolve_task(opts.task, opts.task_args, opts.model, info.outputs).with_min_agreement(opts.min_agreement)
    if not uses_labels(gate, eval_set.labels, task) and task.source != "inferred":
        progress(2, total, f"note: {task.note}")
    # the profile's default precision first: it wins when nothing is benchmarked
    order: list[str] = [profile.default_precision, *[p for p in profile.precisions if p != profile.default_precision]]
    plan = _Plan(opts, progress, profile, gate, target, info, out, prep, eval_set, task,
                 order if opts.precision == "auto" else [opts.precision], given=given)
    if given:  # its float build path: the file as it is (no quantizer), gated like fp32 against itself
        progress(2, total, f"note: the model is {given}: built as given, no int8 build tried")
        plan.notes = {p: "not built: an already quantized model is built as given, once" for p in order
                      if p not in ("fp32", "int8")}
        plan.wanted = ["fp32"]
        return plan
    if "int8" in plan.wanted and (why_not := _host_cannot_gate_int8(profile, target)):
        plan.drop("int8", why_not)
    if "bf16" in plan.wanted and (why_not := _bf16.host_cannot_run_bf16(profile)):
        plan.drop("bf16", why_not)  # auto: not considered, and the manifest says why
    if "int8" in plan.wanted:
        if opts.calibration is None:
            plan.drop("int8", "no --calibration set given (pass --calibration FILE.npz)")
        else:
            plan.calib = load_for_model(opts.calibration, info.inputs, info.per_sample, need_labels=False,
                                        what="calibration set", preprocessing=prep, data_axes=info.data_axes)
            if len(plan.calib) < MIN_CALIBRATION_SAMPLES:
                raise InputError(f"{opts.calibration}: {len(plan.calib)} calibration samples; int8 needs at least "
                                 f"{MIN_CALIBRATION_SAMPLES} representative inputs (a few hundred is better)")
    return plan


def _gate_task(plan: _Plan, ref_out: list[Any]) -> TaskSpec | None:
    """The task that gates the candidates, once fp32's outputs are known: an inferred task is inferred again from
    them (a guess gates no int8 or bf16); None when the task's judge cannot read fp32's own outputs (fp32 is then
    gated by output agreement and nothing quantized is built)."""
    opts, gate, eval_set, wanted, notes = plan.opts, plan.gate, plan.eval_set, plan.wanted, plan.notes
    if plan.task.source == "inferred":  # the shape and fp32's values on the evaluation data decide, or say unsure
        task = plan.task = infer_task(plan.info.outputs, ref_out[0], ref_out).with_min_agreement(opts.min_agreement)
        if not uses_labels(gate, eval_set.labels, task):
            plan.progress(2, plan.total, f"note: {task.note}")
            for guessed in [q for q in ("int8", "bf16") if q in wanted and not task.sure]:
                why = (f"the task is not known for sure ({task.note}), and a guessed task cannot judge an "
                       f"{guessed} engine")
                if not plan.auto or len(wanted) == 1:
                    raise AccuracyGateFailed(f"no {guessed} engine was gated: {why}")
                wanted.remove(guessed)
                notes[guessed] = f"not built: {why}"
    task = plan.task
    if not uses_labels(gate, eval_set.labels, task) and (why_not := _cannot_judge(task, plan.info, ref_out, gate)):
        # a judge that cannot read fp32's own outputs cannot judge an engine: no quantized build is gated by it
        for p in [p for p in wanted if p != "fp32"]:
            if not plan.auto or "fp32" not in wanted:
                raise InputError(f"cannot gate {p}: {why_not}")
            wanted.remove(p)
            notes[p] = f"not built: {why_not}"
        return None  # fp32 itself is gated by output agreement
    return task


def _build_candidates(plan: _Plan, engines: _Engines, work: Path, ref_out: list[Any]) -> dict[str, _Built]:
    """Every wanted precision built and gated against fp32; a quantized build that fails is left out with its
    reason (auto), and an int8 build over budget tries keeping its most sensitive layers in float."""
    opts, target, info, wanted = plan.opts, plan.target, plan.info, plan.wanted
    gate_task = _gate_task(plan, ref_out)
    source = opts.model
    min_opset = target.qdq_int8_min_opset
    if "int8" in wanted and min_opset is not None and info.opset < min_opset:
        try:  # a model that takes one sample per call is checked sample by sample (ensure_opset)
            source = ensure_opset(opts.model, min_opset, work / f"source-opset{min_opset}.onnx",
                                  plan.eval_set.head(16))
            note("int8 source", f"converted from opset {info.opset} to {min_opset} (outputs checked equal)",
                 f"QDQ int8 on {plan.profile.backend} needs opset {min_opset} or newer")
        except CompilerError as exc:  # with auto, the float build still ships
            if not plan.auto or len(wanted) == 1:
                raise
            plan.drop("int8", f"opset {info.opset} could not be converted for QDQ: {_one_line(exc)}")
    plan.progress(4, plan.total, f"building and gating {plan.profile.backend} {' and '.join(wanted)}")
    built: dict[str, _Built] = {}
    for precision in list(wanted):
        try:
            built[precision] = _build_and_gate(target, source if precision == "int8" else opts.model, engines,
                                               precision, plan.calib, work, plan.eval_set, ref_out, plan.gate,
                                               gate_task)
        except (CompilerError, JudgeError, EngineError) as exc:
            # the fp32 reference ran, so a quantized build that fails (the quantizer crashes, onnxruntime cannot
            # load or run what it wrote) is this model's limit with this quantizer, not a broken toolchain
            if precision == "fp32" or _toolchain_missing(exc) or (
                    not target.builds_with_reference_runtime and (not plan.auto or len(wanted) == 1)):
                raise
            why = _one_line(exc)
            if not plan.auto or len(wanted) == 1:
                raise InputError(f"cannot build {precision} for this model: {why}; the fp32 model runs, so "
                                 "--precision auto ships fp32 and says why (or compile with --precision fp32)"
                                 ) from exc
            note(f"{precision} build", "left out: the other precisions ship", why)
            plan.drop(precision, f"its build failed: {why}")  # auto: fp32 still ships

    int8 = built.get("int8")
    if int8 is not None and not int8.accuracy.passed and not plan.given:  # measured only if the refusal needs advice
        plan.causes = lambda: _causes(plan, engines, work, source, ref_out, built["int8"], gate_task)
    if int8 is not None and not int8.accuracy.passed and opts.fallback and plan.calib is not None \
            and min_opset is not None:
        timed = opts.benchmark and plan.profile.accelerator == "cpu"
        plan.progress(4, plan.total, "int8 over budget: keeping the most sensitive layers in float")
        built["int8"] = fell = _float_fallback(int8, source, target, engines, plan.calib, work, plan.eval_set,
                                               ref_out, plan.gate, plan.task, timed)
        wide = target.full_weight_scheme(plan.profile)
        if not fell.accuracy.passed and wide is not None and gate_task is not None and gate_task.name == "detection":
            plan.progress(4, plan.total, f"int8 over budget: 8-bit weights ({wide}, exact on every CPU of the profile)")
            assert fell.quantization is not None
            built["int8"] = _full_weights(int8, fell, wide, source, target, engines, plan.calib, work, plan.eval_set,
                                          ref_out, plan.gate, gate_task, timed, fell.quantization.fallback_steps)
    if plan.given:  # what the file computes: its integer kernels, judged against the model itself
        b = built.pop("fp32")
        acc = b.accuracy.model_copy(update={"candidate_precision": "int8", "reference_precision": "int8"})
        built["int8"] = _Built("int8", b.engine, b.runner, None, acc)
    if opts.keep_engines is not None:  # for a caller that measures the candidates itself (bench/corpus.py)
        opts.keep_engines.mkdir(parents=True, exist_ok=True)
        for b in built.values():
            shutil.copyfile(b.engine, opts.keep_engines / f"{b.precision}{engines.runtime.suffix}")
    return built


def _choose(plan: _Plan, built: dict[str, _Built], reference: Runner) -> tuple[PrecisionChoice, list[_Built]]:
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
            b.points = _benchmark(fp32_runner, b.runner, plan.eval_set, profile)
    elif cannot_time is not None and opts.benchmark:
        plan.progress(5, plan.total, f"benchmark skipped: {cannot_time}")
    else:
        plan.progress(5, plan.total, "benchmark skipped" if not benchmarked else "fp32 only: nothing to compare")
    measured = [Measured(p, b.accuracy.passed, _gate_note(b.accuracy), b.points) for p, b in built.items()]
    first = plan.wanted[0]
    decided = choose_precision(measured, benchmarked) if plan.auto else (
        (first, f"{first}: asked for with --precision") if built[first].accuracy.passed else None)
    if decided is None:
        failed = "; ".join(_gate_note(b.accuracy) for b in built.values())
        raise AccuracyGateFailed(
            f"accuracy gate failed: {failed}; "
            + advice(built["int8"].accuracy if "int8" in built else next(iter(built.values())).accuracy,
                     plan.task, "n/a" if plan.target.qdq_int8_min_opset is None or "int8" not in built
                     else "tried" if opts.fallback else "off", profile.quantization.per_channel,
                     plan.causes() if plan.causes is not None else None)
            + _per_output_report(built))
    chosen, reason = decided
    # the build host cannot time this profile's CPUs: every passing precision ships, the device times them
    passing = [b for b in built.values() if b.accuracy.passed]
    variants = passing[1:] if plan.auto and cannot_time is not None and len(passing) > 1 else []
    if variants:
        chosen = passing[0].precision
        reason = (f"device: {' and '.join(b.precision for b in passing)} pass the gate and {cannot_time}, so "
                  f"each device times them at install and serves the faster; {chosen} (the profile's "
                  f"default first) for an agent that does not time them; "
                  + "; ".join(_gate_note(b.accuracy) for b in passing))
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
                                note=_fallback_note(b))
             for p, b in built.items()]
            + [PrecisionCandidate(precision=p, note=n) for p, n in notes.items()]))  # type: ignore[arg-type]
    return choice, variants


def _quantized_input(opts: CompileOptions, profile: HardwareProfile, target: BuildTarget) -> str:
    """The phrase "already quantized (N Op, ...)" for a model that came quantized, "" for a float one. It is built
    only as given, by ``--precision auto`` on a target whose engine is the ONNX file onnxruntime runs (the
    reference's runtime); anything else is an InputError that asks for the original float model (quantizing it
    again fails in onnxruntime's quantizer, KeyError: '..._scale', and no gate can judge a quantization without
    the float model it came from)."""
    counts = quantized_ops(opts.model)
    if not counts:
        return ""
    given = quantized_phrase(counts)
    original = "give the original float model (the export before it was quantized)"
    if not target.builds_with_reference_runtime:
        raise InputError(f"the model is {given}: the {profile.backend} target builds its engines from a float "
                         f"model; {original}")
    if "int8" not in profile.precisions:
        raise InputError(f"the model is {given}, and profile {profile.name} allows {list(profile.precisions)}, not "
                         f"int8; {original}")
    if opts.precision != "auto":
        what = ("has nothing left to quantize, and there is no FP32 original to judge this quantization against"
                if opts.precision == "int8" else f"asks for an {opts.precision} engine, which cannot be built from it")
        raise InputError(f"the model is {given}: --precision {opts.precision} {what}; {original}, or compile with "
                         "--precision auto, which builds this one as given (labelled int8, gated against itself)")
    return given


def _as_given_choice(plan: _Plan, b: _Built) -> PrecisionChoice:
    """The precision choice of a model that came quantized (``plan.given``): built as given, labelled int8, gated
    against the model itself and not benchmarked (nothing else was built to compare it with)."""
    gate_note = _gate_note(b.accuracy)
    if not b.accuracy.passed:
        raise AccuracyGateFailed(f"accuracy gate failed: {gate_note}; the model is {plan.given}, built as given and "
                                 "gated against itself" + _per_output_report({"int8": b}))
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


def _bundle(plan: _Plan, engines: _Engines, work: Path, built: dict[str, _Built], reference: Runner,
            ref_out: list[Any]) -> Manifest:
    """Choose, write the self-test samples and the manifest, and pack the bundle at ``plan.out``."""
    opts, profile, info, target, task = plan.opts, plan.profile, plan.info, plan.target, plan.task
    choice, variants = _choose(plan, built, reference)
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
        note(f"no drift reference: {_one_line(exc)}")
        return manifest


def _fit_layout(model: Path, info: GraphInfo, data: Dataset, progress: Progress, total: int) -> GraphInfo:
    """Batch axes as the data and the model show them: an input whose samples lie on another dynamic axis than
    declared (state [2, N, 128] exported as [?, ?, 128]) takes that axis; outputs are probed (graph.probe_batching)."""
    moved = {s.name: data.axes.get(s.name) for s in info.inputs if not info.per_sample
             and data.axes.get(s.name) != s.batch_axis}
    if moved:
        ins = tuple(s.model_copy(update={"batch_axis": moved[s.name]}) if s.name in moved else s for s in info.inputs)
        info = GraphInfo(ins, info.outputs, info.op_types, info.opset, info.metadata, info.per_sample,
                         "; ".join(f"input {k!r} holds its samples on axis {a}" for k, a in moved.items()))
    note = info.batching_note
    info = probe_batching(model, info, data)
    for n in dict.fromkeys([note, info.batching_note]):
        if n:
            progress(2, total, f"note: {n}")
    return info


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


def _data_files(path: Path | None) -> list[Path | None]:
    """The files a data set is made of (a folder of images: every file, in order), for the cache key."""
    if path is None or not path.is_dir():
        return [path]
    return [p for p in sorted(path.rglob("*")) if p.is_file()]


def _preprocessing(opts: CompileOptions, info: GraphInfo) -> Preprocessing | None:
    """The recorded image preprocessing: --preprocess, else derived from a fixed-size image input when a
    data set is a folder of images, else none."""
    prep: Preprocessing | None
    if opts.preprocess is not None:
        prep = load_preprocessing(opts.preprocess)
    elif any(p is not None and p.is_dir() for p in (opts.calibration, opts.eval)) and len(info.inputs) == 1:
        prep = default_preprocessing(info.inputs[0].name, info.inputs[0].shape)
        if prep is None:
            raise InputError(f"input {info.inputs[0].name!r} has shape {list(info.inputs[0].shape)}, not a fixed-size "
                             "image: say how to preprocess images with --preprocess preprocess.yaml")
    else:
        return None
    spec = next((s for s in info.inputs if s.name == prep.input), None)
    if spec is None:
        raise InputError(f"--preprocess feeds input {prep.input!r}; the model's inputs are "
                         f"{[s.name for s in info.inputs]}")
    want = spec.shape[1:]
    if len(want) != 3 or any(w not in (-1, h) for w, h in zip(want, prep.sample_shape(), strict=True)):
        raise InputError(f"--preprocess makes {prep.layout} samples of {list(prep.sample_shape())}; model input "
                         f"{spec.name!r} wants {list(spec.shape)}")
    return prep


def _sample_top1(sample: Dataset, expected: list[np.ndarray]) -> float | None:
    if sample.labels is not None and expected[0].ndim == 2 and sample.labels.shape == expected[0].shape[:1]:
        return float((expected[0].argmax(axis=1) == sample.labels).mean())
    return None


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


def _host_cannot_gate_int8(profile: HardwareProfile, target: BuildTarget) -> str | None:
    """The gate runs the engine on the build host, so the host must compute what the profile's CPUs
    compute. Reduced-range and u8u8 engines compute exactly everywhere; full-range u8s8 (VNNI
    profiles) saturates on an AVX2 host without VNNI, which would gate numbers no device computes."""
    if profile.arch != "x86_64" or cpu_arch() != "x86_64" or target.qdq_int8_min_opset is None:
        return None
    if profile.int8_scheme()[0] in ("u8s8", "s8s8") and u8s8_saturates():
        return (f"the build host has AVX2 without VNNI, where full-range int8 saturates, so the accuracy gate "
                f"would measure numbers no {profile.name} device computes; build {profile.name} on a CPU "
                "with avx512_vnni (or one without AVX2)")
    return None


def _fallback_note(b: _Built) -> str | None:
    steps = b.quantization.fallback_steps if b.quantization is not None else ()
    if not steps:
        return None
    kept = len(b.quantization.float_nodes) if b.quantization is not None else 0
    if not b.accuracy.passed:
        return f"float fallback tried {len(steps) - 1} step(s): {steps[-1]}"
    wide = next((s.split(": ", 1)[0] for s in steps[1:] if s.startswith("8-bit weights")), None) \
        if b.quantization is not None and b.quantization.weight_bits == 8 else None
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


def _gate_note(acc: AccuracyReport) -> str:
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


def _causes(plan: _Plan, engines: _Engines, work: Path, source: Path, ref_out: list[Any], b: _Built,
            task: TaskSpec | None) -> Causes:
    """Why ``b`` (int8) failed the gate, measured (compiler.gate.measure_causes): its answers against fp32's, its
    calibration range, its layers (when the float fallback was off) and a trial on half the calibration set."""
    info, calib = plan.info, plan.calib
    cand = predict_all(b.runner, plan.eval_set, output_axes=[o.batch_axis for o in info.outputs])
    names = [o.name for o in info.outputs]

    def rank() -> list[tuple[tuple[str, ...], float]]:
        from edgefleet.compiler.sensitivity import rank_sensitive_nodes

        assert calib is not None
        prepared = plan.target.prepare_float(source, work / "prepared.onnx")
        return rank_sensitive_nodes(prepared, b.engine, calib.head(1 if calib.per_sample else 8).inputs)

    def rebuild(data: Dataset) -> AccuracyReport:
        (work / "trial").mkdir(exist_ok=True)
        return _build_and_gate(plan.target, source, engines, "int8", data, work / "trial", plan.eval_set, ref_out,
                               plan.gate, task).accuracy

    try:
        return measure_causes(b.accuracy, task, names.index(task.output) if task is not None else 0, ref_out, cand,
                              calib, plan.eval_set, rank if not plan.opts.fallback and calib is not None and
                              plan.target.qdq_int8_min_opset is not None else None, rebuild)
    except (CompilerError, JudgeError, EngineError) as exc:  # the gate's verdict stands; the advice names no cause
        plan.progress(5, plan.total, f"note: the causes of the int8 failure could not be measured ({_one_line(exc)})")
        return Causes()



def _per_output_report(built: dict[str, _Built]) -> str:
    lines = []
    for p, b in built.items():
        if b.quantization is not None and b.quantization.fallback_steps:
            lines += [f"\n  float fallback: {step}" for step in b.quantization.fallback_steps]
        for o in b.accuracy.outputs:
            t1 = "–" if o.top1_agreement is None else f"{o.top1_agreement:.4f}"
            lines.append(f"\n  {p} output {o.name!r}: top-1 agreement {t1}, cosine {o.cosine:.4f}, "
                         f"max abs error {o.max_abs_error:.4g}, mean abs error {o.mean_abs_error:.4g}")
    return "".join(lines)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An error as one line for a reason or a note: its type when the text does not say it (a KeyError's text is
    only the key), whitespace folded, at most ``limit`` characters."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (KeyError, IndexError, AssertionError)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _toolchain_missing(exc: BaseException) -> bool:
    """A build that failed because a toolchain is not installed here (a missing module), not because of the model."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ImportError):
            return True
        seen = seen.__cause__
    return False


def _cannot_judge(task: TaskSpec, info: GraphInfo, ref_out: list[Any], gate: GateSettings) -> str | None:
    """Why the task's judge cannot judge an engine of this model (None: it can): it refuses fp32's own outputs (a
    layout it does not read, masks that are empty or whole on every sample)."""
    names = [o.name for o in info.outputs]
    try:
        judge(task, ref_out[names.index(task.output)], ref_out[names.index(task.output)], gate.min_agreement,
              {n: (r, r) for n, r in zip(names, ref_out, strict=True)})
    except JudgeInputError as exc:
        return f"the {task.name} gate cannot judge this model's outputs ({_one_line(exc)})"
    return None


def _build_and_gate(target: BuildTarget, model: Path, engines: _Engines, precision: str,
                    calib: Dataset | None, work: Path, eval_set: Dataset, ref_out: list[Any],
                    gate: GateSettings, task: TaskSpec | None) -> _Built:
    if precision == "bf16":
        return _build_and_gate_bf16(target, model, engines, work, eval_set, ref_out, gate, task)
    info, profile = engines.info, engines.profile
    engine = work / f"model-{precision}{engines.runtime.suffix}"
    # int8 calibrates on the calibration set; a TensorRT float build still needs sample inputs: it
    # fixes the dynamic dimensions other than the batch (a detector's H and W) at their size
    data = calib if precision == "int8" else eval_set.head(1) if target.float_build_needs_samples else None
    if precision == "int8" and target.qdq_int8_min_opset is not None and task is not None and task.name == "detection" \
            and data is not None:
        from edgefleet.compiler.sensitivity import quantize_keeping_head  # boxes and scores keep their own ranges

        quant = quantize_keeping_head(model, profile, data, engine, task.output)
    else:
        quant = target.build(model, info, precision, profile, data, engine)
    kind = engines.runtime.name
    runner = engines.open(kind, engine, precision, f"the {precision} {kind} candidate")
    cand_out = predict_all(runner, eval_set, output_axes=[o.batch_axis for o in info.outputs])
    report = evaluate_gate([o.name for o in info.outputs], ref_out, cand_out, eval_set.labels, precision, gate, task)
    return _Built(precision, engine, runner, quant, report)


def _build_and_gate_bf16(target: BuildTarget, model: Path, engines: _Engines, work: Path, eval_set: Dataset,
                         ref_out: list[Any], gate: GateSettings, task: TaskSpec | None) -> _Built:
    """bf16 (compiler.bf16): the fp32 build's ONNX file, run by OpenVINO with its bf16 hint and judged by the same
    gate as int8 against the fp32 reference; tagged bf16 wherever it goes, never fp32."""
    info = engines.info
    engine = work / f"model-bf16{engines.runtime.suffix}"
    target.build(model, info, "fp32", engines.profile, None, engine)
    runtime = _bf16.runtime(engines.profile)
    if runtime is None:  # host_cannot_run_bf16 refused it before: never reached
        raise ToolchainError(f"no runtime runs {engines.profile.backend} engines in bf16")
    runner = engines.open(runtime, engine, "bf16", f"the bf16 {runtime} candidate")
    cand_out = predict_all(runner, eval_set, output_axes=[o.batch_axis for o in info.outputs])
    report = evaluate_gate([o.name for o in info.outputs], ref_out, cand_out, eval_set.labels, "bf16", gate, task)
    return _Built("bf16", engine, runner, None, report)


def _full_weights(first: _Built, fell: _Built, scheme: Int8Scheme, source: Path, target: BuildTarget,
                  engines: _Engines, calib: Dataset, work: Path, eval_set: Dataset, ref_out: list[Any],
                  gate: GateSettings, task: TaskSpec, benchmark: bool, steps: tuple[str, ...]) -> _Built:
    """A detector whose int8 builds with the profile's 7-bit weights lose boxes even with the float fallback's
    layers in float (``fell``), built once more from ``first``'s float nodes (its decode head and input layer) with
    8-bit weights in ``scheme`` (the target's :meth:`full_weight_scheme`, computing the same on every CPU of the
    profile; slower kernels on AVX2). Measured on the YOLOv8n DocLayNet detector: 7-bit weights alone (activations
    in float) lose 3.7% of its boxes on document pages, 8-bit ones 1.2%. Returns it when it passes, else ``fell``
    with this step added to its steps."""
    assert first.quantization is not None and fell.quantization is not None
    keep = first.quantization.float_nodes
    label = f"8-bit weights ({scheme})" + (f", the first build's {len(keep)} nodes in float" if keep else "")
    engine = work / f"model-int8-{scheme}{engines.runtime.suffix}"
    try:
        prepared = target.prepare_float(source, work / "prepared.onnx")
        quant = target.build_int8_keeping_float(prepared, engines.profile, calib, engine, keep, scheme=scheme)
        runner = engines.open(engines.runtime.name, engine, "int8", f"the int8 candidate with {label}")
        report = evaluate_gate([o.name for o in engines.info.outputs], ref_out,
                               predict_all(runner, eval_set, output_axes=[o.batch_axis for o in engines.info.outputs]),
                               eval_set.labels, "int8", gate, task)
    except (CompilerError, JudgeError, EngineError) as exc:  # the float fallback's answer stands
        return _Built("int8", fell.engine, fell.runner, fell.quantization.model_copy(update={
            "fallback_steps": (*steps, f"{label}: the build failed ({_one_line(exc, 200)})")}), fell.accuracy)
    step = f"{label}: {_gate_note(report)}"
    note("int8 float fallback", f"rebuilt with {label}", step)
    if not report.passed:
        return _Built("int8", fell.engine, fell.runner,
                      fell.quantization.model_copy(update={"fallback_steps": (*steps, step)}), fell.accuracy)
    speed = _benchmark(first.runner, runner, eval_set, engines.profile) if benchmark else ()
    return _Built("int8", engine, runner, quant.model_copy(update={
        "fallback_steps": (*steps, step), "fallback_speed": speed,
        "reason": f"{quant.reason}; the first build's {len(keep)} float nodes kept in float"}), report)


def _float_fallback(full: _Built, source: Path, target: BuildTarget, engines: _Engines, calib: Dataset,
                    work: Path, eval_set: Dataset, ref_out: list[Any], gate: GateSettings, task: TaskSpec,
                    benchmark: bool) -> _Built:
    """Keep the 1, 2, 4, ... layers that lose the most to quantization in float (up to a quarter of the
    compute layers) until the gate passes; return the first build that passes, else the full one. The build
    target prepares and quantizes (a target whose int8 is ONNX QDQ: ``qdq_int8_min_opset``), in ``full``'s scheme."""
    import onnx

    from edgefleet.compiler.sensitivity import rank_sensitive_nodes

    info, profile = engines.info, engines.profile
    prepared = target.prepare_float(source, work / "prepared.onnx")
    steps = [f"all layers int8: {_gate_note(full.accuracy)}"]
    scheme = full.quantization.scheme if full.quantization is not None else None
    try:
        ranked = rank_sensitive_nodes(prepared, full.engine,
                                      calib.head(1 if calib.per_sample else info.fixed_batch or 8).inputs)
    except Exception as exc:  # onnxruntime and onnx raise assorted types; the full build still stands
        steps.append(f"could not rank the layers ({type(exc).__name__}: {str(exc)[:200]}); no fallback")
        assert full.quantization is not None
        return _Built("int8", full.engine, full.runner,
                      full.quantization.model_copy(update={"fallback_steps": tuple(steps)}), full.accuracy)

    layers = len(onnx.load(str(prepared)).graph.node)
    limit = max(4, layers // 4)
    tried: set[tuple[str, ...]] = set()
    base = full.quantization.float_nodes if full.quantization is not None else ()  # a detector's decode head
    for k in (1, 2, 4, 8, 16, 32, 64):
        keep = tuple(dict.fromkeys([*base, *(n for group, _ in ranked[:k] for n in group)]))
        if len(keep) > limit or not keep or keep in tried:
            break
        tried.add(keep)
        engine = work / f"model-int8-float{k}.onnx"
        try:
            quant = target.build_int8_keeping_float(prepared, profile, calib, engine, keep, scheme=scheme)
            runner = engines.open(engines.runtime.name, engine, "int8",
                                  f"the int8 candidate with {len(keep)} float layers")
            report = evaluate_gate([o.name for o in info.outputs], ref_out,
                                   predict_all(runner, eval_set, output_axes=[o.batch_axis for o in info.outputs]),
                                   eval_set.labels, "int8", gate, task)
        except (CompilerError, JudgeError, EngineError) as exc:  # this build failed: the next keeps more in float
            steps.append(f"{len(keep)} layer{'s' if len(keep) > 1 else ''} in float: the build failed "
                         f"({_one_line(exc, 200)})")
            continue
        steps.append(f"{len(keep)} layer{'s' if len(keep) > 1 else ''} in float ({', '.join(keep)}): "
                     f"{_gate_note(report)}")
        if report.passed:
            note("int8 float fallback", f"{len(keep)} layer(s) kept in float ({', '.join(keep)})", steps[0])
            speed = _benchmark(full.runner, runner, eval_set, profile) if benchmark else ()
            quant = quant.model_copy(update={"fallback_steps": tuple(steps), "fallback_speed": speed})
            return _Built("int8", engine, runner, quant, report)
    steps.append(f"gave up: keeping more than {limit} of {layers} layers in float defeats int8")
    note("int8 float fallback", f"tried {len(steps) - 2} step(s) keeping layers in float: none passed", steps[-2])
    assert full.quantization is not None
    return _Built("int8", full.engine, full.runner,
                  full.quantization.model_copy(update={"fallback_steps": tuple(steps)}), full.accuracy)


def _benchmark(reference: Runner, candidate: Runner, data: Dataset,
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


def _selftest_sample(data: Dataset) -> Dataset:
    """Up to 64 evaluation samples, fewer when the inputs are big (at least one)."""
    per_sample = sum(v.nbytes for v in data.take(0, 1).values()) or 1
    return data.head(max(1, min(SELFTEST_MAX_SAMPLES, SELFTEST_MAX_INPUT_BYTES // per_sample)))
