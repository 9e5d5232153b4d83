"""Outside probes of the on-box socket's fast path (agent/transports/local.py _Connection._quick: a cached
RequestTemplate, the batcher entry answered from its future's callback), on a real agent with the digits model: the same
request bytes sent again after the world under the template changed (regions, the object, the data, the model version),
clients that go away with requests pending, pipelining far beyond local_max_inflight, a full queue, exact metrics, and
partial frames held against the in-flight byte budget."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import uuid
from contextlib import contextmanager
from multiprocessing import shared_memory

import httpx
import numpy as np
import pytest

from edgefleet.agent.transports import local as agent_local
from edgefleet.agent.transports.local_client import LocalClient, LocalError, decode_result, infer_request
from edgefleet.protocol import local as wire
from tests.agent_harness import (
    gated,
    metric,
    on_loop,
    preinstall,
    recording_local_servers,
    running_agent,
    until_on_loop,
)
from tests.waiting import wait_for

IN_BYTES = 4 * 64 * 4  # 4 digits images, FP32
OUT_BYTES = 4 * 10 * 4


# -- harness -------------------------------------------------------------------------------------


@contextmanager
def probed_agent(data, bundle, **overrides):
    """A real agent with the socket on, and its LocalServer (recorded as it starts) for inspection."""
    preinstall(data, bundle)
    with recording_local_servers() as servers, \
            running_agent(data, local_socket="local.sock", inline_max_us=0, **overrides) as (a, url):
        assert len(servers) == 1
        yield a, url, servers[0]


def stats(url, model="digits"):
    r = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["model_stats"][0]


@pytest.fixture
def fast_hits(monkeypatch):
    """How many INFER frames the fast path (_quick) took."""
    hits = [0]
    real = agent_local._Connection._quick

    def quick(self, rid, body):
        took = real(self, rid, body)
        hits[0] += took
        return took

    monkeypatch.setattr(agent_local._Connection, "_quick", quick)
    return hits


def frames(sock, count, timeout_s=60.0):
    """Read ``count`` whole frames -> [(kind, rid, body)]."""
    sock.settimeout(timeout_s)
    buf = bytearray()
    out = []
    while len(out) < count:
        while len(buf) >= 16:
            kind, rid, length = wire.unpack_header(bytes(buf[:16]), 1 << 30)
            if len(buf) < 16 + length:
                break
            out.append((kind, rid, bytes(buf[16:16 + length])))
            del buf[:16 + length]
            if len(out) == count:
                return out
        chunk = sock.recv(1 << 20)
        assert chunk, f"the agent closed after {len(out)} of {count} frames"
        buf += chunk
    return out


def status_of(kind, body):
    return 200 if kind == wire.RESULT else struct.unpack_from("<H", body)[0]


@pytest.fixture(scope="module")
def agent(tmp_path_factory, digits_bundle):
    with probed_agent(tmp_path_factory.mktemp("agent"), digits_bundle, max_shm_regions_per_client=4,
                      max_shm_regions=8, max_shm_bytes=1024 * 1024, local_max_connections=8, local_max_inflight=64,
                      max_body_bytes=64 * 1024) as got:
        yield got


@pytest.fixture
def region():
    name = f"edgefleet-probe-{uuid.uuid4().hex[:12]}"
    r = shared_memory.SharedMemory(name, create=True, size=64 * 1024)
    yield "/" + name, name, r
    r.close()
    try:
        r.unlink()
    except FileNotFoundError:
        pass


def x4(test_images):
    return np.ascontiguousarray(test_images[0][:4], np.float32)


# -- (a)-(c): the template's world changed under the same bytes ------------------------------------


def test_regions_changed_under_a_cached_request(agent, region, test_images, fast_hits):
    a, url, srv = agent
    key, _, r = region
    x = x4(test_images)
    want = LocalClient(a.local_socket).infer("digits", {"input": x})["logits"]
    r.buf[:IN_BYTES] = x.tobytes()
    by_ref = infer_request("digits", {"input": ("io", 0, IN_BYTES, [4, 1, 8, 8])},
                           outputs={"logits": ("io", 32768, OUT_BYTES)})

    def ok(c):
        r.buf[32768:32768 + OUT_BYTES] = bytes(OUT_BYTES)
        doc, _ = c.infer_raw(by_ref)
        assert doc["outputs"][0]["parameters"]["shared_memory_region"] == "io"
        got = np.frombuffer(bytes(r.buf[32768:32768 + OUT_BYTES]), np.float32).reshape(4, 10)
        assert got.tobytes() == want.tobytes()

    def refused(c, words):
        with pytest.raises(LocalError) as e:
            c.infer_raw(by_ref)
        assert e.value.status == 400 and words in e.value.message, e.value

    with LocalClient(a.local_socket, timeout_s=30) as c:
        c.register_region("io", key, 64 * 1024)
        ok(c)
        hits = fast_hits[0]
        ok(c)
        assert fast_hits[0] == hits + 1  # the second went by the template
        c.unregister_region("io")
        refused(c, "no shared-memory region 'io' is registered on this connection")
        c.register_region("io", key, 1024)  # again, smaller: neither the input's end nor the output fits
        refused(c, f"bytes 32768..{32768 + OUT_BYTES} are beyond shared-memory region 'io' (1024 bytes)")
        c.unregister_region("io")
        c.register_region("io", key, 32768 + OUT_BYTES - 4)  # the input fits, the output by 4 bytes not
        refused(c, f"bytes 32768..{32768 + OUT_BYTES} are beyond shared-memory region 'io'")
        c.unregister_region("io")
        c.register_region("io", key, 64 * 1024)
        hits = fast_hits[0]
        ok(c)
        ok(c)
        assert fast_hits[0] >= hits + 1
        if os.geteuid() != 0:  # root opens any object read-write: a read-only region needs another user
            ro = f"edgefleet-probe-ro-{uuid.uuid4().hex[:8]}"
            t = shared_memory.SharedMemory(ro, create=True, size=64 * 1024)
            try:
                t.buf[:IN_BYTES] = x.tobytes()
                os.chmod(f"/dev/shm/{ro}", 0o400)
                c.unregister_region("io")
                c.register_region("io", "/" + ro, 64 * 1024)
                refused(c, "outputs cannot be written into shared-memory object")
            finally:
                t.close()
                t.unlink()
        c.unregister_region()
    until_on_loop(a, lambda: srv.inflight_bytes == 0, "no request bytes in flight")


def test_object_truncated_and_nan_under_a_cached_request(agent, region, test_images, fast_hits):
    a, url, srv = agent
    key, name, r = region
    x = x4(test_images)
    r.buf[:IN_BYTES] = x.tobytes()
    inp = {"input": ("io", 0, IN_BYTES, [4, 1, 8, 8])}
    body = infer_request("digits", inp)
    out_body = infer_request("digits", {"input": x}, outputs={"logits": ("io", 32768, OUT_BYTES)})
    with LocalClient(a.local_socket, timeout_s=30) as c:
        c.register_region("io", key, 64 * 1024)
        for _ in range(2):
            assert decode_result(c.call(wire.INFER, body))[1]["logits"].shape == (4, 10)
            c.call(wire.INFER, out_body)
        hits = fast_hits[0]
        # NaN (then infinity) in the region: refused as uncached, then served again once the data is clean
        for bad in (np.nan, np.inf):
            r.buf[4:8] = np.float32(bad).tobytes()
            with pytest.raises(LocalError) as e:
                c.call(wire.INFER, body)
            assert e.value.status == 400 and "input 'input': data contains NaN or infinity" in e.value.message
            r.buf[:IN_BYTES] = x.tobytes()
            assert decode_result(c.call(wire.INFER, body))[1]["logits"].shape == (4, 10)
        assert fast_hits[0] >= hits + 2
        # the object truncated below the region: the input cannot be read, the output cannot be written
        os.truncate(f"/dev/shm/{name}", 128)
        with pytest.raises(LocalError) as e:
            c.call(wire.INFER, body)
        assert e.value.status == 400 and "was truncated below region 'io'" in e.value.message, e.value
        with pytest.raises(LocalError) as e:
            c.call(wire.INFER, out_body)
        assert e.value.status == 400 and "was truncated below region 'io'" in e.value.message, e.value
        assert decode_result(c.call(wire.INFER, infer_request("digits", {"input": x})))[1]["logits"].shape == (4, 10)
    until_on_loop(a, lambda: srv.inflight_bytes == 0, "no request bytes in flight")


# -- (e) a client gone with requests pending ---------------------------------------------------------


def test_a_client_gone_with_many_fast_requests_pending(agent, test_images, fast_hits):
    a, url, srv = agent
    x = x4(test_images)
    body = infer_request("digits", {"input": x})
    before_499 = metric(url, "edgefleet_inference_errors_total", model="digits", version="1.0.0", code="499")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(a.local_socket))
    s.sendall(wire.pack(wire.INFER, 1, body))
    assert frames(s, 1)[0][0] == wire.RESULT  # decoded once: cached
    hits = fast_hits[0]
    with gated(a) as gate:
        s.sendall(b"".join(wire.pack(wire.INFER, 2 + i, body) for i in range(50)))
        until_on_loop(a, lambda: sum(len(c.pending) for c in srv.connections) == 50, "50 requests pending")
        assert fast_hits[0] == hits + 50
        s.close()
        until_on_loop(a, lambda: not any(c.pending for c in srv.connections) and len(srv.connections) == 0,
                      "the connection and its pending requests gone")
        gate.set()
        served = on_loop(a, lambda: a.host.models["digits"])
        until_on_loop(a, lambda: served.batcher.queued_samples == 0, "the queue empty")
    until_on_loop(a, lambda: srv.inflight_bytes == 0, "no request bytes in flight")
    assert metric(url, "edgefleet_inference_errors_total", model="digits", version="1.0.0", code="499") \
        == before_499 + 50
    assert metric(url, "edgefleet_queue_depth", model="digits", version="1.0.0") == 0
    with LocalClient(a.local_socket, timeout_s=30) as c:  # the agent serves the next client
        assert c.infer("digits", {"input": x})["logits"].shape == (4, 10)


# -- (f) pipelining far beyond local_max_inflight -------------------------------------------------------


def test_pipelining_far_beyond_max_inflight(agent, test_images, monkeypatch):
    a, url, srv = agent
    x = x4(test_images)
    body = infer_request("digits", {"input": x})
    seen = {"inflight": 0, "buf": 0}
    real = agent_local._Connection._dispatch

    def dispatch(self, kind, rid, b):
        real(self, kind, rid, b)
        seen["inflight"] = max(seen["inflight"], self.inflight)
        seen["buf"] = max(seen["buf"], len(self.buf))

    monkeypatch.setattr(agent_local._Connection, "_dispatch", dispatch)
    n = 3000
    data = b"".join(wire.pack(wire.INFER, i + 1, body) for i in range(n))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(a.local_socket))
    sender = threading.Thread(target=s.sendall, args=(data,), daemon=True)
    sender.start()
    try:
        got = frames(s, n)
    finally:
        sender.join(60)
    assert not sender.is_alive()
    rids = [rid for _, rid, _ in got]
    assert sorted(rids) == list(range(1, n + 1))  # each answered, once
    assert {status_of(k, b) for k, _, b in got} == {200}
    want = decode_result(got[0][2])[1]["logits"].tobytes()
    assert all(decode_result(b)[1]["logits"].tobytes() == want for _, _, b in got)
    s.settimeout(0.5)
    with pytest.raises(socket.timeout):  # nothing more
        s.recv(1)
    s.close()
    assert seen["inflight"] <= 64, seen  # local_max_inflight: the requests in flight on one connection
    until_on_loop(a, lambda: srv.inflight_bytes == 0 and not srv.connections, "all settled")


# -- (h) metrics exact at once ------------------------------------------------------------------------------------


def test_metrics_count_every_fast_request_at_once(agent, test_images, fast_hits):
    a, url, _ = agent
    x = x4(test_images)
    body = infer_request("digits", {"input": x})
    with LocalClient(a.local_socket, timeout_s=30) as c:
        c.call(wire.INFER, body)  # cached
        for n in (1, 255, 256, 300):  # below, at and above the fold size
            req0 = metric(url, "edgefleet_inference_requests_total", model="digits", version="1.0.0")
            lat0 = metric(url, "edgefleet_request_duration_seconds_count", model="digits", version="1.0.0")
            st0 = stats(url)["inference_stats"]["success"]["count"]
            tel0 = on_loop(a, lambda: a.host.metrics.total_requests)
            hits = fast_hits[0]
            for _ in range(n):
                c.call(wire.INFER, body)
            assert fast_hits[0] == hits + n
            assert stats(url)["inference_stats"]["success"]["count"] == st0 + n
            assert metric(url, "edgefleet_inference_requests_total", model="digits", version="1.0.0") == req0 + n
            assert metric(url, "edgefleet_request_duration_seconds_count", model="digits",
                          version="1.0.0") == lat0 + n
            assert on_loop(a, lambda: a.host.metrics.total_requests) == tel0 + n


# -- (g) a full queue on the fast path --------------------------------------------------------------------------


def test_queue_full_on_the_fast_path(tmp_path, digits_bundle, test_images, fast_hits):
    x = x4(test_images)[:1]
    body = infer_request("digits", {"input": x})
    with probed_agent(tmp_path, digits_bundle, max_queue_size=2, max_batch_size=1,
                      local_max_inflight=1024) as (a, url, srv):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(a.local_socket))
        s.sendall(wire.pack(wire.INFER, 1, body))
        assert frames(s, 1)[0][0] == wire.RESULT
        lab = {"model": "digits", "version": "1.0.0"}
        req0 = metric(url, "edgefleet_inference_requests_total", **lab)
        e429 = metric(url, "edgefleet_inference_errors_total", code="429", **lab)
        st0 = stats(url)["inference_stats"]
        n = 40
        with gated(a) as gate:
            s.sendall(b"".join(wire.pack(wire.INFER, 2 + i, body) for i in range(n)))
            # every frame read and dispatched: those the queue took are pending (at most 2 queued, 1 on the thread,
            # 1 staged behind it, per batcher turn), the rest were answered 429 at once
            until_on_loop(a, lambda: all(not c.buf for c in srv.connections)
                          and srv.inflight_bytes == len(body) * sum(len(c.pending) for c in srv.connections),
                          "all dispatched")
            k = on_loop(a, lambda: sum(len(c.pending) for c in srv.connections))
            early = frames(s, n - k)
            gate.set()
            late = frames(s, k)
        got = early + late
        assert sorted(rid for _, rid, _ in got) == list(range(2, 2 + n))
        statuses = [status_of(k, b) for k, _, b in got]
        refused = [b for k, _, b in got if k == wire.ERROR]
        assert 1 <= k < n and statuses == [429] * (n - k) + [200] * k  # nothing ran while the gate held
        assert all("queue full" in b[2:].decode() for b in refused)
        assert fast_hits[0] >= n
        n429, n200 = statuses.count(429), statuses.count(200)
        assert metric(url, "edgefleet_inference_errors_total", code="429", **lab) == e429 + n429
        assert metric(url, "edgefleet_inference_requests_total", **lab) == req0 + n
        st = stats(url)["inference_stats"]
        assert st["fail"]["count"] == st0["fail"]["count"] + n429
        assert st["success"]["count"] == st0["success"]["count"] + n200
        s.close()
        until_on_loop(a, lambda: srv.inflight_bytes == 0 and a.host.models["digits"].batcher.queued_samples == 0,
                      "settled")


# -- (d) the model hot-swapped under cached requests ---------------------------------------------------------


def test_a_swapped_model_never_gets_the_old_versions_template(tmp_path, digits_bundle, digits_bundle_v2,
                                                              test_images, fast_hits):
    from edgefleet.agent.install.store import ModelStore
    from edgefleet.engines import EngineSpec
    from edgefleet.engines.onnxruntime import OnnxRuntimeEngine
    from edgefleet.protocol.bundle import sha256_file

    x = x4(test_images)
    any_version = infer_request("digits", {"input": x})
    pinned = infer_request("digits", {"input": x}, version="1.0.0")
    with probed_agent(tmp_path / "a", digits_bundle) as (a, url, srv):
        store = ModelStore(tmp_path / "v2")
        store.recover()
        staged = store.stage(digits_bundle_v2, sha256_file(digits_bundle_v2))
        be = OnnxRuntimeEngine(EngineSpec.from_manifest(staged.manifest))
        be.load(staged.engine, 1)
        with LocalClient(a.local_socket, timeout_s=30) as c:
            for _ in range(2):
                assert c.infer_raw(any_version)[0]["model_version"] == "1.0.0"
                assert c.infer_raw(pinned)[0]["model_version"] == "1.0.0"
            hits = fast_hits[0]
            asyncio.run_coroutine_threadsafe(a.host.swap(staged.manifest, [be]), a._loop).result(60)
            v1_unknown = metric(url, "edgefleet_inference_errors_total", model="digits", version="_unknown",
                                code="404")
            nobody = metric(url, "edgefleet_inference_requests_total", model="_unknown")
            for _ in range(3):
                doc, outs = c.infer_raw(any_version)
                assert doc["model_version"] == "1.1.0"
                with pytest.raises(LocalError) as e:
                    c.infer_raw(pinned)
                assert e.value.status == 404 and "version '1.0.0' is not loaded; serving 1.1.0" in e.value.message
            assert fast_hits[0] > hits  # the new version's requests went by a template again, their own
            # the fast path's 404 counted as the uncached path counts it: model digits, version _unknown
            assert metric(url, "edgefleet_inference_errors_total", model="digits", version="_unknown",
                          code="404") == v1_unknown + 3
            assert metric(url, "edgefleet_inference_requests_total", model="_unknown") == nobody
            m = on_loop(a, lambda: a.host.models["digits"].manifest)
            conns = on_loop(a, lambda: list(srv.connections))
            assert all(t.specs is m.inputs for conn in conns for _, v, t in conn.quick.values() if v is None)
        with LocalClient(a.local_socket, timeout_s=30) as c:  # the uncached answer equals the cached one
            assert c.infer_raw(any_version)[1]["logits"].tobytes() == outs["logits"].tobytes()


# -- partial frames against the in-flight byte budget ----------------------------------------------------------


def test_partial_frames_count_against_the_inflight_byte_budget(tmp_path, digits_bundle, test_images):
    """Each connection sends most of a large frame and stops: those bytes are held, so they count against
    max_inflight_body_bytes (here four frames' worth); the connections beyond it are refused 503 and closed."""
    big = 60 * 1024
    with probed_agent(tmp_path, digits_bundle, max_body_bytes=64 * 1024, max_inflight_body_bytes=4 * 64 * 1024,
                      local_max_connections=16) as (a, url, srv):
        held = []
        try:
            for _ in range(10):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(a.local_socket))
                s.sendall(wire.pack(wire.INFER, 1, b"\0" * big)[:-16])
                held.append(s)
            refused: set[int] = set()  # polled from the client's side: a refused connection has its 503 waiting

            def six_refused() -> bool:
                for k, s in enumerate(held):
                    if k in refused:
                        continue
                    s.setblocking(False)
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    kind, rid, length = wire.unpack_header(data[:16], 1 << 20)
                    assert (kind, rid, status_of(kind, data[16:])) == (wire.ERROR, 0, 503), data
                    assert b"too many request bytes in flight" in data, data
                    refused.add(k)
                return len(refused) >= 6

            wait_for(six_refused, 30, "six connections refused")
            # four frames' worth fit (4 x 60 KiB of 256 KiB), the other six are refused
            assert len(refused) == 6
            until_on_loop(a, lambda: len(srv.connections) == 4 and all(len(c.buf) == big for c in srv.connections),
                          "four connections holding their partial frames")
            assert on_loop(a, lambda: srv.inflight_bytes) == 4 * big <= srv.max_inflight_bytes
        finally:
            for s in held:
                s.close()
        until_on_loop(a, lambda: not srv.connections and srv.inflight_bytes == 0, "the budget released on close")
        with LocalClient(a.local_socket, timeout_s=30) as c:
            assert c.infer("digits", {"input": x4(test_images)})["logits"].shape == (4, 10)


def test_an_unexpected_error_on_the_fast_path_goes_to_the_exact_path(agent, test_images, fast_hits, monkeypatch):
    """Whatever the cached template raises, the request is answered by the uncached path (its exact verdict), the
    connection stays open and no request bytes stay counted in flight."""
    from edgefleet.agent.transports import kserve

    a, url, srv = agent
    x = x4(test_images)
    body = infer_request("digits", {"input": x})
    with LocalClient(a.local_socket, timeout_s=30) as c:
        c.infer_raw(body)
        want = c.infer_raw(body)  # by the template
        hits = fast_hits[0]
        real, calls = kserve.RequestTemplate.apply, []

        def apply(self, binary, shm):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("something no check foresaw")
            return real(self, binary, shm)

        monkeypatch.setattr(kserve.RequestTemplate, "apply", apply)
        got = c.infer_raw(body)  # the fast path failed: answered all the same, on the same connection
        assert calls and got[1]["logits"].tobytes() == want[1]["logits"].tobytes()
        assert c.infer_raw(body)[1]["logits"].tobytes() == want[1]["logits"].tobytes()
        assert fast_hits[0] == hits + 1  # the fourth went by the template again
    until_on_loop(a, lambda: srv.inflight_bytes == 0, "no request bytes left in flight")
