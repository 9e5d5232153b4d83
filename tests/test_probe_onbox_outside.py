"""Outside probes of the agent's on-box serving surfaces -- gRPC (tritonclient.grpc and the raw service stub), the
HTTP system shared-memory extension and the local socket with shared memory -- by hostile or careless local
clients, against one real agent with all three on (the digits model). Each probe is bounded and says what it
guards."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from multiprocessing import shared_memory

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.local_client import LocalClient, LocalError
from protocol import local as wire
from tests.agent_harness import preinstall, running_agent

grpc = pytest.importorskip("grpc", reason="gRPC needs edgefleet[grpc]")
tgrpc = pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc]")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

IN_BYTES = 4 * 64 * 4  # 4 digits images, FP32
OUT_BYTES = 4 * 10 * 4


@pytest.fixture(scope="module")
def agent(tmp_path_factory, digits_bundle):
    data = tmp_path_factory.mktemp("agent")
    preinstall(data, digits_bundle)
    with running_agent(data, grpc_port=0, local_socket="local.sock", max_shm_regions_per_client=4,
                       max_shm_regions=8, max_shm_bytes=1024 * 1024, local_max_connections=8,
                       max_body_bytes=256 * 1024) as (a, url):
        yield a, url


@pytest.fixture
def stub(agent):
    ch = grpc.insecure_channel(f"127.0.0.1:{agent[0].grpc_port}")
    yield service_pb2_grpc.GRPCInferenceServiceStub(ch)
    ch.close()


@pytest.fixture
def region():
    """A POSIX shared-memory object of 64 KiB, unlinked after the test (if the test did not)."""
    name = f"edgefleet-outside-{uuid.uuid4().hex[:12]}"
    r = shared_memory.SharedMemory(name, create=True, size=64 * 1024)
    yield "/" + name, r
    r.close()
    try:
        r.unlink()
    except FileNotFoundError:
        pass


@pytest.fixture(autouse=True)
def no_regions_left(agent):
    yield
    httpx.post(f"{agent[1]}/v2/systemsharedmemory/unregister", timeout=10)


def on_loop(a, fn):
    """``fn()`` run on the agent's event loop -> its result."""
    async def call():
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), a._loop).result(30)


def metric(url, name, **labels) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@contextmanager
def gated(a):
    """The digits backend held at a gate (its batches wait on their inference thread until the block ends)."""
    served = on_loop(a, lambda: a.host.models["digits"])
    gate = threading.Event()
    patched = []
    for be in served.backends:
        real = be.infer

        def infer(feeds, real=real):
            gate.wait(30)
            return real(feeds)

        be.infer = infer
        patched.append(be)
    try:
        yield gate
    finally:
        gate.set()
        for be in patched:
            del be.infer


def x4(test_images):
    return np.ascontiguousarray(test_images[0][:4], np.float32)


def grpc_infer_request(x: np.ndarray) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="digits")
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


def register(url, name, timeout=10.0, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v2/systemsharedmemory/region/{name}/register", timeout=timeout, **kw)


# -- (1) a FIFO in /dev/shm the agent may only open for reading --------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def test_a_fifo_the_agent_may_not_write_is_refused_not_waited_on(agent):
    """A client makes a FIFO in /dev/shm that the agent's user may read but not write (mode 0644, another owner)
    and registers it. The agent opens the object read-write, is refused, and falls back to read-only: on a FIFO
    without a writer that open waits for one -- on the event loop, holding the shared-memory lock. The agent's
    user is simulated on the event loop's thread with setfsuid (per thread: the test process is root)."""
    a, url = agent
    key = f"/edgefleet-fifo-{uuid.uuid4().hex[:10]}"
    path = "/dev/shm" + key
    os.mkfifo(path, 0o644)
    on_loop(a, lambda: (_libc.setfsuid(65534), _libc.setfsgid(65534)))
    try:
        try:
            r = register(url, "fifo", json={"key": key, "byte_size": 16}, timeout=5)
        except httpx.TimeoutException:
            r = None
        finally:
            # a writer, for a moment: an agent stuck in open() gets out (then the test can end)
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK) if r is None else -1
            if fd >= 0:
                time.sleep(0.2)
                os.close(fd)
        assert r is not None, "the agent waited on the FIFO (its event loop stuck in open())"
        assert r.status_code == 400 and "not a shared-memory object" in r.json()["error"], r.text
    finally:
        on_loop(a, lambda: (_libc.setfsuid(0), _libc.setfsgid(0)))
        os.unlink(path)
    assert httpx.get(f"{url}/v2/health/live", timeout=5).status_code == 200
