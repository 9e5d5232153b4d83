"""bench/serve.py's baselines, each a process of its own: **the naive server** (a Starlette endpoint taking raw
float32 bytes with the tutorial asyncio micro-batcher: ``python bench/serve_baselines.py --naive-server ...``, run by
``NaiveProcess``) and **the transport floor** (a loopback server that only reads the bytes: what any server pays for
them).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO
from serve_bench import _die_with_parent, _free_port
from serve_limit import _session, on_inference_cpus

NAIVE_DELAY_S = 0.005  # the naive batcher's fixed collection window
NAIVE_MAX_BATCH = 16


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
                                         stdin=subprocess.DEVNULL, cwd=REPO, preexec_fn=on_inference_cpus)
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


if __name__ == "__main__":  # the naive server's own process (NaiveProcess)
    if sys.argv[1:2] != ["--naive-server"]:
        raise SystemExit("usage: serve_baselines.py --naive-server ENGINE PORT THREADS (run by NaiveProcess)")
    naive_server(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
