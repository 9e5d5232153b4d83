"""Run a real agent (uvicorn on loopback) in a thread of the test process."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import pytest

from edgefleet.agent.config import AgentConfig
from edgefleet.agent.daemon import Agent, run_until_stopped
from edgefleet.agent.install.store import ModelStore
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.bundle import sha256_file
from tests.waiting import wait_for

DIGITS_IN_BYTES = 64 * 4  # one digits image (1x8x8 FP32) in
DIGITS_OUT_BYTES = 10 * 4  # its ten FP32 logits out


def preinstall(data_dir: Path, bundle: Path) -> None:
    store = ModelStore(data_dir / "store")
    store.recover()
    store.commit(store.stage(bundle, sha256_file(bundle)), rollout_id=None)


@contextmanager
def running_agent(data_dir: Path, **overrides) -> Iterator[tuple[Agent, str]]:
    # tests that give no root trust the (fake or unreachable) fleet's on first use, as the agent's flag says
    tofu = "trusted_root" not in overrides
    cfg = AgentConfig(**{"device_id": "dev-1", "fleet_url": "http://127.0.0.1:9", "data_dir": data_dir,
                         "http_port": 0, "telemetry_interval_s": 0.5, "trust_on_first_use": tofu,
                         # onnxruntime's answers, which the tests compare with, unless a test asks for the runtime
                         # chosen on the device (runtime="auto": tests/test_agent_runtime_choice.py)
                         "runtime": "onnxruntime", **overrides})
    agent = Agent(cfg)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_until_stopped(agent)  # as the daemon runs, on its event loop
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert agent.ready.wait(30), errors
    try:
        # uvicorn needs a moment after the socket is bound
        wait_for(lambda: httpx.get(f"{agent.inference_url}/v2/health/live", timeout=1), 10,
                 "the agent's HTTP answering", retry_on=(httpx.TransportError,))
        yield agent, agent.inference_url
    finally:
        agent.request_stop()
        t.join(30)
        assert not t.is_alive(), "the agent did not stop"
        assert not errors, errors


@contextmanager
def installed_agent(data_dir: Path, bundle: Path, **overrides) -> Iterator[tuple[Agent, str]]:
    """``running_agent`` on ``data_dir`` with ``bundle`` installed first (as a device that had it before a restart)."""
    preinstall(data_dir, bundle)
    with running_agent(data_dir, **overrides) as agent_url:
        yield agent_url


@contextmanager
def serving_app(app, setup=None) -> Iterator[str]:
    """Any ASGI app (e.g. ``agent.transports.http.create_app`` around a test backend) on uvicorn, 127.0.0.1, a free
    port; ``setup`` (a coroutine function) runs first on the server's event loop, e.g. ``ModelHost.swap``."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    async def main() -> None:
        if setup is not None:
            await setup()
        await server.serve(sockets=[sock])

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    try:
        wait_for(lambda: server.started, 10, "uvicorn started")
        yield url
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()


def on_loop(a, fn):
    """``fn()`` run on the agent's event loop -> its result."""
    async def call():
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), a._loop).result(30)


@contextmanager
def gated(a, hold_s: float = 60.0):
    """The digits backend held at a gate (its batches wait on their inference thread until the block ends, at most
    ``hold_s``)."""
    served = on_loop(a, lambda: a.host.models["digits"])
    gate = threading.Event()
    patched = []
    for be in served.backends:
        real = be.infer

        def infer(feeds, real=real):
            gate.wait(hold_s)
            return real(feeds)

        be.infer = infer
        patched.append(be)
    try:
        yield gate
    finally:
        gate.set()
        for be in patched:
            del be.infer


def until_on_loop(a, fn, what: str, timeout_s: float = 30.0):
    """Ask ``fn()`` on the agent's event loop until it is truthy (bounded, tests.waiting.wait_for) -> that value."""
    return wait_for(lambda: on_loop(a, fn), timeout_s, what)


@contextmanager
def recording_local_servers() -> Iterator[list]:
    """The agent's local-socket servers (agent.transports.local.LocalServer), recorded as each starts: a test reads
    their connections and bytes in flight."""
    from edgefleet.agent.transports import local as agent_local

    servers: list = []
    real = agent_local.LocalServer.start

    async def start(self, path):
        servers.append(self)
        return await real(self, path)

    mp = pytest.MonkeyPatch()
    mp.setattr(agent_local.LocalServer, "start", start)
    try:
        yield servers
    finally:
        mp.undo()


def spooled_telemetry(agent: Agent, after_seq: int = -1) -> list[proto.Telemetry]:
    """The telemetry records ``agent`` has spooled after sequence number ``after_seq``, in order (an agent with no
    fleet to send them to keeps them all); a record being written is skipped."""
    out = []
    for p in sorted(Path(agent.config.data_dir, "spool").glob("[0-9]*.json")):
        if int(p.stem) <= after_seq:
            continue
        try:
            out.append(proto.decode(proto.Telemetry, p.read_bytes(), str(p)))
        except (OSError, proto.MessageError):  # being written
            continue
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the agent's /metrics samples called ``name`` with ``labels`` (0 if none), parsed with
    prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def served_version(url: str, model: str = "digits", timeout_s: float = 2.0) -> str | None:
    """The version of ``model`` the agent at ``url`` serves; None while it does not answer or serves none."""
    try:
        r = httpx.get(f"{url}/v2/models/{model}", timeout=timeout_s)
    except httpx.TransportError:
        return None
    return r.json()["versions"][0] if r.status_code == 200 else None


def post_at_once(url: str, bodies: list[bytes], timeout_s: float = 60.0) -> list[httpx.Response]:
    """POST each body from a thread of its own, all released together by a barrier; every reply is a response
    (a transport error fails the test with it)."""
    out: list[httpx.Response | BaseException | None] = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def send(i: int) -> None:
        try:
            start.wait()
            out[i] = httpx.post(url, content=bodies[i], timeout=timeout_s)
        except BaseException as exc:  # surfaced below
            out[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 60)
    for r in out:
        assert isinstance(r, httpx.Response), r
    return out  # type: ignore[return-value]


def in_batcher(b) -> int:
    """Samples a batcher holds: queued, waiting behind a running batch, or running."""
    return b.queued_samples + sum(p.n for batch in b._running.values() for p in batch)


@contextmanager
def shm_object(prefix: str, size: int = 64 * 1024) -> Iterator[tuple[str, shared_memory.SharedMemory]]:
    """A POSIX shared-memory object of ``size`` bytes -> (its key, "/" + name; the object), unlinked afterwards (if
    the test did not)."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    r = shared_memory.SharedMemory(name, create=True, size=size)
    try:
        yield "/" + name, r
    finally:
        r.close()
        try:
            r.unlink()
        except FileNotFoundError:
            pass


class Load:
    """What the clients of :func:`under_load` record: one (status, version served, answer right) per request, and
    the failures' texts; ``stopped`` is set when the load is to end."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.results: list[tuple[int, str | None, bool]] = []
        self.failures: list[str] = []
        self._lock = threading.Lock()

    def add(self, result: tuple[int, str | None, bool], failure: str | None = None) -> None:
        with self._lock:
            self.results.append(result)
            if failure is not None:
                self.failures.append(failure)

    def count(self) -> int:
        with self._lock:
            return len(self.results)


@contextmanager
def under_load(client: Callable[[Load, int], None], clients: int, join_s: float) -> Iterator[Load]:
    """``client(load, seed)`` in ``clients`` threads (seeds 0, 1, ...) for the time of the block (e.g. a hot swap):
    each requests until ``load.stopped``, which the block's end sets, then each thread is joined (``join_s``)."""
    load = Load()
    threads = [threading.Thread(target=client, args=(load, s)) for s in range(clients)]
    for t in threads:
        t.start()
    try:
        yield load
    finally:
        load.stopped.set()
        for t in threads:
            t.join(join_s)


def ocr_pipeline_or_skip():
    """tests.ocr_pipeline (the PP-OCRv4 pipeline bundles the pipeline tests serve), or the calling module skipped: it
    needs OpenCV (the [image] extra) to crop, onnx to read the recognizer's charset, and the rapidocr models."""
    pytest.importorskip("cv2", reason="pipelines crop with OpenCV (the [image] extra)")
    pytest.importorskip("onnx", reason="the charset is read from the recognizer's ONNX metadata")
    ocr = pytest.importorskip("tests.ocr_pipeline")
    try:
        ocr.models_dir()
    except FileNotFoundError as exc:  # pragma: no cover - the venv installs it
        pytest.skip(str(exc), allow_module_level=True)
    return ocr
