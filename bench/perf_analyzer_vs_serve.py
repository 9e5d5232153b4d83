"""Triton's perf_analyzer against bench/serve.py's load generator, on one agent, for the same model, client count and
protocol (issue 41.1), for each kind of model the agent serves: a single model (digits) and a pipeline (OCR).

One agent process (as bench/serve.py starts it: digits INT8 compiled and installed, the agent choosing its own
layout and batches, gRPC on; or, with ``--model ocr``, the PP-OCRv4 detect-then-read pipeline, FP32, assembled from
rapidocr-onnxruntime's models as tests/ocr_pipeline.py assembles it for the tests) serves both; for each client
count (closed loop: perf_analyzer's ``--concurrency-range N:N`` keeps N requests outstanding, serve.py's generator N
clients) and each protocol the two run back to back, alternating which goes first:

    http  perf_analyzer -i http (binary tensors)         serve.py 'binary'
    grpc  perf_analyzer -i grpc                           serve.py 'grpc'
    shm   perf_analyzer -i http --shared-memory system    serve.py 'shm' (system shared memory over HTTP)

perf_analyzer comes from bench/perf_analyzer.sh; its windows are --measurement-interval ms, until three agree within
--stability-percentage (default 1000: the first three; on a shared 2-core box its default 10% is rarely met, and
50% failed 20 windows running at 1 client); its figure is their mean. serve.py's level is --requests timed requests
after --warmup per client.

The pipeline (``--model ocr``): both generators send one page, the same bytes each request, [1, 3, H, W] FP32 at the
pipeline's image size (its H and W are open, so perf_analyzer gets ``--shape x:3,H,W``): ``--ocr-input page``, a
synthetic page of four text lines (tests/ocr_pipeline.py's pages, seed 1000; perf_analyzer reads it from a file
named after the input, ``--input-data DIR``), so both stages run; or ``zero``, a blank page (``--input-data zero``:
the detector finds nothing, the reader never runs). Every output is asked for on both sides. serve.py's generator
checks each answer's strings (the first 'count' rows of 'text') against the agent's answer to one request sent
before the runs (for a page it must have read something). Its windows and levels default longer and fewer (a page
takes 0.1-0.5 s here): --measurement-interval 10000, --requests 100, --warmup 1.

Run from the repository root:  .venv/bin/python bench/perf_analyzer_vs_serve.py [--model ocr] [--clients 1,8,32]
[--json out.json] [--split-cpus 0:1]: the agent on CPU 0, both generators on CPU 1 (on a 2-core box, without it the
generator that costs more CPU takes more of the agent's cores, and the two compare load generators more than the
agent)
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
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import say
from serve import prepare
from serve_bench import AgentProcess, _free_port
from serve_load import _phases, bodies, run_level

REPO = Path(__file__).resolve().parent.parent
PROTOCOLS = {"http": ("binary", ("-i", "http")), "grpc": ("grpc", ("-i", "grpc")),
             "shm": ("shm", ("-i", "http", "--shared-memory", "system"))}
# per model: serve.py's timed requests and warm-up per client, perf_analyzer's window (ms), where not given
DEFAULTS = {"digits": {"requests": 2000, "warmup": 5, "measurement_interval": 2000},
            "ocr": {"requests": 100, "warmup": 1, "measurement_interval": 10000}}


def prepare_ocr(work: Path) -> dict[str, Any]:
    """The PP-OCRv4 pipeline bundle (FP32; tests/ocr_pipeline.py's, from rapidocr-onnxruntime's installed models: no
    download) installed in an agent's data directory under ``work`` (kept there: a --work-dir used before reuses
    it), and the agent's settings: a queue timeout long enough for N clients' pages on a slow box (this measures
    throughput, not the 5 s latency bound)."""
    sys.path.insert(0, str(REPO))  # tests/ocr_pipeline.py
    from edgefleet.agent.install.store import ModelStore
    from edgefleet.protocol.bundle import sha256_file
    from tests.ocr_pipeline import ocr_bundle

    data_dir = work / "ocr" / "agent"
    store = ModelStore(data_dir / "store")
    store.recover()
    if store.current is None:
        say("assembling the PP-OCRv4 pipeline bundle (FP32) ...")
        bundle = ocr_bundle(work / "ocr" / "ocr-1.0.0.tar")
        store.commit(store.stage(bundle, sha256_file(bundle)), rollout_id=None)
    else:
        say(f"ocr: installed in {work} before; reused")
    config = work / "ocr" / "agent.yaml"
    config.write_text("queue_timeout_ms: 120000\n")
    return {"model": "ocr", "data_dir": data_dir, "agent_args": ("--config", str(config))}


def ocr_input(url: str, model: str, which: str, work: Path) -> dict[str, Any]:
    """The one page both generators send (``which``: 'page' or 'zero') at the served pipeline's image size, the
    input's name, perf_analyzer's flags for it, and the agent's strings for it (one request's answer: the label
    serve.py's generator checks every answer against)."""
    from tests.ocr_pipeline import body, pages, texts

    with urllib.request.urlopen(f"{url}/v2/models/{model}/config", timeout=30) as r:  # loopback: the agent
        cfg = json.loads(r.read())
    with urllib.request.urlopen(f"{url}/v2/models/{model}", timeout=30) as r:
        name = json.loads(r.read())["inputs"][0]["name"]
    h, w = cfg["pipeline"]["image_size"]
    if which == "zero":
        images = np.zeros((1, 3, h, w), np.float32)
        pa_data = "zero"
    else:
        images = pages(1, seed=1000)
        if images.shape[2:] != (h, w):
            raise SystemExit(f"the pipeline's images are {h}x{w}; the test pages {images.shape[2:]}")
        (work / "pa-input").mkdir(exist_ok=True)
        (work / "pa-input" / name).write_bytes(np.ascontiguousarray(images[0]).tobytes())  # batch 1, row-major
        pa_data = str(work / "pa-input")
    content, headers = body(images)
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=content,
                                 headers={**headers, "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=300) as r:  # loopback: the agent
        want = texts(json.loads(r.read()))[0]
    if which == "page" and not want:
        raise SystemExit("the agent read nothing on the page: its answers could not be checked")
    say(f"ocr: {which} input [1, 3, {h}, {w}]; the agent reads {want}")
    return {"images": images, "input_name": name, "labels": [want], "shape": [1, 3, h, w],
            "pa_args": ("--shape", f"{name}:3,{h},{w}", "--input-data", pa_data)}


def perf_analyzer_path() -> str:
    got = subprocess.run(["bash", str(REPO / "bench" / "perf_analyzer.sh")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHON": sys.executable})
    if got.returncode != 0:
        raise SystemExit(f"bench/perf_analyzer.sh: {got.stderr.strip()[-500:]}")
    return got.stdout.strip().splitlines()[-1]


def run_pa(pa: str, model: str, url: str, proto_args: tuple[str, ...], clients: int, interval_ms: int,
           stability: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pa.csv"
        cmd = [pa, "-m", model, "-u", url, *proto_args, *extra, "--concurrency-range", f"{clients}:{clients}",
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
          f"{'client CPU us/req pa / serve':>29} {'agent us/req pa / serve':>24}")
    for r in rows:
        a, s = r["pa"], r["serve"]
        if "error" in a:
            print(f"{r['clients']:>7} {r['protocol']:>8} perf_analyzer failed: {a['error']}")
            continue
        print(f"{r['clients']:>7} {r['protocol']:>8} {_rate(a['req_per_s']):>16} {_rate(s['req_per_s']):>11} "
              f"{r['pa_vs_serve']:>6.2f} {a['p50_ms']:>9.2f} {s['p50_ms']:>12.2f} {a['p99_ms']:>9.2f} "
              f"{s['p99_ms']:>12.2f} {_us(a.get('client_us_per_req')):>14} / {_us(s.get('client_us_per_req')):<12} "
              f"{_us(a.get('agent_us_per_req')):>11} / {_us(s.get('agent_us_per_req')):<10}")


def _served(stats_url: str) -> tuple[int, int] | None:
    """(requests the agent answered, their nanoseconds from arrival to answer) so far: its Triton statistics."""
    try:
        return _phases(stats_url)["success"]
    except (OSError, KeyError, IndexError, ValueError):
        return None


def _agent_us(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The agent's own time per request over a generator's run (warm-up included): what each tool was served."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0]) / 1e3


def _rate(v: float) -> str:  # a pipeline's few pages a second keep two decimals
    return f"{v:.0f}" if v >= 100 else f"{v:.2f}"


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(DEFAULTS), default="digits",
                   help="digits (a single model, INT8) or ocr (the PP-OCRv4 detect-then-read pipeline, FP32)")
    p.add_argument("--ocr-input", choices=("page", "zero"), default="page",
                   help="ocr: the page both send, a synthetic page of text lines or a blank one (zeros)")
    p.add_argument("--clients", default="1,8,32", help="closed-loop client counts (perf_analyzer's concurrency)")
    p.add_argument("--protocols", default="http,grpc,shm", help=f"of {', '.join(PROTOCOLS)}")
    p.add_argument("--requests", type=int, help="serve.py: timed requests per level (digits 2000, ocr 100)")
    p.add_argument("--warmup", type=int, help="serve.py: untimed requests per client first (digits 5, ocr 1)")
    p.add_argument("--measurement-interval", type=int,
                   help="perf_analyzer: ms per window (digits 2000, ocr 10000)")
    p.add_argument("--stability-percentage", type=int, default=1000,
                   help="perf_analyzer: windows agree within this (default: any three; a shared box rarely meets 10%%)")
    p.add_argument("--work-dir", type=Path, help="keep the compiled bundle and the agent's data here")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--split-cpus", metavar="AGENT:CLIENTS",
                   help="e.g. 0:1: the agent on these CPUs, both load generators on those (each side its own cores, "
                        "so neither generator takes the agent's; default: all share every CPU)")
    args = p.parse_args(argv)
    for k, v in DEFAULTS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    split = None
    if args.split_cpus:
        a, c = (frozenset(int(x) for x in side.split(",")) for side in args.split_cpus.split(":"))
        split = (a, c)
        os.sched_setaffinity(0, a)  # the agent started below inherits these; the generators later get the others
    pa = perf_analyzer_path()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pa-vs-serve-"))
    m = prepare("digits", work) if args.model == "digits" else prepare_ocr(work)
    grpc_port = _free_port()
    rows: list[dict[str, Any]] = []
    with AgentProcess(m["data_dir"], work / "logs" / "agent.log", 0, None, None, 120 if args.model == "digits" else 600,
                      instances=None, extra_args=("--grpc-port", str(grpc_port), *m.get("agent_args", ()))) as agent:
        if split is not None:  # perf_analyzer and serve.py's spawned generator inherit the clients' CPUs
            os.sched_setaffinity(0, split[1])
        host = agent.url.removeprefix("http://")
        stats_url = f"{agent.url}/v2/models/{m['model']}/stats"
        # what both send: digits' test images (perf_analyzer its random data), or the pipeline's one page
        load: dict[str, Any] = {"images": m.get("images"), "labels": m.get("labels"), "input_name": "input",
                                "shape": None, "pa_args": (), "answer": "top1"}
        if args.model == "ocr":
            load.update(ocr_input(agent.url, m["model"], args.ocr_input, work), answer="texts")
        for clients in [int(c) for c in args.clients.split(",")]:
            for i, proto in enumerate(args.protocols.split(",")):
                kind, pa_args = PROTOCOLS[proto]
                url = f"http://127.0.0.1:{grpc_port}" if kind == "grpc" else agent.url
                pa_url = f"127.0.0.1:{grpc_port}" if kind == "grpc" else host
                got: dict[str, Any] = {}
                order = ("serve", "pa") if (clients + i) % 2 == 0 else ("pa", "serve")
                for who in order:
                    seen = _served(stats_url)
                    if who == "pa":
                        got["pa"] = run_pa(pa, m["model"], pa_url, pa_args, clients, args.measurement_interval,
                                           args.stability_percentage, load["pa_args"])
                    else:
                        path, reqs, _ = bodies(kind, m["model"], load["images"], load["input_name"])
                        r = run_level(url, kind, path, reqs, load["labels"], clients, args.requests, args.warmup,
                                      shape=load["shape"], answer=load["answer"])
                        if r["errors"] or r["wrong"]:
                            say(f"serve.py's generator: {r['errors']} errors, {r['wrong']} wrong answers of "
                                f"{r['requests'] + r['errors']} (first error: {r['first_error']})")
                        got["serve"] = {k: r[k] for k in ("req_per_s", "p50_ms", "p99_ms", "errors", "wrong")}
                        got["serve"]["client_us_per_req"] = 1e6 * r["load_cores"] / r["req_per_s"]
                    got[who]["agent_us_per_req"] = _agent_us(seen, _served(stats_url))
                row = {"model": m["model"], "clients": clients, "protocol": proto, "first": order[0], **got}
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
