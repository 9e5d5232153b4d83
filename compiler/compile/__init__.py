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
import tempfile
from pathlib import Path

from ...engines.onnxruntime import CPU
from ...judge.predict import predict_all
from ...protocol.profile import load_profile
from ..buildnotes import collecting
from ..cache import BuildCache
from ..graph import check_model
from ..source import source_model
from ..targets import get_target
from .build import build_candidates
from .bundle import make_bundle, with_drift
from .candidates import CompileEngines
from .choose import Measured, choose_precision
from .options import (
    REFERENCE_RUNTIME,
    CompileOptions,
    CompileResult,
    Progress,
    compiler_errors,
    gate_settings,
    no_progress,
    validate,
)
from .plan import build_cache_key, make_plan, quantized_input
from .report import task_figures

__all__ = ["REFERENCE_RUNTIME", "CompileOptions", "CompileResult", "Measured", "Progress", "choose_precision",
           "compile_model", "compiler_errors", "task_figures", "with_drift"]


def compile_model(opts: CompileOptions, progress: Progress = no_progress) -> CompileResult:
    """Build, gate, benchmark and bundle; errors of the engines it runs and of the judge it gates with are
    translated here: a feed the engine refuses, or data the judge cannot judge, is the data's fault (InputError),
    any other engine failure the toolchain's."""
    with compiler_errors(), collecting(), tempfile.TemporaryDirectory(prefix="edgefleet-model-") as tmp:
        # external data embedded, a fixed batch made dynamic (compiler.source): one self-contained file from here on
        return _compile(dataclasses.replace(opts, model=source_model(opts.model, Path(tmp), progress)), progress)


def _compile(opts: CompileOptions, progress: Progress = no_progress) -> CompileResult:
    total = 7
    validate(opts)
    progress(1, total, f"loading profile {opts.profile}")
    profile = load_profile(opts.profile)
    gate = gate_settings(opts, profile)
    target = get_target(profile.backend)

    progress(2, total, f"checking graph {opts.model}")
    info = check_model(opts.model)
    given = quantized_input(opts, profile, target)
    out = opts.out_dir / f"{opts.name}-{opts.version}-{profile.name}.tar"
    cache = cache_key = None
    if opts.cache_dir is not None:
        cache = BuildCache(opts.cache_dir)
        cache_key = build_cache_key(cache, opts, profile, target, given)
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        hit = cache.get(cache_key, out)
        if hit is not None:
            progress(total, total, f"unchanged inputs: reused the bundle built {hit.created_at}")
            return CompileResult(bundle=out, manifest=hit, cached=True)
    plan = make_plan(opts, progress, profile, gate, target, info, out, given)

    opts.out_dir.mkdir(parents=True, exist_ok=True)
    engines = CompileEngines(plan.info, profile)
    with tempfile.TemporaryDirectory(prefix="edgefleet-build-", dir=opts.out_dir) as tmp, contextlib.closing(engines):
        work = Path(tmp)
        progress(3, total, "running the fp32 reference")
        reference = engines.open(REFERENCE_RUNTIME, opts.model, "fp32", "the fp32 reference (source model)", (CPU,))
        ref_out = predict_all(reference, plan.eval_set, output_axes=[o.batch_axis for o in plan.info.outputs])
        built = build_candidates(plan, engines, work, ref_out)
        manifest = make_bundle(plan, engines, work, built, reference, ref_out)
    if cache is not None and cache_key is not None:
        cache.put(cache_key, out)
    return CompileResult(bundle=out, manifest=manifest)
