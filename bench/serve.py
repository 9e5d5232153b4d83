"""Serving benchmark: the agent against the runtime's limit and a naive micro-batcher, in one run.

For each model (digits INT8, MobileNetV2-like FP32 and INT8 from models/zoo/make_zoo.py), all on 127.0.0.1
and with every loop bounded:

1. compile it for x86-cpu and install the bundle into an agent data dir (no fleet);
2. **the limit**: raw onnxruntime in this process, the agent's session options, at batch 1, 2, 4, 8, 16:
   the best images/s is the limit (measured before and after the servers run; the mean is used);
   ``--limit-runtimes all`` times every runtime installed that runs the bundle (raw OpenVINO with the engine's
   own properties too) and ``vs best`` is against the fastest; ``--spot-limits`` times them again around each
   load level, with images per CPU-second against the agent's inference threads';
3. start **the agent** (``python -m edgefleet.cli agent``, cold start to ready and idle RSS measured) and
   **the naive baseline** (serve_baselines.py ``--naive-server``: a Starlette endpoint taking raw float32 bytes
   with an asyncio micro-batcher that collects for up to 5 ms and runs the model inside the event loop, the
   common tutorial pattern) as separate processes;
4. closed-loop load from a separate process at 1, 8 and 32 clients (one image per request), interleaving
   the variants level by level: naive raw bytes, agent binary OIP, agent JSON OIP; for digits also the on-box
   clients: gRPC, system shared memory over HTTP (shm), and the agent's Unix socket (agent/transports/local_client.py,
   every client on one pipelined connection): ``local`` with the tensors in shared memory, ``local-inline`` in the
   frames;
5. print ratios against the limit, p50/p99, the median latency the server adds at 1 client over a raw
   batch-1 call, and the JSON decode cost (``json.loads`` + ``np.asarray`` of one request body; also with
   orjson, the parser the agent uses, for a stricter JSON target).

Run from the repository root:  .venv/bin/python bench/serve.py [--quick] [--models digits,mobilenetv2-fp32]

This file runs a model through these steps and prints the report; the parts are beside it: serve_limit.py (the
limit, ``PIN``, bare memory), serve_baselines.py (the naive server, the transport floor), serve_load.py (request
bodies, the load generator, one level), serve_report.py (the printed report).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_limit
from _common import model_files, say
from serve_baselines import NaiveProcess, transport_floor_ms
from serve_bench import AgentProcess, _free_port
from serve_limit import (
    _layout_bests,
    _rate,
    _rss_mb,
    _runner,
    _session,
    bare_rss,
    limit_runtimes,
    spot_limits,
    the_limit,
)
from serve_load import bodies, json_decode_ms, run_level
from serve_report import print_report

REPO = Path(__file__).resolve().parent.parent
MODELS = ("digits", "mobilenetv2-fp32", "mobilenetv2-int8")
# also accepted by --models: a bf16 bundle (x86-cpu-bf16; needs avx512_bf16/AMX and edgefleet[openvino])
MORE_MODELS = ("mobilenetv2-bf16",)


def prepare(name: str, work: Path) -> dict[str, Any]:
    """Compile and install one model; -> data dir, engine, images and labels for the load."""
    from edgefleet.agent.install.store import ModelStore
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.protocol.bundle import sha256_file

    model, calib, evalp, precision, model_name = model_files(name)
    with np.load(evalp) as npz:
        if name == "digits":
            images, labels = npz["input"].astype(np.float32), npz["labels"].astype(np.int64)
        else:
            images, labels = npz["input"][:16].astype(np.float32), npz["labels"][:16].astype(np.int64)
    data_dir = work / name / "agent"
    done = work / name / "prepared.json"  # a --work-dir used before: compiled and installed already
    if done.exists() and Path(json.loads(done.read_text())["engine"]).exists():
        engine, shipped = Path(json.loads(done.read_text())["engine"]), json.loads(done.read_text())["precision"]
        say(f"{name}: compiled and installed in {work} before; reused")
    else:
        profile = "x86-cpu-bf16" if precision == "bf16" else "x86-cpu"
        result = compile_model(CompileOptions(model=model, profile=profile, calibration=calib, eval=evalp,
                                              out_dir=work / name / "dist", name=model_name, version="1.0.0",
                                              benchmark=False, precision=precision, max_accuracy_drop=1.0))
        store = ModelStore(data_dir / "store")
        store.recover()
        staged = store.stage(result.bundle, sha256_file(result.bundle))
        store.commit(staged, None)
        engine, shipped = staged.engine, result.manifest.precision
        done.write_text(json.dumps({"engine": str(engine), "precision": shipped}))
    if name != "digits":  # labels for a random-weight model: what this engine itself says (a bf16 bundle: OpenVINO
        # in bf16, its only runtime; onnxruntime would run its ONNX file in fp32 and count bf16's flips on near-tied
        # random logits as wrong answers)
        runtime = "openvino" if shipped == "bf16" else "onnxruntime"
        labels = np.asarray(_runner(runtime, engine, 2, shipped).run(None, {"input": images})[0]).argmax(1)
    return {"name": name, "model": model_name, "data_dir": data_dir, "engine": engine,
            "images": images, "labels": [int(v) for v in labels], "precision": shipped}


def _have_grpc() -> bool:
    try:
        import grpc  # type: ignore[import-untyped]  # noqa: F401
        import tritonclient.grpc  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        say("no grpcio / tritonclient[grpc] (edgefleet[grpc]): the gRPC and shared-memory rows are skipped")
        return False
    return True


def bench_model(m: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    name, images, labels = m["name"], m["images"], m["labels"]
    small = name == "digits"
    totals = {"naive": args.requests if small else args.requests_big,
              "binary": args.requests if small else args.requests_big,
              "json": args.requests if small else max(20, args.requests_big // 5),
              "grpc": args.requests, "shm": args.requests, "local": args.requests, "local-inline": args.requests}
    runtimes = limit_runtimes(args.limit_runtimes, m["precision"])
    say(f"{name}: the limit (bare {', '.join(runtimes)} in this process, batch 1..16, every layout of "
        f"{args.threads} CPU(s))")
    limits_before = {r: the_limit(m["engine"], images, args.threads, args.limit_seconds, r, m["precision"])
                     for r in runtimes}
    limit_before = limits_before[runtimes[0]]  # the first runtime's: the 'vs limit' column, the layouts, batch 1
    layout = {"auto": limit_before["layout"], "default": f"1x{args.threads}"}.get(args.agent_layout, args.agent_layout)
    # "agent": no --instances/--threads, the agent measures and chooses its layout (read back from its config)
    instances, per = (None, None) if layout == "agent" else (int(v) for v in layout.split("x"))
    say(f"{name}: limit {limit_before['images_per_s']:.1f} img/s ({limit_before['by_layout']}); the agent runs "
         + ("the layout it chooses" if layout == "agent" else f"{instances} instance(s) of {per} thread(s)"))
    json_body = bodies("json", m["model"], images[:1])[1][0]
    decode_ms = json_decode_ms(json_body)
    import orjson

    decode_ms_orjson = json_decode_ms(json_body, loads=orjson.loads)
    binary_request = bodies("binary", m["model"], images[:1])[1][0]
    floor_ms = transport_floor_ms(len(binary_request))
    asgi_floor_ms = transport_floor_ms(len(binary_request), asgi=True)
    t0 = time.monotonic()
    pin = serve_limit.PIN
    pin_args = ("--inference-cpus", ",".join(map(str, sorted(pin[0])))) if pin else ()
    local = small and _have_grpc()  # digits, where the transport is the cost: gRPC and shared memory too
    grpc_port = _free_port()
    sock = m["data_dir"] / "local.sock"  # the on-box socket (agent/transports/local.py), for digits
    agent = AgentProcess(m["data_dir"], work / "logs" / f"{name}-agent.log", 0, args.max_batch_size, per, 120,
                         instances=instances,
                         extra_args=("-v", *pin_args, *_runtime_args(args, work),  # -v: its install log lines
                                     *(("--grpc-port", str(grpc_port)) if local else ()),
                                     *(("--local-socket", str(sock)) if small else ())))
    rows: list[dict[str, Any]] = []
    with agent:
        cold_s = time.monotonic() - t0
        assert agent.proc is not None
        time.sleep(1.0)
        idle_rss = _rss_mb(agent.proc.pid)
        chosen, chosen_layout = agent_choice(agent.url, m["model"])
        agent_cfg = agent_config(agent.url, m["model"])
        layout = chosen_layout if layout == "agent" else layout
        instances, per = (int(v) for v in layout.split("x"))
        say(f"{name}: the agent serves {chosen}")
        with NaiveProcess(m["engine"], args.threads, work / "logs" / f"{name}-naive.log") as naive:
            variants = [("naive", naive.url), ("binary", agent.url), ("json", agent.url)]
            if local:
                variants += [("grpc", f"http://127.0.0.1:{grpc_port}"), ("shm", agent.url)]
            if small:
                variants += [("local", str(sock)), ("local-inline", str(sock))]
            if args.variants:
                variants = [v for v in variants if v[0] in args.variants]
            for clients in args.clients:
                order = variants if clients % 2 == 0 else list(reversed(variants))  # interleave, alternating order
                for kind, url in order:
                    path, reqs, _ = bodies(kind, m["model"], images)
                    pid = (naive if kind == "naive" else agent).proc.pid  # type: ignore[union-attr]
                    stats = f"{agent.url}/v2/models/{m['model']}/stats" if kind != "naive" else None
                    spot = spot_limits(m["engine"], images, limits_before, m["precision"], args.limit_seconds) \
                        if args.spot_limits else {}
                    r = run_level(url, kind, path, reqs, labels, clients, totals[kind], args.warmup, server_pid=pid,
                                  stats_url=stats)
                    if spot:  # the same before and after this level: the mean is its baseline
                        after = spot_limits(m["engine"], images, limits_before, m["precision"], args.limit_seconds)
                        r["spot_limits"] = {k: (v[0] + after[k][0]) / 2 for k, v in spot.items()}
                        r["spot_per_cpu_s"] = {k: (v[1] + after[k][1]) / 2 for k, v in spot.items()}
                        r["spot_best"] = max(r["spot_limits"], key=lambda k: r["spot_limits"][k])
                        r["vs_best_spot"] = r["req_per_s"] / r["spot_limits"][r["spot_best"]]
                        # images per CPU-second: the agent's inference threads (all but its event loop) against
                        # the fastest runtime's bare calls, a figure the box's load does not move
                        best_cpu = max(r["spot_per_cpu_s"].values())
                        if r.get("server_other_cores"):
                            r["agent_per_cpu_s"] = r["req_per_s"] / r["server_other_cores"]
                            r["vs_best_per_cpu_s"] = r["agent_per_cpu_s"] / best_cpu
                    rows.append({"variant": kind, "clients": clients, **r})
                    say(f"  {name:>16} {kind:>6} {clients:>3} clients: {r['req_per_s']:8.1f} req/s  "
                         f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}  "
                         f"wrong {r['wrong']}" + (f"  first error {r['first_error']}" if r["first_error"] else ""))
        load_rss, peak_rss = _rss_mb(agent.proc.pid), _rss_mb(agent.proc.pid, "VmHWM")
    limits_after = {r: the_limit(m["engine"], images, args.threads, args.limit_seconds, r, m["precision"])
                    for r in reversed(runtimes)}  # the other order: a slow spell lands on each runtime alike
    limit_after = limits_after[runtimes[0]]
    tuning = agent_cfg.get("batch_tuning") or {}
    chosen_batch = int(tuning.get("max_formed_batch_size") or args.max_batch_size or 16)
    bare = bare_rss(m["engine"], layout, chosen_batch)
    memory = {"agent_after_install_mb": idle_rss, "agent_after_load_mb": load_rss, "agent_peak_mb": peak_rss,
              "bare_layout": layout, "bare_batch": chosen_batch, **{f"bare_{k}": v for k, v in bare.items()}}
    agent_layouts = {n: f["images_per_second"] for n, f in ((tuning.get("layout") or {}).get("measured") or {}).items()}
    limit = (limit_before["images_per_s"] + limit_after["images_per_s"]) / 2
    # a request at one client costs one batch-1 call of the server's own session: the agent's layout, or the
    # naive server's single session of all the threads
    b1_ms = {k: (limit_before["batch1_ms"][k] + limit_after["batch1_ms"][k]) / 2 for k in limit_before["batch1_ms"]}
    if layout not in b1_ms:  # a layout the limit did not measure
        b1_ms[layout] = statistics.median(_rate(_session(m["engine"], per), images[:1], args.limit_seconds)[1]) * 1000
    cpus = os.cpu_count() or 1
    # each runtime's limit (the mean of before and after) and the fastest: what the agent's share is taken of
    by_runtime = {r: (limits_before[r]["images_per_s"] + limits_after[r]["images_per_s"]) / 2 for r in runtimes}
    best_engine = max(by_runtime, key=lambda r: by_runtime[r])
    for r in rows:
        r["vs_limit"] = r["req_per_s"] / limit
        r["vs_best_engine"] = r["req_per_s"] / by_runtime[best_engine]
        # the limit ran alone; under load the generator's own CPU is gone from the machine: the ratio against the
        # limit scaled to the cores it left
        r["vs_limit_cpu_left"] = r["req_per_s"] / (limit * max(0.05, cpus - r["load_cores"]) / cpus)
        if r["clients"] == 1:
            r["added_ms"] = r["p50_ms"] - b1_ms[f"1x{args.threads}" if r["variant"] == "naive" else layout]
            if "compute_b1_ms" in r:  # against the agent's own runtime calls of this run: no session-to-session noise
                r["added_own_ms"] = r["p50_ms"] - r["compute_b1_ms"]
    naive_by_c = {r["clients"]: r["req_per_s"] for r in rows if r["variant"] == "naive"}
    json_target = {c: 1 / (1 / v + decode_ms / 1000) for c, v in naive_by_c.items()}
    json_target_orjson = {c: 1 / (1 / v + decode_ms_orjson / 1000) for c, v in naive_by_c.items()}
    return {"model": name, "precision": m["precision"], "limit_img_s": limit, "limit_before": limit_before,
            "limit_after": limit_after, "raw_batch1_ms": b1_ms, "json_decode_ms": decode_ms,
            "transport_floor_ms": floor_ms, "asgi_floor_ms": asgi_floor_ms,
            "json_decode_orjson_ms": decode_ms_orjson, "json_target_req_s": json_target,
            "json_target_orjson_req_s": json_target_orjson, "cold_start_s": cold_s, "idle_rss_mb": idle_rss,
            "rows": rows, "agent_layout": layout, "agent_choice": chosen, "memory": memory,
            "agent_layouts_img_s": agent_layouts, "limit_by_layout_best": _layout_bests(limit_before, limit_after),
            "limit_runtime": runtimes[0], "limits_by_runtime": by_runtime, "best_engine": best_engine,
            "limits_before_by_runtime": limits_before, "limits_after_by_runtime": limits_after,
            "agent_runtime": agent_cfg.get("runtime_choice")}


def agent_config(url: str, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/config", timeout=30) as r:  # loopback: the agent under test
        return json.loads(r.read())


def _runtime_args(args: argparse.Namespace, work: Path) -> tuple[str, ...]:
    """``--agent-runtime``: the agent's ``runtime`` setting, in a config file of its own (no flag sets it)."""
    if not args.agent_runtime:
        return ()
    cfg = work / f"agent-runtime-{args.agent_runtime}.yaml"
    cfg.write_text(f"runtime: {args.agent_runtime}\n")
    return ("--config", str(cfg))


def agent_choice(url: str, model: str) -> tuple[str, str]:
    """What the agent chose to serve with, from its model configuration (batch_tuning, instance_group), and its
    layout (INSTANCESxTHREADS)."""
    with urllib.request.urlopen(f"{url}/v2/models/{model}/config", timeout=30) as r:  # loopback: the agent under test
        cfg = json.loads(r.read())
    t = cfg.get("batch_tuning") or {}
    layout = t.get("layout") or {}
    out = (f"batches of at most {t.get('max_formed_batch_size', '?')} ({t.get('mode', 'untold')}"
           + (f"; images/s by batch size {t['images_per_second']}" if t.get("images_per_second") else "") + "), "
           f"{cfg['instance_group'][0]['count']} instance(s)")
    if layout:
        out += f" of {layout.get('threads', '?')} thread(s) ({layout.get('source', '?')}"
        out += f"; {layout['measured']}" if layout.get("measured") else ""
        out += ")"
    return out, f"{cfg['instance_group'][0]['count']}x{layout.get('threads', '?')}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="serve.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (a rough look, about 2 minutes)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--clients", help="closed-loop client counts (default 1,8,32; with --simulate 8,32,64)")
    p.add_argument("--requests", type=int, help="timed requests per level, digits (default 3000, quick 1000)")
    p.add_argument("--requests-big", type=int, help="timed requests per level, MobileNetV2 binary and naive (JSON: "
                                                    "a fifth) (default 600, quick 200)")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per client first")
    p.add_argument("--agent-runtime", choices=("auto", "onnxruntime", "openvino"),
                   help="the agent's runtime setting (default: its own, auto: it times the runtimes installed)")
    p.add_argument("--variants", help="only these variants, comma-separated (e.g. naive,binary); default: all")
    p.add_argument("--threads", type=int, default=2, help="threads for inference, everywhere (the naive server: one "
                                                         "session of this many; the limit: both layouts)")
    p.add_argument("--agent-layout", default="agent",
                   help="the agent's INSTANCESxTHREADS as an operator's setting, e.g. 2x1; default: one instance of "
                        "--threads threads; auto: the layout that gave the limit first; agent: none given, the agent "
                        "measures its layouts at install and chooses")
    p.add_argument("--max-batch-size", type=int,
                   help="the agent's max batch size, as an operator's setting (it then does not tune its own); "
                        "default: the agent measures and chooses its own at install (batch_tuning: auto)")
    p.add_argument("--pin", action="store_true",
                   help="give the runtime its own CPU(s): the limit, the agent's inference threads and the naive "
                        "server on --inference-cpus, the agent's event loop and the load generator on the rest; "
                        "--threads becomes the number of inference CPUs")
    p.add_argument("--inference-cpus", help="with --pin: CPU numbers, e.g. 1 or 2,3 (default: the last CPU)")
    p.add_argument("--limit-seconds", type=float, default=1.5, help="timing per batch size for the limit")
    p.add_argument("--spot-limits", action="store_true",
                   help="also time each runtime's bare rate (at its best layout and batch size) just before and after "
                        "each load level: 'vs best spot' is against the fastest of those")
    p.add_argument("--limit-runtimes", default="onnxruntime",
                   help="the runtimes whose bare limit is timed, comma-separated (onnxruntime, openvino), or all: "
                        "every one installed here that runs the bundle; 'vs best' is against the fastest")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--work-dir", type=Path, help="keep bundles and logs here (default: a temp dir)")
    sim = p.add_argument_group("simulated boxes (serve_sim.py, issue 44)")
    sim.add_argument("--simulate", type=Path, metavar="FILE",
                     help="serving curves (../shared/data/xeon16-serving.json): the agent on a simulated runtime "
                          "that takes the curves' time (bench/sim_runtime.py) instead of the models above")
    sim.add_argument("--sim-cores", default="4,8,16", help="the simulated boxes' CPUs (4, 8, 16)")
    sim.add_argument("--sim-models", default="mobilenetv2-fp32,mobilenetv2-int8", help="the curves' models")
    sim.add_argument("--sim-seconds", type=float, default=3.0, help="about this long per level")
    sim.add_argument("--time-scale", type=float, default=1.0, help="every simulated call takes this many times "
                                                                   "its curve time (the limit divides by it)")
    sim.add_argument("--sim-delay-us", type=int, default=0,
                     help="the agent's --max-queue-delay-us on the simulated boxes (its default: 0)")
    sim.add_argument("--sim-client", choices=("serve_load", "perf_analyzer"), default="serve_load",
                     help="the load generator: serve_load's (Python, every answer checked) or Triton's perf_analyzer "
                          "(C++, about 50 us of CPU a request; bench/perf_analyzer.sh fetches it)")
    sim.add_argument("--frontend", action="store_true", help="the front end's CPU per request instead (1 KB and "
                                                            "602 KB; HTTP, gRPC, local socket)")
    sim.add_argument("--frontend-clients", type=int, default=32, help="clients of a --frontend level")
    sim.add_argument("--frontend-requests", type=int, default=3000, help="timed requests of a --frontend level")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in (args.clients or ("8,32,64" if args.simulate else "1,8,32")).split(",")
                    if c.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    if args.pin:
        allowed = sorted(os.sched_getaffinity(0))
        mine = frozenset(int(c) for c in args.inference_cpus.split(",")) if args.inference_cpus else \
            frozenset(allowed[-1:])
        rest = frozenset(allowed) - mine
        if not mine <= set(allowed) or not rest:
            p.error(f"--inference-cpus {sorted(mine)}: must be CPUs of {allowed}, leaving at least one")
        serve_limit.PIN = (mine, rest)
        args.threads = len(mine)
        say(f"pinned: inference on CPU(s) {sorted(mine)}, event loops and the load generator on {sorted(rest)}; "
             f"{args.threads} inference thread(s)")
    args.requests = args.requests or (1000 if args.quick else 3000)
    if args.simulate:  # the agent on simulated boxes (serve_sim.py): none of the models above is compiled
        import serve_sim

        args.sim_cores = [int(c) for c in args.sim_cores.split(",") if c.strip()]
        args.sim_models = [m.strip() for m in args.sim_models.split(",") if m.strip()]
        with contextlib.ExitStack() as stack:
            work = args.work_dir.resolve() if args.work_dir else Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="edgefleet-serve-sim-")))
            return serve_sim.main(args, work)
    args.requests_big = args.requests_big or (200 if args.quick else 600)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS + MORE_MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS + MORE_MODELS)}")
    import onnxruntime as ort

    pin = serve_limit.PIN
    with contextlib.ExitStack() as stack:
        work = args.work_dir.resolve() if args.work_dir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="edgefleet-serve-")))
        results: list[dict[str, Any]] = []
        doc = {"benchmark": "edgefleet bench/serve.py", "models": results,
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "onnxruntime": ort.__version__, "platform": platform.platform()},
               "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "pin_cpus": [sorted(pin[0]), sorted(pin[1])] if pin else None}}
        for n in names:
            say(f"{n}: compiling for x86-cpu and installing")
            results.append(bench_model(prepare(n, work), args, work))
            if args.json:  # after each model: a run cut short keeps what it measured
                args.json.write_text(json.dumps(doc, indent=2, default=str))
    print_report(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
