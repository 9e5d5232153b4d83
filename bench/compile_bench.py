"""Compiler benchmark: INT8 engines against their FP32 source on the zoo models, measured in one run.

For each zoo model (models/zoo/make_zoo.py: MobileNetV2-like and ResNet-18-like, built on first use):

1. compile it with ``compiler.compile.compile_model`` for ``x86-cpu``, and for ``x86-cpu-vnni`` unless this
   CPU saturates full-range int8 (AVX2 without VNNI, where the compiler refuses to gate that profile),
   with ``precision="int8"``, ``max_accuracy_drop=1.0`` (speed only: no gate can stop it) and no benchmark;
   then compile again with identical options, timing both (with a fresh build cache, so the first compile
   is cold and the second may be a cache hit; ``--no-cache`` builds both times);
2. time the FP32 source model against the bundle's INT8 engine in onnxruntime at batch 1 and 16: warm-up,
   then a fixed number of iterations alternating which runs first (``compiler.benchmark.benchmark_pair``);
   the medians and their ratio are reported. Both run through ``engines.load``, the code the compiler's gate
   and the agent share (the profile's intra-op threads, 2; one inter-op thread; thread spinning off). For
   ``arm64-cpu`` (LiteRT), the FP32 and full-integer INT8 ``.tflite`` engines the compiler builds are timed
   against each other through LiteRT (XNNPACK);
3. top-1 agreement of INT8 with FP32 over eval.npz (whose labels are the FP32 model's own argmax).

The machine's speed drifts, so only ratios measured within one run mean anything.

Run from the repository root:  .venv/bin/python bench/compile_bench.py --quick
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from _common import load_zoo, run_and_report, say

MODELS = ("mobilenetv2", "resnet18")
PROFILES = ("x86-cpu", "x86-cpu-vnni", "arm64-cpu")
LITERT_PROFILES = ("arm64-cpu",)  # LiteRT (XNNPACK) engines, which run on this x86 host too
SESSIONS = ("engines",)  # one implementation per runtime since the engines layer: the gate's is the agent's
VNNI_PROFILES = ("x86-cpu-vnni",)
BATCHES = (1, 16)
# (warm-up, timed iterations) per batch size; every loop is bounded
ITERATIONS = {1: (5, 60), 16: (2, 15)}
QUICK_ITERATIONS = {1: (2, 15), 16: (1, 4)}
Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]  # as compiler.benchmark.Runner


def _progress(step: int, total: int, what: str) -> None:
    say(f"    [{step}/{total}] {what}")


def compile_twice(model_dir: Path, name: str, profile: str, work: Path, use_cache: bool,
                  precision: str = "int8", times_: int = 2) -> dict[str, Any]:
    """Compile the same inputs twice; -> the bundle, its manifest and both wall times."""
    from edgefleet.compiler.compile import CompileOptions, compile_model

    opts = CompileOptions(
        model=model_dir / "model.onnx", profile=profile, calibration=model_dir / "calibration.npz",
        eval=model_dir / "eval.npz", out_dir=work / f"dist-{precision}", name=name, version="1.0.0",
        precision=precision,  # type: ignore[arg-type]
        max_accuracy_drop=1.0, benchmark=False, cache_dir=work / "cache" if use_cache else None)
    times: list[float] = []
    cached: list[bool] = []
    for attempt in ("first", "second")[:times_]:
        say(f"  compile {name} {precision} for {profile} ({attempt})")
        t0 = time.perf_counter()
        result = compile_model(opts, _progress)
        times.append(time.perf_counter() - t0)
        cached.append(result.cached)
    return {"bundle": result.bundle, "manifest": result.manifest, "first_s": round(times[0], 2),
            "second_s": round(times[-1], 2), "second_cached": cached[-1]}


def _runners(sessions: str, fp32_model: Path, engine: Path, profile: Any, manifest: Any) -> tuple[Runner, Runner]:
    """(fp32, int8) runners: the engines the compiler gates and the agent serves (engines.load), onnxruntime's
    or, for a LiteRT profile, both .tflite engines."""
    from edgefleet import engines
    kind = "litert" if sessions == "litert" else "onnxruntime"
    pair = []
    for path, precision in ((fp32_model, "fp32"), (engine, "int8")):  # the fp32 source has the bundle's names
        spec = engines.EngineSpec(manifest.inputs, manifest.outputs, precision, profile.name,
                                  f"{precision} {path.name}")
        pair.append(engines.load(kind, path, spec, profile.runtime.intra_op_threads).infer)
    return pair[0], pair[1]


def measure(model_dir: Path, engine: Path, profile_name: str, manifest: Any, sessions: str,
            iterations: dict[int, tuple[int, int]], fp32_engine: Path | None = None) -> dict[str, Any]:
    """FP32 source vs INT8 engine: batch timings (alternating) and top-1 agreement over eval.npz."""
    from edgefleet.compiler.benchmark import benchmark_pair
    from edgefleet.judge.data import Dataset
    from edgefleet.judge.predict import predict_all
    from edgefleet.protocol.profile import load_profile

    profile = load_profile(profile_name)
    fp32, int8 = _runners(sessions, fp32_engine or model_dir / "model.onnx", engine, profile, manifest)
    with np.load(model_dir / "eval.npz") as npz:
        data = Dataset({"input": npz["input"]}, npz["labels"])
    rows = []
    for batch in BATCHES:
        warmup, iters = iterations[batch]
        (f50, _), (i50, _) = benchmark_pair(fp32, int8, data, batch, iters, warmup)
        rows.append({"batch": batch, "fp32_ms": round(f50, 3), "int8_ms": round(i50, 3),
                     "speedup": round(f50 / i50, 3) if i50 > 0 else None, "iterations": iters})
    assert data.labels is not None
    fp32_top1 = predict_all(fp32, data, batch=16)[0].argmax(axis=1)
    int8_top1 = predict_all(int8, data, batch=16)[0].argmax(axis=1)
    return {
        "sessions": sessions,
        "threads": profile.runtime.intra_op_threads,
        "points": rows,
        "top1_agreement": round(float((int8_top1 == fp32_top1).mean()), 4),
        "fp32_matches_labels": round(float((fp32_top1 == data.labels).mean()), 4),  # 1.0 unless a CPU differs
        "eval_samples": len(data),
        "eval_classes": len(set(data.labels.tolist())),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import onnxruntime

    from edgefleet.protocol.bundle import extract_bundle
    from edgefleet.protocol.cpu import cpu_features, u8s8_saturates

    t_start = time.perf_counter()
    zoo = load_zoo()
    iterations = QUICK_ITERATIONS if args.quick else ITERATIONS
    saturates = u8s8_saturates()
    from edgefleet.compiler import toolchain

    litert_ready = toolchain.status("tflite").installed
    profiles = [p for p in args.profiles if not (p in VNNI_PROFILES and saturates)
                and not (p in LITERT_PROFILES and not litert_ready)]
    skipped = [{"profile": p, "reason": "this CPU has AVX2 without VNNI (protocol.cpu.u8s8_saturates()): full-range "
                "int8 saturates here, so the compiler will not gate a VNNI build on it" if p in VNNI_PROFILES else
                "the tflite toolchain is not installed: run `edgefleet toolchain install tflite`"}
               for p in args.profiles if p not in profiles]
    for s in skipped:
        say(f"skipping {s['profile']}: {s['reason']}")
    results: list[dict[str, Any]] = []
    compiles: list[dict[str, Any]] = []
    for name in args.models:
        say(f"{name}: making sure models/zoo/build/{name} is current")
        model_dir = zoo.ensure(name)
        for profile in profiles:
            c = compile_twice(model_dir, name, profile, work / name / profile, not args.no_cache)
            manifest = c["manifest"]
            engine_dir = work / name / profile / "engine"
            extract_bundle(c["bundle"], engine_dir)
            scheme = manifest.quantization.scheme if manifest.quantization is not None else manifest.precision
            fp32_engine: Path | None = None
            if profile in LITERT_PROFILES:  # FP32 LiteRT is a .tflite of its own, not the ONNX source
                f = compile_twice(model_dir, name, profile, work / name / profile, not args.no_cache, "fp32", 1)
                extract_bundle(f["bundle"], work / name / profile / "fp32")
                fp32_engine = work / name / profile / "fp32" / f["manifest"].engine
            for sessions in (["litert"] if profile in LITERT_PROFILES else args.sessions):
                say(f"  timing {name} fp32 vs int8 ({profile}, {scheme}, {sessions} sessions)")
                m = measure(model_dir, engine_dir / manifest.engine, profile, manifest, sessions, iterations,
                            fp32_engine)
                results.append({"model": name, "profile": profile, "scheme": scheme, **m})
            compiles.append({"model": name, "profile": profile, "first_s": c["first_s"], "second_s": c["second_s"],
                             "second_cached": c["second_cached"], "cache": not args.no_cache,
                             "bundle_bytes": c["bundle"].stat().st_size})
    return {
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "host": {"cpu_features": sorted(cpu_features()), "u8s8_saturates": saturates,
                 "onnxruntime": onnxruntime.__version__},
        "quick": args.quick,
        "skipped": skipped,
        "results": results,
        "compiles": compiles,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }


def print_report(doc: dict[str, Any], out: TextIO) -> None:
    def p(line: str = "") -> None:
        print(line, file=out)

    p(f"onnxruntime {doc['host']['onnxruntime']}; CPU: {' '.join(doc['host']['cpu_features'])}")
    p()
    head = f"{'model':<12} {'profile':<13} {'int8 scheme':<13} {'sessions':<9} {'batch':>5} {'fp32 ms':>9} " \
           f"{'int8 ms':>9} {'speedup':>8} {'top-1 agree':>11}"
    p(head)
    p("-" * len(head))
    for r in doc["results"]:
        for pt in r["points"]:
            speed = f"{pt['speedup']:.2f}x" if pt["speedup"] is not None else "-"
            p(f"{r['model']:<12} {r['profile']:<13} {r['scheme']:<13} {r['sessions']:<9} {pt['batch']:>5} "
              f"{pt['fp32_ms']:>9.2f} {pt['int8_ms']:>9.2f} {speed:>8} {r['top1_agreement']:>11.4f}")
    for r in doc["results"]:
        if r["fp32_matches_labels"] < 1.0:
            p(f"note: {r['model']}: the FP32 model here matches eval.npz's labels on only "
              f"{r['fp32_matches_labels']:.4f} of the samples")
    if doc["results"]:
        r0 = doc["results"][0]
        p(f"(medians of {', '.join(str(pt['iterations']) for pt in r0['points'])} alternating iterations at batch "
          f"{', '.join(str(pt['batch']) for pt in r0['points'])}; {r0['threads']} intra-op threads; top-1 agreement "
          f"over {r0['eval_samples']} eval images, whose FP32 labels fall in "
          + ", ".join(f"{r['eval_classes']} classes ({r['model']})" for r in doc["results"]
                      if r["profile"] == r0["profile"] and r["sessions"] == r0["sessions"]) + ")")
        p("sessions: engines = onnxruntime through engines.load (what the gate measures and the agent serves); "
          "litert = LiteRT (XNNPACK) FP32 .tflite vs full-integer INT8 .tflite")
    for s in doc["skipped"]:
        p(f"skipped {s['profile']}: {s['reason']}")
    p()
    head = f"{'model':<12} {'profile':<13} {'first compile s':>15} {'second compile s':>16}  second"
    p(head)
    p("-" * len(head))
    for c in doc["compiles"]:
        how = "reused the build cache" if c["second_cached"] else \
            "built again" + ("" if c["cache"] else " (--no-cache)")
        p(f"{c['model']:<12} {c['profile']:<13} {c['first_s']:>15.1f} {c['second_s']:>16.1f}  {how}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="INT8 vs FP32 speed of compiled zoo models, measured in one run.")
    ap.add_argument("--quick", action="store_true", help="fewer timed iterations (about a quarter)")
    ap.add_argument("--json", action="store_true", help="print JSON on stdout (the table goes to stderr)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    ap.add_argument("--sessions", default="engines", help="engines (the only one: onnxruntime through "
                    "engines.load, as the gate measures and the agent serves)")
    ap.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated (default: all of "
                    f"{','.join(PROFILES)}; arm64-cpu builds LiteRT engines, which need the tflite toolchain)")
    ap.add_argument("--no-cache", action="store_true", help="compile without a build cache (the second compile "
                    "then builds again)")
    ap.add_argument("--work-dir", type=Path, help="keep bundles here (default: a temporary folder)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.sessions = [m for m in args.sessions.split(",") if m]
    args.profiles = [m for m in args.profiles.split(",") if m]
    for opt, given, known in (("--models", args.models, MODELS), ("--sessions", args.sessions, SESSIONS),
                              ("--profiles", args.profiles, PROFILES)):
        unknown = [g for g in given if g not in known]
        if unknown or not given:
            ap.error(f"{opt} takes some of {', '.join(known)}, not {','.join(unknown) or 'nothing'}")
    return run_and_report(args, run, print_report, "edgefleet-compile-bench-")


if __name__ == "__main__":
    raise SystemExit(main())
