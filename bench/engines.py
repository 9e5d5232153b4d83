"""Each engine's limit side by side, in one run: onnxruntime FP32 and INT8, OpenVINO f32, INT8 and bf16.

The model: MobileNetV2-like from models/zoo (built on first use), its FP32 ONNX file and the compiler's QDQ INT8
engine of it (``compile_model`` for x86-cpu-vnni where the CPU has VNNI, else x86-cpu; ``max_accuracy_drop=1.0``:
speed only). Every engine is loaded through ``engines.load`` (the code the gate and the agent run) with the same
threads (2 by default, one stream/one inter-op thread, spinning off for onnxruntime, no pinning for OpenVINO) and the
precision hint set explicitly; the bf16 row runs the FP32 file with OpenVINO's bf16 hint, where OpenVINO says the
CPU runs bf16.

The limit: one engine called back to back on a batch of eval.npz images for ``--seconds``, its images/s. The
engines take turns (every engine at one batch size, then the next round), ``--rounds`` times, the best round
counting, so a slow spell of the machine lands on all of them; each figure is printed with its ratio to
onnxruntime FP32 at the same batch size, measured in the same rounds. Answers: each engine's outputs on the 64
eval images against onnxruntime FP32 (max abs difference, top-1 agreement).

Run from the repository root:  .venv/bin/python bench/engines.py [--quick] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from _common import load_zoo, say  # noqa: E402  (bench/ is not a package)

# (label, runtime, which file, precision)
ENGINES = (
    ("onnxruntime FP32", "onnxruntime", "fp32", "fp32"),
    ("onnxruntime INT8", "onnxruntime", "int8", "int8"),
    ("OpenVINO f32", "openvino", "fp32", "fp32"),
    ("OpenVINO INT8", "openvino", "int8", "int8"),
    ("OpenVINO bf16", "openvino", "fp32", "bf16"),
)
BASELINE = "onnxruntime FP32"


def build_int8(model_dir: Path, work: Path) -> tuple[Path, Any]:
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.protocol.bundle import extract_bundle
    from edgefleet.protocol.cpu import VNNI_FEATURES, cpu_features

    profile = "x86-cpu-vnni" if cpu_features() & VNNI_FEATURES else "x86-cpu"
    say(f"compiling the INT8 engine for {profile}")
    result = compile_model(CompileOptions(
        model=model_dir / "model.onnx", profile=profile, calibration=model_dir / "calibration.npz",
        eval=model_dir / "eval.npz", out_dir=work / "dist", name="mobilenetv2", version="1.0.0", precision="int8",
        max_accuracy_drop=1.0, benchmark=False, cache_dir=REPO / "models" / "zoo" / "build" / ".bench-cache"))
    manifest = extract_bundle(result.bundle, work / "bundle")
    return work / "bundle" / manifest.engine, manifest


def rate(infer: Any, feed: dict[str, np.ndarray], batch: int, seconds: float) -> float:
    infer(feed)  # the first call at a size may set up per shape: not the limit
    n = 0
    t0 = time.perf_counter()
    while True:
        infer(feed)
        n += 1
        spent = time.perf_counter() - t0
        if spent >= seconds and n >= 3:
            return batch * n / spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--seconds", type=float, default=3.0, help="per figure per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 s per figure, batches 1 and 8")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.quick:
        a.seconds, a.batches = 1.0, "1,8"
    batches = tuple(int(b) for b in a.batches.split(","))
    if not (1 <= a.threads <= 256 and all(1 <= b <= 256 for b in batches) and 0 < a.seconds <= 60
            and 1 <= a.rounds <= 10):
        ap.error("threads and batches 1-256, seconds 0-60, rounds 1-10")

    from edgefleet import engines
    from edgefleet.protocol.cpu import cpu_features

    model_dir = load_zoo().ensure("mobilenetv2")
    with np.load(model_dir / "eval.npz") as npz:
        images = np.ascontiguousarray(npz["input"], dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-engines-") as tmp:
        int8_file, manifest = build_int8(model_dir, Path(tmp))
        files = {"fp32": model_dir / "model.onnx", "int8": int8_file}
        loaded: dict[str, engines.Engine] = {}
        skipped: dict[str, str] = {}
        for label, runtime, which, precision in ENGINES:
            spec = engines.EngineSpec(manifest.inputs, manifest.outputs, precision, None, label)
            try:
                loaded[label] = engines.load(runtime, files[which], spec, a.threads)
            except engines.EngineLoadError as exc:
                skipped[label] = str(exc)
                say(f"skipped {label}: {exc}")
        try:
            ref = loaded[BASELINE].infer({"input": images})[0]
            answers = {}
            for label, e in loaded.items():
                out = e.infer({"input": images})[0]
                answers[label] = {"max_abs_diff": round(float(np.abs(out - ref).max()), 4),
                                  "top1_agreement": round(float((out.argmax(1) == ref.argmax(1)).mean()), 4)}
            best: dict[str, dict[int, float]] = {label: {} for label in loaded}
            for r in range(a.rounds):
                for b in batches:
                    feed = {"input": np.ascontiguousarray(images[np.arange(b) % len(images)])}
                    for label, e in loaded.items():
                        v = rate(e.infer, feed, b, a.seconds)
                        best[label][b] = max(best[label].get(b, 0.0), v)
                        say(f"  round {r + 1} batch {b:3d} {label:18s} {v:8.1f} img/s")
        finally:
            for e in loaded.values():
                e.close()
    rows = []
    for label in loaded:
        rows.append({"engine": label, **answers[label],
                     "img_per_s": {b: round(best[label][b], 1) for b in batches},
                     "vs_onnxruntime_fp32": {b: round(best[label][b] / best[BASELINE][b], 2) for b in batches}})
    print(f"\nMobileNetV2-like, {a.threads} threads, best of {a.rounds} rounds of {a.seconds:g} s per figure, "
          f"{platform.processor() or platform.machine()}; bf16/VNNI: "
          f"{sorted(cpu_features() & {'avx512_bf16', 'avx512_vnni', 'amx_bf16'})}")
    head = "| engine | " + " | ".join(f"batch {b}" for b in batches) + " | answers vs onnxruntime FP32 |"
    print(head)
    print("|" + " --- |" * (len(batches) + 2))
    for row in rows:
        cells = [f"{row['img_per_s'][b]:g} img/s ({row['vs_onnxruntime_fp32'][b]:.2f}x)" for b in batches]
        print(f"| {row['engine']} | " + " | ".join(cells) + f" | max abs diff {row['max_abs_diff']:g}, top-1 "
              f"{row['top1_agreement']:.0%} of {len(images)} |")
    for label, why in skipped.items():
        print(f"| {label} | skipped: {why} |")
    if a.json:
        a.json.write_text(json.dumps({"when": dt.datetime.now(dt.UTC).isoformat(), "threads": a.threads,
                                      "seconds": a.seconds, "rounds": a.rounds, "rows": rows, "skipped": skipped},
                                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
