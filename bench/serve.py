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
   **the naive baseline** (this script with ``--naive-server``: a Starlette endpoint taking raw float32 bytes
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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_files, say
from serve_bench import AgentProcess, _die_with_parent, _free_port

REPO = Path(__file__).resolve().parent.parent
MODELS = ("digits", "mobilenetv2-fp32", "mobilenetv2-int8")
# also accepted by --models: a bf16 bundle (x86-cpu-bf16; needs avx512_bf16/AMX and edgefleet[openvino])
MORE_MODELS = ("mobilenetv2-bf16",)
# --pin: (the inference CPUs, the rest): the limit's sessions, the agent's inference threads and the naive server
# (whose runtime runs in its event loop) on the first; the agent's event loop and the load generator on the rest
PIN: tuple[frozenset[int], frozenset[int]] | None = None


@contextlib.contextmanager
def _pinned(cpus: frozenset[int] | None) -> Any:
    """This thread (and the threads it starts meanwhile, e.g. onnxruntime's pool) on ``cpus`` for a while."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
NAIVE_DELAY_S = 0.005  # the naive batcher's fixed collection window
NAIVE_MAX_BATCH = 16


# -- models ------------------------------------------------------------------------------------------


def prepare(name: str, work: Path) -> dict[str, Any]:
    """Compile and install one model; -> data dir, engine, images and labels for the load."""
    from edgefleet.agent.install.store import ModelStore
    from edgefleet.compiler.pipeline import CompileOptions, compile_model
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


def _session(engine: Path, threads: int) -> Any:
    import onnxruntime as ort

    from edgefleet.engines.onnxruntime import session_options

    # the agent's own session options (engines.onnxruntime), called raw: the runtime's limit
    return ort.InferenceSession(str(engine), session_options(ort, threads), providers=["CPUExecutionProvider"])


class _OpenVINORaw:
    """Raw OpenVINO as the agent's engine compiles it (engines.openvino.compile_config: the bundle's precision hint,
    one stream of ``threads`` threads, latency hint, no pinning): one compiled model and one infer request, the
    batch's array shared in and the outputs shared out. ``run`` as InferenceSession's, for the limit's loops."""

    def __init__(self, engine: Path, threads: int, precision: str):
        from edgefleet.engines.openvino import HINTS, compile_config, core

        ov_core = core()
        self.compiled = ov_core.compile_model(ov_core.read_model(str(engine)), "CPU",
                                              compile_config(HINTS[precision][0], threads))
        self.request = self.compiled.create_infer_request()

    def run(self, _names: Any, feed: dict[str, np.ndarray]) -> Any:
        return self.request.infer(feed, share_inputs=True, share_outputs=True)


def _runner(runtime: str, engine: Path, threads: int, precision: str) -> Any:
    """A bare session of ``runtime`` on ``engine``: onnxruntime's InferenceSession with the agent's options, or raw
    OpenVINO with the agent's properties."""
    if runtime == "openvino":
        return _OpenVINORaw(engine, threads, precision)
    return _session(engine, threads)


def limit_runtimes(setting: str, precision: str) -> list[str]:
    """``--limit-runtimes``: the runtimes whose bare limit is timed. ``all``: every runtime installed here that runs
    an onnxruntime bundle of ``precision`` (engines.runtimes_for; onnxruntime first where it runs it)."""
    from edgefleet.engines import runtime_installed, runtimes_for

    able = runtimes_for("onnxruntime", precision)
    if setting == "all":
        return [r for r in able if runtime_installed(r)]
    asked = [r.strip() for r in setting.split(",") if r.strip()]
    return [r for r in asked if r in able] or [r for r in able if runtime_installed(r)][:1]


def _rate(sess: Any, x: np.ndarray, seconds: float, start: Any = None) -> tuple[float, list[float]]:
    """Images/s and call times of ``sess.run`` on ``x`` for about ``seconds`` (at most 5000 calls), after a
    warm-up and, if given, a ``threading.Barrier`` shared with the sessions that run at the same time."""
    for _ in range(3):
        sess.run(None, {"input": x})
    if start is not None:
        start.wait()
    times = []
    t_end = time.perf_counter() + seconds
    for _ in range(5000):
        t0 = time.perf_counter()
        sess.run(None, {"input": x})
        times.append(time.perf_counter() - t0)
        if t0 > t_end:
            break
    return len(x) * len(times) / sum(times), times


def the_limit(engine: Path, images: np.ndarray, threads: int, seconds_each: float, runtime: str = "onnxruntime",
              precision: str = "fp32") -> dict[str, Any]:
    """Images/s of a bare ``runtime`` session (InferenceSession.run, or raw OpenVINO: :func:`_runner`) at batch 1..16
    in every layout of ``threads`` CPUs the agent may choose (one session of ``threads`` intra-op threads, ...,
    ``threads`` sessions of one thread each), the sessions called from as many Python threads at once (on CPUs
    one-thread sessions often do more per second); the limit is the best of all. Also each layout's batch-1 median
    call time."""
    with _pinned(PIN[0] if PIN else None):
        return _the_limit(engine, images, threads, seconds_each, runtime, precision)


def _the_limit(engine: Path, images: np.ndarray, threads: int, seconds_each: float, runtime: str = "onnxruntime",
               precision: str = "fp32") -> dict[str, Any]:
    import threading

    from edgefleet.agent.core.batching.tuning import layout_candidates

    layouts = list(layout_candidates(threads))  # every layout the agent may choose: 1xT, ..., Tx1
    out: dict[str, Any] = {"by_layout": {}, "batch1_ms": {}}
    best = (0.0, "", 0)
    for instances, per in layouts:
        name = f"{instances}x{per}"
        sessions = [_runner(runtime, engine, per, precision) for _ in range(instances)]
        rates: dict[int, float] = {}
        for batch in (1, 2, 4, 8, 16):
            x = np.ascontiguousarray(np.resize(images, (batch, *images.shape[1:])), dtype=np.float32)
            got: list[tuple[float, list[float]]] = [(0.0, [])] * instances
            start = threading.Barrier(instances)

            def work(i: int, x: np.ndarray = x, start: Any = start, got: list = got, sessions: list = sessions) -> None:
                got[i] = _rate(sessions[i], x, seconds_each, start)

            workers = [threading.Thread(target=work, args=(i,)) for i in range(instances)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            rates[batch] = sum(r for r, _ in got)
            if batch == 1:
                out["batch1_ms"][name] = statistics.median(got[0][1]) * 1000
        out["by_layout"][name] = {b: round(r, 1) for b, r in rates.items()}
        b = max(rates, key=lambda k: rates[k])
        if rates[b] > best[0]:
            best = (rates[b], name, b)
    out.update(images_per_s=best[0], layout=best[1], best_batch=best[2], runtime=runtime)
    return out


def spot_limits(engine: Path, images: np.ndarray, limits: dict[str, dict[str, Any]], precision: str,
                seconds: float) -> dict[str, tuple[float, float]]:
    """Each runtime's bare (images/s, images per CPU-second of this process) now, at the layout and batch size where
    its limit was best (``limits``: from :func:`the_limit`): a baseline taken next to one load level, so that the
    box's load, which moves the limit by up to 2x within one run here, is nearly the same for both. The CPU figure
    (all this process's threads: the runtime's own pools too) does not move with the load."""
    import threading

    out = {}
    with _pinned(PIN[0] if PIN else None):
        for runtime, lim in limits.items():
            instances, per = (int(v) for v in lim["layout"].split("x"))
            sessions = [_runner(runtime, engine, per, precision) for _ in range(instances)]
            x = np.ascontiguousarray(np.resize(images, (lim["best_batch"], *images.shape[1:])), dtype=np.float32)
            for sess in sessions:  # warm: the first calls at a size set up per shape
                for _ in range(3):
                    sess.run(None, {"input": x})
            done = [0] * instances
            start = threading.Barrier(instances + 1)
            until = [0.0]  # set just before the start: the end of the timed calls

            def work(i: int, x: np.ndarray = x, start: Any = start, done: list = done,
                     sessions: list = sessions, until: list = until) -> None:
                start.wait()
                for _ in range(5000):
                    sessions[i].run(None, {"input": x})
                    done[i] += len(x)
                    if time.perf_counter() > until[0]:
                        break

            workers = [threading.Thread(target=work, args=(i,)) for i in range(instances)]
            for w in workers:
                w.start()
            until[0] = time.perf_counter() + seconds
            cpu0, t0 = time.process_time(), time.perf_counter()
            start.wait()
            for w in workers:
                w.join()
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            out[runtime] = (round(sum(done) / wall, 1), round(sum(done) / max(cpu, 1e-9), 1))
    return out


def json_decode_ms(body: bytes, repeats: int = 5, loads: Callable[[bytes], Any] = json.loads) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        doc = loads(body)
        np.asarray(doc["inputs"][0]["data"], dtype=np.float32)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


# -- the transport floor: a body's round trip to a server that only reads it ---------------------------


def _sink_server(port_q: Any, asgi: bool = False) -> None:
    """A loopback server that reads each request (head, then Content-Length bytes) and answers 4 KB: what
    any HTTP server pays for the bytes alone, without parsing, validation or inference. ``asgi``: the same through
    uvicorn and a Starlette route that reads the whole body (``await request.body()``), the HTTP stack the agent
    serves with: what that stack adds over the bytes, before the agent does anything with them."""
    _die_with_parent()

    async def main() -> None:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    head = await r.readuntil(b"\r\n\r\n")
                    n = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                             if line.lower().startswith(b"content-length"))
                    await r.readexactly(n)
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4096\r\n\r\n" + b"x" * 4096)

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_q.put(srv.sockets[0].getsockname()[1])
        await asyncio.sleep(120)  # bounded; the parent terminates it sooner

    async def main_asgi() -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        async def sink(request: Request) -> Response:
            await request.body()
            return Response(b"x" * 4096, media_type="application/octet-stream")

        port = _free_port()
        cfg = uvicorn.Config(Starlette(routes=[Route("/sink", sink, methods=["POST"])]), host="127.0.0.1", port=port,
                             log_level="warning", access_log=False, lifespan="off", loop="uvloop")
        server = uvicorn.Server(cfg)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port_q.put(port)
        await asyncio.sleep(120)  # bounded; the parent terminates it sooner
        task.cancel()

    try:
        import uvloop
        uvloop.run(main_asgi() if asgi else main())
    except ImportError:
        asyncio.run(main_asgi() if asgi else main())


def transport_floor_ms(body_bytes: int, rounds: int = 400, asgi: bool = False) -> float:
    """Median round trip of a ``body_bytes`` POST and a 4 KB answer over loopback (one blocking client); ``asgi``:
    through uvicorn and Starlette (_sink_server)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sink_server, args=(q, asgi), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)
        req = b"POST /sink HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % body_bytes + bytes(body_bytes)
        lats = []
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            f = s.makefile("rb")
            for _ in range(rounds):
                t0 = time.perf_counter()
                s.sendall(req)
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                f.read(length)
                lats.append(time.perf_counter() - t0)
        return statistics.median(lats[rounds // 10:]) * 1000
    finally:
        proc.terminate()
        proc.join(10)


# -- the naive baseline server (runs as its own process) ---------------------------------------------


def naive_server(engine: str, port: int, threads: int) -> None:
    """A Starlette endpoint with the tutorial asyncio micro-batcher: collect for 5 ms, run in the event loop."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    sess = _session(Path(engine), threads)
    shape = [d if isinstance(d, int) else 1 for d in sess.get_inputs()[0].shape][1:]
    pending: list[tuple[np.ndarray, asyncio.Future]] = []
    wake = asyncio.Event()

    async def batcher() -> None:
        while True:
            await wake.wait()
            await asyncio.sleep(NAIVE_DELAY_S)
            wake.clear()
            while pending:
                batch, rest = pending[:NAIVE_MAX_BATCH], pending[NAIVE_MAX_BATCH:]
                pending[:] = rest
                out = sess.run(None, {"input": np.concatenate([x for x, _ in batch])})[0]  # in the event loop
                for i, (_, fut) in enumerate(batch):
                    if not fut.done():
                        fut.set_result(out[i : i + 1])

    async def predict(request: Request) -> Response:
        x = np.frombuffer(await request.body(), np.float32).reshape(1, *shape)
        fut = asyncio.get_running_loop().create_future()
        pending.append((x, fut))
        wake.set()
        return Response((await fut).tobytes(), media_type="application/octet-stream")

    async def ready(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    async def main() -> None:
        task = asyncio.create_task(batcher())
        app = Starlette(routes=[Route("/predict", predict, methods=["POST"]), Route("/v2/health/ready", ready)])
        cfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")
        await uvicorn.Server(cfg).serve()
        task.cancel()

    asyncio.run(main())


def _naive_child() -> None:  # in the child before exec: --pin puts the whole naive server on the inference CPUs
    _die_with_parent()
    if PIN:
        os.sched_setaffinity(0, PIN[0])


class NaiveProcess:
    def __init__(self, engine: Path, threads: int, log_path: Path):
        self.engine, self.threads, self.log_path = engine, threads, log_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> NaiveProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, "--naive-server", str(self.engine), str(self.port),
                                          str(self.threads)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=REPO, preexec_fn=_naive_child)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the naive server exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2):
                    return self
            time.sleep(0.1)
        raise RuntimeError("the naive server did not start in 60 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# -- requests and the load generator -------------------------------------------------------------------


def bodies(kind: str, model: str, images: np.ndarray) -> tuple[str, list[bytes], dict[str, str]]:
    """-> (path, one body per image, extra headers) for one variant. grpc: serialized ModelInferRequests; shm: the
    images' raw bytes (the load generator writes them into its shared-memory region)."""
    if kind == "grpc":
        from tritonclient.grpc import service_pb2

        out = []
        for img in images:
            r = service_pb2.ModelInferRequest(model_name=model)
            r.inputs.add(name="input", datatype="FP32", shape=[1, *images.shape[1:]])
            r.raw_input_contents.append(np.ascontiguousarray(img[None], dtype=np.float32).tobytes())
            out.append(r.SerializeToString())
        return "/inference.GRPCInferenceService/ModelInfer", out, {}
    if kind in ("shm", "local"):
        return f"/v2/models/{model}/infer", [np.ascontiguousarray(i[None], np.float32).tobytes() for i in images], {}
    if kind == "local-inline":
        from edgefleet.agent.transports.local_client import infer_request

        return model, [infer_request(model, {"input": np.ascontiguousarray(i[None], np.float32)}) for i in images], {}
    if kind == "naive":
        return "/predict", [np.ascontiguousarray(img[None]).tobytes() for img in images], {}
    path = f"/v2/models/{model}/infer"
    shape = [1, *images.shape[1:]]
    if kind == "json":
        return path, [json.dumps({"inputs": [{"name": "input", "shape": shape, "datatype": "FP32",
                                              "data": img.reshape(-1).tolist()}]}).encode() for img in images], {}
    out = []
    for img in images:
        raw = np.ascontiguousarray(img[None], dtype=np.float32).tobytes()
        head = json.dumps({"inputs": [{"name": "input", "shape": shape, "datatype": "FP32",
                                       "parameters": {"binary_data_size": len(raw)}}],
                           "parameters": {"binary_data_output": True}}).encode()
        out.append(len(head).to_bytes(4, "little") + head + raw)  # the header length rides in front, split later
    return path, out, {}


def _request(host: str, port: int, path: str, body: bytes, kind: str) -> bytes:
    extra = ""
    if kind == "binary":
        hl = int.from_bytes(body[:4], "little")
        body = body[4:]
        extra = f"Inference-Header-Content-Length: {hl}\r\n"
    ctype = "application/json" if kind == "json" else "application/octet-stream"
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {ctype}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _post(conn: list[Any], host: str, port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    if not conn:
        r, w = await asyncio.open_connection(host, port)
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn[:] = [r, w]
    reader, writer = conn
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        return int(head[9:12]), headers, await reader.readexactly(int(headers[b"content-length"]))
    except BaseException:
        writer.close()
        conn.clear()
        raise


def _top1(kind: str, headers: dict[bytes, bytes], content: bytes) -> int:
    if kind == "naive":
        return int(np.frombuffer(content, np.float32).argmax())
    if kind == "binary":
        hl = int(headers[b"inference-header-content-length"])
        return int(np.frombuffer(content, np.float32, offset=hl).argmax())
    return int(np.argmax(json.loads(content)["outputs"][0]["data"]))


async def _closed_loop(clients: int, total: int, warmup: int, n_reqs: int,
                       one: Callable[[int, int], Awaitable[tuple[str | None, bool]]],
                       timed: Callable[[], object] | None) -> dict[str, Any]:
    """Closed-loop load: each of ``clients`` sends ``warmup`` untimed requests, then its share of ``total`` timed
    ones, one at a time. ``one(slot, i)`` sends request ``i`` for client ``slot`` and returns (the error, or None;
    whether the answer's top-1 is wrong). ``timed``, if given, is called as the timed phase starts."""
    lat: list[float] = []
    bad = {"errors": 0, "wrong": 0}
    first_error: list[str] = []

    async def client(slot: int, n: int, record: bool) -> None:
        i = (slot * 7919) % n_reqs
        for _ in range(n):
            t0 = time.perf_counter()
            try:
                err, wrong = await one(slot, i)
            except Exception as exc:
                err, wrong = repr(exc), False
            dt = time.perf_counter() - t0
            if record:
                if err is None:
                    lat.append(dt)
                    bad["wrong"] += wrong
                else:
                    bad["errors"] += 1
                    if not first_error:
                        first_error.append(err[:300])
            i = (i + 1) % n_reqs

    await asyncio.gather(*(client(k, warmup, False) for k in range(clients)))
    per = max(1, total // clients)
    if timed is not None:
        timed()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(client(k, per, True) for k in range(clients)))
    wall = time.perf_counter() - t0
    return {"wall": wall, "latencies": lat, **bad, "first_error": first_error[0] if first_error else None,
            "load_cpu_s": time.process_time() - cpu0}


async def _drive(url: str, kind: str, path: str, reqs: list[bytes], labels: list[int], clients: int, total: int,
                 warmup: int, timed: Callable[[], object] | None = None) -> dict[str, Any]:
    """``timed``, if given, is called as the timed phase starts (the parent then reads the servers' CPU clocks)."""
    if kind in ("local", "local-inline"):
        return await _drive_socket(url, kind, path, reqs, labels, clients, total, warmup, timed)
    host, port_s = url.removeprefix("http://").rsplit(":", 1)
    port = int(port_s)
    if kind in ("grpc", "shm"):
        return await _drive_local(host, port, kind, path, reqs, labels, clients, total, warmup, timed)
    prebuilt = [_request(host, port, path, b, kind) for b in reqs]
    conns: list[list[Any]] = [[] for _ in range(clients)]

    async def one(slot: int, i: int) -> tuple[str | None, bool]:
        status, headers, content = await asyncio.wait_for(_post(conns[slot], host, port, prebuilt[i]), 60)
        if status != 200:
            return f"{status}: {content[:200]!r}", False
        return None, _top1(kind, headers, content) != labels[i]

    try:
        return await _closed_loop(clients, total, warmup, len(prebuilt), one, timed)
    finally:
        for c in conns:
            if c:
                c[1].close()


async def _drive_local(host: str, port: int, kind: str, path: str, reqs: list[bytes], labels: list[int],
                       clients: int, total: int, warmup: int, timed: Callable[[], object] | None) -> dict[str, Any]:
    """The on-box clients: ``grpc`` (one grpc.aio channel, requests prebuilt) to the agent's gRPC port (``port`` is
    then that port), or ``shm``: binary-free HTTP requests whose input and output live in one POSIX shared-memory
    region this process registers (each client its own slice; it writes its image there before each request and
    reads the logits back from it)."""
    from multiprocessing import shared_memory

    in_bytes, out_bytes = len(reqs[0]) if kind == "shm" else 0, 4096  # 4 KiB of outputs is plenty here
    region: Any = None
    call: Callable[[int, int], Any]
    if kind == "grpc":
        import grpc  # type: ignore[import-untyped]
        from tritonclient.grpc import service_pb2  # type: ignore[import-untyped]

        channel = grpc.aio.insecure_channel(f"{host}:{port}", options=[("grpc.max_receive_message_length", 1 << 26),
                                                                       ("grpc.max_send_message_length", 1 << 26)])
        infer = channel.unary_unary(path, request_serializer=None,
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)

        async def call(slot: int, i: int) -> int:
            r = await infer(reqs[i], timeout=60)
            return int(np.frombuffer(r.raw_output_contents[0], np.float32).argmax())
    else:
        slot_bytes = in_bytes + out_bytes
        key = f"edgefleet-bench-{os.getpid()}"
        region = shared_memory.SharedMemory(key, create=True, size=slot_bytes * clients)
        conns: list[list[Any]] = [[] for _ in range(clients)]
        reg = json.dumps({"key": "/" + key, "offset": 0, "byte_size": slot_bytes * clients}).encode()
        status, _, content = await _post([], host, port, _request(host, port, f"/v2/systemsharedmemory/region/{key}"
                                                                              "/register", reg, "json"))
        if status != 200:
            raise RuntimeError(f"registering the shared-memory region: {status} {content[:200]!r}")
        with urllib.request.urlopen(f"http://{host}:{port}{path.removesuffix('/infer')}", timeout=30) as r:
            meta = json.loads(r.read())  # loopback: the agent under test
        shape = [1 if d == -1 else d for d in meta["inputs"][0]["shape"]]
        prebuilt = []
        for slot in range(clients):
            base = slot * slot_bytes
            head = json.dumps({
                "inputs": [{"name": meta["inputs"][0]["name"], "shape": shape, "datatype": "FP32", "parameters": {
                    "shared_memory_region": key, "shared_memory_byte_size": in_bytes, "shared_memory_offset": base}}],
                "outputs": [{"name": meta["outputs"][0]["name"], "parameters": {
                    "shared_memory_region": key, "shared_memory_byte_size": out_bytes,
                    "shared_memory_offset": base + in_bytes}}]})
            prebuilt.append(head)
        buf = region.buf

        async def call(slot: int, i: int) -> int:
            base = slot * slot_bytes
            buf[base:base + in_bytes] = reqs[i]
            status, _, content = await _post(conns[slot], host, port, _request(host, port, path,
                                                                               prebuilt[slot].encode(), "json"))
            if status != 200:
                raise RuntimeError(f"{status}: {content[:200]!r}")
            n = json.loads(content)["outputs"][0]["parameters"]["shared_memory_byte_size"]
            return int(np.frombuffer(buf[base + in_bytes:base + in_bytes + n], np.float32).argmax())

    async def one(slot: int, i: int) -> tuple[str | None, bool]:
        return None, await asyncio.wait_for(call(slot, i), 60) != labels[i]

    try:
        return await _closed_loop(clients, total, warmup, len(reqs), one, timed)
    finally:
        if kind == "grpc":
            await channel.close()
        if region is not None:
            with contextlib.suppress(Exception):
                await _post([], host, port, _request(host, port, "/v2/systemsharedmemory/unregister", b"", "json"))
            region.close()
            region.unlink()


async def _drive_socket(sock_path: str, kind: str, path: str, reqs: list[bytes], labels: list[int], clients: int,
                        total: int, warmup: int, timed: Callable[[], object] | None) -> dict[str, Any]:
    """The agent's on-box socket (agent/transports/local_client.py): every client on one connection, its requests
    pipelined. ``local``: the input and the output in one shared-memory region (each client its own slice, as for
    ``shm``); ``local-inline``: the input bytes in the frame (``reqs`` are prebuilt INFER bodies), the output in the
    answer."""
    from multiprocessing import shared_memory

    import orjson

    from edgefleet.agent.transports.local_client import AsyncLocalClient, decode_result, infer_request

    region: Any = None
    conn = await AsyncLocalClient.connect(sock_path)
    call: Callable[[int, int], Any]
    # A/B of the load generator itself: EDGEFLEET_BENCH_SOCKET_WAIT_FOR=1 times each request out with
    # asyncio.wait_for (a task per request, as before) instead of the client's timeout_s
    wait_for = os.environ.get("EDGEFLEET_BENCH_SOCKET_WAIT_FOR") == "1"
    timeout_s = None if wait_for else 60.0
    if kind == "local":
        in_bytes, out_bytes = len(reqs[0]), 4096
        slot_bytes = in_bytes + out_bytes
        key = f"edgefleet-bench-{os.getpid()}"
        region = shared_memory.SharedMemory(key, create=True, size=slot_bytes * clients)
        await conn.register_region(key, "/" + key, slot_bytes * clients)
        # the digits model (the only one this variant runs for): input [N, 1, 8, 8], output logits
        prebuilt = [infer_request(path.split("/")[3], {"input": (key, s * slot_bytes, in_bytes, [1, 1, 8, 8])},
                                  outputs={"logits": (key, s * slot_bytes + in_bytes, out_bytes)})
                    for s in range(clients)]
        buf = region.buf

        async def call(slot: int, i: int) -> int:
            base = slot * slot_bytes
            buf[base:base + in_bytes] = reqs[i]
            body = await conn.infer_raw(prebuilt[slot], timeout_s)
            jl = int.from_bytes(body[:4], "little")
            n = orjson.loads(body[4:4 + jl])["outputs"][0]["parameters"]["shared_memory_byte_size"]
            return int(np.frombuffer(buf[base + in_bytes:base + in_bytes + n], np.float32).argmax())
    else:
        async def call(slot: int, i: int) -> int:
            return int(decode_result(await conn.infer_raw(reqs[i], timeout_s))[1]["logits"].argmax())

    async def one(slot: int, i: int) -> tuple[str | None, bool]:
        # the client's own timeout (one timer for all): no task per request as asyncio.wait_for makes
        top1 = await (asyncio.wait_for(call(slot, i), 60) if wait_for else call(slot, i))
        return None, top1 != labels[i]

    try:
        return await _closed_loop(clients, total, warmup, len(reqs), one, timed)
    finally:
        conn.close()
        if region is not None:
            del buf
            region.close()
            region.unlink()


def _load_worker(args: tuple, results: Any, cpus: frozenset[int] | None = None) -> None:
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # --pin: the load generator off the inference CPUs
        url, kind, path, reqs, labels, clients, total, warmup = args
        results.put(asyncio.run(_drive(url, kind, path, reqs, labels, clients, total, warmup,
                                       timed=lambda: results.put({"timed": True}))))
    except BaseException as exc:
        results.put({"fatal": f"{type(exc).__name__}: {exc}"})


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, by thread id (Linux /proc)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def run_level(url: str, kind: str, path: str, reqs: list[bytes], labels: list[int], clients: int, total: int,
              warmup: int, timeout_s: float = 600, server_pid: int | None = None,
              stats_url: str | None = None) -> dict[str, Any]:
    """One closed-loop level from a separate (spawned) load-generator process. With ``server_pid``, also where
    the machine's CPU went during the timed phase, in cores: the server's main (event-loop) thread, its other
    threads (inference), and the load generator. With ``stats_url`` (the agent's Triton statistics), the mean
    time its runtime took per batch-1 call during the timed phase: the raw call of that very run."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    w = ctx.Process(target=_load_worker, args=((url, kind, path, reqs, labels, clients, total, warmup), results,
                                               PIN[1] if PIN else None), daemon=True)
    w.start()
    before: dict[str, float] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            out = results.get(timeout=max(0.0, deadline - time.monotonic()))
            if "timed" not in out:
                break
            if server_pid is not None:
                before = _thread_cpu_s(server_pid)
            if stats_url is not None:
                b1_before = _batch1_compute(stats_url)
                sizes_before = _batches(stats_url)
                phases_before = _phases(stats_url)
    except queue.Empty as exc:
        raise RuntimeError(f"the load generator did not finish in {timeout_s:.0f}s") from exc
    finally:
        w.join(10)
        if w.is_alive():
            w.terminate()
    if "fatal" in out:
        raise RuntimeError(f"load generator: {out['fatal']}")
    lat = np.array(out["latencies"]) * 1000
    n = len(lat)
    res = {"requests": n, "errors": out["errors"], "wrong": out["wrong"], "first_error": out["first_error"],
           "req_per_s": n / out["wall"] if out["wall"] > 0 else float("nan"),
           "p50_ms": float(np.percentile(lat, 50)) if n else float("nan"),
           "p99_ms": float(np.percentile(lat, 99)) if n else float("nan"),
           "load_cores": out["load_cpu_s"] / out["wall"] if out["wall"] > 0 else float("nan")}
    if server_pid is not None and out["wall"] > 0:
        after = _thread_cpu_s(server_pid)
        main = str(server_pid)
        used = {t: after[t] - before.get(t, 0.0) for t in after}
        res["server_main_cores"] = used.get(main, 0.0) / out["wall"]
        res["server_other_cores"] = sum(v for t, v in used.items() if t != main) / out["wall"]
    if stats_url is not None:
        (n1, ns1), (n0, ns0) = _batch1_compute(stats_url), b1_before
        res["compute_b1_ms"] = (ns1 - ns0) / (n1 - n0) / 1e6 if n1 > n0 else float("nan")
        # the batches the agent formed in the timed phase, and the share of it its runtime was running one
        sizes_after = _batches(stats_url)
        formed = {b: (c - sizes_before.get(b, (0, 0))[0], ns - sizes_before.get(b, (0, 0))[1])
                  for b, (c, ns) in sizes_after.items()}
        formed = {b: v for b, v in formed.items() if v[0] > 0}
        res["batches_formed"] = {b: c for b, (c, _) in sorted(formed.items())}
        # images per second of the agent's runtime while it ran a batch: against the bare limit, what its calls cost
        ran_s = sum(ns for _, ns in formed.values()) / 1e9
        res["runtime_img_s"] = sum(b * c for b, (c, _) in formed.items()) / ran_s if ran_s > 0 else float("nan")
        res["runtime_busy"] = sum(ns for _, ns in formed.values()) / 1e9 / out["wall"] if out["wall"] > 0 else 0.0
        # per request, in the agent: from its handler's start to its answer (success), in the queue until its batch
        # started (queue), in the runtime (compute); means over the timed phase
        after_ph = _phases(stats_url)
        res["agent_ms"] = {k: (after_ph[k][1] - phases_before[k][1]) / (after_ph[k][0] - phases_before[k][0]) / 1e6
                           for k in after_ph if after_ph[k][0] > phases_before[k][0]}
    return res


def _phases(stats_url: str) -> dict[str, tuple[int, int]]:
    """success / queue / compute_infer -> (count, nanoseconds) so far, from the agent's Triton statistics."""
    with urllib.request.urlopen(stats_url, timeout=30) as r:  # loopback: the agent under test
        doc = json.loads(r.read())
    st = doc["model_stats"][0]["inference_stats"]
    return {k: (int(st[k]["count"]), int(st[k]["ns"])) for k in ("success", "queue", "compute_infer")}


def _batches(stats_url: str) -> dict[int, tuple[int, int]]:
    """batch size -> (batches run, nanoseconds in the runtime) so far, from the agent's Triton statistics."""
    with urllib.request.urlopen(stats_url, timeout=30) as r:  # loopback: the agent under test
        doc = json.loads(r.read())
    return {int(b["batch_size"]): (int(b["compute_infer"]["count"]), int(b["compute_infer"]["ns"]))
            for b in doc["model_stats"][0]["batch_stats"]}


def _batch1_compute(stats_url: str) -> tuple[int, int]:
    """(batch-1 calls, nanoseconds in the runtime) so far, from the agent's Triton statistics."""
    with urllib.request.urlopen(stats_url, timeout=30) as r:  # loopback: the agent under test
        doc = json.loads(r.read())
    for b in doc["model_stats"][0]["batch_stats"]:
        if b["batch_size"] == 1:
            return int(b["compute_infer"]["count"]), int(b["compute_infer"]["ns"])
    return 0, 0


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (``VmRSS``) or at its peak (``VmHWM``), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bare_sessions(engine: str, instances: int, threads: int, batch: int, seconds: float) -> None:
    """In a process of its own (``--bare-sessions``): ``instances`` sessions of ``threads`` threads (the agent's
    session options) loaded and run at once at ``batch`` for ``seconds``; prints its RSS and peak RSS (JSON)."""
    import threading

    sessions = [_session(Path(engine), threads) for _ in range(instances)]
    shape = [d if isinstance(d, int) else 1 for d in sessions[0].get_inputs()[0].shape][1:]
    x = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)
    loaded = _rss_mb(os.getpid())
    workers = [threading.Thread(target=_rate, args=(s, x, seconds)) for s in sessions]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps({"loaded_mb": loaded, "rss_mb": _rss_mb(os.getpid()), "peak_mb": _rss_mb(os.getpid(), "VmHWM")}))


def bare_rss(engine: Path, layout: str, batch: int, seconds: float = 2.0) -> dict[str, float]:
    """RSS of a bare process (numpy and onnxruntime only) holding ``layout``'s sessions, run at ``batch``: what the
    agent's memory is held against (after the run, and its peak)."""
    instances, threads = (int(v) for v in layout.split("x"))
    done = subprocess.run([sys.executable, __file__, "--bare-sessions", str(engine), str(instances), str(threads),
                           str(batch), str(seconds)], capture_output=True, timeout=300, check=True, cwd=REPO,
                          preexec_fn=_naive_child)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


# -- one model ---------------------------------------------------------------------------------------


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
    pin_args = ("--inference-cpus", ",".join(map(str, sorted(PIN[0])))) if PIN else ()
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


def _layout_bests(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """Each layout the limit measured -> (its best images/s, the mean of before and after; the batch it was best at
    after)."""
    out = {}
    for name, rates in after["by_layout"].items():
        b = max(rates, key=lambda k: rates[k])
        both = [max(r[name].values()) for r in (before["by_layout"], after["by_layout"]) if name in r]
        out[name] = (sum(both) / len(both), int(b))
    return out


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


def print_layouts_and_memory(res: dict[str, Any]) -> None:
    """The layout-vs-limit line, the agent's layout table beside the limit's, and the agent's RSS beside a bare
    process's with the chosen layout's sessions."""
    limit_bests: dict[str, tuple[float, int]] = res.get("limit_by_layout_best") or {}
    if limit_bests:
        best_name = max(limit_bests, key=lambda k: limit_bests[k][0])
        best = limit_bests[best_name][0]
        mine = limit_bests.get(res["agent_layout"])
        print(f"layout vs limit: the agent serves {res['agent_layout']}; the limit's best layout is {best_name} "
              f"({best:.1f} img/s at batch {limit_bests[best_name][1]})"
              + (f"; the limit measured {res['agent_layout']} at {mine[0]:.1f} img/s = {mine[0] / best:.1%} of its best"
                 if mine else "; the limit did not measure the agent's layout"))
        trial = res.get("agent_layouts_img_s") or {}
        print(f"{'layout':>8} {'limit img/s':>12} {'(batch)':>7} {'agent trial img/s':>18} {'trial / limit':>13}")
        for name, (v, b) in limit_bests.items():
            t = trial.get(name)
            print(f"{name:>8} {v:>12.1f} {b:>7} {t if t is not None else '':>18} "
                  f"{f'{t / v:.1%}' if t is not None and v else '':>13}")
    mem = res.get("memory")
    if mem:
        bare, peak = mem["bare_rss_mb"], mem["bare_peak_mb"]
        print(f"memory: the agent's RSS after install {mem['agent_after_install_mb']:.0f} MB "
              f"({mem['agent_after_install_mb'] / bare:.2f}x), after the load {mem['agent_after_load_mb']:.0f} MB "
              f"({mem['agent_after_load_mb'] / bare:.2f}x), peak {mem['agent_peak_mb']:.0f} MB "
              f"({mem['agent_peak_mb'] / peak:.2f}x); a bare process with {mem['bare_layout']}'s sessions run at batch "
              f"{mem['bare_batch']}: RSS {bare:.0f} MB, peak {peak:.0f} MB (goal: each ratio <= 1.3x)")


def print_engines(res: dict[str, Any]) -> None:
    """Each runtime's bare limit in this run, the fastest, and the runtime the agent chose (and why)."""
    by = res.get("limits_by_runtime") or {}
    if not by:
        return
    before, after = res["limits_before_by_runtime"], res["limits_after_by_runtime"]
    cells = [f"{r} {v:.1f} img/s (before {before[r]['images_per_s']:.1f}, {before[r]['layout']} at batch "
             f"{before[r]['best_batch']}; after {after[r]['images_per_s']:.1f}, {after[r]['layout']} at batch "
             f"{after[r]['best_batch']})" for r, v in by.items()]
    rc = res.get("agent_runtime") or {}
    why = ", ".join(f"{k} {v:g}/s" for k, v in (rc.get("items_per_second") or {}).items())
    print(f"engines (bare, this run): {'; '.join(cells)}; the fastest: {res['best_engine']}. The agent serves on "
          f"{rc.get('runtime', 'onnxruntime (it does not say)')}" + (f" ({rc.get('source')}" if rc else "")
          + (f": timed {why})" if why else ")" if rc else ""))
    binary = [r for r in res["rows"] if r["variant"] == "binary"]
    if binary:
        print(f"the agent's share of the fastest engine's limit ({res['best_engine']} "
              f"{by[res['best_engine']]:.1f} img/s), binary OIP: "
              + ", ".join(f"{r['clients']} clients {r['req_per_s']:.1f} req/s = {r['vs_best_engine']:.3f}"
                          for r in binary))
    for r in binary:
        if "spot_limits" in r:
            spots = ", ".join(f"{k} {v:.1f}" for k, v in r["spot_limits"].items())
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["spot_per_cpu_s"].items())
            print(f"  {r['clients']} clients, against the bare limits timed just before and after the level ({spots} "
                  f"img/s): {r['req_per_s']:.1f} / {r['spot_limits'][r['spot_best']]:.1f} = {r['vs_best_spot']:.3f}"
                  + (f"; the agent's runtime ran {r['runtime_img_s']:.1f} img/s while busy "
                     f"({r['runtime_busy']:.1%} of the time)" if "runtime_img_s" in r else "")
                  + (f"; per CPU-second: the agent's inference threads {r['agent_per_cpu_s']:.1f} img, bare {cpu} "
                     f"-> {r['vs_best_per_cpu_s']:.3f}" if "agent_per_cpu_s" in r else ""))


def print_report(doc: dict[str, Any]) -> None:
    pin = doc["config"].get("pin_cpus")
    pinned = f" (pinned: inference on {pin[0]}, the rest on {pin[1]})" if pin else ""
    print(f"\nbench/serve.py: {doc['machine']['cpus']} CPUs{pinned}, python {doc['machine']['python']}, onnxruntime "
          f"{doc['machine']['onnxruntime']}, {doc['config']['threads']} intra-op threads, spinning off everywhere")
    for res in doc["models"]:
        lb, la = res["limit_before"], res["limit_after"]
        b1 = ", ".join(f"{k} {v:.3f} ms" for k, v in res["raw_batch1_ms"].items())
        print(f"\n{res['model']} ({res['precision']}): limit {res['limit_img_s']:.1f} img/s (before "
              f"{lb['images_per_s']:.1f}, {lb['layout']} at batch {lb['best_batch']}; after {la['images_per_s']:.1f}, "
              f"{la['layout']} at batch {la['best_batch']}; sessions x threads); the agent ran "
              f"{res['agent_layout']}, serving {res.get('agent_choice', '?')}; raw batch-1 call {b1}; agent cold "
              f"start to ready "
              f"{res['cold_start_s']:.2f} s, idle RSS {res['idle_rss_mb']:.0f} MB; JSON decode of one request "
              f"{res['json_decode_ms']:.2f} ms (json), {res['json_decode_orjson_ms']:.2f} ms (orjson, the agent's)")
        print_engines(res)
        print_layouts_and_memory(res)
        print(f"{'variant':>12} {'clients':>7} {'req/s':>9} {'vs limit':>8} {'vs best':>8} {'p50 ms':>8} "
              f"{'p99 ms':>8} {'added ms':>8} {'errors':>6} {'wrong':>5} | cores: {'load':>5} {'main':>5} "
              f"{'other':>5} | {'vs limit on CPU left':>20}")
        own = []
        for r in res["rows"]:
            added = f"{r['added_ms']:.3f}" if "added_ms" in r else ""
            if "added_own_ms" in r:
                own.append(f"{r['variant']} {r['added_own_ms']:.3f} ms (p50 {r['p50_ms']:.2f} ms, its batch-1 calls "
                           f"{r['compute_b1_ms']:.2f} ms)")
            print(f"{r['variant']:>12} {r['clients']:>7} {r['req_per_s']:>9.1f} {r['vs_limit']:>8.1%} "
                  f"{r.get('vs_best_engine', r['vs_limit']):>8.1%} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                  f"{added:>8} {r['errors']:>6} {r['wrong']:>5} | "
                  f"{'':>6} {r['load_cores']:>5.2f} {r.get('server_main_cores', float('nan')):>5.2f} "
                  f"{r.get('server_other_cores', float('nan')):>5.2f} | {r['vs_limit_cpu_left']:>20.1%}")
        print("vs limit: against the limit of the first runtime timed (--limit-runtimes); vs best: against the "
              "fastest runtime's limit. "
              "cores: CPU used during the timed phase, in cores, by the load generator, the server's main (event "
              "loop) thread and its other threads (inference; the naive server runs inference on its main thread "
              "and in onnxruntime's pool). vs limit on CPU left: against the limit scaled to the cores the load "
              "generator left.")
        formed = [f"{r['variant']} {r['clients']} clients: runtime busy {r['runtime_busy']:.1%}, batches "
                  f"{r['batches_formed']}" for r in res["rows"] if "batches_formed" in r and r["clients"] > 1]
        if formed:
            print("the agent's runtime in the timed phase (its statistics: the share of the time it ran a batch, "
                  "batches formed by size): " + "; ".join(formed))
        binary = {r["clients"]: r["req_per_s"] for r in res["rows"] if r["variant"] == "binary"}
        for c, v in binary.items():
            near = [f"{r['variant']} {r['req_per_s'] / v:.2f}x" for r in res["rows"] if r["clients"] == c
                    and r["variant"] in ("grpc", "shm", "local", "local-inline")]
            if near:
                print(f"on-box clients at {c} clients, against binary HTTP ({v:,.0f} req/s): " + ", ".join(near))
        if own:
            print("added at 1 client over the agent's own runtime calls in the same run (its statistics): "
                  + "; ".join(own))
        for r in res["rows"]:
            ph = r.get("agent_ms") or {}
            if r["clients"] == 1 and {"success", "queue", "compute_infer"} <= set(ph):
                rest = ph["success"] - ph["queue"] - ph["compute_infer"]
                print(f"where a lone {r['variant']} request's time goes (means, the agent's statistics): in the agent "
                      f"{ph['success']:.3f} ms = queued until its batch started {ph['queue']:.3f} + runtime "
                      f"{ph['compute_infer']:.3f} + the rest (decode, thread hand-offs, encode) {rest:.3f}; outside "
                      f"it (client, loopback, HTTP before the handler) p50 - that = {r['p50_ms'] - ph['success']:.3f}")
        print(f"transport floor: a binary request's bytes to a loopback server that only reads them and back, "
              f"{res['transport_floor_ms']:.3f} ms; through uvicorn and a Starlette route that reads the body (the "
              f"agent's HTTP stack, nothing decoded) {res['asgi_floor_ms']:.3f} ms: that stack adds "
              f"{res['asgi_floor_ms'] - res['transport_floor_ms']:.3f} ms before the agent's own work")
        tgt = ", ".join(f"{c} clients {v:.1f}" for c, v in res["json_target_req_s"].items())
        print(f"JSON target (naive raw-bytes req/s with the decode cost added per request): {tgt}")
        tgt = ", ".join(f"{c} clients {v:.1f}" for c, v in res["json_target_orjson_req_s"].items())
        print(f"JSON target with orjson's decode cost (stricter): {tgt}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--naive-server"]:
        naive_server(argv[1], int(argv[2]), int(argv[3]))
        return 0
    if argv[:1] == ["--bare-sessions"]:
        bare_sessions(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), float(argv[5]))
        return 0
    p = argparse.ArgumentParser(prog="serve.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (a rough look, about 2 minutes)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--clients", default="1,8,32", help="closed-loop client counts")
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
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    if args.pin:
        global PIN
        allowed = sorted(os.sched_getaffinity(0))
        mine = frozenset(int(c) for c in args.inference_cpus.split(",")) if args.inference_cpus else \
            frozenset(allowed[-1:])
        rest = frozenset(allowed) - mine
        if not mine <= set(allowed) or not rest:
            p.error(f"--inference-cpus {sorted(mine)}: must be CPUs of {allowed}, leaving at least one")
        PIN = (mine, rest)
        args.threads = len(mine)
        say(f"pinned: inference on CPU(s) {sorted(mine)}, event loops and the load generator on {sorted(rest)}; "
             f"{args.threads} inference thread(s)")
    args.requests = args.requests or (1000 if args.quick else 3000)
    args.requests_big = args.requests_big or (200 if args.quick else 600)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS + MORE_MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS + MORE_MODELS)}")
    import onnxruntime as ort

    with contextlib.ExitStack() as stack:
        work = args.work_dir.resolve() if args.work_dir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="edgefleet-serve-")))
        results: list[dict[str, Any]] = []
        doc = {"benchmark": "edgefleet bench/serve.py", "models": results,
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "onnxruntime": ort.__version__, "platform": platform.platform()},
               "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "pin_cpus": [sorted(PIN[0]), sorted(PIN[1])] if PIN else None}}
        for n in names:
            say(f"{n}: compiling for x86-cpu and installing")
            results.append(bench_model(prepare(n, work), args, work))
            if args.json:  # after each model: a run cut short keeps what it measured
                args.json.write_text(json.dumps(doc, indent=2, default=str))
    print_report(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
