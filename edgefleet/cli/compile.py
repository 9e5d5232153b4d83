"""``edgefleet compile`` and ``edgefleet compile-pipeline``: build a bundle (a model, or a detector + reader
pipeline) for a hardware profile, and print what the build measured."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from edgefleet.cli.command import Formatter, UsageError, command
from edgefleet.progress import progress_bar
from edgefleet.protocol.errors import EdgefleetError
from edgefleet.protocol.exits import ExitCode, exit_for


@command("compiler", imports=("edgefleet.compiler.compile", "edgefleet.compiler.fallback"))
def cmd_compile(a: argparse.Namespace) -> int:
    from edgefleet.compiler.fallback import choose as choose_fallback
    from edgefleet.protocol.profile import list_profiles

    profiles = list_profiles() if a.profile == "all" else [p.strip() for p in a.profile.split(",") if p.strip()]
    if not profiles:
        raise UsageError("--profile names no profile")
    matrix = len(profiles) > 1
    results: list[dict[str, Any]] = []
    done: dict[str, dict[str, Any]] = {}  # profile built -> its result: a fallback also asked for is built once
    first_failure = ExitCode.OK
    for i, profile in enumerate(profiles, start=1):
        fallback = None if a.no_cpu_fallback else choose_fallback(profile)
        build = fallback.profile_arg if fallback is not None else profile
        label = f"[{i}/{len(profiles)} {profile}] " if matrix else ""
        if build in done:  # built already in this compile (as asked, or as another profile's fallback)
            r = {**done[build], "seconds": 0.0}
        else:
            r = done[build] = _compile_one(a, build, label)
        if fallback is not None:
            # one entry per profile asked for; the bundle (and its manifest) is the fallback's
            r = {**r, "profile": profile, "cpu_fallback": fallback.as_json()}
            if r["ok"]:
                print(fallback.line(), file=sys.stderr)
            else:
                r["error"] = (f"{fallback.reason}; building its CPU fallback {fallback.built} instead failed: "
                              f"{r['error']}")
        if not r["ok"]:
            first_failure = first_failure or r["exit_code"]
            if not a.json:
                sys.stderr.write("\n")
                print(f"error: {label}{r['error']}", file=sys.stderr)
        elif not matrix and not a.json:
            print(_compile_summary(Path(r["bundle"]), r.pop("_manifest"), r["cached"]))
        r.pop("_manifest", None)
        results.append(r)
    if a.json:
        print(json.dumps({"ok": first_failure == ExitCode.OK, "builds": results} if matrix else results[0], indent=2))
    elif matrix:
        print(_matrix_table(results))
    return first_failure


def _compile_one(a: argparse.Namespace, profile: str, label: str) -> dict[str, Any]:
    """One build; a failure is a result (``ok`` false, its exit code), not an exception."""
    from edgefleet.compiler.cache import default_cache_dir
    from edgefleet.compiler.compile import CompileOptions, compile_model

    opts = CompileOptions(
        model=a.model, profile=profile, calibration=a.calibration, eval=a.eval, out_dir=a.out,
        name=a.name or _default_name(a.model), version=a.version, precision=a.precision,
        max_accuracy_drop=a.max_accuracy_drop, benchmark=not a.no_benchmark, gate=a.gate,
        min_agreement=a.min_agreement, agreement_metric=a.agreement_metric,
        cache_dir=None if a.no_cache else default_cache_dir(), preprocess=a.preprocess,
        fallback=not a.no_fallback, task=a.task, task_args=a.task_args)
    progress = (lambda *_: None) if a.json or a.quiet else (
        lambda step, total, what, label=label: progress_bar(step, total, label + what))
    t0 = time.monotonic()
    try:
        result = compile_model(opts, progress)
    except EdgefleetError as exc:
        code, line = exit_for(exc)
        return {"ok": False, "profile": profile, "error": line, "kind": type(exc).__name__, "exit_code": code,
                "seconds": round(time.monotonic() - t0, 2)}
    m = result.manifest
    return {"ok": True, "profile": profile, "bundle": str(result.bundle), "cached": result.cached,
            "seconds": round(time.monotonic() - t0, 2), "manifest": m.model_dump(mode="json"), "_manifest": m}


def _default_name(model: Path) -> str:
    """The model's folder name (or file stem) as a registry name: lower case, [a-z0-9._-]."""
    import re

    raw = model.parent.name if model.parent.name not in ("", ".") else model.stem
    return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-._")[:63] or "model"


def _compile_summary(bundle: Path, m: Any, cached: bool) -> str:
    acc = m.accuracy
    if acc.task is not None:
        figure = (f"{acc.task.metric.replace('_', ' ')} {acc.task.value:.4f} against {acc.reference_precision} "
                  f"({'passed' if acc.passed else 'FAILED'} the {acc.task.task} gate, {acc.eval_samples} samples)")
    elif acc.metric == "agreement":
        worst = min(acc.outputs, key=lambda o: o.value)
        figure = (f"agreement with {acc.reference_precision} {acc.candidate:.4f} (worst output {worst.name!r} by "
                  f"{worst.metric.replace('_', ' ')}; needed {1 - acc.max_drop:.4f}, {acc.eval_samples} samples)")
    else:
        ci = f", 95% CI {acc.drop_ci95[0]:+.4f}..{acc.drop_ci95[1]:+.4f}" if acc.drop_ci95 else ""
        figure = (f"top-1 {acc.candidate_precision} {acc.candidate:.4f}  vs {acc.reference_precision} "
                  f"{acc.reference:.4f}  (drop {acc.drop:+.4f}{ci}, allowed {acc.max_drop:.4f}, "
                  f"{acc.eval_samples} samples)")
    lines = [f"bundle    {bundle}" + ("  (reused from the build cache: inputs unchanged)" if cached else ""),
             f"model     {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision}",
             f"accuracy  {figure}"]
    if acc.task is not None:
        from edgefleet.compiler.compile import task_figures

        t = acc.task
        lines.append(f"task      {t.task} ({t.source}) on output {t.output!r}: {task_figures(t)}")
    if acc.not_judged:
        moved = {k.split(".", 1)[1]: v for k, v in (acc.task.details if acc.task else {}).items()
                 if k.startswith("unjudged_rel_l2.")}
        lines.append("not judged " + ", ".join(f"{o!r}" + (f" (relative L2 vs fp32 {moved[o]:.3g})" if o in moved
                                                           else "") for o in acc.not_judged)
                     + ": no task reads it; declare its task in a --task list to judge it")
    for o in acc.outputs:
        t1 = "" if o.top1_agreement is None else f"top-1 agreement {o.top1_agreement:.4f}, "
        lines.append(f"output    {o.name}: {t1}cosine {o.cosine:.4f}, max abs error {o.max_abs_error:.4g}, "
                     f"mean abs error {o.mean_abs_error:.4g}")
    if m.precision_choice is not None:
        for c in m.precision_choice.candidates:
            if c.precision != m.precision and c.top1 is not None:
                what = "agreement" if c.metric == "agreement" else "top-1"
                shipped = "; shipped too: the device times it" if c.precision in m.precisions else ""
                lines.append(f"also      {what} {c.precision} {c.top1:.4f} (drop {c.drop:+.4f}, "
                             f"{'passed' if c.passed else 'FAILED'} the gate)" + (f"; {c.note}" if c.note else "")
                             + shipped)
            elif c.note:
                lines.append(f"also      {c.precision}: {c.note}")
    if m.quantization is not None:
        q = m.quantization
        lines.append(f"int8      {q.scheme} ({q.activation_type} activations, {q.weight_bits}-bit {q.weight_type} "
                     f"weights): {q.reason}")
        for step in q.fallback_steps:
            lines.append(f"fallback  {step}")
        for p in q.fallback_speed:
            lines.append(f"fallback  speed at batch {p.batch_size}: {p.speedup:.2f}x of all-int8")
    for n in getattr(m, "build_notes", ()):  # every retry, fallback and workaround of the build
        lines.append(f"build     {n.step}: {n.action}" + (f" ({n.reason})" if n.reason else ""))
    if m.benchmark:
        ref, cand = m.benchmark.reference_precision, m.benchmark.candidate_precision or acc.candidate_precision
        for p in m.benchmark.points:
            p99 = f", p99 {p.reference_ms_p99:.3f} / {p.candidate_ms_p99:.3f} ms" if p.candidate_ms_p99 else ""
            lines.append(f"latency   batch {p.batch_size:>3}: {ref} {p.reference_ms_p50:.3f} ms, "
                         f"{cand} {p.candidate_ms_p50:.3f} ms p50 ({p.speedup:.2f}x){p99}")
    if m.build_host is not None:
        lines.append(f"built on  {m.build_host.arch} with {', '.join(m.build_host.cpu_features)}; "
                     f"the engine needs {', '.join(m.cpu_features) or 'no particular CPU feature'}")
    if m.engine_compatibility:
        lines.append("engine    needs " + ", ".join(f"{k} {v}" for k, v in sorted(m.engine_compatibility.items())))
    if m.precision_choice is not None:
        lines.append(f"chose     {m.precision_choice.reason}")
    return "\n".join(lines)


def _matrix_table(results: list[dict[str, Any]]) -> str:
    head = f"{'PROFILE':<18} {'BACKEND':<12} {'PREC':<5} {'SIZE':>9} {'FIDELITY':<22} {'LATENCY b1':>11} STATUS"
    rows = [head]
    for r in results:
        fb = r.get("cpu_fallback")
        asked = r["profile"]
        if not r["ok"]:
            rows.append(f"{asked:<18} {'–':<12} {'–':<5} {'–':>9} {'–':<22} {'–':>11} FAILED: {r['error']}")
            continue
        m = r["manifest"]
        acc = m["accuracy"]
        task = acc.get("task")
        fid = (f"top-1 {acc['candidate']:.4f} (-{acc['drop']:.4f})" if acc["metric"] == "top1"
               else f"{task['task']} {task['value']:.4f}" if task else f"agree {acc['candidate']:.4f}")
        size = sum(f["size_bytes"] for f in m["files"].values())
        bench = m.get("benchmark") or {}
        pts = bench.get("points") or []
        shipped = "candidate_ms_p50" if bench.get("candidate_precision") == m["precision"] else "reference_ms_p50"
        lat = f"{pts[0][shipped]:.3f} ms" if pts else "–"  # of the precision shipped
        status = "ok (cached)" if r["cached"] else "ok"
        if fb:
            status += f": built its CPU fallback {fb['built']} ({fb['reason']})"
        rows.append(f"{asked:<18} {m['backend']:<12} {m['precision']:<5} {size / 1024:>7.0f}KB {fid:<22} "
                    f"{lat:>11} {status}")
    return "\n".join(rows)


# -- compile-pipeline -------------------------------------------------------------------------------
@command("compiler", imports=("edgefleet.compiler.pipeline_bundle",),
         json_error=lambda a, line, code: {"ok": False, "pipeline": str(a.pipeline), "profile": a.profile,
                                           "error": line, "exit_code": int(code)})
def cmd_compile_pipeline(a: argparse.Namespace) -> int:
    from edgefleet.compiler.cache import default_cache_dir
    from edgefleet.compiler.pipeline_bundle import PipelineOptions, compile_pipeline

    out = a.out if a.out is not None else Path("dist") / f"{a.pipeline.parent.name or 'pipeline'}-{a.profile}.bundle"
    opts = PipelineOptions(pipeline=a.pipeline, profile=a.profile, eval=a.eval, out=out, calibration=a.calibration,
                           preprocess=a.preprocess, version=a.version, benchmark=not a.no_benchmark,
                           fallback=not a.no_fallback, cache_dir=None if a.no_cache else default_cache_dir(),
                           min_answers=a.min_answers, max_cer=a.max_cer)
    progress = (lambda *_: None) if a.json or a.quiet else progress_bar
    t0 = time.monotonic()
    r = compile_pipeline(opts, progress)
    m = r.manifest
    seconds = round(time.monotonic() - t0, 2)
    if a.json:
        print(json.dumps({"ok": True, "profile": m.profile, "bundle": str(r.bundle), "seconds": seconds,
                          "stage_seconds": r.stage_seconds, "notes": list(r.notes), "gate": list(r.gate),
                          "manifest": m.model_dump(mode="json")}, indent=2))
        return ExitCode.OK
    from edgefleet.compiler.compile import task_figures

    assert m.pipeline is not None and m.accuracy.task is not None
    lines = [f"bundle    {r.bundle}",
             f"pipeline  {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision} (lowest stage)"]
    for st in m.pipeline.stages:
        lines.append(f"stage     {st.name}: {st.precision}, engine {st.engine}; "
                     + (st.precision_choice.reason if st.precision_choice is not None else ""))
    for t in r.gate:
        lines.append(f"gate      {' and '.join(f'{k} {v}' for k, v in t['stages'].items())} ({t['how']}): "
                     f"{t['kept']} of {t['of']} end answers kept, {'passed' if t['passed'] else 'FAILED'}")
    lines.append(f"end gate  {task_figures(m.accuracy.task)} on {m.accuracy.eval_samples} images")
    lines.append(f"took      {seconds:.1f} s")
    print("\n".join(lines))
    return ExitCode.OK


def _image_options(c: argparse.ArgumentParser, calibration: str, preprocess: str) -> None:
    """--calibration and --preprocess, which both compile commands take (each says what they mean to it)."""
    c.add_argument("--calibration", type=Path, help=calibration)
    c.add_argument("--preprocess", type=Path, help=preprocess)


def _add_compile(sub: Any) -> None:
    c = sub.add_parser("compile", formatter_class=Formatter, help="compile an ONNX model into a bundle",
                       description="Check the graph, quantize (static INT8, QDQ) for the weakest CPU the profile "
                                   "admits (its cpu_features, never the build host), gate on accuracy against FP32, "
                                   "benchmark, keep the fastest precision that passes (--precision auto), and "
                                   "write a bundle archive.")
    c.add_argument("model", type=Path, help="source ONNX model with a dynamic batch dimension")
    c.add_argument("--profile", required=True,
                   help="hardware profile name (hw-profiles/NAME.yaml) or a YAML path; several as a comma list, or "
                        "'all': builds each, continues past a failed one, prints a summary table, and exits "
                        "non-zero if any failed")
    _image_options(c, "for INT8 calibration: an .npz keyed by input name, an .npy, or a folder of images (decoded "
                      "with OpenCV through --preprocess)",
                   "preprocess.yaml (input, height, width, color rgb|bgr|gray, layout nchw|nhwc, scale, mean, std): "
                   "how an image becomes the input; recorded in the bundle for the agent's image endpoint (default "
                   "with image folders: RGB in [0, 1] at the input's size)")
    c.add_argument("--eval", required=True, type=Path,
                   help=".npz with the input(s), and 'labels' if you have them, or a folder of images (one "
                        "subfolder per class gives labels): with labels the gate is top-1 accuracy against fp32, "
                        "without it is output agreement with fp32")
    c.add_argument("--name", help="model name in the registry (default: the model's folder name)")
    c.add_argument("--version", default="1.0.0", help="model version, MAJOR.MINOR.PATCH")
    c.add_argument("--precision", choices=["auto", "int8", "bf16", "fp32", "fp16"], default="auto",
                   help="auto: build every precision the profile allows and this host can gate (bf16: a CPU with "
                        "avx512_bf16 or amx_bf16 and edgefleet[openvino]), keep the fastest that passes the "
                        "accuracy gate on the profile's benchmark, and record each")
    c.add_argument("--max-accuracy-drop", type=float,
                   help="largest allowed top-1 drop versus FP32, absolute (default: the profile's accuracy.max_drop)")
    c.add_argument("--gate", choices=["auto", "accuracy", "agreement"], default="auto",
                   help="auto: accuracy when --eval has labels that fit the first output, else agreement")
    c.add_argument("--min-agreement", type=float,
                   help="agreement gate: every output's top-1 agreement (class scores, sequences) or cosine "
                        "similarity (other outputs) with fp32 must reach this (default: the profile's "
                        "accuracy.min_agreement)")
    c.add_argument("--agreement-metric", choices=["auto", "top1", "cosine"], default="auto",
                   help="how outputs are compared without labels; use cosine for embeddings")
    c.add_argument("--task", help="what the model is for, judged by the gate without labels: classification (top-1 "
                   "agreement), detection (box recall/precision/IoU), ctc (decoded strings: exact agreement, "
                   "character error rate), segmentation (mask IoU), regression (decision agreement, errors; alias "
                   "probabilities), embedding (cosine), keypoints (landmarks, pose: PCK). A model whose outputs "
                   "serve several tasks: a list 'NAME:k=v,...;NAME:output=OUT,...' (e.g. 'classification:output=prob;"
                   "keypoints:output=lms,boxes=box'), each task after the first naming its output. Default: "
                   "MODEL.task.yaml beside the model, else inferred from the output shapes (printed)")
    c.add_argument("--task-args", help="k=v,... for the (first) task, e.g. 'format=yolov8,score=0.25,iou=0.5' or "
                   "'format=centernet,wh=WH,offset=REG,landmarks=LMS' (detection), 'boxes=BOX,pck=0.05' (keypoints), "
                   "'blank=0,min_exact=0.95,max_cer=0.02' (ctc), 'threshold=0.5' (regression, segmentation), "
                   "'output=NAME' (which output the task reads)")
    c.add_argument("--no-fallback", action="store_true",
                   help="int8 over budget fails (or auto ships another precision) instead of keeping the layers "
                        "that lose most to quantization in float until it passes (onnxruntime targets)")
    c.add_argument("--no-cpu-fallback", action="store_true",
                   help="a profile whose toolchain is not on this host (TensorRT for jetson-*) fails (exit 5) instead "
                        "of building the CPU profile it names as cpu_fallback (arm64-cpu), which its devices then "
                        "get until a bundle of their own profile is uploaded")
    c.add_argument("--no-cache", action="store_true",
                   help="build even if an identical build is cached ($EDGEFLEET_CACHE_DIR or ~/.cache/edgefleet)")
    c.add_argument("--out", type=Path, default=Path("dist"), help="folder for the bundle")
    c.add_argument("--no-benchmark", action="store_true", help="skip the latency benchmark")
    c.add_argument("--json", action="store_true", help="print the result as JSON on stdout (for CI)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_compile)


def _add_compile_pipeline(sub: Any) -> None:
    c = sub.add_parser(
        "compile-pipeline", formatter_class=Formatter, help="compile a detector + reader pipeline into one bundle",
        description="Build a detect-then-read pipeline (pipeline.yaml: two stages, each an ONNX model, and the steps "
                    "between them: boxes from the detector, crops, CTC decode or top-k) for one hardware profile as "
                    "ONE bundle the agent serves as one model. The FP32 pipeline runs once on --eval: its end "
                    "answers are the reference and its crops become the reader's evaluation and calibration data. "
                    "Each stage is compiled as 'edgefleet compile' would (its precision from pipeline.yaml, default "
                    "auto; gated on its own task: segmentation for a probability-map detector, detection for a YOLO "
                    "head, ctc or classification for the reader), then the whole pipeline is gated on its end "
                    "answers against the FP32 pipeline (boxes matched at IoU 0.5, strings exact and by character "
                    "error rate). Signing happens at upload, as for compile (edgefleet fleet upload --sign-key).")
    c.add_argument("pipeline", type=Path, help="pipeline.yaml (stages' model paths relative to its folder)")
    c.add_argument("--profile", required=True, help="hardware profile name (hw-profiles/NAME.yaml) or a YAML path")
    c.add_argument("--eval", required=True, type=Path,
                   help="the detector's input images: an .npz keyed by its input name (NCHW, normalized as "
                        "crop.source says), an .npy, or a folder of images (needs --preprocess); at least 10 boxes "
                        "must be found on them for the end-answer gate to judge")
    _image_options(c, "images INT8 calibrates on, same forms as --eval (default: the --eval images; the reader "
                      "calibrates on the FP32 pipeline's crops of them)",
                   "preprocess.yaml for the detector's input (its scale/mean/std must be crop.source's): recorded so "
                   "the agent's /infer/image feeds the pipeline; needed with a folder of images")
    c.add_argument("-o", "--out", type=Path,
                   help="the bundle file to write (default dist/<pipeline folder>-<profile>.bundle)")
    c.add_argument("--version", help="the bundle's version (default: pipeline.yaml's)")
    c.add_argument("--min-answers", type=float, default=0.98,
                   help="end-answer gate: the share of the FP32 pipeline's answers (boxes found and read the same) "
                        "the built pipeline must keep")
    c.add_argument("--max-cer", type=float, default=0.02,
                   help="end-answer gate: the largest character error rate against the FP32 pipeline's strings")
    c.add_argument("--no-fallback", action="store_true",
                   help="a stage's int8 over its gate is not rescued by keeping its most sensitive layers in float")
    c.add_argument("--no-cache", action="store_true", help="build each stage even if an identical build is cached")
    c.add_argument("--no-benchmark", action="store_true", help="skip the stages' latency benchmarks")
    c.add_argument("--json", action="store_true", help="print the result as JSON on stdout (for CI)")
    c.add_argument("--quiet", action="store_true", help="no progress")
    c.set_defaults(fn=cmd_compile_pipeline)


def add_parsers(sub: Any) -> None:
    _add_compile(sub)
    _add_compile_pipeline(sub)
