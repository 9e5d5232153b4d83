"""int8 over budget: keep its most sensitive layers in float (and, for a detector, 8-bit weights) until the gate
passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...engines import EngineError
from ...judge.data import Dataset
from ...judge.errors import JudgeError
from ...judge.gate import GateSettings, evaluate_gate
from ...judge.predict import predict_all
from ...judge.tasks import TaskSpec
from ...protocol.manifest import Int8Scheme
from ..buildnotes import note
from ..errors import CompilerError
from ..targets.base import BuildTarget
from .candidates import Built, CompileEngines
from .choose import benchmark_points
from .report import gate_summary, one_line


def full_weights(first: Built, fell: Built, scheme: Int8Scheme, source: Path, target: BuildTarget,
                  engines: CompileEngines, calib: Dataset, work: Path, eval_set: Dataset, ref_out: list[Any],
                  gate: GateSettings, task: TaskSpec, benchmark: bool, steps: tuple[str, ...]) -> Built:
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
        return Built("int8", fell.engine, fell.runner, fell.quantization.model_copy(update={
            "fallback_steps": (*steps, f"{label}: the build failed ({one_line(exc, 200)})")}), fell.accuracy)
    step = f"{label}: {gate_summary(report)}"
    note("int8 float fallback", f"rebuilt with {label}", step)
    if not report.passed:
        return Built("int8", fell.engine, fell.runner,
                      fell.quantization.model_copy(update={"fallback_steps": (*steps, step)}), fell.accuracy)
    speed = benchmark_points(first.runner, runner, eval_set, engines.profile) if benchmark else ()
    return Built("int8", engine, runner, quant.model_copy(update={
        "fallback_steps": (*steps, step), "fallback_speed": speed,
        "reason": f"{quant.reason}; the first build's {len(keep)} float nodes kept in float"}), report)


def float_fallback(full: Built, source: Path, target: BuildTarget, engines: CompileEngines, calib: Dataset,
                    work: Path, eval_set: Dataset, ref_out: list[Any], gate: GateSettings, task: TaskSpec,
                    benchmark: bool) -> Built:
    """Keep the 1, 2, 4, ... layers that lose the most to quantization in float (up to a quarter of the
    compute layers) until the gate passes; return the first build that passes, else the full one. The build
    target prepares and quantizes (a target whose int8 is ONNX QDQ: ``qdq_int8_min_opset``), in ``full``'s scheme."""
    import onnx

    from ..sensitivity import rank_sensitive_nodes

    info, profile = engines.info, engines.profile
    prepared = target.prepare_float(source, work / "prepared.onnx")
    steps = [f"all layers int8: {gate_summary(full.accuracy)}"]
    scheme = full.quantization.scheme if full.quantization is not None else None
    try:
        ranked = rank_sensitive_nodes(prepared, full.engine,
                                      calib.head(1 if calib.per_sample else info.fixed_batch or 8).inputs)
    except Exception as exc:  # onnxruntime and onnx raise assorted types; the full build still stands
        steps.append(f"could not rank the layers ({type(exc).__name__}: {str(exc)[:200]}); no fallback")
        assert full.quantization is not None
        return Built("int8", full.engine, full.runner,
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
                         f"({one_line(exc, 200)})")
            continue
        steps.append(f"{len(keep)} layer{'s' if len(keep) > 1 else ''} in float ({', '.join(keep)}): "
                     f"{gate_summary(report)}")
        if report.passed:
            note("int8 float fallback", f"{len(keep)} layer(s) kept in float ({', '.join(keep)})", steps[0])
            speed = benchmark_points(full.runner, runner, eval_set, profile) if benchmark else ()
            quant = quant.model_copy(update={"fallback_steps": tuple(steps), "fallback_speed": speed})
            return Built("int8", engine, runner, quant, report)
    steps.append(f"gave up: keeping more than {limit} of {layers} layers in float defeats int8")
    note("int8 float fallback", f"tried {len(steps) - 2} step(s) keeping layers in float: none passed", steps[-2])
    assert full.quantization is not None
    return Built("int8", full.engine, full.runner,
                  full.quantization.model_copy(update={"fallback_steps": tuple(steps)}), full.accuracy)
