"""Connections to the agent's gRPC port and local socket are bounded in time and count (issue 45.1), through the
real listeners of a running agent.

gRPC: before, a TCP connection that never sent HTTP/2's preface was held for gRPC core's default handshake
timeout (120 s: 2,000 of them held 2,000 descriptors for at least 30 s, measured), and one that sent the preface
and SETTINGS and then nothing was held for as long as its client liked (no idle timeout), with no cap on how many.
Now the agent's grpc_handshake_timeout_s, grpc_idle_timeout_s and grpc_max_connections bound them.

Local socket: a second local user (a client dropped to ``nobody``) floods it with connections that send half a
frame and then nothing: it holds at most its share, every other connection is refused and closed at once, the
ones it holds are closed at local_frame_timeout_s, and root is served all along. A module of its own, so that no
other agent's event loop is alive beside its agent's (grpc.aio binds every live loop to one shared poller)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from edgefleet.agent.transports.local_client import LocalClient
from edgefleet.protocol import local as wire
from tests.agent_harness import running_agent
from tests.waiting import wait_for

grpc = pytest.importorskip("grpc", reason="gRPC needs edgefleet[grpc]")
pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc]")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

NOBODY = 65534
REPO = Path(__file__).resolve().parent.parent
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # an HTTP/2 SETTINGS frame with no settings
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a client of another user needs root to drop to nobody")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def closed_by_server(s: socket.socket) -> bool:
    """True once the server has closed ``s`` (EOF or a reset; a GOAWAY frame before it is read past)."""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def live(port: int, metadata: tuple = ()) -> bool:
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        return stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10, metadata=metadata).live
    finally:
        ch.close()


@pytest.mark.trust("connections to the gRPC port that never send a call")
def test_grpc_connections_that_never_call_are_closed(tmp_path):
    """200 connections: half send nothing, half the preface and SETTINGS and then nothing. The agent closes every
    one (past grpc_max_connections at once, the rest at the handshake or idle timeout), its descriptors return to
    where they were, and a healthy client is served; while a hostile client holds connections below the cap, a
    healthy one is served too. Before: none was closed (a 120 s handshake timeout, no idle timeout)."""
    with running_agent(tmp_path, grpc_port=0, grpc_max_connections=16, grpc_handshake_timeout_s=1,
                       grpc_idle_timeout_s=2) as (a, _url):
        port = a.grpc_port
        before = open_fds()
        # 8 of 16 held from another address (its whole share: grpc_max_connections_per_peer is half the cap)
        held = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)) for _ in range(8)]
        try:
            assert live(port)  # a healthy client on 127.0.0.1 is served beside them
        finally:
            for s in held:
                s.close()
        socks = []
        try:
            for i in range(200):
                s = socket.create_connection(("127.0.0.1", port))
                if i % 2:
                    s.sendall(PREFACE + EMPTY_SETTINGS)
                s.setblocking(False)
                socks.append(s)
            wait_for(lambda: sum(closed_by_server(s) for s in socks) == len(socks), 30,
                     "every connection closed by the agent", interval_s=0.2)
        finally:
            for s in socks:
                s.close()
        wait_for(lambda: open_fds() <= before, 10, "the descriptors back to where they were")
        assert live(port)


@pytest.mark.trust("a gRPC call with huge metadata")
def test_grpc_huge_metadata_is_refused_and_the_port_keeps_serving(tmp_path):
    """A call carrying 1 MiB of metadata is refused (not held); the next call is answered."""
    with running_agent(tmp_path, grpc_port=0) as (a, _url):
        with pytest.raises(grpc.RpcError) as err:
            live(a.grpc_port, metadata=(("x-big", "a" * (1 << 20)),))
        assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                                    grpc.StatusCode.UNAVAILABLE), err.value
        assert live(a.grpc_port)


def _flood_as(uid: int, path: str, n: int, out) -> None:
    """As ``uid``: ``n`` connections, each sending half a frame header; report how many the agent closed at once
    and how many it held, then how many of the held ones it closed later (bounded wait)."""
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        socks = []
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            socks.append(s)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused and closed before they went
                s.sendall(wire.pack(wire.INFER, 1, b"x" * 64)[:8])
        for s in socks:
            s.settimeout(0.5)  # the refusal (ERROR 503, then EOF) was written as it was accepted
        refused = [s for s in socks if _eof_within(s)]
        out.put(("flooded", len(socks), len(refused)))
        held = [s for s in socks if s not in refused]
        for s in held:
            s.settimeout(30)
        out.put(("held closed", sum(_eof_within(s) for s in held)))
    except BaseException as exc:  # surfaced to the test
        out.put(("failed", repr(exc)))


def _eof_within(s: socket.socket) -> bool:
    try:
        while True:
            if not s.recv(4096):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


@as_root
@pytest.mark.trust("another local user's half-sent frames on the local socket")
def test_local_socket_half_frames_of_another_user(tmp_path):
    """nobody opens 2,000 connections that send half a frame header and nothing more: it holds its share (4 of 8),
    the other 1,996 are refused and closed at once; root is served beside them; the 4 are closed at
    local_frame_timeout_s."""
    where = Path(tempfile.mkdtemp(prefix="edgefleet-flood-"))  # pytest's own tmp folders are root's alone
    where.chmod(0o755)
    try:
        with running_agent(tmp_path / "agent", local_socket=where / "local.sock", local_max_connections=8,
                           local_frame_timeout_s=5) as (a, _url):
            os.chown(a.local_socket, 0, NOBODY)  # nobody's group may connect (mode 0660), as a second user would
            ctx = multiprocessing.get_context("fork")
            out = ctx.Queue()
            p = ctx.Process(target=_flood_as, args=(NOBODY, str(a.local_socket), 2000, out))
            p.start()
            try:
                got = out.get(timeout=120)
                assert len(got) == 3, got
                what, opened, refused = got
                # 4 held at most (those the frame timeout closed already count as refused here)
                assert (what, opened) == ("flooded", 2000) and refused >= 1996, (what, opened, refused)
                with LocalClient(a.local_socket, timeout_s=10) as c:  # root, beside nobody's 4
                    c.sock.sendall(wire.pack(wire.UNREGISTER, 7, b"{}"))
                    head = c.sock.recv(wire.HEADER.size)
                    assert wire.unpack_header(head, 1 << 20)[:2] == (wire.OK, 7)
                assert out.get(timeout=60) == ("held closed", 2000 - refused)
            finally:
                p.join(30)
                if p.is_alive():
                    p.kill()
    finally:
        shutil.rmtree(where, ignore_errors=True)


AGENT_AT_256_FDS = """
import resource, sys, tempfile, threading
from pathlib import Path
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from tests.agent_harness import running_agent
with running_agent(Path(tempfile.mkdtemp()), grpc_port=0, grpc_handshake_timeout_s=60) as (a, _url):
    print(a.grpc_port, flush=True)
    sys.stdin.readline()
"""


@pytest.mark.trust("connections to the gRPC port past a quarter of the agent's descriptor limit")
def test_grpc_connections_stay_under_a_quarter_of_the_descriptor_limit(tmp_path):
    """An agent with 256 descriptors (grpc_max_connections 256 by default): 300 silent connections leave it at most
    64 descriptors for them (a quarter: 21 connections of three each), the rest closed as accepted, so its other
    listeners and files keep their descriptors; gRPC answers once they are gone. Before: it took connections until
    the table was full (256)."""
    proc = subprocess.Popen([sys.executable, "-c", AGENT_AT_256_FDS], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        fds = Path(f"/proc/{proc.pid}/fd")
        before = len(list(fds.iterdir()))
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            socks.append(s)
        wait_for(lambda: sum(closed_by_server(s) for s in socks) >= 300 - 64, 30, "the connections past the cap closed",
                 interval_s=0.2)
        assert len(list(fds.iterdir())) <= before + 64
        for s in socks:
            s.close()
        wait_for(lambda: len(list(fds.iterdir())) <= before, 30, "the agent's descriptors back to where they were")
        assert live(port)
    finally:
        for s in socks:
            s.close()
        proc.communicate("stop\n", timeout=60)
