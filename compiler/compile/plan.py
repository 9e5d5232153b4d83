"""Checking the source: the data, the task and the precisions to build, each left out with its reason when this
host cannot build or gate it; a model that came quantized is built as given."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ... import protocol
from ...judge.data import Dataset, load_for_model
from ...judge.gate import GateSettings, uses_labels
from ...judge.tasks import TaskSpec, resolve_task
from ...protocol.cpu import cpu_arch, cpu_features, u8s8_saturates
from ...protocol.manifest import MANIFEST_VERSION
from ...protocol.preprocess import Preprocessing, default_preprocessing, load_preprocessing
from ...protocol.profile import HardwareProfile, resolve_profile_path
from .. import bf16 as _bf16
from ..advice import Causes
from ..cache import BuildCache
from ..errors import InputError, ToolchainError
from ..graph import GraphInfo, probe_batching, quantized_ops, quantized_phrase
from ..targets.base import BuildTarget
from .options import MIN_CALIBRATION_SAMPLES, CompileOptions, Progress


@dataclass
class Plan:
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


def make_plan(opts: CompileOptions, progress: Progress, profile: HardwareProfile, gate: GateSettings,
          target: BuildTarget, info: GraphInfo, out: Path, given: str = "") -> Plan:
    """The data, the task and the precisions to build, each left out with its reason when this host cannot build or
    gate it; a model ``given`` quantized (:func:`quantized_input`) is built once, as given."""
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
    plan = Plan(opts, progress, profile, gate, target, info, out, prep, eval_set, task,
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


def quantized_input(opts: CompileOptions, profile: HardwareProfile, target: BuildTarget) -> str:
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


def data_files(path: Path | None) -> list[Path | None]:
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


def build_cache_key(cache: BuildCache, opts: CompileOptions, profile: HardwareProfile, target: BuildTarget,
                    given: str) -> str:
    """The build cache's key (compiler.cache): every input file, every option that changes the bundle, the
    toolchain's and this host's make; a model ``given`` quantized is keyed as such."""
    params = {k: v for k, v in vars(opts).items() if k not in ("model", "calibration", "eval", "out_dir",
                                                               "cache_dir", "profile", "preprocess",
                                                               "keep_engines")}
    return cache.key([opts.model, resolve_profile_path(opts.profile), opts.preprocess,
                      *data_files(opts.calibration), *data_files(opts.eval)], {
        **params, "edgefleet": protocol.__version__, "manifest_version": MANIFEST_VERSION,
        "toolchain": target.toolchain_versions(), "host": sorted(cpu_features()),
        **_bf16.cache_key(profile), **({"as_given": given} if given else {})})
