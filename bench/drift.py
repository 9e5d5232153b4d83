"""What the drift sketch costs a request, against the request's own inference, measured in one run.

    .venv/bin/python bench/drift.py                 # digits (fp32), batch 1, 5,000 requests a round
    .venv/bin/python bench/drift.py --requests 20000 --batch 4

Compiles digits (fp32, with its drift reference), loads its engine with onnxruntime (1 thread) and, in
alternating rounds so that the machine's drift hits both alike:

- **infer alone**: the engine's own call per request (the baseline: serving without any agent around it);
- **infer + offer**: the same with ``DriftRecorder.offer`` after each answer and the sketch thread counting
  (what the sketch costs serving, GIL included);
- **offer alone**: the request path's share (a lookup and a deque append);
- **count**: the sketch thread's work per answer (``DriftAccumulator.add``), one answer alone and in a group of
  64 (the thread counts what queued up every 50 ms in one pass).

Figures: medians over the rounds, in microseconds, and each as a ratio of **infer**.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgefleet.agent.core.drift import DriftRecorder
from edgefleet.compiler.compile import CompileOptions, compile_model
from edgefleet.engines import load_bundle_engine
from edgefleet.protocol.bundle import extract_bundle
from edgefleet.protocol.drift import DriftAccumulator

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "models" / "digits"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not 1 <= a.requests <= 1_000_000 or not 1 <= a.batch <= 256 or not 1 <= a.rounds <= 100:
        ap.error("--requests 1..1e6, --batch 1..256, --rounds 1..100")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        bundle = compile_model(CompileOptions(
            model=DIGITS / "model.onnx", profile="x86-cpu", calibration=None, eval=DIGITS / "test.npz", out_dir=out,
            name="digits", version="1.0.0", benchmark=False, precision="fp32")).bundle
        m = extract_bundle(bundle, out / "x")
        engine = load_bundle_engine(m, out / "x" / m.engine, threads=1)
        with np.load(DIGITS / "test.npz") as npz:
            images = npz["input"].astype(np.float32)
        feeds = [{m.inputs[0].name: images[i:i + a.batch]} for i in range(0, len(images) - a.batch, a.batch)]
        outs = [engine.infer(f) for f in feeds]
        rec = DriftRecorder()
        acc = DriftAccumulator(m.drift, m.name, m.version) if m.drift else None
        if acc is None:
            print("the bundle has no drift reference", file=sys.stderr)
            return 1
        infer_us, served_us, offer_us, one_us, group_us = [], [], [], [], []
        group = np.concatenate([o[0] for o in outs[:64]])
        for _ in range(a.rounds):  # alternating, so the machine's drift hits each alike
            t0 = time.perf_counter()
            for i in range(a.requests):
                engine.infer(feeds[i % len(feeds)])
            infer_us.append((time.perf_counter() - t0) / a.requests * 1e6)
            t0 = time.perf_counter()
            for i in range(a.requests):  # what serving does with the sketch on: answer, offer; the thread counts
                rec.offer(m, engine.infer(feeds[i % len(feeds)]))
            served_us.append((time.perf_counter() - t0) / a.requests * 1e6)
            rec.wait_idle(60)
            t0 = time.perf_counter()
            for i in range(a.requests):
                rec.offer(m, outs[i % len(outs)])
            offer_us.append((time.perf_counter() - t0) / a.requests * 1e6)
            rec.wait_idle(60)
            t0 = time.perf_counter()
            for i in range(a.requests // 10):
                acc.add(outs[i % len(outs)][0])
            one_us.append((time.perf_counter() - t0) / (a.requests // 10) * 1e6)
            t0 = time.perf_counter()
            for _ in range(max(a.requests // 64, 1)):
                acc.add(group)
            group_us.append((time.perf_counter() - t0) / (max(a.requests // 64, 1) * len(group)) * 1e6)
        taken = rec.take(m.name, m.version)
        rec.close()
        engine.close()
    inf, srv, off, one, grp = (statistics.median(x) for x in (infer_us, served_us, offer_us, one_us, group_us))
    print(f"digits fp32, batch {a.batch}, {a.requests} requests x {a.rounds} rounds, alternating (medians)")
    print(f"  infer alone (baseline)          {inf:8.2f} us/request  1.000")
    print(f"  infer + offer, sketch thread on {srv:8.2f} us/request  {srv / inf:.3f} of the baseline")
    print(f"  offer alone (request path)      {off:8.2f} us/request  {off / inf:.3f}")
    print(f"  count one answer alone (thread) {one:8.2f} us/answer   {one / inf:.3f} (at most one pass per 50 ms)")
    print(f"  count in a group of 64 (thread) {grp:8.2f} us/answer   {grp / inf:.3f}")
    print(f"  answers counted {taken.samples if taken else 0}, skipped while the thread was behind "
          f"{taken.skipped if taken else 0}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
