"""Connections at the HTTP listeners (issue 45): deadlines, head limits, smuggling and connection caps.

Every shape goes through a real listener on loopback over plain sockets: the agent's (tests/agent_harness.py)
and the fleet's (tests/fleet_harness.py), both held by protocol/httpguard.py. Deadlines are short here (1 s) so
the tests are quick; the waits on them are generous bounds, not thresholds.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from edgefleet.fleet.routes.console import COOKIE
from tests.agent_harness import running_agent
from tests.fleet_harness import running_fleet
from tests.waiting import wait_for

HEALTH = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
HALF_HEAD = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: "
DRIP_GAP_S = 0.2  # between two bytes of a drip-fed body: the pacing under test, not a wait


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def connect(port: int, src: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


def answer(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes (a reset after its answer counts as a close); TimeoutError if
    it keeps the connection open past ``timeout_s``."""
    s.settimeout(timeout_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def ask(port: int, request: bytes, src: str = "127.0.0.1") -> bytes:
    with connect(port, src) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):  # closed before all of it was read: its answer still counts
            pass
        return answer(s)


def held(port: int) -> int:
    """Descriptors this process (where the listener runs) holds for connections accepted on ``port``: its
    sockets whose local end is that port, listening socket aside (/proc/net/tcp: inode by local port)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if int(cols[1].split(":")[1], 16) == port and cols[3] != "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in inodes
        except OSError:  # closed meanwhile
            pass
    return n


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Iterator[int]:
    """A real agent with 1 s deadlines and the default caps."""
    with running_agent(tmp_path_factory.mktemp("agent"), http_head_timeout_s=1.0, http_idle_timeout_s=1.0) as (_, url):
        yield _port(url)


@pytest.fixture(scope="module")
def capped_agent(tmp_path_factory) -> Iterator[int]:
    """A real agent holding at most 8 connections, 4 per address, with deadlines longer than the tests."""
    with running_agent(tmp_path_factory.mktemp("capped"), http_max_connections=8, http_max_connections_per_peer=4,
                       http_head_timeout_s=60.0) as (_, url):
        yield _port(url)


@pytest.mark.trust("HTTP: half-sent request heads and silent connections held open")
def test_a_head_that_never_ends_is_closed_at_its_deadline(agent):
    half = [connect(agent) for _ in range(40)]
    silent = [connect(agent) for _ in range(40)]
    for s in half:
        s.sendall(HALF_HEAD)
    answers = [answer(s) for s in half + silent]  # TimeoutError: still open 10 s later
    assert [status(a) for a in answers[:40]] == [408] * 40
    assert answers[40:] == [b""] * 40  # nothing asked, nothing answered: closed
    for s in half + silent:
        s.close()
    wait_for(lambda: held(agent) == 0, 10, "the agent's descriptors for them closed")
    assert status(ask(agent, HEALTH)) == 200


@pytest.mark.trust("HTTP: a drip-fed request body")
def test_a_drip_fed_body_ends(agent):
    with connect(agent) as s:
        s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        s.settimeout(0.01)
        closed = False
        for _ in range(100):  # 100 bytes over 20 s at most
            try:
                s.sendall(b" ")
                if s.recv(65536):
                    closed = True
                    break
            except TimeoutError:
                time.sleep(DRIP_GAP_S)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, "the body was still being taken 20 s later"


@pytest.mark.trust("HTTP: request heads over 64 KiB, in one value or many lines, and 150 header lines")
@pytest.mark.parametrize("head", [
    b"X-Big: " + b"a" * 70 * 1024 + b"\r\n",
    b"".join(b"X-Line-%d: %s\r\n" % (i, b"b" * 900) for i in range(80)),
    b"".join(b"X-%d: 1\r\n" % i for i in range(150)),
], ids=["one-value", "many-lines", "150-headers"])
def test_a_head_over_the_limit_gets_431_and_a_close(agent, head):
    raw = ask(agent, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
    assert status(raw) == 431, raw[:200]
    assert status(ask(agent, HEALTH)) == 200


@pytest.mark.trust("HTTP: request smuggling")
@pytest.mark.parametrize("headers", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    b"Content-Length: 5\r\nContent-Length: 6\r\n",
    b"Content-Length: 5, 5\r\n",
    b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked, identity\r\n",
], ids=["cl-te", "te-cl", "two-cl", "cl-list", "two-te", "te-not-last"])
def test_smuggling_shapes_get_400_and_a_close(agent, headers):
    raw = ask(agent, b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n0\r\n\r\n"
                     b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status(raw) == 400, raw[:200]
    assert raw.count(b"HTTP/1.1 ") == 1  # the request behind it never ran


@pytest.mark.trust("HTTP: a chunk-size line of endless extensions")
def test_a_chunk_size_line_over_4_KiB_gets_400(agent):
    raw = ask(agent, b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5;" + b"e" * 10_000)
    assert status(raw) == 400, raw[:200]


@pytest.mark.trust("HTTP: a client that pipelines requests and never reads the answers")
def test_a_client_that_stops_reading_is_closed(agent):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind(("127.0.0.4", 0))
    s.connect(("127.0.0.1", agent))
    s.settimeout(5)
    with s:
        request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
        try:
            for _ in range(2000):  # answers of ~20 KB each, none read: the agent's buffer fills
                s.sendall(request * 10)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):  # it stopped reading, or closed
            pass
        wait_for(lambda: held(agent) == 0, 15, "the agent's side closed")


@pytest.mark.trust("HTTP: one address holding its connection cap")
def test_the_per_address_cap_holds_while_others_are_served(capped_agent):
    holding = [connect(capped_agent) for _ in range(4)]
    try:
        assert status(ask(capped_agent, HEALTH)) == 503  # a fifth from the same address
        assert status(ask(capped_agent, HEALTH, src="127.0.0.2")) == 200  # another address is served
        extra = [connect(capped_agent) for _ in range(30)]  # 30 more: refused at once, none held
        assert [answer(s)[:12] for s in extra] == [b"HTTP/1.1 503"] * 30
        assert held(capped_agent) == 4
        for s in extra:
            s.close()
    finally:
        for s in holding:
            s.close()
    wait_for(lambda: held(capped_agent) == 0, 10, "the agent's descriptors for them closed")
    wait_for(lambda: status(ask(capped_agent, HEALTH)) == 200, 10, "the address served again once it left")


@pytest.mark.trust("HTTP: idle connections from many addresses up to the total cap")
def test_at_the_total_cap_the_longest_idle_connection_makes_room(capped_agent):
    holding = [connect(capped_agent, src) for src in ("127.0.0.1", "127.0.0.2") for _ in range(4)]
    try:
        with connect(capped_agent) as s:  # keeps 127.0.0.1's count: it is refused at its own cap, evicting none
            assert status(answer(s)) == 503
        assert status(ask(capped_agent, HEALTH, src="127.0.0.3")) == 200  # a ninth, from elsewhere: served
        assert answer(holding[0]) == b""  # the longest idle one was closed for it
        for s in holding[1:]:  # the others are still open
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in holding:
            s.close()


@pytest.mark.trust("HTTP: busy connections from many addresses up to the total cap")
def test_the_total_cap_holds_when_no_connection_is_idle(capped_agent):
    holding = [connect(capped_agent, src) for src in ("127.0.0.1", "127.0.0.2") for _ in range(4)]
    try:
        for s in holding:  # each has begun a request: none is idle
            s.sendall(HALF_HEAD)
        assert status(ask(capped_agent, HEALTH, src="127.0.0.3")) == 503
    finally:
        for s in holding:
            s.close()
    wait_for(lambda: status(ask(capped_agent, HEALTH, src="127.0.0.3")) == 200, 10, "served again")


@pytest.mark.trust("HTTP: WebSocket upgrades leaving the guard's count behind")
def test_a_websocket_upgrade_is_not_taken_and_frees_its_place(capped_agent):
    upgrade = (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    for i in range(12):  # more than the cap of 8: each must give its place back when it closes
        with connect(capped_agent, f"127.0.0.{10 + i}") as s:
            s.sendall(upgrade)
            s.settimeout(10)
            assert not s.recv(64).startswith(b"HTTP/1.1 101"), "upgraded to a WebSocket"
    wait_for(lambda: status(ask(capped_agent, HEALTH, src="127.0.0.3")) == 200, 10, "still served")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[int]:
    with running_fleet(tmp_path_factory.mktemp("fleet"), None, http_max_connections_per_peer=4,
                       http_head_timeout_s=1.0) as (_, url):
        yield _port(url)


FLEET_HEALTH = b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.mark.trust("fleet HTTP: one address holding its cap, a half-sent head, a 70 KiB head")
def test_the_fleet_listener_holds_the_same_limits(fleet):
    holding = [connect(fleet) for _ in range(4)]
    try:
        assert status(ask(fleet, FLEET_HEALTH)) == 503
        assert status(ask(fleet, FLEET_HEALTH, src="127.0.0.2")) == 200
    finally:
        for s in holding:
            s.close()
    assert status(ask(fleet, b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n")) == 408
    assert status(ask(fleet, b"GET /api/v1/health HTTP/1.1\r\nX-Big: " + b"a" * 70 * 1024 + b"\r\n\r\n")) == 431
    wait_for(lambda: held(fleet) == 0, 10, "the fleet's descriptors for them closed")


@pytest.mark.trust("console: framing, type sniffing, scripts")
def test_console_pages_and_the_api_forbid_framing_sniffing_and_scripts(fleet):
    import httpx

    from tests.fleet_harness import api

    base = f"http://127.0.0.1:{fleet}"
    answers = {"login page": httpx.get(f"{base}/"),
               "signed in": httpx.get(f"{base}/", headers={"Cookie": f"{COOKIE}={api.token}"}),
               "health": httpx.get(f"{base}/api/v1/health"), "unknown": httpx.get(f"{base}/nowhere")}
    assert answers["signed in"].status_code == 200 and "rollout" in answers["signed in"].text
    for what, r in answers.items():
        assert r.headers.get("x-frame-options") == "DENY", what
        assert r.headers.get("x-content-type-options") == "nosniff", what
        csp = r.headers.get("content-security-policy", "")
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp and "script-src" not in csp, what
    for what in ("login page", "signed in"):
        assert "<script" not in answers[what].text.lower(), what
    too_large = ask(fleet, b"POST /api/v1/tokens HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
    assert status(too_large) == 413 and too_large.count(b"HTTP/1.1 ") == 1, too_large
    too_large = too_large.lower()
    assert b"x-frame-options: deny" in too_large and b"nosniff" in too_large


@pytest.mark.trust("HTTP: a chunk-size line or trailers grown after many small chunks")
@pytest.mark.parametrize("tail", [b"1;" + b"e" * 10_000, b"0\r\n" + b"X-T: " + b"t" * 10_000],
                         ids=["long-line", "long-trailers"])
def test_small_chunks_earn_no_room_for_a_long_line_later(agent, tail):
    with connect(agent) as s:
        s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + b"1\r\n \r\n" * 50)
        time.sleep(DRIP_GAP_S)  # the next bytes in a read of their own: the pacing under test, not a wait
        s.sendall(tail)
        raw = answer(s)
    assert status(raw) == 400, raw[:200]


def test_pipelined_requests_with_bodies_are_all_answered(agent):
    body = b'{"ready": false}'
    one = b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    chunked = (b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
    raw = ask(agent, (one + chunked) * 20 + HEALTH)
    assert raw.count(b"HTTP/1.1 200 OK") == 41, raw[:300]


def test_a_head_in_small_pieces_is_read_whole(agent):
    with connect(agent) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(0, len(HEALTH), 3):  # its end (CRLF CRLF) split across two sends as well
            s.sendall(HEALTH[i:i + 3])
            time.sleep(0.005)  # pacing: each piece in a read of its own, not a wait
        assert status(answer(s)) == 200
