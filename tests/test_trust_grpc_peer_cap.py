"""One peer cannot take the agent's gRPC port from the others (issue 45.1), through a running agent's listener.

Before, gRPC core's own cap (grpc_max_connections) was the only bound: one address that opened that many
connections and sent HTTP/2's preface and SETTINGS (then nothing, held until the idle timeout) left every other
client refused as it connected. Now the agent's gRPC front admits at most ``grpc_max_connections_per_peer`` from
one address, and at the total cap closes the connection idle the longest to make room for a new one.

The healthy client is a plain gRPC channel from 127.0.0.1; the hostile ones bind other loopback addresses
(127.0.0.0/8 is all routed to lo on Linux). A module of its own: grpc.aio binds every live event loop to one
shared poller, so no other agent's loop may be alive beside this one's."""

from __future__ import annotations

import socket

import pytest

from tests.agent_harness import running_agent
from tests.test_trust_grpc_local_conn import EMPTY_SETTINGS, PREFACE, closed_by_server, live, open_fds
from tests.waiting import wait_for

pytest.importorskip("grpc", reason="gRPC needs edgefleet[grpc]")
pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc]")


def handshaken(src: str, port: int) -> socket.socket:
    """A connection from ``src`` that sends HTTP/2's preface and SETTINGS and then nothing (gRPC holds it until its
    idle timeout)."""
    s = socket.socket()
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    try:
        s.sendall(PREFACE + EMPTY_SETTINGS)
    except OSError:  # refused and closed before it went
        pass
    s.setblocking(False)
    return s


@pytest.mark.trust("one address holding the gRPC port's connections")
def test_one_address_at_its_cap_leaves_the_port_to_the_others(tmp_path):
    """127.0.0.2 opens 40 handshaken connections to an agent with grpc_max_connections 16: it keeps at most 8 (the
    per-address share, half the cap by default), the other 32 are closed as they come, and a client on 127.0.0.1 is
    answered beside them, several times on fresh channels. Once 127.0.0.2 leaves, the descriptors return to where
    they were. Before: 127.0.0.2 held all 16 and 127.0.0.1 was refused."""
    with running_agent(tmp_path, grpc_port=0, grpc_max_connections=16, grpc_idle_timeout_s=60) as (a, _url):
        port = a.grpc_port
        assert live(port)
        before = open_fds()
        socks = [handshaken("127.0.0.2", port) for _ in range(40)]
        try:
            wait_for(lambda: sum(closed_by_server(s) for s in socks) >= 32, 30,
                     "the connections past 127.0.0.2's share closed", interval_s=0.2)
            for _ in range(3):
                assert live(port)
            assert sum(closed_by_server(s) for s in socks) <= 32  # its share is held, not churned
        finally:
            for s in socks:
                s.close()
        wait_for(lambda: open_fds() <= before, 30, "the descriptors back to where they were", interval_s=0.2)
        assert live(port)


@pytest.mark.trust("idle gRPC connections from many addresses filling the total cap")
def test_at_the_total_cap_the_idle_longest_makes_room(tmp_path):
    """16 addresses (127.0.0.10-25) hold one handshaken, idle connection each: the total cap of 16, none past its
    share. A new client on 127.0.0.1 is still answered: the connection idle the longest (127.0.0.10's) is closed
    for it. Before: the 17th connection was closed as it was accepted, and the client refused."""
    with running_agent(tmp_path, grpc_port=0, grpc_max_connections=16, grpc_idle_timeout_s=60) as (a, _url):
        port = a.grpc_port
        socks = []
        try:
            for i in range(16):
                socks.append(handshaken(f"127.0.0.{10 + i}", port))
                # each is admitted before the next (so "the oldest" is well defined): the server's SETTINGS came
                wait_for(lambda s=socks[-1]: _got_bytes(s), 10, "the server's SETTINGS", interval_s=0.02)
            assert not any(closed_by_server(s) for s in socks)
            assert live(port)
            wait_for(lambda: closed_by_server(socks[0]), 10, "the idle longest closed for the new client")
            assert not any(closed_by_server(s) for s in socks[2:])
        finally:
            for s in socks:
                s.close()


def _got_bytes(s: socket.socket) -> bool:
    try:
        return bool(s.recv(65536, socket.MSG_PEEK))
    except BlockingIOError:
        return False


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload


def _literal(name: bytes, value: bytes) -> bytes:  # HPACK: a literal header, not indexed, no Huffman coding
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def half_sent_calls(src: str, port: int, n: int) -> socket.socket:
    """A connection from ``src`` that begins ``n`` ModelInfer calls (HEADERS) and never sends their messages."""
    head = b"".join(_literal(k, v) for k, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
        (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"), (b"te", b"trailers")))
    s = socket.socket()
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(PREFACE + EMPTY_SETTINGS + b"".join(_frame(1, 0x4, 2 * i + 1, head) for i in range(n)))  # END_HEADERS
    s.setblocking(False)
    return s


@pytest.mark.trust("gRPC calls whose request message never comes")
def test_half_sent_calls_are_cut_off(tmp_path):
    """127.0.0.3 begins 10 ModelInfer calls and sends none of their messages (within its share, below). Each held a
    slot of the agent's concurrent calls for as long as its client liked (gRPC core sets no deadline on a call's
    request: 200 of them left every other call, health too, RESOURCE_EXHAUSTED). Now a call's message must arrive
    within grpc_handshake_timeout_s (plus a second per 64 KiB of it): the connection is closed, the descriptors
    return, and a client on 127.0.0.1 is answered. Before: never closed."""
    with running_agent(tmp_path, grpc_port=0, grpc_handshake_timeout_s=1) as (a, _url):
        port = a.grpc_port
        before = open_fds()
        s = half_sent_calls("127.0.0.3", port, 10)
        try:
            wait_for(lambda: closed_by_server(s), 30, "the half-sent calls' connection closed", interval_s=0.2)
            assert live(port)
        finally:
            s.close()
        wait_for(lambda: open_fds() <= before, 30, "the descriptors back to where they were", interval_s=0.2)


@pytest.mark.trust("gRPC calls begun and never sent from one address, within their deadline")
def test_one_address_holds_at_most_its_share_of_half_sent_calls(tmp_path):
    """Within the request deadline (60 s here), 127.0.0.3 begins 10 calls on each of 8 connections and sends none:
    80 would hold every slot of the agent's 64 concurrent calls until the deadline. An address may have at most a
    quarter of them (16) begun and unsent: the connection whose call passes that is closed, the first one's 10 stay
    held, and a client on 127.0.0.1 is answered meanwhile. Before: RESOURCE_EXHAUSTED until the deadline."""
    with running_agent(tmp_path, grpc_port=0, grpc_handshake_timeout_s=60) as (a, _url):
        port = a.grpc_port
        socks = [half_sent_calls("127.0.0.3", port, 10) for _ in range(8)]
        try:
            wait_for(lambda: all(closed_by_server(s) for s in socks[2:]), 30, "the connections past the share closed",
                     interval_s=0.2)
            assert live(port)
            assert not closed_by_server(socks[0])
        finally:
            for s in socks:
                s.close()
