"""The on-box socket (protocol/local.py, agent/transports/local.py), from the outside: a real agent on loopback, its
Unix socket, and hostile local clients. Each hostile frame gets a precise ERROR and the agent keeps serving the other
clients; answers equal HTTP's bit for bit for the digits bundle."""

import json
import multiprocessing
import os
import socket
import stat
import struct
import time
import uuid
from multiprocessing import shared_memory

import httpx
import numpy as np
import pytest

from edgefleet.agent.transports.local_client import (
    AsyncLocalClient,
    LocalClient,
    LocalError,
    decode_result,
    infer_request,
)
from edgefleet.protocol import local as wire
from tests.agent_harness import DIGITS_IN_BYTES, DIGITS_OUT_BYTES, installed_agent, shm_object
from tests.waiting import wait_for

IN_BYTES, OUT_BYTES = DIGITS_IN_BYTES * 16, DIGITS_OUT_BYTES * 16  # 16 digits images


@pytest.fixture(scope="module")
def agent(tmp_path_factory, digits_bundle):
    with installed_agent(tmp_path_factory.mktemp("agent"), digits_bundle, local_socket="local.sock",
                         max_shm_regions_per_client=3, max_shm_regions=4, max_shm_bytes=1024 * 1024,
                         local_max_connections=6, max_body_bytes=64 * 1024,
                         local_max_connections_per_user=6) as agent_url:  # one user here: the total's limit
        yield agent_url


@pytest.fixture
def client(agent):
    with LocalClient(agent[0].local_socket, timeout_s=30) as c:
        yield c


@pytest.fixture
def region():
    """A POSIX shared-memory object of 64 KiB, unlinked after the test (if the test did not)."""
    with shm_object("edgefleet-local") as o:
        yield o


def http_logits(url, x):
    raw = np.ascontiguousarray(x, np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(raw)}}],
                       "parameters": {"binary_data_output": True}}).encode()
    r = httpx.post(f"{url}/v2/models/digits/infer", content=head + raw, timeout=30,
                   headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 200, r.text
    hl = int(r.headers["inference-header-content-length"])
    return np.frombuffer(r.content, np.float32, offset=hl).reshape(x.shape[0], 10)


def serves(path, x):
    """A fresh client still gets answers (the agent keeps serving)."""
    with LocalClient(path, timeout_s=30) as c:
        return c.infer("digits", {"input": x})["logits"]


def test_socket_mode_and_answers_equal_http_bit_for_bit(agent, client, region, test_images):
    a, url = agent
    assert stat.S_IMODE(os.stat(a.local_socket).st_mode) == 0o660 and stat.S_ISSOCK(os.stat(a.local_socket).st_mode)
    images, labels = test_images
    for n in (1, 7, 16):
        x = np.ascontiguousarray(images[:n], np.float32)
        inline = client.infer("digits", {"input": x})["logits"]
        assert inline.tobytes() == http_logits(url, x).tobytes()
    # by reference: the input and the output in a shared-memory region
    key, r = region
    x = np.ascontiguousarray(images[:16], np.float32)
    r.buf[:IN_BYTES] = x.tobytes()
    client.register_region("io", key, 64 * 1024)
    out = client.infer("digits", {"input": ("io", 0, IN_BYTES, [16, 1, 8, 8])}, outputs={"logits": ("io", 32768,
                                                                                                   OUT_BYTES)})
    assert out["logits"]["parameters"] == {"shared_memory_region": "io", "shared_memory_byte_size": OUT_BYTES,
                                           "shared_memory_offset": 32768}
    got = np.frombuffer(bytes(r.buf[32768:32768 + OUT_BYTES]), np.float32).reshape(16, 10)
    assert got.tobytes() == http_logits(url, x).tobytes()
    assert (got.argmax(1) == labels[:16]).mean() >= 0.9
    # a region of this connection is not HTTP's, nor another connection's
    assert httpx.get(f"{url}/v2/systemsharedmemory/status").json() == []
    with LocalClient(a.local_socket) as other:
        with pytest.raises(LocalError) as e:
            other.infer("digits", {"input": ("io", 0, IN_BYTES, [16, 1, 8, 8])})
        assert e.value.status == 400 and "no shared-memory region 'io' is registered on this connection" in str(e.value)
    client.unregister_region("io")
    client.unregister_region("io")  # an unknown name is not an error (as in Triton)


def test_pipelined_requests_on_one_connection(agent, test_images):
    import asyncio

    images, _ = test_images
    bodies = [infer_request("digits", {"input": np.ascontiguousarray(images[i:i + 1], np.float32)}) for i in range(64)]

    async def main():
        c = await AsyncLocalClient.connect(agent[0].local_socket)
        try:
            return await asyncio.gather(*(c.infer_raw(b) for b in bodies))
        finally:
            c.close()

    answers = asyncio.run(main())
    for i, body in enumerate(answers):  # batched with each other on the agent, as HTTP's would be
        want = http_logits(agent[1], np.ascontiguousarray(images[i:i + 1], np.float32))
        assert decode_result(body)[1]["logits"].tobytes() == want.tobytes()


def frame_error(sock_path, data):
    """Send raw bytes on a fresh connection -> (kind, request id, status, message) of the agent's answer."""
    with LocalClient(sock_path, timeout_s=30) as c:
        c.send_raw(data)
        kind, rid, body = c.read_frame()
        assert kind == wire.ERROR
        (status,) = struct.unpack_from("<H", body)
        return rid, status, body[2:].decode(), c


def test_garbage_and_oversized_frames_close_that_connection_only(agent, client, test_images):
    path = agent[0].local_socket
    x = np.ascontiguousarray(test_images[0][:1], np.float32)
    rid, status, msg, _ = frame_error(path, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (rid, status) == (0, 400) and "not an edgefleet local frame: magic b'GET '" in msg
    rid, status, msg, _ = frame_error(path, wire.HEADER.pack(wire.MAGIC, 9, wire.INFER, 0, 5, 0))
    assert (rid, status) == (0, 400) and "frame version 9 is not supported" in msg
    rid, status, msg, _ = frame_error(path, wire.HEADER.pack(wire.MAGIC, 1, wire.INFER, 0, 5, 0xFFFFFFFF))
    assert (rid, status) == (0, 413) and "4294967295 bytes exceeds this agent's limit of 65536" in msg
    rid, status, msg, _ = frame_error(path, wire.HEADER.pack(wire.MAGIC, 1, wire.INFER, 3, 5, 0))
    assert (rid, status) == (0, 400) and "flags 0x3" in msg
    # the agent closed those connections after saying why; this one (and everyone else) is still served
    assert client.infer("digits", {"input": x})["logits"].shape == (1, 10)


@pytest.mark.parametrize(("body", "words"), [
    (b"", "ends before the length of its model name"),
    (struct.pack("<H", 50) + b"digits", "model name is 50 bytes, but only 6 follow"),
    (wire.infer_body("resnet", b"{}"), "unknown model 'resnet'"),
    (wire.infer_body("digits", b"{}", version="9.9.9"), "version '9.9.9' is not loaded"),
    (wire.infer_body("digits", b"{not json"), "is not valid JSON"),
    (wire.infer_body("digits", b'{"inputs": [{"name": "input", "shape": [1, 1, 8, 9], "datatype": "FP32", '
                               b'"parameters": {"binary_data_size": 288}}]}', bytes(288)), "dimension 3 must be 8"),
    (wire.infer_body("digits", b'{"inputs": [{"name": "input", "shape": [2, 1, 8, 8], "datatype": "FP32", '
                               b'"parameters": {"binary_data_size": 512}}]}', bytes(256)), "binary"),
])
def test_malformed_requests_get_a_precise_error_and_the_connection_stays(client, body, words, test_images):
    with pytest.raises(LocalError) as e:
        client.call(wire.INFER, body)
    assert e.value.status in (400, 404) and words in e.value.message, e.value
    with pytest.raises(LocalError) as e:
        client.call(0x42, b"x")
    assert e.value.status == 400 and "unknown frame kind 0x42" in e.value.message
    x = np.ascontiguousarray(test_images[0][:1], np.float32)
    assert client.infer("digits", {"input": x})["logits"].shape == (1, 10)  # the same connection


def test_hostile_regions(agent, client, region, test_images):
    key, r = region
    cases = [
        ({"name": "a/b", "key": key, "byte_size": 16}, "region name 'a/b'"),
        ({"name": "..", "key": "/../etc/passwd", "byte_size": 16}, "shared-memory key '/../etc/passwd'"),
        ({"name": "x", "key": "/..", "byte_size": 16}, "shared-memory key '/..'"),
        ({"name": "x", "key": key, "byte_size": 16, "offset": 64 * 1024}, "beyond the end"),
        ({"name": "x", "key": key, "byte_size": 0}, "at least 1"),
        ({"name": "x", "key": "/edgefleet-no-such-object", "byte_size": 16}, "no shared-memory object"),
        ({"name": "x", "key": key}, "REGISTER takes a JSON object"),
    ]
    for doc, words in cases:
        with pytest.raises(LocalError) as e:
            client.call(wire.REGISTER, json.dumps(doc).encode())
        assert e.value.status == 400 and words in e.value.message, (doc, e.value)
    with pytest.raises(LocalError) as e:
        client.call(wire.REGISTER, b"\xff")
    assert "not valid JSON" in e.value.message
    # offsets and sizes outside a registered region
    client.register_region("small", key, 1024)
    for inp, out, words in [
        (("small", 0, IN_BYTES, [16, 1, 8, 8]), None, "bytes 0..4096 are beyond shared-memory region 'small' (1024"),
        (("small", 0, 100, [1, 1, 8, 8]), None, "shared_memory_byte_size is 100; shape [1, 1, 8, 8] of FP32 needs 256"),
        (("small", 1000, 256, [1, 1, 8, 8]), None, "bytes 1000..1256 are beyond shared-memory region 'small'"),
        (("small", -1, 256, [1, 1, 8, 8]), None, "shared_memory_offset must be a byte count"),
        (("small", 0, 256, [1, 1, 8, 8]), {"logits": ("small", 1020, 40)}, "beyond shared-memory region 'small'"),
    ]:
        with pytest.raises(LocalError) as e:
            client.infer("digits", {"input": inp}, outputs=out)
        assert e.value.status == 400 and words in e.value.message, (inp, e.value)
    # too many regions: 3 per connection (max_shm_regions_per_client), 4 in all
    client.register_region("r2", key, 1024)
    client.register_region("r3", key, 1024)
    with pytest.raises(LocalError) as e:
        client.register_region("r4", key, 1024)
    assert "holds 3 shared-memory regions" in e.value.message
    with LocalClient(agent[0].local_socket) as other:
        other.register_region("small", key, 1024)  # the same name on another connection: its own
        with pytest.raises(LocalError) as e:
            other.register_region("more", key, 1024)
        assert "4 shared-memory regions are registered" in e.value.message
    # that connection closed: its region is gone, so there is room again
    def room_again() -> bool:
        client.call(wire.UNREGISTER, b'{"name": "r3"}')
        client.register_region("r3", key, 1024)
        with LocalClient(agent[0].local_socket) as third:
            third.register_region("mine", key, 1024)
        return True

    wait_for(room_again, 10, "room for a region again", retry_on=(LocalError,))
    client.unregister_region()
    x = np.ascontiguousarray(test_images[0][:1], np.float32)
    assert client.infer("digits", {"input": x})["logits"].shape == (1, 10)


def test_a_region_unlinked_or_truncated_under_the_agent(client, region, test_images):
    key, r = region
    x = np.ascontiguousarray(test_images[0][:4], np.float32)
    r.buf[:x.nbytes] = x.tobytes()
    client.register_region("gone", key, 64 * 1024)
    r.unlink()  # the agent's mapping stays until the region is unregistered: the bytes still read
    out = client.infer("digits", {"input": ("gone", 0, x.nbytes, list(x.shape))})["logits"]
    assert out.shape == (4, 10)
    client.unregister_region("gone")
    name = f"edgefleet-local-{uuid.uuid4().hex[:12]}"
    t = shared_memory.SharedMemory(name, create=True, size=64 * 1024)
    try:
        client.register_region("cut", "/" + name, 64 * 1024)
        os.truncate(f"/dev/shm/{name}", 128)
        with pytest.raises(LocalError) as e:
            client.infer("digits", {"input": ("cut", 0, x.nbytes, list(x.shape))})
        assert e.value.status == 400 and "was truncated below region 'cut'" in e.value.message
    finally:
        t.close()
        t.unlink()
    assert client.infer("digits", {"input": x})["logits"].shape == (4, 10)


def test_an_input_from_shared_memory_is_bounded_like_a_body(client, test_images):
    """A region may be far bigger than one request may be: an input that names more of it than max_body_bytes (64
    KiB here) is refused (413) before the agent allocates or reads anything (it read all of it first, then
    refused the batch size), and the agent keeps serving."""
    name = f"edgefleet-local-{uuid.uuid4().hex[:12]}"
    t = shared_memory.SharedMemory(name, create=True, size=256 * 1024)
    try:
        client.register_region("big", "/" + name, 256 * 1024)
        with pytest.raises(LocalError) as e:
            client.infer("digits", {"input": ("big", 0, 512 * 64 * 4, [512, 1, 8, 8])})
        assert e.value.status == 413, e.value.message
        assert f"{512 * 64 * 4} bytes from shared-memory region 'big' exceed the {64 * 1024}-byte limit of one " \
               "request (max_body_bytes)" in e.value.message
        client.unregister_region("big")
    finally:
        t.close()
        t.unlink()
    x = np.ascontiguousarray(test_images[0][:4], np.float32)
    assert client.infer("digits", {"input": x})["logits"].shape == (4, 10)


def _flap(path: str, stop_at: float, flapping) -> None:
    """In its own process: truncate a shared-memory object to nothing and regrow it, as fast as it can (``flapping``,
    a multiprocessing.Event, is set once it does)."""
    fd = os.open(path, os.O_RDWR)
    flapping.set()
    try:
        while time.monotonic() < stop_at:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, 64 * 1024)
    finally:
        os.close(fd)


def test_a_client_that_truncates_its_object_while_the_agent_reads_and_writes_it(agent, test_images):
    """A hostile local client races the agent: its object shrinks to nothing and grows back, over and over, while
    its requests name it for the input and the output. A mapped read or write that lands on a vanished page would
    kill the agent with SIGBUS (it did, within a second, when regions were mapped); each request must instead be
    answered, or refused by name as truncated, and the agent keep serving."""
    a, _ = agent
    name = f"edgefleet-local-{uuid.uuid4().hex[:12]}"
    t = shared_memory.SharedMemory(name, create=True, size=64 * 1024)
    x = np.ascontiguousarray(test_images[0][:16], np.float32)
    outcomes: dict[str, int] = {}
    flapper = None
    try:
        with LocalClient(a.local_socket, timeout_s=30) as c:
            c.register_region("flap", "/" + name, 64 * 1024)
            ctx = multiprocessing.get_context("spawn")
            flapping = ctx.Event()
            flapper = ctx.Process(target=_flap, args=(f"/dev/shm/{name}", time.monotonic() + 30, flapping), daemon=True)
            flapper.start()
            # a spawned interpreter takes a while to start (seconds on a busy machine): the race starts when it does
            wait_for(flapping.is_set, 30, "the flapping process at work")
            n = 0
            while n < 3000 and (len(outcomes) < 3 or n < 300):  # bounded: at most 3,000 requests
                n += 1
                try:
                    c.infer("digits", {"input": ("flap", 8192, x.nbytes, list(x.shape))},
                            outputs={"logits": ("flap", 16384, OUT_BYTES)})
                    outcomes["answered"] = outcomes.get("answered", 0) + 1
                except LocalError as e:
                    assert e.status == 400 and "was truncated below region 'flap'" in e.message, e.message
                    kind = "input refused" if e.message.startswith("input") else "output refused"
                    outcomes[kind] = outcomes.get(kind, 0) + 1
            c.unregister_region("flap")
    finally:
        if flapper is not None:
            flapper.kill()
            flapper.join(10)
        t.close()
        t.unlink()
    # the race was run: the object was seen both whole and truncated
    assert outcomes.get("answered", 0) > 0 and outcomes.get("input refused", 0) > 0, outcomes
    assert serves(a.local_socket, x).shape == (16, 10)


def test_a_client_that_goes_away_mid_request_or_mid_frame(agent, client, region, test_images):
    path = agent[0].local_socket
    key, _ = region
    x = np.ascontiguousarray(test_images[0][:1], np.float32)
    body = infer_request("digits", {"input": x})
    for _ in range(20):  # whole requests, then gone before the answers
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        s.sendall(b"".join(wire.pack(wire.INFER, i + 1, body) for i in range(8)))
        s.close()
    with LocalClient(path) as c:  # half a frame, a region, then gone
        c.register_region("left", key, 1024)
        c.send_raw(wire.pack(wire.INFER, 1, body)[:30])
    assert client.infer("digits", {"input": x})["logits"].shape == (1, 10)
    wait_for(lambda: not agent[0].shm._regions, 10, "its region gone with its connection")
    assert not agent[0].shm._regions


def test_a_stalled_frame_times_out(tmp_path, digits_bundle, test_images):
    """A frame that never completes: ERROR 408 after the frame timeout, connection closed."""
    import asyncio

    from edgefleet.agent.core.batching.settings import BatchSettings
    from edgefleet.agent.core.host import ModelHost
    from edgefleet.agent.core.metrics import Metrics
    from edgefleet.agent.transports.local import LocalServer

    async def main():
        srv = LocalServer(ModelHost(BatchSettings(), Metrics()), None, 1024, frame_timeout_s=0.2)
        path = await srv.start(tmp_path / "s.sock")
        r, w = await asyncio.open_unix_connection(str(path))
        w.write(wire.pack(wire.INFER, 1, b"x" * 100)[:20])
        head = await asyncio.wait_for(r.readexactly(16), 10)
        kind, rid, length = wire.unpack_header(head, 1 << 20)
        body = await r.readexactly(length)
        assert await r.read() == b""  # closed
        w.close()
        await srv.stop(1)
        assert not path.exists()
        return kind, rid, body

    kind, rid, body = asyncio.run(main())
    assert (kind, rid) == (wire.ERROR, 0) and struct.unpack_from("<H", body)[0] == 408
    assert b"did not arrive whole within 0.2 s" in body


def test_too_many_connections_get_503(agent, client, test_images):
    path = agent[0].local_socket
    held = []
    try:
        for _ in range(8):
            c = LocalClient(path, timeout_s=5)
            held.append(c)
            c.sock.setblocking(False)
        refused: set[int] = set()  # the connections beyond the limit, answered 503 (polled: no fixed sleep)

        def three_refused() -> bool:
            for k, c in enumerate(held):
                if k in refused:
                    continue
                try:
                    data = c.sock.recv(4096)
                except BlockingIOError:
                    continue
                if data:
                    kind, rid, length = wire.unpack_header(data[:16], 1 << 20)
                    assert kind == wire.ERROR and struct.unpack_from("<H", data, 16)[0] == 503
                    assert b"local_max_connections 6" in data
                    refused.add(k)
            return len(refused) >= 3

        wait_for(three_refused, 30, "three connections refused", interval_s=0.02)
        refused_n = len(refused)
        assert refused_n >= 3  # 6 allowed, one held by the fixture
    finally:
        for c in held:
            c.close()
    x = np.ascontiguousarray(test_images[0][:1], np.float32)
    # the closed connections' slots come back once the agent has seen them go
    wait_for(lambda: serves(path, x).shape == (1, 10), 30, "a connection served again", retry_on=(Exception,))
    assert serves(path, x).shape == (1, 10)


def test_a_file_at_the_socket_path_is_refused(tmp_path):
    import asyncio

    from edgefleet.agent.core.batching.settings import BatchSettings
    from edgefleet.agent.core.host import ModelHost
    from edgefleet.agent.core.metrics import Metrics
    from edgefleet.agent.transports.local import LocalServer

    (tmp_path / "s.sock").write_text("mine")

    async def main():
        await LocalServer(ModelHost(BatchSettings(), Metrics()), None, 1024).start(tmp_path / "s.sock")

    with pytest.raises(OSError, match="exists and is not a socket"):
        asyncio.run(main())
    assert (tmp_path / "s.sock").read_text() == "mine"
