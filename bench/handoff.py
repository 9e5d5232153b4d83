"""The floor under a thread hand-off: two threads on two CPUs pass a lock back and forth, nothing else.

    .venv/bin/python bench/handoff.py                 # CPUs 0 and 1, 300 round trips per gap
    .venv/bin/python bench/handoff.py --cpus 2,3 --rounds 1000 --json

The agent hands each batch from its event loop to an inference thread and the answer back
(agent/core/batching/dispatch.py): two wake-ups of a thread on another core. This measures what the machine charges for
that alone, back to back and after the other core has idled for a while (a lone request: the inference core sleeps
between requests), so the agent's own figures can be read against it. Bounded: ``--rounds`` round trips per gap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time


def round_trips(cpus: tuple[int, int], rounds: int, gaps_ms: list[float]) -> dict[str, dict[str, float]]:
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()
    total = rounds * len(gaps_ms)

    def other() -> None:
        os.sched_setaffinity(0, {cpus[1]})
        for _ in range(total):
            ping.acquire()
            pong.release()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    os.sched_setaffinity(0, {cpus[0]})
    out: dict[str, dict[str, float]] = {}
    for gap in gaps_ms:
        rts = []
        for _ in range(rounds):
            if gap:
                time.sleep(gap / 1000)
            t0 = time.perf_counter()
            ping.release()
            pong.acquire()
            rts.append(time.perf_counter() - t0)
        rts.sort()
        out[f"{gap:g} ms idle"] = {"median_us": statistics.median(rts) * 1e6,
                                   "p90_us": rts[int(len(rts) * 0.9)] * 1e6}
    t.join(10)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cpus", default="0,1", help="the two CPUs, as taskset -c counts them")
    p.add_argument("--rounds", type=int, default=300, help="round trips per idle gap")
    p.add_argument("--gaps-ms", default="0,1", help="how long the other core idles before each round trip")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    cpus = tuple(int(c) for c in args.cpus.split(","))
    if len(cpus) != 2 or not set(cpus) <= os.sched_getaffinity(0):
        print(f"--cpus must name two CPUs this process may use ({sorted(os.sched_getaffinity(0))})", file=sys.stderr)
        return 2
    res = round_trips((cpus[0], cpus[1]), max(1, args.rounds), [float(g) for g in args.gaps_ms.split(",")])
    if args.json:
        print(json.dumps(res))
    else:
        for gap, r in res.items():
            print(f"lock round trip between CPUs {cpus[0]} and {cpus[1]}, {gap}: median {r['median_us']:.1f} us, "
                  f"p90 {r['p90_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
