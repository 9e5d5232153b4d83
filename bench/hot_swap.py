"""Hot swap under load: the longest pause and the failed requests while the agent swaps model versions.

    .venv/bin/python bench/hot_swap.py                                   # MobileNetV2-like FP32, then digits
    .venv/bin/python bench/hot_swap.py --models digits --swaps 3 --clients 4
    .venv/bin/python bench/hot_swap.py --clients 1,2,8                  # one run per client count

For each model: compile two versions (1.0.0 and 1.1.0, the same engine) for x86-cpu and install both into an
agent data dir; run a real agent (uvicorn on 127.0.0.1, a free port) in this process; drive it with closed-loop
binary-OIP load from a separate process for a fixed time (bounded); while the load runs, swap versions several
times the way a rollback does (load, self-test and warm up the other version while the active one serves,
then switch). Every answer is logged with its completion time, latency, status and the version that answered.

Figures, per model, as ratios against the same run's steady state (the seconds before the first swap):

- failed requests over the whole run (goal: 0), and both versions seen answering;
- **the pause**: the longest gap between two consecutive answers in a window around each switch (from the
  swap call until 0.5 s after it returned), against the longest gap in steady-state windows of the same
  length: the worst such window, and the typical one (the median of the windows' longest gaps). The goal
  is a pause under 50 ms; with batching, answers come a batch at a time, so under load the steady gap
  is a batch's run time (MobileNetV2 at 8 clients: 85-100 ms on an AVX2-only host) and what a swap adds
  to it is the figure to read;
- the worst latency of a request answered in a swap window against the steady-state p99 (the other version
  loading and warming up competes for the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_files, say  # noqa: E402
from serve_load import _post, _request, bodies  # noqa: E402

MODELS = ("mobilenetv2-fp32", "digits")
AFTER_SWAP_S = 0.5  # a swap window reaches this far past the switch


def prepare(name: str, work: Path) -> dict[str, Any]:
    """Compile versions 1.0.0 and 1.1.0 and install both (1.1.0 serves, 1.0.0 is kept for rollback)."""
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from tests.agent_harness import preinstall

    model, calib, evalp, precision, model_name = model_files(name)
    with np.load(evalp) as npz:
        images = npz["input"][:64].astype(np.float32)
    data_dir = work / name / "agent"
    for version in ("1.0.0", "1.1.0"):
        result = compile_model(CompileOptions(model=model, profile="x86-cpu", calibration=calib, eval=evalp,
                                              out_dir=work / name / version, name=model_name, version=version,
                                              benchmark=False, precision=precision, max_accuracy_drop=1.0))
        preinstall(data_dir, result.bundle)
    return {"name": name, "model": model_name, "data_dir": data_dir, "images": images}


# -- load (a separate process) -------------------------------------------------------------------------


async def _drive(url: str, path: str, reqs: list[bytes], clients: int, duration_s: float) -> list[tuple]:
    """Closed loop for ``duration_s``: one (monotonic end, latency s, status, version) per answer."""
    host, port_s = url.removeprefix("http://").rsplit(":", 1)
    port = int(port_s)
    prebuilt = [_request(host, port, path, b, "binary") for b in reqs]
    log: list[tuple] = []
    deadline = time.monotonic() + duration_s

    async def client(slot: int) -> None:
        conn: list[Any] = []
        i = (slot * 7919) % len(prebuilt)
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            version = None
            try:
                status, headers, content = await asyncio.wait_for(_post(conn, host, port, prebuilt[i]), 60)
                if status == 200:
                    hl = int(headers[b"inference-header-content-length"])
                    version = json.loads(content[:hl]).get("model_version")
            except Exception:
                status = 0
            t1 = time.monotonic()
            log.append((t1, t1 - t0, status, version))
            i = (i + 1) % len(prebuilt)
        if conn:
            conn[1].close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return log


def _load_worker(args: tuple, results: Any) -> None:
    try:
        results.put(asyncio.run(_drive(*args)))
    except BaseException as exc:
        results.put({"fatal": f"{type(exc).__name__}: {exc}"})


# -- one model -----------------------------------------------------------------------------------------


def _longest_gap(ends: np.ndarray, lo: float, hi: float) -> float:
    """The longest time in [lo, hi] without an answer (the window's edges count as bounds)."""
    inside = ends[(ends >= lo) & (ends <= hi)]
    points = np.concatenate([[lo], inside, [hi]])
    return float(np.diff(points).max())


def bench_model(m: dict[str, Any], args: argparse.Namespace, clients: int) -> dict[str, Any]:
    from tests.agent_harness import running_agent

    name = m["name"]
    path, reqs, _ = bodies("binary", m["model"], m["images"])
    steady_s = args.steady_s
    duration_s = steady_s + args.swaps * args.swap_every_s + 2.0
    swaps: list[tuple[float, float, str]] = []
    with running_agent(m["data_dir"], max_batch_size=16, intra_op_threads=args.threads) as (agent, url):
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        w = ctx.Process(target=_load_worker, args=((url, path, reqs, clients, duration_s), results), daemon=True)
        w.start()
        try:
            time.sleep(steady_s)
            assert agent._loop is not None
            for k in range(args.swaps):
                t0 = time.monotonic()
                manifest = asyncio.run_coroutine_threadsafe(agent.rollback(m["model"]), agent._loop).result(300)
                t1 = time.monotonic()
                swaps.append((t0, t1, manifest.version))
                say(f"  {name}: swap {k + 1}/{args.swaps} to {manifest.version} took {t1 - t0:.2f} s "
                     "(load, self-test, warm-up, switch)")
                time.sleep(max(0.0, args.swap_every_s - (t1 - t0)))
            log = results.get(timeout=duration_s + 120)
        except queue.Empty as exc:
            raise RuntimeError("the load generator did not finish") from exc
        finally:
            w.join(10)
            if w.is_alive():
                w.terminate()
    if isinstance(log, dict):
        raise RuntimeError(f"load generator: {log['fatal']}")
    arr = np.array([(t, lat, status) for t, lat, status, _ in log], dtype=np.float64)
    ends, lats, status = arr[:, 0], arr[:, 1] * 1000, arr[:, 2]
    t_start = ends.min()
    failed = int((status != 200).sum())
    versions = sorted({v for *_, v in log if v})
    # steady state: from 1 s into the load until the first swap, cut into windows as long as a swap window
    first = swaps[0][0]
    win = float(np.mean([t1 - t0 for t0, t1, _ in swaps])) + AFTER_SWAP_S
    steady = (ends >= t_start + 1.0) & (ends < first)
    steady_gaps = [_longest_gap(ends, lo, lo + win) for lo in np.arange(t_start + 1.0, first - win, win / 2)]
    steady_gap = max(steady_gaps) * 1000 if steady_gaps else float("nan")
    typical_gap = float(np.median(steady_gaps)) * 1000 if steady_gaps else float("nan")
    steady_p99 = float(np.percentile(lats[steady], 99)) if steady.any() else float("nan")
    # the switch: the gap around the moment rollback() returned (the swap itself) and over the whole window
    switch_gaps = [_longest_gap(ends, t1 - 0.25, t1 + AFTER_SWAP_S) * 1000 for _, t1, _ in swaps]
    window_gaps = [_longest_gap(ends, t0, t1 + AFTER_SWAP_S) * 1000 for t0, t1, _ in swaps]
    in_windows = np.zeros(len(ends), dtype=bool)
    for t0, t1, _ in swaps:
        in_windows |= (ends >= t0) & (ends <= t1 + AFTER_SWAP_S)
    worst = float(lats[in_windows].max()) if in_windows.any() else float("nan")
    return {"model": name, "clients": clients, "requests": len(log), "failed": failed, "versions": versions,
            "swaps": len(swaps), "swap_s": [round(t1 - t0, 3) for t0, t1, _ in swaps],
            "steady_longest_gap_ms": steady_gap, "steady_typical_gap_ms": typical_gap, "steady_p99_ms": steady_p99,
            "switch_longest_gap_ms": max(switch_gaps), "window_longest_gap_ms": max(window_gaps),
            "window_worst_latency_ms": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hot_swap.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--clients", default="1,8", help="closed-loop client counts, comma-separated (one run each)")
    p.add_argument("--swaps", type=int, default=5, help="swaps per model")
    p.add_argument("--swap-every-s", type=float, default=4.0, help="seconds between swap starts")
    p.add_argument("--steady-s", type=float, default=6.0, help="load before the first swap (the baseline)")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    logging.getLogger("edgefleet").setLevel(logging.ERROR)  # the agent follows no fleet here: its retries are noise
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    if args.swaps < 1 or args.steady_s < 3:
        p.error("--swaps must be at least 1 and --steady-s at least 3 (the baseline needs windows)")
    try:
        client_counts = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        client_counts = []
    if not client_counts or min(client_counts) < 1:
        p.error(f"--clients must be positive integers separated by commas, not {args.clients!r}")
    out = []
    with tempfile.TemporaryDirectory(prefix="edgefleet-hot-swap-") as tmp:
        for n in names:
            say(f"{n}: compiling 1.0.0 and 1.1.0 for x86-cpu and installing both")
            m = prepare(n, Path(tmp))
            for c in client_counts:
                out.append(bench_model(m, args, c))
    print(f"\nbench/hot_swap.py: binary OIP, {args.swaps} swaps per model and client count, "
          f"{args.threads} intra-op threads")
    for r in out:
        label = f"{r['model']} x{r['clients']}"
        print(f"{label:>20}: {r['requests']} requests, {r['failed']} failed, versions answering "
              f"{', '.join(r['versions'])}; swaps took {min(r['swap_s']):.2f}-{max(r['swap_s']):.2f} s")
        print(f"{'':>20}  longest pause at a switch {r['switch_longest_gap_ms']:.1f} ms, over a whole swap window "
              f"{r['window_longest_gap_ms']:.1f} ms (steady state: worst {r['steady_longest_gap_ms']:.1f} ms, "
              f"typical {r['steady_typical_gap_ms']:.1f} ms; the swap adds "
              f"{r['window_longest_gap_ms'] - r['steady_typical_gap_ms']:+.1f} ms, "
              f"{r['window_longest_gap_ms'] / r['steady_longest_gap_ms']:.2f}x the worst); "
              "worst latency in a swap window "
              f"{r['window_worst_latency_ms']:.1f} ms (steady p99 {r['steady_p99_ms']:.1f} ms, "
              f"{r['window_worst_latency_ms'] / r['steady_p99_ms']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 1 if any(r["failed"] for r in out) else 0


if __name__ == "__main__":
    raise SystemExit(main())
