"""bench/serve.py --simulate FILE: the agent on a simulated 4-, 8- and 16-CPU box (issue 44).

The agent runs as its own process, unchanged, on the simulated runtime (bench/sim_runtime.py: each call sleeps its
curve time, no CPU): its HTTP, batching, dispatch, layout and batch trials all run, the trials timing the simulated
calls. A box of 4 CPUs plays the curve's ``pinned 4 CPUs`` set-up, 8 its ``unpinned 8 CPUs``, 16 that one doubled
(sim_runtime.Curve.doubled). For each model's curve (FP32, INT8) and box, closed-loop clients (one small image a
request, binary OIP over HTTP, serve_load's load generator) at 8, 32 and 64, and the report: requests/s against the
simulated limit (the best images/s in the curve), against the closed-loop bound (what c one-image requests in flight
can be served at, batches spread over the instances, round trips taken as zero: ``bound``), the runtime's busy share
(its time in calls, from the agent's statistics, / (instances x wall)), the layout the trial chose against the
curve's best, the CPU of the agent's event loop, the box's load.

``--frontend``: the front end's ceiling instead (issue 44.3): the agent's CPU per request (process CPU time from
/proc over the timed phase / requests) for 1 KB and 602 KB requests over HTTP (binary), gRPC and the local socket
with shared memory, on the simulated 16-CPU INT8 box (the runtime uses no CPU: all the agent's CPU is its front
end's), as requests/s per core.

    .venv/bin/python bench/serve.py --simulate ../shared/data/xeon16-serving.json [--sim-cores 4,8,16]
        [--sim-models mobilenetv2-fp32,mobilenetv2-int8] [--clients 8,32,64] [--sim-seconds 3] [--frontend]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import say
from serve_bench import AgentProcess, _free_port
from serve_limit import _rss_mb
from serve_load import bodies, run_level
from sim_runtime import Curve, build_bundle, simulation_env

MODEL = "simnet"
SETUPS = {4: "pinned 4 CPUs", 8: "unpinned 8 CPUs", 16: "unpinned 8 CPUs"}  # 16: the 8-CPU curve doubled
SMALL = (1, 16, 16)  # 1 KB of FP32 a request: the scheduling runs
BIG = (3, 224, 224)  # 602 KB: MobileNetV2's input
MAX_SIM_BATCH = 16  # the largest batch the curves measured


def sim_curve(path: Path, model: str, cores: int, time_scale: float = 1.0) -> Curve:
    if cores not in SETUPS:
        raise ValueError(f"--sim-cores: {cores} is not one of {sorted(SETUPS)}")
    curve = Curve.from_file(path, SETUPS[cores], model, time_scale)
    return curve.doubled() if cores == 16 else curve


def install(bundle: Path, data_dir: Path) -> None:
    from edgefleet.agent.install.store import ModelStore
    from edgefleet.protocol.bundle import sha256_file

    store = ModelStore(data_dir / "store")
    store.recover()
    store.commit(store.stage(bundle, sha256_file(bundle)), None)


def _config(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v2/models/{MODEL}/config", timeout=30) as r:  # loopback: the agent
        return json.loads(r.read())


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _samples(shape: tuple[int, ...], n: int = 64, classes: int = 10) -> tuple[np.ndarray, list[int]]:
    """``n`` random inputs and the simulated model's answers (the argmax of each one's first ``classes`` values)."""
    x = np.random.default_rng(7).random((n, *shape), dtype=np.float32)
    return x, [int(v) for v in x.reshape(n, -1)[:, :classes].argmax(1)]


def bound(curve: Curve, instances: int, clients: int) -> float:
    """The closed-loop bound at ``clients`` one-image clients on ``instances`` instances, every round trip taken as
    zero: the most the curve serves with at most ``clients`` requests in flight, each instance running a batch of
    b_i of them (0: idle; sum of b_i <= clients) at its curve time whoever else runs (an instance at batch b serves
    rate(instances, b) / instances images/s). 8 clients on 16 instances: 8 at batch 1, half the batch-1 rate; on 8
    instances: the batch-1 rate (94.9% of INT8's limit, which needs batch 8); 32 on 16: batches of 2."""
    per = [0.0] + [curve.rate(instances, b) / curve.time_scale / instances for b in range(1, MAX_SIM_BATCH + 1)]
    best = [0.0] * (clients + 1)  # best[c]: the most c requests serve over the instances counted so far
    for _ in range(instances):
        best = [max(best[c - b] + per[b] for b in range(min(c, MAX_SIM_BATCH) + 1)) for c in range(clients + 1)]
    return min(curve.best()[0], best[clients])


def _cores(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.2f} cores"


def _level_pa(pa: str, url: str, clients: int, seconds: float, stats_url: str, pid: int | None) -> dict[str, Any]:
    """One level driven by Triton's perf_analyzer (``--sim-client perf_analyzer``; ``pa`` its path): its rate and
    latencies (three windows of ``seconds``, zeros as input), the runtime's busy time and batches from the agent's
    statistics over perf_analyzer's whole run, as the agent's threads' CPU. Its answers are not checked
    (perf_analyzer reads none)."""
    from perf_analyzer_vs_serve import run_pa
    from serve_load import _batches, _thread_cpu_s, batches_since, thread_cores

    before, threads, t0 = _batches(stats_url), _thread_cpu_s(pid) if pid else {}, time.monotonic()
    got = run_pa(pa, MODEL, url.removeprefix("http://"), ("-i", "http"), clients, int(seconds * 1000), 1000,
                 ("--input-data", "zero"))
    wall = time.monotonic() - t0
    if "error" in got:
        raise RuntimeError(f"perf_analyzer: {got['error']}")
    formed = batches_since(stats_url, before)
    main, other = thread_cores(pid, threads, wall) if pid and wall > 0 else (None, None)
    return {"requests": None, "req_per_s": got["req_per_s"], "p50_ms": got["p50_ms"], "p99_ms": got["p99_ms"],
            "errors": 0, "wrong": None, "batches_formed": {b: c for b, (c, _) in sorted(formed.items())},
            "runtime_busy": sum(ns for _, ns in formed.values()) / 1e9 / wall if wall > 0 else 0.0,
            "load_cores": (got["client_us_per_req"] or 0) * got["req_per_s"] / 1e6,
            "server_main_cores": main, "server_other_cores": other}


def run_box(args: argparse.Namespace, work: Path, bundle: Path, model: str, cores: int) -> dict[str, Any]:
    """One simulated box: the agent started on it, its choice read back, every client level run."""
    curve = sim_curve(args.simulate, model, cores, args.time_scale)
    limit, best_layout, best_batch = curve.best()
    name = f"{model}-{cores}"
    data_dir = work / name / "agent"
    install(bundle, data_dir)
    images, labels = _samples(SMALL)
    path, reqs, _ = bodies("binary", MODEL, images)
    say(f"{name}: {curve.label}; limit {limit:.1f} img/s ({best_layout} at batch {best_batch})")
    t0 = time.monotonic()
    with AgentProcess(data_dir, work / "logs" / f"{name}.log", getattr(args, "sim_delay_us", 0), None, None, 300,
                      instances=None, extra_args=("-v",), env=simulation_env(curve)) as agent:
        started_s = time.monotonic() - t0
        cfg = _config(agent.url)
        tuning = cfg.get("batch_tuning") or {}
        lay = tuning.get("layout") or {}
        instances = int(cfg["instance_group"][0]["count"])
        threads = int(lay.get("threads") or 0)
        chosen = f"{instances}x{threads}"
        say(f"{name}: the agent chose {chosen}, batches of at most {tuning.get('max_formed_batch_size')} "
            f"(trial: {lay.get('measured')}); started in {started_s:.1f} s")
        rows = []
        pa = None
        if getattr(args, "sim_client", "serve_load") == "perf_analyzer":
            from perf_analyzer_vs_serve import perf_analyzer_path

            pa = perf_analyzer_path()
        for clients in args.clients:
            total = int(min(40000, max(400, args.sim_seconds * bound(curve, instances, clients))))
            load0 = _load()
            stats_url = f"{agent.url}/v2/models/{MODEL}/stats"
            if pa is not None:
                r = _level_pa(pa, agent.url, clients, args.sim_seconds, stats_url,
                              agent.proc.pid if agent.proc else None)
            else:
                r = run_level(agent.url, "binary", path, reqs, labels, clients, total, args.warmup,
                              server_pid=agent.proc.pid if agent.proc else None, stats_url=stats_url)
            b = bound(curve, instances, clients)
            gathering = (_config(agent.url).get("batch_tuning") or {}).get("gathering")
            row = {"gathering": gathering, "clients": clients, "requests": r["requests"], "req_per_s": r["req_per_s"],
                   "vs_limit": r["req_per_s"] / limit, "bound": b, "vs_bound": r["req_per_s"] / b,
                   "busy_share": r.get("runtime_busy", 0.0) / instances, "batches": r.get("batches_formed"),
                   "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "errors": r["errors"], "wrong": r["wrong"],
                   "loop_cores": r.get("server_main_cores"), "other_cores": r.get("server_other_cores"),
                   "load_cores": r["load_cores"], "loadavg": [load0, _load()], "agent_ms": r.get("agent_ms")}
            formed = row["batches"] or {}
            row["mean_batch"] = (sum(int(b) * c for b, c in formed.items()) / sum(formed.values())
                                 if formed else float("nan"))
            # the load generator's own CPU: it shares this box's cores with the agent
            row["gen_us_per_req"] = 1e6 * row["load_cores"] / row["req_per_s"] if row["req_per_s"] else float("nan")
            rows.append(row)
            say(f"  {name} {clients:>3} clients: {row['req_per_s']:8.1f} req/s = {row['vs_limit']:.1%} of the limit, "
                f"{row['vs_bound']:.1%} of the bound; busy {row['busy_share']:.1%}; batches {row['batches']} "
                f"(mean {row['mean_batch']:.2f}); loop {_cores(row['loop_cores'])}; generator "
                f"{row['load_cores']:.2f} cores ({row['gen_us_per_req']:.0f} us a request); load {row['loadavg']}; "
                f"errors {row['errors']} wrong {'not read' if row['wrong'] is None else row['wrong']}; gathering "
                f"{gathering}")
    chosen_best = curve.layout_best(instances)
    return {"model": model, "cores": cores, "curve": curve.label, "limit": limit, "best_layout": best_layout,
            "best_batch": best_batch, "chosen_layout": chosen, "chosen_layout_best": chosen_best,
            "layout_vs_best": chosen_best / limit, "max_batch": tuning.get("max_formed_batch_size"),
            "trial": lay.get("measured"), "started_s": started_s, "rows": rows}


def run_frontend(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The front end's CPU per request: 1 KB and 602 KB, HTTP binary, gRPC, local socket + shared memory."""
    curve = sim_curve(args.simulate, "mobilenetv2-int8", 16, args.time_scale)
    out = []
    for label, shape in (("1KB", SMALL), ("602KB", BIG)):
        classes = 1000 if shape == BIG else 10
        bundle = build_bundle(work / f"bundle-{label}", shape, classes=classes, name=MODEL)
        data_dir = work / f"frontend-{label}" / "agent"
        install(bundle, data_dir)
        images, labels = _samples(shape, 16 if shape == BIG else 64, classes)
        grpc_port = _free_port()
        sock = data_dir / "local.sock"
        with AgentProcess(data_dir, work / "logs" / f"frontend-{label}.log", 0, None, None, 300, instances=None,
                          extra_args=("-v", "--grpc-port", str(grpc_port), "--local-socket", str(sock)),
                          env=simulation_env(curve)) as agent:
            for kind, url in (("binary", agent.url), ("grpc", f"http://127.0.0.1:{grpc_port}"),
                              ("local", str(sock))):
                path, reqs, _ = bodies(kind, MODEL, images)
                load0 = _load()
                r = run_level(url, kind, path, reqs, labels, args.frontend_clients, args.frontend_requests,
                              args.warmup, server_pid=agent.proc.pid if agent.proc else None,
                              shape=[1, *shape])
                cores = (r.get("server_main_cores") or 0.0) + (r.get("server_other_cores") or 0.0)
                row = {"size": label, "bytes": int(np.prod(shape)) * 4, "variant": kind,
                       "clients": args.frontend_clients, "requests": r["requests"], "req_per_s": r["req_per_s"],
                       "agent_cores": cores, "loop_cores": r.get("server_main_cores"),
                       "cpu_us_per_req": 1e6 * cores / r["req_per_s"] if r["req_per_s"] else float("nan"),
                       "req_per_core_s": r["req_per_s"] / cores if cores else float("nan"),
                       "load_cores": r["load_cores"], "errors": r["errors"], "wrong": r["wrong"],
                       "loadavg": [load0, _load()], "agent_rss_mb": _rss_mb(agent.proc.pid) if agent.proc else None}
                out.append(row)
                say(f"  front end {label:>5} {kind:>6}: {row['req_per_s']:8.1f} req/s, agent {cores:.2f} cores "
                    f"(loop {row['loop_cores'] or 0:.2f}) = {row['cpu_us_per_req']:.0f} us CPU a request = "
                    f"{row['req_per_core_s']:.0f} req/s per core; RSS {row['agent_rss_mb']:.0f} MB; load "
                    f"{row['loadavg']}; errors {row['errors']} wrong {row['wrong']}")
    return out


def print_sim_report(doc: dict[str, Any]) -> None:
    target = doc.get("frontend_target_req_s")
    for box in doc.get("boxes", []):
        print(f"\n{box['model']} on a simulated {box['cores']}-CPU box ({box['curve']}): limit {box['limit']:.1f} "
              f"img/s ({box['best_layout']} at batch {box['best_batch']}); the agent chose {box['chosen_layout']} "
              f"(the curve's best for it {box['chosen_layout_best']:.1f} = {box['layout_vs_best']:.1%} of the limit), "
              f"batches of at most {box['max_batch']}")
        print(f"{'clients':>7} {'req/s':>9} {'vs limit':>9} {'vs bound':>9} {'busy':>6} {'loop':>5} {'gen':>5} "
              f"{'batch':>5} {'p50 ms':>7} {'p99 ms':>7} {'load':>11}  batches formed")
        for r in box["rows"]:
            print(f"{r['clients']:>7} {r['req_per_s']:>9.1f} {r['vs_limit']:>9.1%} {r['vs_bound']:>9.1%} "
                  f"{r['busy_share']:>6.1%} {r['loop_cores'] or 0:>5.2f} {r['load_cores']:>5.2f} "
                  f"{r.get('mean_batch', float('nan')):>5.2f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
                  f"{r['loadavg']!s:>11}  {r['batches']}")
        print("(loop: the agent's event loop, gen: the load generator, in cores; batch: the mean batch formed)")
    if doc.get("frontend"):
        print(f"\nthe front end (simulated 16-CPU INT8 box, the runtime using no CPU; target {target} req/s: 2x its "
              "limit)")
        print(f"{'size':>6} {'variant':>7} {'req/s':>9} {'agent cores':>11} {'CPU us/req':>10} {'req/s/core':>10} "
              f"{'load':>11}")
        for r in doc["frontend"]:
            print(f"{r['size']:>6} {r['variant']:>7} {r['req_per_s']:>9.1f} {r['agent_cores']:>11.2f} "
                  f"{r['cpu_us_per_req']:>10.0f} {r['req_per_core_s']:>10.0f} {r['loadavg']!s:>11}")


def main(args: argparse.Namespace, work: Path) -> int:
    """``bench/serve.py --simulate``: the boxes (or ``--frontend``), then the report."""
    doc: dict[str, Any] = {"benchmark": "edgefleet bench/serve.py --simulate", "curves": str(args.simulate),
                           "time_scale": args.time_scale, "cpus_here": os.cpu_count()}
    if args.frontend:
        # the target: 2x the INT8 limit measured on the 16-core Xeon (its 'unpinned 8 CPUs' set-up, 1,766)
        doc["frontend_target_req_s"] = round(2 * sim_curve(args.simulate, "mobilenetv2-int8", 8, 1.0).best()[0])
        doc["frontend"] = run_frontend(args, work)
    else:
        bundle = build_bundle(work / "bundle", SMALL, classes=10, name=MODEL)
        doc["boxes"] = []
        for model in args.sim_models:
            for cores in args.sim_cores:
                doc["boxes"].append(run_box(args, work, bundle, model, cores))
                if args.json:
                    args.json.write_text(json.dumps(doc, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, default=str))
    print_sim_report(doc)
    return 0
