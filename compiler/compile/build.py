"""Building and gating each wanted precision against the fp32 reference; an int8 build over budget goes to
:mod:`.float_fallback`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ...engines import EngineError
from ...judge.data import Dataset
from ...judge.errors import InputError as JudgeInputError
from ...judge.errors import JudgeError
from ...judge.gate import GateSettings, evaluate_gate, uses_labels
from ...judge.predict import predict_all
from ...judge.tasks import TaskSpec, infer_task, judge
from ...protocol.manifest import AccuracyReport
from .. import bf16 as _bf16
from ..advice import Causes, measure_causes
from ..buildnotes import note
from ..errors import AccuracyGateFailed, CompilerError, InputError, ToolchainError
from ..graph import GraphInfo, ensure_opset
from ..targets.base import BuildTarget
from .candidates import Built, CompileEngines
from .float_fallback import float_fallback, full_weights
from .plan import Plan
from .report import one_line


def _gate_task(plan: Plan, ref_out: list[Any]) -> TaskSpec | None:
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


def build_candidates(plan: Plan, engines: CompileEngines, work: Path, ref_out: list[Any]) -> dict[str, Built]:
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
            plan.drop("int8", f"opset {info.opset} could not be converted for QDQ: {one_line(exc)}")
    plan.progress(4, plan.total, f"building and gating {plan.profile.backend} {' and '.join(wanted)}")
    built: dict[str, Built] = {}
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
            why = one_line(exc)
            if not plan.auto or len(wanted) == 1:
                raise InputError(f"cannot build {precision} for this model: {why}; the fp32 model runs, so "
                                 "--precision auto ships fp32 and says why (or compile with --precision fp32)"
                                 ) from exc
            note(f"{precision} build", "left out: the other precisions ship", why)
            plan.drop(precision, f"its build failed: {why}")  # auto: fp32 still ships

    int8 = built.get("int8")
    if int8 is not None and not int8.accuracy.passed and not plan.given:  # measured only if the refusal needs advice
        plan.causes = lambda: _causes(plan, engines, work, source, ref_out, built["int8"], gate_task)
    if (int8 is not None and not int8.accuracy.passed and opts.fallback and plan.calib is not None
            and min_opset is not None):
        timed = opts.benchmark and plan.profile.accelerator == "cpu"
        plan.progress(4, plan.total, "int8 over budget: keeping the most sensitive layers in float")
        built["int8"] = fell = float_fallback(int8, source, target, engines, plan.calib, work, plan.eval_set,
                                               ref_out, plan.gate, plan.task, timed)
        wide = target.full_weight_scheme(plan.profile)
        if not fell.accuracy.passed and wide is not None and gate_task is not None and gate_task.name == "detection":
            plan.progress(4, plan.total, f"int8 over budget: 8-bit weights ({wide}, exact on every CPU of the profile)")
            assert fell.quantization is not None
            built["int8"] = full_weights(int8, fell, wide, source, target, engines, plan.calib, work, plan.eval_set,
                                          ref_out, plan.gate, gate_task, timed, fell.quantization.fallback_steps)
    if plan.given:  # what the file computes: its integer kernels, judged against the model itself
        b = built.pop("fp32")
        acc = b.accuracy.model_copy(update={"candidate_precision": "int8", "reference_precision": "int8"})
        built["int8"] = Built("int8", b.engine, b.runner, None, acc)
    if opts.keep_engines is not None:  # for a caller that measures the candidates itself (bench/corpus.py)
        opts.keep_engines.mkdir(parents=True, exist_ok=True)
        for b in built.values():
            shutil.copyfile(b.engine, opts.keep_engines / f"{b.precision}{engines.runtime.suffix}")
    return built


def _causes(plan: Plan, engines: CompileEngines, work: Path, source: Path, ref_out: list[Any], b: Built,
            task: TaskSpec | None) -> Causes:
    """Why ``b`` (int8) failed the gate, measured (compiler.advice.measure_causes): its answers against fp32's, its
    calibration range, its layers (when the float fallback was off) and a trial on half the calibration set."""
    info, calib = plan.info, plan.calib
    cand = predict_all(b.runner, plan.eval_set, output_axes=[o.batch_axis for o in info.outputs])
    names = [o.name for o in info.outputs]

    def rank() -> list[tuple[tuple[str, ...], float]]:
        from ..sensitivity import rank_sensitive_nodes

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
        plan.progress(5, plan.total, f"note: the causes of the int8 failure could not be measured ({one_line(exc)})")
        return Causes()


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
        return f"the {task.name} gate cannot judge this model's outputs ({one_line(exc)})"
    return None


def _build_and_gate(target: BuildTarget, model: Path, engines: CompileEngines, precision: str,
                    calib: Dataset | None, work: Path, eval_set: Dataset, ref_out: list[Any],
                    gate: GateSettings, task: TaskSpec | None) -> Built:
    if precision == "bf16":
        return _build_and_gate_bf16(target, model, engines, work, eval_set, ref_out, gate, task)
    info, profile = engines.info, engines.profile
    engine = work / f"model-{precision}{engines.runtime.suffix}"
    # int8 calibrates on the calibration set; a TensorRT float build still needs sample inputs: it
    # fixes the dynamic dimensions other than the batch (a detector's H and W) at their size
    data = calib if precision == "int8" else eval_set.head(1) if target.float_build_needs_samples else None
    if (precision == "int8" and target.qdq_int8_min_opset is not None and task is not None
            and task.name == "detection" and data is not None):
        from ..sensitivity import quantize_keeping_head  # boxes and scores keep their own ranges

        quant = quantize_keeping_head(model, profile, data, engine, task.output)
    else:
        quant = target.build(model, info, precision, profile, data, engine)
    kind = engines.runtime.name
    runner = engines.open(kind, engine, precision, f"the {precision} {kind} candidate")
    cand_out = predict_all(runner, eval_set, output_axes=[o.batch_axis for o in info.outputs])
    report = evaluate_gate([o.name for o in info.outputs], ref_out, cand_out, eval_set.labels, precision, gate, task)
    return Built(precision, engine, runner, quant, report)


def _build_and_gate_bf16(target: BuildTarget, model: Path, engines: CompileEngines, work: Path, eval_set: Dataset,
                         ref_out: list[Any], gate: GateSettings, task: TaskSpec | None) -> Built:
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
    return Built("bf16", engine, runner, None, report)
