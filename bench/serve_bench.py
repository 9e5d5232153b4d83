"""Serving benchmark: the agent's KServe v2 HTTP path against raw onnxruntime, measured in one run.

Steps (everything on 127.0.0.1, every loop bounded):

1. compile models/digits for x86-cpu (static INT8) into a temporary folder;
2. install the bundle into an agent data dir through ``agent.install.store.ModelStore`` (no fleet);
3. baseline: raw onnxruntime, in this process, on the same INT8 engine file, batch 1 and batch 16;
4. for each ``--max-queue-delay-us`` setting (alternating over ``--rounds``): start the agent as its own
   process (``python -m edgefleet.cli agent`` with an unreachable fleet URL), wait until it is ready,
   then drive it with N concurrent clients (one image per request) from separate load-generator
   processes running asyncio + httpx, and stop it;
5. print a table (stdout; stderr with ``--json``, which prints a JSON document on stdout).

Run from the repository root:  .venv/bin/python bench/serve_bench.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import run_and_report, say

from edgefleet.protocol.processes import stop_processes

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "models" / "digits"
MODEL = "digits"
UNREACHABLE_FLEET = "http://127.0.0.1:9"  # discard port: the agent serves its installed model and retries


# -- model: compile and install ------------------------------------------------------------------------


def compile_and_install(work: Path) -> tuple[Path, Path, Any]:
    """Compile the digits model and commit it into ``work/agent/store``; -> (data dir, engine path, manifest)."""
    from edgefleet.agent.install.store import ModelStore
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.protocol.bundle import sha256_file

    result = compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="x86-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=work / "dist", name=MODEL, version="1.0.0", benchmark=False))
    data_dir = work / "agent"
    store = ModelStore(data_dir / "store")
    store.recover()
    staged = store.stage(result.bundle, sha256_file(result.bundle))
    store.commit(staged, None)
    return data_dir, staged.engine, result.manifest


# -- baseline: raw onnxruntime in this process ---------------------------------------------------------


def ort_baseline(engine: Path, images: np.ndarray, threads: int, iters_b1: int, iters_b16: int,
                 spinning: bool, repeats: int = 3) -> dict[str, Any]:
    """Images per second of ``InferenceSession.run`` on the engine, batch 1 and batch 16, fixed iterations."""
    import onnxruntime as ort

    from edgefleet.engines.onnxruntime import session_options

    so = session_options(ort, threads)  # the agent's own, spinning off; on only when asked
    if spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    sess = ort.InferenceSession(str(engine), so, providers=["CPUExecutionProvider"])
    in_name = sess.get_inputs()[0].name
    out_names = [o.name for o in sess.get_outputs()]
    out: dict[str, Any] = {"threads": threads, "spinning": spinning, "onnxruntime": ort.__version__}
    for batch, iters in ((1, iters_b1), (16, iters_b16)):
        feeds = {in_name: np.ascontiguousarray(np.resize(images, (batch, *images.shape[1:])), dtype=np.float32)}
        for _ in range(min(200, iters)):
            sess.run(out_names, feeds)
        rates = []
        for _ in range(repeats):  # the median of a few timed passes: one pass is at the mercy of a noisy neighbour
            t0 = time.perf_counter()
            for _ in range(iters):
                sess.run(out_names, feeds)
            rates.append(iters * batch / (time.perf_counter() - t0))
        rate = statistics.median(rates)
        out[f"batch{batch}"] = {"iterations": iters, "repeats": repeats, "images_per_s": round(rate, 1),
                                "images_per_s_passes": [round(r, 1) for r in rates],
                                "ms_per_call": round(batch / rate * 1000, 4)}
    return out


# -- the agent process ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child: SIGTERM it if the benchmark dies
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class AgentProcess:
    """``python -m edgefleet.cli agent`` on a free loopback port; a context manager that always stops it."""

    def __init__(self, data_dir: Path, log_path: Path, delay_us: int, max_batch_size: int | None, threads: int | None,
                 ready_timeout_s: float, instances: int | None = 1, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        """``max_batch_size``, ``threads``, ``instances``: None leaves the flag out (the agent's own choice). ``env``:
        more environment for the agent (bench/sim_runtime.py's simulation_env: the agent on a simulated runtime)."""
        self.data_dir, self.log_path = data_dir, log_path
        self.env = env or {}
        self.extra_args = extra_args  # more `edgefleet agent` flags, e.g. ("--inference-cpus", "1")
        self.delay_us, self.max_batch_size, self.threads = delay_us, max_batch_size, threads
        self.instances = instances
        self.ready_timeout_s = ready_timeout_s
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> AgentProcess:
        args = [sys.executable, "-m", "edgefleet.cli", "agent", "--device-id", "bench", "--fleet", UNREACHABLE_FLEET,
                "--data-dir", str(self.data_dir), "--http-port", str(self.port),
                "--max-queue-delay-us", str(self.delay_us),
                "--trust-on-first-use", *self.extra_args]  # no fleet here: it serves the bundle preinstalled
        for flag, v in (("--max-batch-size", self.max_batch_size), ("--threads", self.threads),
                        ("--instances", self.instances)):
            if v is not None:  # an operator's setting: the agent does not choose it itself
                args += [flag, str(v)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                                         preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(0.1)
        raise RuntimeError(f"the agent was not ready after {self.ready_timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def cpu_seconds(self) -> float:
        """User + system CPU time of the agent process so far (Linux /proc)."""
        assert self.proc is not None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], grace_s=10)


# -- the load generator (runs in its own processes) ----------------------------------------------------


def request_bodies(images: np.ndarray) -> list[bytes]:
    """One KServe v2 JSON body per image, encoded once so the clients only send bytes."""
    return [json.dumps({"inputs": [{"name": "input", "shape": [1, *img.shape], "datatype": "FP32",
                                    "data": img.reshape(-1).tolist()}]}).encode() for img in images]


class _RawConnection:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams: requests are prebuilt bytes, so a request costs
    the client tens of microseconds instead of the ~1-3 ms httpx spends (which made the client the bottleneck)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, request: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self._writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self._reader is not None
        try:
            self._writer.write(request)
            head = await self._reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = None
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length is None:
                raise ConnectionError("response without Content-Length")
            return status, await self._reader.readexactly(length)
        except BaseException:
            await self.close()  # the stream is out of step; the next request reconnects
            raise

    async def close(self) -> None:
        w, self._writer, self._reader = self._writer, None, None
        if w is not None:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()


async def _drive(kind: str, url: str, bodies: list[bytes], labels: list[int], clients: int, offset: int,
                 requests: int, warmup: int, barrier: Any) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    path = f"/v2/models/{MODEL}/infer"
    lat: list[float] = []
    stats = {"errors": 0, "correct": 0, "checked": 0}
    first_error: list[str] = []
    cleanup: list[Any] = []

    if kind == "raw":
        prebuilt = [f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies]
        conns = [_RawConnection(host, int(port)) for _ in range(clients)]
        cleanup.extend(c.close for c in conns)

        async def send(slot: int, i: int) -> tuple[int, bytes]:
            return await conns[slot].post(prebuilt[i])
    else:
        import httpx

        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=clients, max_keepalive_connections=clients),
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        client = httpx.AsyncClient(transport=transport, timeout=30.0)
        cleanup.append(client.aclose)
        headers = {"content-type": "application/json"}

        async def send(slot: int, i: int) -> tuple[int, bytes]:
            r = await client.post(f"{url}{path}", content=bodies[i], headers=headers)
            return r.status_code, r.content

    async def client_loop(slot: int, n: int, record: bool) -> None:
        i = ((offset + slot) * 7919) % len(bodies)  # each client starts on a different image
        for _ in range(n):
            t0 = time.perf_counter()
            try:
                status, content = await asyncio.wait_for(send(slot, i), 30.0)
                ok = status == 200
                detail = f"HTTP {status}: {content[:200]!r}"
            except Exception as exc:  # connection errors, timeouts, a malformed response; httpx's own errors
                ok, detail, content = False, f"{type(exc).__name__}: {exc}", b""
            dt = time.perf_counter() - t0
            if record:
                if ok:
                    lat.append(dt)
                    logits = json.loads(content)["outputs"][0]["data"]
                    stats["checked"] += 1
                    stats["correct"] += int(max(range(len(logits)), key=logits.__getitem__) == labels[i])
                else:
                    stats["errors"] += 1
                    if not first_error:
                        first_error.append(detail)
            i = (i + 1) % len(bodies)

    try:
        await asyncio.gather(*(client_loop(k, warmup, False) for k in range(clients)))  # open every connection
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 120)
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.gather(*(client_loop(k, requests, True) for k in range(clients)))
        t1, cpu1 = time.monotonic(), time.process_time()
    finally:
        for close in cleanup:
            await close()
    return {"start": t0, "end": t1, "cpu_s": cpu1 - cpu0, "latencies": lat, **stats,
            "first_error": first_error[0] if first_error else None}


def _load_worker(kind: str, url: str, bodies: list[bytes], labels: list[int], clients: int, offset: int,
                 requests: int, warmup: int, barrier: Any, results: Any) -> None:
    try:
        results.put(asyncio.run(_drive(kind, url, bodies, labels, clients, offset, requests, warmup, barrier)))
    except BaseException as exc:  # report instead of leaving the parent waiting
        results.put({"fatal": f"{type(exc).__name__}: {exc}"})
        raise


@dataclass
class LoadResult:
    delay_us: int
    clients: int
    round: int
    requests: int
    errors: int
    seconds: float
    req_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    accuracy: float
    agent_cpu_pct: float
    client_cpu_pct: float
    vs_ort_b1: float
    first_error: str | None = None


def run_load(kind: str, agent: AgentProcess, bodies: list[bytes], labels: list[int], clients: int, requests: int,
             warmup: int, procs: int, timeout_s: float) -> dict[str, Any]:
    """``clients`` concurrent clients split over ``procs`` processes, ``requests`` requests each."""
    ctx = mp.get_context("spawn")  # no fork of a process holding onnxruntime threads
    procs = max(1, min(procs, clients))
    shares = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    barrier = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    workers = []
    offset = 0
    for share in shares:
        w = ctx.Process(target=_load_worker, daemon=True,
                        args=(kind, agent.url, bodies, labels, share, offset, requests, warmup, barrier, results))
        w.start()
        workers.append(w)
        offset += share
    outs: list[dict[str, Any]] = []
    try:
        barrier.wait(min(timeout_s, 120.0))  # every worker connected and warmed up
        cpu0 = agent.cpu_seconds()
        deadline = time.monotonic() + timeout_s
        while len(outs) < procs:
            try:
                outs.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty as exc:
                raise RuntimeError(f"the load generator did not finish in {timeout_s:.0f}s") from exc
            if "fatal" in outs[-1]:
                raise RuntimeError(f"a load-generator process failed: {outs[-1]['fatal']}")
        cpu1 = agent.cpu_seconds()
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.terminate()
                w.join(5)
    start, end = min(o["start"] for o in outs), max(o["end"] for o in outs)
    lat_ms = np.array([x for o in outs for x in o["latencies"]]) * 1000
    wall = end - start
    checked = sum(o["checked"] for o in outs)
    return {"requests": len(lat_ms), "errors": sum(o["errors"] for o in outs), "seconds": wall,
            "req_per_s": len(lat_ms) / wall if wall > 0 else float("nan"),
            "p50_ms": float(np.percentile(lat_ms, 50)) if len(lat_ms) else float("nan"),
            "p99_ms": float(np.percentile(lat_ms, 99)) if len(lat_ms) else float("nan"),
            "mean_ms": float(lat_ms.mean()) if len(lat_ms) else float("nan"),
            "accuracy": sum(o["correct"] for o in outs) / checked if checked else float("nan"),
            "agent_cpu_pct": 100 * (cpu1 - cpu0) / wall if wall > 0 else float("nan"),
            "client_cpu_pct": 100 * sum(o["cpu_s"] for o in outs) / wall if wall > 0 else float("nan"),
            "first_error": next((o["first_error"] for o in outs if o["first_error"]), None)}


# -- orchestration and reporting -----------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve_bench.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Benchmark the edgefleet agent's KServe v2 HTTP serving path (dynamic batching) against raw "
                    "onnxruntime on the same INT8 engine, in one run, on 127.0.0.1.")
    p.add_argument("--quick", action="store_true",
                   help="short run (< 60 s): 1 round, fewer requests and baseline iterations")
    p.add_argument("--json", action="store_true", help="print a JSON document on stdout (the table goes to stderr)")
    p.add_argument("--clients", type=_ints, default=[1, 8, 32], help="concurrent-client sweep, comma-separated")
    p.add_argument("--delays", type=_ints, default=[0, 2000],
                   help="agent --max-queue-delay-us settings to compare, comma-separated")
    p.add_argument("--rounds", type=int, help="times each delay setting is run, alternating (default 1 quick, 3)")
    p.add_argument("--requests", type=int, help="timed requests per client (default 200 quick, 1000)")
    p.add_argument("--warmup", type=int, default=10, help="untimed requests per client before timing")
    p.add_argument("--client", choices=["raw", "httpx"], default="raw",
                   help="load-generator HTTP client: a lean asyncio HTTP/1.1 keep-alive client, or httpx.AsyncClient "
                        "(much more client CPU per request)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="load-generator processes (asyncio + httpx each); clients are split between them")
    p.add_argument("--max-batch-size", type=int, default=16, help="agent --max-batch-size")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads (agent and baseline)")
    p.add_argument("--ort-iters", type=int, help="baseline iterations at batch 1 (batch 16 runs a tenth; "
                                                 "default 5000 quick, 20000; 3 passes each)")
    p.add_argument("--ort-spinning", action="store_true",
                   help="let the baseline's onnxruntime threads spin (the agent turns spinning off)")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the agent to be ready")
    p.add_argument("--load-timeout", type=float, default=300.0, help="seconds one load level may take at most")
    p.add_argument("--work-dir", type=Path, help="keep the bundle, agent store and logs here (default: a temp dir)")
    return p


def _summarize(rows: list[LoadResult]) -> list[dict[str, Any]]:
    """Median over rounds for each (delay, clients)."""
    out = []
    for key in sorted({(r.delay_us, r.clients) for r in rows}):
        group = [r for r in rows if (r.delay_us, r.clients) == key]
        out.append({"delay_us": key[0], "clients": key[1], "rounds": len(group),
                    **{f: round(statistics.median(getattr(r, f) for r in group), 5 if f == "vs_ort_b1" else 3)
                       for f in ("req_per_s", "p50_ms", "p99_ms", "vs_ort_b1", "agent_cpu_pct", "client_cpu_pct")},
                    "req_per_s_min": round(min(r.req_per_s for r in group), 1),
                    "req_per_s_max": round(max(r.req_per_s for r in group), 1),
                    "errors": sum(r.errors for r in group)})
    return out


def print_report(doc: dict[str, Any], out: Any) -> None:
    b = doc["baseline"]
    cfg = doc["config"]
    print(f"\nserve_bench: {MODEL} {doc['model']['version']} {doc['model']['profile']} {doc['model']['precision']}, "
          f"{doc['machine']['cpus']} CPUs, python {doc['machine']['python']}, onnxruntime {b['onnxruntime']}", file=out)
    print(f"raw onnxruntime in-process (same engine, {b['threads']} intra-op threads, spinning "
          f"{'on' if b['spinning'] else 'off'}): batch 1 {b['batch1']['images_per_s']:,.0f} img/s "
          f"({b['batch1']['ms_per_call']:.3f} ms/call), batch 16 {b['batch16']['images_per_s']:,.0f} img/s "
          f"({b['batch16']['ms_per_call']:.3f} ms/call)", file=out)
    print(f"agent over HTTP: KServe v2 JSON, 1 image/request, max batch {cfg['max_batch_size']}, "
          f"{cfg['requests_per_client']} timed requests per client, {cfg['client']} client in "
          f"{cfg['client_procs']} load-generator process(es); 'vs ort b1' = req/s / raw batch-1 img/s\n", file=out)
    hdr = (f"{'delay us':>8} {'clients':>7} {'round':>5} {'requests':>8} {'errors':>6} {'req/s':>9} {'p50 ms':>7} "
           f"{'p99 ms':>7} {'acc':>6} {'agent cpu%':>10} {'client cpu%':>11} {'vs ort b1':>9}")
    print(hdr, file=out)
    for r in doc["runs"]:
        print(f"{r['delay_us']:>8} {r['clients']:>7} {r['round']:>5} {r['requests']:>8} {r['errors']:>6} "
              f"{r['req_per_s']:>9,.0f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['accuracy']:>6.3f} "
              f"{r['agent_cpu_pct']:>10.0f} {r['client_cpu_pct']:>11.0f} {r['vs_ort_b1']:>9.4f}", file=out)
        if r["first_error"]:
            print(f"{'':>8} first error: {r['first_error']}", file=out)
    if cfg["rounds"] > 1:
        print(f"\nmedian over {cfg['rounds']} rounds:", file=out)
        print(f"{'delay us':>8} {'clients':>7} {'req/s':>9} {'(min-max)':>15} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'agent cpu%':>10} {'vs ort b1':>9}", file=out)
        for s in doc["summary"]:
            span = f"{s['req_per_s_min']:,.0f}-{s['req_per_s_max']:,.0f}"
            print(f"{s['delay_us']:>8} {s['clients']:>7} {s['req_per_s']:>9,.0f} {span:>15} {s['p50_ms']:>7.2f} "
                  f"{s['p99_ms']:>7.2f} {s['agent_cpu_pct']:>10.0f} {s['vs_ort_b1']:>9.4f}", file=out)
    out.flush()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rounds = args.rounds or (1 if args.quick else 3)
    requests = args.requests or (200 if args.quick else 1000)
    ort_iters = args.ort_iters or (5000 if args.quick else 20000)
    t_start = time.monotonic()

    say("compiling models/digits for x86-cpu (static INT8) and installing it into the agent store")
    data_dir, engine, manifest = compile_and_install(work)
    with np.load(DIGITS / "test.npz") as npz:
        images, labels = npz["input"].astype(np.float32), [int(v) for v in npz["labels"]]

    say(f"raw onnxruntime baseline on {engine.name}: 3 x {ort_iters} x batch 1, 3 x {max(1, ort_iters // 10)} "
         "x batch 16")
    baseline = ort_baseline(engine, images, args.threads, ort_iters, max(1, ort_iters // 10), args.ort_spinning)
    b1 = baseline["batch1"]["images_per_s"]

    bodies = request_bodies(images)
    rows: list[LoadResult] = []
    for rnd in range(1, rounds + 1):
        order = args.delays if rnd % 2 == 1 else list(reversed(args.delays))  # alternate: A B, B A, ...
        for delay in order:
            log_path = work / "logs" / f"agent-delay{delay}-round{rnd}.log"
            with AgentProcess(data_dir, log_path, delay, args.max_batch_size, args.threads,
                              args.ready_timeout) as agent:
                say(f"round {rnd}/{rounds}: agent on {agent.url} (max-queue-delay-us {delay})")
                for clients in args.clients:
                    if clients == 0:
                        continue
                    m = run_load(args.client, agent, bodies, labels, clients, requests, args.warmup, args.client_procs,
                                 args.load_timeout)
                    row = LoadResult(delay_us=delay, clients=clients, round=rnd, requests=m["requests"],
                                     errors=m["errors"], seconds=round(m["seconds"], 3),
                                     req_per_s=round(m["req_per_s"], 1), p50_ms=round(m["p50_ms"], 3),
                                     p99_ms=round(m["p99_ms"], 3), mean_ms=round(m["mean_ms"], 3),
                                     accuracy=round(m["accuracy"], 4), agent_cpu_pct=round(m["agent_cpu_pct"], 1),
                                     client_cpu_pct=round(m["client_cpu_pct"], 1),
                                     vs_ort_b1=round(m["req_per_s"] / b1, 5), first_error=m["first_error"])
                    rows.append(row)
                    say(f"    {clients:>3} clients: {row.req_per_s:>8,.0f} req/s  p50 {row.p50_ms:.2f} ms  "
                         f"p99 {row.p99_ms:.2f} ms  errors {row.errors}")
    return {
        "benchmark": "edgefleet serve_bench",
        "model": {"name": manifest.name, "version": manifest.version, "profile": manifest.profile,
                  "precision": manifest.precision, "engine": engine.name},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "config": {"quick": args.quick, "clients": args.clients, "delays_us": args.delays, "rounds": rounds,
                   "requests_per_client": requests, "warmup_per_client": args.warmup,
                   "client": args.client, "client_procs": args.client_procs, "max_batch_size": args.max_batch_size,
                   "threads": args.threads, "ort_iters_batch1": ort_iters, "fleet_url": UNREACHABLE_FLEET},
        "baseline": baseline,
        "runs": [asdict(r) for r in rows],
        "summary": _summarize(rows),
        "total_seconds": round(time.monotonic() - t_start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.rounds is not None and args.rounds < 1) or (args.requests is not None and args.requests < 1):
        say("error: --rounds and --requests must be at least 1")
        return 2
    try:
        return run_and_report(args, run, print_report, "edgefleet-bench-")
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
