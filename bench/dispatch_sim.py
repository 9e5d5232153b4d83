"""The agent's batching alone, in one process: its Batcher over engines whose calls sleep the curve's time, closed-loop
clients that wait a set round trip between an answer and their next request (issue 44).

bench/serve.py --simulate runs the whole agent over HTTP, so its figures hold the front end's round trip on this
box. This one holds the dispatch apart from it: the same clients and curve with a round trip you choose, spreading
(the install's figures withheld: gathering never weighed) against the same batcher with the figures
(agent/core/batching/gathering.py decides), back to back in one run. The limit is the curve's best images/s at the
batch sizes allowed; each row: requests/s against it, the batch sizes run, the runtime's busy share, what gathering
chose and the idle gap it measured.

    .venv/bin/python bench/dispatch_sim.py [--cores 16] [--model mobilenetv2-int8] [--clients 32]
        [--round-trip-ms 0,1,2] [--time-scale 8] [--seconds 5] [--max-batch 4] [--json]
    .venv/bin/python bench/dispatch_sim.py --rates 1:100,2:190,4:300 --instances 1 --clients 2 --time-scale 1
        --round-trip-ms 0.5     # a GPU's shape: a pair costs barely more than one

Loopback is not involved: nothing leaves the process. Runs are bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import say
from sim_runtime import CURVES, Curve

from edgefleet.agent.core.batching.batcher import Batcher
from edgefleet.agent.core.batching.settings import BatchSettings
from edgefleet.engines import Engine, EngineSpec
from edgefleet.protocol.manifest import TensorSpec

SETUPS = {4: "pinned 4 CPUs", 8: "unpinned 8 CPUs", 16: "unpinned 8 CPUs"}  # 16: the 8-CPU curve doubled
X = (TensorSpec(name="x", datatype="FP32", shape=(-1, 2)),)
Y = (TensorSpec(name="y", datatype="FP32", shape=(-1, 2)),)


class Timed(Engine):
    """One one-thread instance of the curve's layout: a call of b samples sleeps the curve's time (no CPU, the GIL
    released); its busy time and batch sizes are counted."""

    kind = "fake"

    def __init__(self, curve: Curve, tally: dict[str, Any]):
        super().__init__(EngineSpec(X, Y, label="timed"))
        self.curve, self.tally = curve, tally

    @property
    def inputs(self):
        return X

    @property
    def outputs(self):
        return Y

    def load(self, engine: Path, threads: int) -> None:
        pass

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = feeds["x"]
        t0 = time.perf_counter()
        time.sleep(self.curve.call_s(1, len(x)))
        with self.tally["lock"]:
            self.tally["busy_s"] += time.perf_counter() - t0
            self.tally["sizes"][len(x)] += 1
        return [x * 2]

    def _close_impl(self) -> None:
        pass


def run_one(curve: Curve, instances: int, clients: int, round_trip_s: float, seconds: float, max_batch: int,
            gather: bool) -> dict[str, Any]:
    """One level: ``clients`` closed-loop clients for ``seconds`` (the first second a warm-up, not counted)."""
    sizes = tuple(b for b in (1, 2, 4, 8, 16) if b <= max_batch)
    settings = BatchSettings(max_batch_size=max_batch, preferred_batch_sizes=(max_batch,) if max_batch > 1 else (),
                             call_ms=tuple((b, 1e3 * curve.call_s(1, b)) for b in sizes) if gather else ())
    tally: dict[str, Any] = {"lock": threading.Lock(), "busy_s": 0.0, "sizes": collections.Counter()}

    async def main() -> dict[str, Any]:
        b = Batcher([Timed(curve, tally) for _ in range(instances)], settings)
        b.start()
        start = time.monotonic()
        warm, stop = start + min(1.0, seconds / 4), start + seconds
        counted = [0]
        busy0: list[float] = []

        async def client(i: int) -> None:
            await asyncio.sleep(i * 0.0003)  # not all in step
            while time.monotonic() < stop:
                v = np.array([[i, 1]], np.float32)
                out = await b.submit({"x": v})
                if not np.array_equal(out[0], v * 2):
                    raise AssertionError(f"client {i} got another request's answer")
                if time.monotonic() >= warm:
                    if not busy0:
                        busy0.append(tally["busy_s"])
                    counted[0] += 1
                await asyncio.sleep(round_trip_s)

        await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.monotonic() - warm
        report = b.gathering_report()
        await b.close()
        rate = counted[0] / wall
        limit = max(curve.rate(instances, s) for s in sizes) / curve.time_scale
        return {"gather": gather, "round_trip_ms": 1e3 * round_trip_s, "req_per_s": rate, "vs_limit": rate / limit,
                "busy_share": (tally["busy_s"] - (busy0[0] if busy0 else 0.0)) / (instances * wall),
                "batches": dict(sorted(tally["sizes"].items())), "gathering": report}

    return asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--curves", type=Path, default=CURVES, help="the measured curves (default: %(default)s)")
    ap.add_argument("--cores", type=int, default=16, choices=sorted(SETUPS), help="the simulated box's CPUs")
    ap.add_argument("--model", default="mobilenetv2-int8", help="the curve's model")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--round-trip-ms", default="0,1,2", help="the clients' waits between an answer and the next "
                    "request, comma-separated (one level each)")
    ap.add_argument("--time-scale", type=float, default=8.0, help="every simulated call takes this many times longer")
    ap.add_argument("--seconds", type=float, default=5.0, help="each level's length (the first second not counted)")
    ap.add_argument("--max-batch", type=int, default=4, help="the largest batch formed (the install's choice)")
    ap.add_argument("--rates", help="a synthetic curve instead: one instance's images/s by batch size, e.g. "
                    "'1:100,2:190,4:300' (a GPU's shape), with --instances of them")
    ap.add_argument("--instances", type=int, default=1, help="with --rates: the instances")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    args = ap.parse_args()
    if not 1 <= args.clients <= 1024 or not 0.5 <= args.seconds <= 600 or not 1 <= args.max_batch <= 16:
        ap.error("--clients 1..1024, --seconds 0.5..600, --max-batch 1..16")
    trips = [float(t) / 1e3 for t in args.round_trip_ms.split(",") if t.strip()]
    if any(not 0 <= t <= 1.0 for t in trips):
        ap.error("--round-trip-ms: 0..1000 each")
    if args.rates:
        if not 1 <= args.instances <= 64:
            ap.error("--instances 1..64")
        try:
            one = {int(b): float(v) for b, v in (x.split(":") for x in args.rates.split(","))}
        except ValueError:
            ap.error("--rates: batch:images_per_s pairs, comma-separated")
        if not one or any(b < 1 or v <= 0 for b, v in one.items()):
            ap.error("--rates: batch sizes >= 1, images/s > 0")
        m = args.instances  # m one-thread instances of that curve, all running: m times its images/s
        curve = Curve(m, {f"{m}x1": {b: m * v for b, v in one.items()}}, f"synthetic {args.rates}", args.time_scale)
        label, instances = f"synthetic {args.rates}, {m}x1", m
    else:
        curve = Curve.from_file(args.curves, SETUPS[args.cores], args.model, args.time_scale)
        curve = curve.doubled() if args.cores == 16 else curve
        label, instances = f"{args.model} {args.cores}x1", args.cores
    rows = []
    for trip in trips:
        for gather in (False, True):
            r = run_one(curve, instances, args.clients, trip, args.seconds, args.max_batch, gather)
            rows.append(r)
            g = r["gathering"] or {}
            say(f"{label}, {args.clients} clients, round trip {r['round_trip_ms']:.1f} ms, "
                f"{'figures (gathering weighed)' if gather else 'spreading only      '}: {r['req_per_s']:7.1f} req/s "
                f"= {r['vs_limit']:.1%} of the limit; busy {r['busy_share']:.1%}; batches {r['batches']}; "
                f"{g.get('mode', 'spreading')}, gap {g.get('measured_gap_ms')} ms, tries {g.get('tries', 0)}")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
