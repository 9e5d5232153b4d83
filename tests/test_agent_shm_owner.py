"""System shared memory and other users on the box (agent/transports/peer.py): a client may make the agent read or write
an object only as far as the client's own user could. Before this, any process that reached the agent's loopback
port -- every local user does -- could register another user's object (one the agent's user may open) and have
the agent read it as an input or write outputs into it.

The refusals need a client running as another user than the agent's, so those tests run a client process that
drops to ``nobody`` (they need root to do so, and skip otherwise, saying why)."""

import contextlib
import json
import multiprocessing
import os
import socket
import threading
import uuid
from contextlib import contextmanager
from multiprocessing import shared_memory

import httpx
import numpy as np
import pytest

from edgefleet.agent.errors import RequestError
from edgefleet.agent.transports.peer import Peer, tcp_peer
from edgefleet.agent.transports.shm import SharedMemory
from tests.agent_harness import preinstall, running_agent

NOBODY = 65534
IN_BYTES = 4 * 64 * 4  # 4 digits images, FP32
OUT_BYTES = 4 * 10 * 4

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a client of another user needs root to drop to nobody")


@pytest.fixture(scope="module")
def agent(tmp_path_factory, digits_bundle):
    data = tmp_path_factory.mktemp("agent")
    preinstall(data, digits_bundle)
    with running_agent(data, max_shm_regions_per_client=8, max_shm_regions=8, max_shm_bytes=1024 * 1024) as (a, url):
        yield a, url


@pytest.fixture
def objects():
    made = []

    def make(owner: int = 0, mode: int = 0o600) -> tuple[str, shared_memory.SharedMemory]:
        name = f"edgefleet-owner-{uuid.uuid4().hex[:12]}"
        r = shared_memory.SharedMemory(name, create=True, size=64 * 1024)
        os.chown(f"/dev/shm/{name}", owner, owner)
        os.chmod(f"/dev/shm/{name}", mode)
        made.append(r)
        return "/" + name, r

    yield make
    for r in made:
        r.close()
        try:
            r.unlink()
        except FileNotFoundError:
            pass


def _post_as(uid: int, port: int, path: str, body: bytes, headers: dict[str, str], out) -> None:
    """In a child process: drop to ``uid`` (and its group), POST over plain loopback TCP, put (status, body)."""
    _request_as(uid, port, "POST", path, body, headers, out)


def post_as(uid: int, url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    ctx = multiprocessing.get_context("fork")  # fork: nothing to import after dropping to nobody
    out = ctx.Queue()
    p = ctx.Process(target=_post_as, args=(uid, int(url.rsplit(":", 1)[1]), path, body, headers or {}, out))
    p.start()
    try:
        return out.get(timeout=60)
    finally:
        p.join(30)


def register_as(uid: int, url: str, region: str, key: str) -> tuple[int, str]:
    status, body = post_as(uid, url, f"/v2/systemsharedmemory/region/{region}/register",
                           json.dumps({"key": key, "offset": 0, "byte_size": 64 * 1024}).encode())
    return status, body.decode(errors="replace")


def infer_as(uid: int, url: str, x: np.ndarray, out_region: str | None) -> tuple[int, bytes]:
    raw = x.tobytes()
    doc: dict = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                             "parameters": {"binary_data_size": len(raw)}}]}
    if out_region is not None:
        doc["outputs"] = [{"name": "logits", "parameters": {"shared_memory_region": out_region,
                                                            "shared_memory_byte_size": OUT_BYTES}}]
    head = json.dumps(doc).encode()
    return post_as(uid, url, "/v2/models/digits/infer", head + raw,
                   {"Inference-Header-Content-Length": str(len(head))})


@as_root
def test_another_users_object_is_refused_over_http(agent, objects, test_images):
    """nobody names root's private object: refused by name, nothing registered, the object untouched."""
    a, url = agent
    key, r = objects(owner=0, mode=0o600)
    r.buf[:8] = b"private!"
    status, body = register_as(NOBODY, url, "theirs", key)
    assert status == 400 and f"this client (uid {NOBODY}) may not read {key!r}" in body, (status, body)
    assert "owner uid 0" in body and "mode 600" in body
    assert all(reg["name"] != "theirs" for reg in a.shm.status())
    assert bytes(r.buf[:8]) == b"private!"


@as_root
def test_an_object_others_may_read_but_not_write_takes_no_outputs(agent, objects, test_images):
    """root's 0644 object: nobody may use it as an input, but the agent writes no output into it for nobody."""
    a, url = agent
    key, r = objects(owner=0, mode=0o644)
    x = np.ascontiguousarray(test_images[0][:4], np.float32)
    try:
        status, body = register_as(NOBODY, url, "readonly", key)
        assert status == 200, body
        before = bytes(r.buf[:OUT_BYTES])
        status, answer = infer_as(NOBODY, url, x, "readonly")
        assert status == 400, answer
        assert f"this client (uid {NOBODY}) may not write it" in answer.decode(), answer
        assert bytes(r.buf[:OUT_BYTES]) == before
    finally:
        a.shm.unregister("readonly")


@as_root
def test_a_clients_own_object_takes_its_outputs(agent, objects, test_images):
    """nobody's own object: registered and written, the same logits as an answer in the body."""
    a, url = agent
    key, r = objects(owner=NOBODY, mode=0o600)
    x = np.ascontiguousarray(test_images[0][:4], np.float32)
    try:
        status, body = register_as(NOBODY, url, "mine", key)
        assert status == 200, body
        status, answer = infer_as(NOBODY, url, x, "mine")
        assert status == 200, answer
        status, plain = infer_as(NOBODY, url, x, None)
        assert status == 200
        want = json.loads(plain)["outputs"][0]["data"]
        got = np.frombuffer(bytes(r.buf[:OUT_BYTES]), np.float32)
        assert np.array_equal(got, np.asarray(want, np.float32)), (got[:4], want[:4])
    finally:
        a.shm.unregister("mine")


def test_a_client_the_agent_cannot_tell_registers_nothing(tmp_path):
    """Not a loopback connection of this box (or not found in /proc/net): no regions, by name."""
    key = f"/edgefleet-owner-{uuid.uuid4().hex[:12]}"
    h = shared_memory.SharedMemory(key[1:], create=True, size=4096)
    try:
        reg = SharedMemory()
        with pytest.raises(RequestError, match="shared-memory regions are for processes on this box"):
            reg.register("x", key, 0, 4096, "10.0.0.5", tcp_peer("10.0.0.5", 40000, 8000))
        with pytest.raises(RequestError, match="shared-memory regions are for processes on this box"):
            reg.register("x", key, 0, 4096, "127.0.0.1", tcp_peer("127.0.0.1", 1, 2))  # no such connection
        assert reg.status() == []
    finally:
        h.close()
        h.unlink()


def test_a_loopback_connection_is_told_by_its_own_socket():
    """The uid of a real loopback connection's client end, over IPv4 and IPv6 where the box has it."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            srv = socket.socket(family)
            srv.bind((host, 0))
        except OSError:
            continue  # no IPv6 loopback here
        with srv:
            srv.listen(1)
            with socket.create_connection((host, srv.getsockname()[1]), timeout=5) as c:
                conn, addr = srv.accept()
                with conn:
                    assert c.getsockname()[:2] == addr[:2]  # the client's end, as the server sees it
                    assert tcp_peer(addr[0], addr[1], srv.getsockname()[1]).uid == os.geteuid()
                    # the same client port towards another server port is no connection of this box
                    assert tcp_peer(addr[0], addr[1], srv.getsockname()[1] ^ 1).uid is None


@pytest.mark.parametrize(("owner", "group", "mode", "want"), [
    (1000, 1000, 0o600, (True, True)),  # its own
    (1000, 1000, 0o400, (True, False)),
    (2000, 1000, 0o640, (True, False)),  # its group's
    (2000, 3000, 0o660, (False, False)),  # neither
    (2000, 3000, 0o604, (True, False)),  # anyone's to read
    (2000, 3000, 0o666, (True, True)),
])
def test_the_kernels_rule_for_a_user(owner, group, mode, want):
    st = os.stat_result((0o100000 | mode, 0, 0, 1, owner, group, 0, 0, 0, 0))
    assert Peer(1000, frozenset({1000})).may(st) == want
    assert Peer(0).may(st) == (True, True)
    assert Peer(None).may(st) == (False, False)


# -- every use of a region answers to its owner (issue 30, finding 5) ------------------------------------
def _request_as(uid: int, port: int, method: str, path: str, body: bytes, headers: dict[str, str], out) -> None:
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n{head}"
                      f"Connection: close\r\n\r\n".encode() + body)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        out.put((int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]))
    except BaseException as exc:  # surfaced to the test
        out.put((0, repr(exc).encode()))


def request_as(uid: int, url: str, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None) -> tuple[int, str]:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_request_as, args=(uid, int(url.rsplit(":", 1)[1]), method, path, body, headers or {},
                                              out))
    p.start()
    try:
        status, raw = out.get(timeout=60)
        return status, raw.decode(errors="replace")
    finally:
        p.join(30)


def _infer_doc(x: np.ndarray, in_region: str | None, out_region: str | None) -> tuple[bytes, dict[str, str]]:
    raw = x.tobytes()
    inp: dict = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    if in_region is None:
        inp["parameters"] = {"binary_data_size": len(raw)}
    else:
        inp["parameters"] = {"shared_memory_region": in_region, "shared_memory_byte_size": len(raw)}
    doc: dict = {"inputs": [inp]}
    if out_region is not None:
        doc["outputs"] = [{"name": "logits", "parameters": {"shared_memory_region": out_region,
                                                            "shared_memory_byte_size": OUT_BYTES,
                                                            "shared_memory_offset": 32 * 1024}}]
    head = json.dumps(doc).encode()
    if in_region is None:
        return head + raw, {"Inference-Header-Content-Length": str(len(head))}
    return head, {"Content-Type": "application/json"}


def _images_in(region, test_images) -> np.ndarray:
    """Four test images written at the start of ``region`` (a SharedMemory): -> them."""
    x = np.ascontiguousarray(test_images[0][:4], np.float32)
    region.buf[:x.nbytes] = x.tobytes()
    return x


def _register(url: str, name: str, key: str) -> int:
    """This process (root) registers the object ``key`` as region ``name`` over HTTP: -> the status code."""
    return httpx.post(f"{url}/v2/systemsharedmemory/region/{name}/register",
                      json={"key": key, "offset": 0, "byte_size": 64 * 1024}).status_code


@as_root
def test_another_users_region_is_refused_for_every_use_over_http(agent, objects, test_images):
    """root registers its private (0600) object; nobody, over plain loopback HTTP, may not see it in a listing,
    ask its status, read it as an input, have outputs written into it or unregister it (one by name or all):
    each refused with 403 by name, the object and the registration untouched. root's own use still works."""
    a, url = agent
    key, r = objects(owner=0, mode=0o600)
    x = _images_in(r, test_images)
    assert _register(url, "private", key) == 200
    try:
        before = bytes(r.buf)
        status, body = request_as(NOBODY, url, "GET", "/v2/systemsharedmemory/status")
        assert status == 200 and "private" not in body, body  # a listing leaves it out
        status, body = request_as(NOBODY, url, "GET", "/v2/systemsharedmemory/region/private/status")
        assert status == 403 and "registered by another user (uid 0)" in body, (status, body)
        assert f"this client (uid {NOBODY}) may not read {key!r}" in body and "mode 600" in body
        content, headers = _infer_doc(x, "private", None)
        status, body = request_as(NOBODY, url, "POST", "/v2/models/digits/infer", content, headers)
        assert status == 403 and "shared-memory region 'private' was registered by another user" in body, body
        content, headers = _infer_doc(x, None, "private")
        status, body = request_as(NOBODY, url, "POST", "/v2/models/digits/infer", content, headers)
        assert status == 403 and f"this client (uid {NOBODY}) may not write {key!r}" in body, body
        status, body = request_as(NOBODY, url, "POST", "/v2/systemsharedmemory/region/private/unregister")
        assert status == 403 and "only the user who registered it (uid 0)" in body, (status, body)
        status, body = request_as(NOBODY, url, "POST", "/v2/systemsharedmemory/unregister")
        assert status == 200  # "all": all of nobody's own, none here
        assert [s["name"] for s in a.shm.status("private")] == ["private"]
        assert bytes(r.buf) == before
        # root's own use: input from the region, output into it, over HTTP from this process
        content, headers = _infer_doc(x, "private", "private")
        answer = httpx.post(f"{url}/v2/models/digits/infer", content=content, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        plain, headers = _infer_doc(x, None, None)
        want = httpx.post(f"{url}/v2/models/digits/infer", content=plain, headers=headers, timeout=30).json()
        got = np.frombuffer(bytes(r.buf[32 * 1024:32 * 1024 + OUT_BYTES]), np.float32)
        assert np.array_equal(got, np.asarray(want["outputs"][0]["data"], np.float32))
        listed = httpx.get(f"{url}/v2/systemsharedmemory/status").json()
        assert [s["name"] for s in listed] == ["private"]
    finally:
        assert httpx.post(f"{url}/v2/systemsharedmemory/region/private/unregister").status_code == 200
    assert a.shm.status() == []


@as_root
def test_a_region_others_may_read_is_theirs_to_read_not_to_write(agent, objects, test_images):
    """The kernel's rule, for a user who did not register the region: root's 0644 object may be nobody's input
    (nobody could read it itself) and listed to it, but takes no output of nobody's and is not nobody's to
    unregister."""
    a, url = agent
    key, r = objects(owner=0, mode=0o644)
    x = _images_in(r, test_images)
    assert _register(url, "shared", key) == 200
    try:
        status, body = request_as(NOBODY, url, "GET", "/v2/systemsharedmemory/status")
        assert status == 200 and '"shared"' in body
        content, headers = _infer_doc(x, "shared", None)
        status, body = request_as(NOBODY, url, "POST", "/v2/models/digits/infer", content, headers)
        assert status == 200, body
        before = bytes(r.buf)
        content, headers = _infer_doc(x, None, "shared")
        status, body = request_as(NOBODY, url, "POST", "/v2/models/digits/infer", content, headers)
        assert status == 403 and f"may not write {key!r}" in body, body
        assert bytes(r.buf) == before
        status, body = request_as(NOBODY, url, "POST", "/v2/systemsharedmemory/region/shared/unregister")
        assert status == 403, body
    finally:
        a.shm.unregister("shared")


def _connect_as(uid: int, port: int, chan: socket.socket) -> None:
    """In a child process: drop to ``uid``, connect to 127.0.0.1:``port`` and hand the socket over ``chan``."""
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        s = socket.create_connection(("127.0.0.1", port), timeout=20)
        socket.send_fds(chan, [b"fd"], [s.fileno()])
    except BaseException as exc:  # surfaced to the test: no fd arrives
        chan.sendall(repr(exc).encode())


@contextmanager
def relay_as(uid: int, port: int):
    """A loopback port whose one connection is relayed over a socket that ``uid`` connected to ``port``: the
    server sees that user's socket (its uid is the socket's, whoever writes into it later), while the client
    library runs here (gRPC cannot run in a forked child, nor this venv's Python as nobody)."""
    ctx = multiprocessing.get_context("fork")
    mine, theirs = socket.socketpair()
    p = ctx.Process(target=_connect_as, args=(uid, port, theirs))
    p.start()
    _msg, fds, _flags, _addr = socket.recv_fds(mine, 1024, 1)
    p.join(30)
    assert fds, _msg
    upstream = socket.socket(fileno=fds[0])
    upstream.settimeout(None)
    listener = socket.create_server(("127.0.0.1", 0))

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        conn, _ = listener.accept()
        threading.Thread(target=pipe, args=(conn, upstream), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        upstream.close()


@as_root
def test_another_users_region_is_refused_over_grpc(tmp_path, digits_bundle, objects):
    """The same registry over gRPC, from a socket nobody connected: root's region is not in nobody's listing,
    and a status, an infer and an unregister naming it are PERMISSION_DENIED, by name."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    key, _r = objects(owner=0, mode=0o600)
    with running_agent(data, grpc_port=0) as (a, url):
        assert _register(url, "private", key) == 200
        with relay_as(NOBODY, a.grpc_port) as port:
            c = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                assert list(c.get_system_shared_memory_status().regions) == []
                x = grpcclient.InferInput("input", [4, 1, 8, 8], "FP32")
                x.set_shared_memory("private", IN_BYTES)
                for call in (lambda: c.get_system_shared_memory_status("private"),
                             lambda: c.infer("digits", [x]),
                             lambda: c.unregister_system_shared_memory("private")):
                    with pytest.raises(InferenceServerException) as err:
                        call()
                    assert "PERMISSION_DENIED" in str(err.value.status()), err.value
                    assert "registered by another user (uid 0)" in err.value.message()
            finally:
                c.close()
        assert [s["name"] for s in a.shm.status()] == ["private"]


def test_a_closed_connection_is_nobodys():
    """A connection closed on both sides leaves its client end in TIME_WAIT, which the kernel lists with uid 0:
    it must not be taken for root's (a client that closes right after its request would be told as root)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    with srv:
        c = socket.create_connection(srv.getsockname(), timeout=5)
        conn, addr = srv.accept()
        c.close()  # the client closes first: its end goes to TIME_WAIT once the server closes too
        assert conn.recv(1) == b""
        conn.close()
        port = srv.getsockname()[1]
        assert tcp_peer(addr[0], addr[1], port, "127.0.0.1").uid is None
        assert tcp_peer(addr[0], addr[1], port).uid is None  # the server address not given
