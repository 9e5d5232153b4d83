"""Triton's perf_analyzer against bench/serve.py's load generator, on one agent, for the same model, client count and
protocol (issue 41.1).

One agent process (as bench/serve.py starts it: digits INT8 compiled and installed, the agent choosing its own
layout and batches, gRPC on) serves both; for each client count (closed loop: perf_analyzer's
``--concurrency-range N:N`` keeps N requests outstanding, serve.py's generator N clients) and each protocol the two
run back to back, alternating which goes first:

    http  perf_analyzer -i http (binary tensors)         serve.py 'binary'
    grpc  perf_analyzer -i grpc                           serve.py 'grpc'
    shm   perf_analyzer -i http --shared-memory system    serve.py 'shm' (system shared memory over HTTP)

perf_analyzer comes from bench/perf_analyzer.sh; its windows are --measurement-interval ms, until three agree within
--stability-percentage (default 1000: the first three; on a shared 2-core box its default 10% is rarely met, and
50% failed 20 windows running at 1 client); its figure is their mean. serve.py's level is --requests timed requests
after --warmup per client.

Run from the repository root:  .venv/bin/python bench/perf_analyzer_vs_serve.py [--clients 1,8,32] [--json out.json]
[--split-cpus 0:1]: the agent on CPU 0, both generators on CPU 1 (on a 2-core box, without it the generator that
costs more CPU takes more of the agent's cores, and the two compare load generators more than the agent)
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import say
from serve import prepare
from serve_bench import AgentProcess, _free_port
from serve_load import bodies, run_level

REPO = Path(__file__).resolve().parent.parent
PROTOCOLS = {"http": ("binary", ("-i", "http")), "grpc": ("grpc", ("-i", "grpc")),
             "shm": ("shm", ("-i", "http", "--shared-memory", "system"))}


def perf_analyzer_path() -> str:
    got = subprocess.run(["bash", str(REPO / "bench" / "perf_analyzer.sh")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHON": sys.executable})
    if got.returncode != 0:
        raise SystemExit(f"bench/perf_analyzer.sh: {got.stderr.strip()[-500:]}")
    return got.stdout.strip().splitlines()[-1]


def run_pa(pa: str, model: str, url: str, proto_args: tuple[str, ...], clients: int, interval_ms: int,
           stability: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pa.csv"
        cmd = [pa, "-m", model, "-u", url, *proto_args, "--concurrency-range", f"{clients}:{clients}",
               "--measurement-interval", str(interval_ms), "--stability-percentage", str(stability),
               "--max-trials", "20", "-f", str(out)]
        before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - t0
        if p.returncode != 0:
            return {"error": (p.stdout + p.stderr).strip()[-300:]}
        row = next(csv.DictReader(io.StringIO(out.read_text())))
    rate = float(row["Inferences/Second"])
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # its CPU over its whole run (start and every window) per request at its measured rate: an upper bound
    return {"req_per_s": rate, "p50_ms": float(row["p50 latency"]) / 1000, "p99_ms": float(row["p99 latency"]) / 1000,
            "client_us_per_req": 1e6 * cpu_s / wall / rate if wall > 0 and rate > 0 else None}


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows, perf_analyzer beside serve.py (throughput, its ratio, p50 and p99 in ms)."""
    print(f"{'clients':>7} {'protocol':>8} {'perf_analyzer/s':>16} {'serve.py/s':>11} {'ratio':>6} "
          f"{'pa p50 ms':>9} {'serve p50 ms':>12} {'pa p99 ms':>9} {'serve p99 ms':>12} "
          f"{'client CPU us/req pa / serve':>29}")
    for r in rows:
        a, s = r["pa"], r["serve"]
        if "error" in a:
            print(f"{r['clients']:>7} {r['protocol']:>8} perf_analyzer failed: {a['error']}")
            continue
        print(f"{r['clients']:>7} {r['protocol']:>8} {a['req_per_s']:>16.0f} {s['req_per_s']:>11.0f} "
              f"{r['pa_vs_serve']:>6.2f} {a['p50_ms']:>9.2f} {s['p50_ms']:>12.2f} {a['p99_ms']:>9.2f} "
              f"{s['p99_ms']:>12.2f} {_us(a.get('client_us_per_req')):>14} / {_us(s.get('client_us_per_req')):<12}")


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,8,32", help="closed-loop client counts (perf_analyzer's concurrency)")
    p.add_argument("--protocols", default="http,grpc,shm", help=f"of {', '.join(PROTOCOLS)}")
    p.add_argument("--requests", type=int, default=2000, help="serve.py: timed requests per level")
    p.add_argument("--warmup", type=int, default=5, help="serve.py: untimed requests per client first")
    p.add_argument("--measurement-interval", type=int, default=2000, help="perf_analyzer: ms per window")
    p.add_argument("--stability-percentage", type=int, default=1000,
                   help="perf_analyzer: windows agree within this (default: any three; a shared box rarely meets 10%%)")
    p.add_argument("--work-dir", type=Path, help="keep the compiled bundle and the agent's data here")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--split-cpus", metavar="AGENT:CLIENTS",
                   help="e.g. 0:1: the agent on these CPUs, both load generators on those (each side its own cores, "
                        "so neither generator takes the agent's; default: all share every CPU)")
    args = p.parse_args(argv)
    split = None
    if args.split_cpus:
        a, c = (frozenset(int(x) for x in side.split(",")) for side in args.split_cpus.split(":"))
        split = (a, c)
        os.sched_setaffinity(0, a)  # the agent started below inherits these; the generators later get the others
    pa = perf_analyzer_path()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pa-vs-serve-"))
    m = prepare("digits", work)
    grpc_port = _free_port()
    rows: list[dict[str, Any]] = []
    with AgentProcess(m["data_dir"], work / "logs" / "agent.log", 0, None, None, 120, instances=None,
                      extra_args=("--grpc-port", str(grpc_port))) as agent:
        if split is not None:  # perf_analyzer and serve.py's spawned generator inherit the clients' CPUs
            os.sched_setaffinity(0, split[1])
        host = agent.url.removeprefix("http://")
        for clients in [int(c) for c in args.clients.split(",")]:
            for i, proto in enumerate(args.protocols.split(",")):
                kind, pa_args = PROTOCOLS[proto]
                url = f"http://127.0.0.1:{grpc_port}" if kind == "grpc" else agent.url
                pa_url = f"127.0.0.1:{grpc_port}" if kind == "grpc" else host
                got: dict[str, Any] = {}
                order = ("serve", "pa") if (clients + i) % 2 == 0 else ("pa", "serve")
                for who in order:
                    if who == "pa":
                        got["pa"] = run_pa(pa, m["model"], pa_url, pa_args, clients, args.measurement_interval,
                                           args.stability_percentage)
                    else:
                        path, reqs, _ = bodies(kind, m["model"], m["images"])
                        r = run_level(url, kind, path, reqs, m["labels"], clients, args.requests, args.warmup)
                        got["serve"] = {k: r[k] for k in ("req_per_s", "p50_ms", "p99_ms")}
                        got["serve"]["client_us_per_req"] = 1e6 * r["load_cores"] / r["req_per_s"]
                row = {"clients": clients, "protocol": proto, "first": order[0], **got}
                if "req_per_s" in got["pa"]:
                    row["pa_vs_serve"] = got["pa"]["req_per_s"] / got["serve"]["req_per_s"]
                rows.append(row)
                say(json.dumps(row))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
