"""The embedded broker's connections are bounded in time, count and memory (issue 45, findings 1, 2 and 4),
tried through its real listener with hand-built packets (paho answers a PUBREC with a PUBREL by itself):

- a connection that ends before its CONNECT (nothing, half a CONNECT, 4 bytes of garbage) gives its
  descriptor back at once, with the cyclic GC off (the fleet freezes its heap and runs it rarely);
- a connection that sends no CONNECT is closed at the CONNECT deadline, a connected one that goes silent
  at its idle timeout;
- one address at its cap gets each further connection closed at once while another client connects; the
  total cap likewise, and a freed slot is taken again;
- a QoS 2 publish to a topic the ACL forbids is dropped unread when it is received (acknowledged, as
  Mosquitto does), its packet id counting in flight until released, so a flood of them that is never
  released ends the connection at the in-flight cap, as do QoS 2 publishes on an allowed topic; nothing of
  them is held after the device left, and the fleet's retained desired state still reaches a healthy device;
- a saved session (clean session false) expires;
- an MQTT 5 CONNECT is refused (amqtt speaks 3.1.1 only) and closed.

Absence is proven by counts (descriptors in /proc, messages the broker holds) or by the broker closing the
socket (end of stream) within a bounded wait, never by a sleep.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator

import pytest

from bench.mqtt_probe import (
    connect_packet,
    fd_count,
    pre_connect_cycles,
    publish_packet,
    raw_connect,
    subscribe_packet,
)
from edgefleet.fleet.acl import FLEET_USER, Account, ActiveAccounts, hash_password
from edgefleet.fleet.broker import EmbeddedBroker
from edgefleet.fleet.broker_limits import BrokerLimits
from edgefleet.protocol import mqtt as proto
from tests.conftest import free_port
from tests.waiting import recv_until, wait_for

DEVICE, PASSWORD, FLEET_PASSWORD = "edge-a", "device-secret", "fleet-secret"
WAIT_S = 20.0
KIB250 = b"x" * (250 * 1024)


def _closed_by_peer(s: socket.socket, timeout_s: float = WAIT_S) -> bool:
    """True if the broker ends the connection (end of stream or reset) within ``timeout_s``."""
    s.settimeout(timeout_s)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.fixture
def broker() -> Iterator[Callable[..., tuple[EmbeddedBroker, int]]]:
    started: list[EmbeddedBroker] = []

    def start(**limits: object) -> tuple[EmbeddedBroker, int]:
        accounts = ActiveAccounts()
        accounts.update([Account(DEVICE, hash_password(PASSWORD)), Account("edge-b", hash_password(PASSWORD)),
                         Account(FLEET_USER, hash_password(FLEET_PASSWORD))])
        port = free_port()
        b = EmbeddedBroker("127.0.0.1", port, accounts, limits=BrokerLimits(**limits))  # type: ignore[arg-type]
        b.start()
        started.append(b)
        return b, port

    yield start
    for b in started:
        b.stop()


@pytest.mark.trust("connections that end before their CONNECT keep their descriptors")
def test_connections_that_end_before_connect_give_their_descriptors_back(broker):
    b, port = broker()
    pid = os.getpid()
    raw_connect(port, DEVICE, DEVICE, PASSWORD).close()  # the broker's lazily made state exists before the baseline
    wait_for(lambda: b.held()["connections"] == 0, WAIT_S, "the first connection closed")
    baseline = fd_count(pid)
    gc.collect()
    gc.disable()  # what the fleet's gc.freeze() and 50,000 threshold make of the cyclic GC
    try:
        pre_connect_cycles(port, 600)  # nothing, half a CONNECT, 4 bytes of garbage, 200 each

        def back() -> tuple[int, int] | None:
            # Both at once: the count of descriptors alone can meet the baseline while the last connections are
            # still being handled, when a descriptor of something else in this process closed meanwhile.
            fds, connections = fd_count(pid), b.held()["connections"]
            return (fds, connections) if fds <= baseline and connections == 0 else None

        fds, connections = wait_for(back, WAIT_S,
                                    f"descriptors back to the baseline of {baseline} and no connection held")
    finally:
        gc.enable()
    assert fds <= baseline
    assert connections == 0


@pytest.mark.trust("a connection that never sends its CONNECT stays open")
@pytest.mark.parametrize("sends", [b"", connect_packet(DEVICE, DEVICE, PASSWORD)[:9]], ids=["nothing", "half"])
def test_a_connection_without_its_connect_is_closed_at_the_deadline(broker, sends: bytes):
    b, port = broker(connect_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(sends)
        assert _closed_by_peer(s), "the broker kept a connection that sent no CONNECT"
    wait_for(lambda: b.held()["connections"] == 0, WAIT_S, "the connection forgotten")


@pytest.mark.trust("a connected client that sends nothing is kept forever")
def test_a_silent_connected_client_is_closed_at_its_idle_timeout(broker):
    _, port = broker(max_keepalive_s=1)  # a keepalive of 0 ("never") gets 1 s: closed after 1.5 s of silence
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(connect_packet(DEVICE, DEVICE, PASSWORD, keepalive=0))
    assert s.recv(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
    assert _closed_by_peer(s), "a silent client was kept past its idle timeout"
    s.close()


@pytest.mark.trust("one address holds connections until the fleet runs out of descriptors")
def test_one_address_at_its_cap_is_refused_while_another_client_connects(broker):
    b, port = broker(max_handshakes_per_peer=4, connect_timeout_s=60.0)
    held = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)) for _ in range(4)]
    try:
        wait_for(lambda: b.held()["connections"] == 4, WAIT_S, "4 connections from 127.0.0.2 admitted")
        extra = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
        assert _closed_by_peer(extra), "a fifth connection from 127.0.0.2 was kept"
        extra.close()
        healthy = raw_connect(port, DEVICE, DEVICE, PASSWORD)  # from 127.0.0.1, while 127.0.0.2 is at its cap
        healthy.close()
        assert b.held()["refused"] >= 1
    finally:
        for s in held:
            s.close()


@pytest.mark.trust("connections beyond the descriptor limit")
def test_the_total_cap_refuses_at_once_and_a_freed_slot_is_taken_again(broker):
    b, port = broker(max_connections=6, max_handshakes_per_peer=3, connect_timeout_s=60.0)
    held = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + i // 3}", 0))
            for i in range(6)]
    try:
        wait_for(lambda: b.held()["connections"] == 6, WAIT_S, "6 connections admitted")
        extra = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.9", 0))
        assert _closed_by_peer(extra), "a connection over the total cap was kept"
        extra.close()
        held.pop().close()
        wait_for(lambda: b.held()["connections"] == 5, WAIT_S, "the closed connection's slot freed")
        raw_connect(port, DEVICE, DEVICE, PASSWORD).close()
    finally:
        for s in held:
            s.close()


def _flood(port: int, topic: str, count: int, clean: bool = True) -> int:
    """QoS 2 publishes of 250 KiB never released (no PUBREL); how many went out before the broker hung up."""
    s = raw_connect(port, DEVICE, DEVICE, PASSWORD, clean=clean)
    sent = 0
    try:
        for i in range(count):
            s.sendall(publish_packet(topic, KIB250, qos=2, packet_id=i + 1))
            sent += 1
    except OSError:
        pass
    finally:
        s.close()
    return sent


@pytest.mark.trust("a device parks QoS 2 messages to a forbidden topic in the broker")
def test_a_qos2_flood_to_a_forbidden_topic_is_refused_when_received(broker):
    b, port = broker(max_inflight_messages=5)
    fleet = raw_connect(port, "edgefleet-fleet-1", FLEET_USER, FLEET_PASSWORD)
    fleet.sendall(publish_packet(proto.topic("edge-b", "desired"), b"for b", qos=1, retain=True))
    assert fleet.recv(4) == b"\x40\x02\x00\x01"  # PUBACK: the broker holds it
    sent = _flood(port, proto.topic("edge-b", "desired"), 400)
    assert sent < 400, "the broker took 400 x 250 KiB QoS 2 publishes to a forbidden topic"
    wait_for(lambda: b.held()["connections"] == 1, WAIT_S, "the device's connection closed")
    held = b.held()
    assert held["inflight_in"] == 0 and held["inflight_in_bytes"] == 0, held
    # the fleet's retained desired state still reaches the device it is for
    victim = raw_connect(port, "edge-b", "edge-b", PASSWORD)
    victim.sendall(subscribe_packet(proto.topic("edge-b", "desired")))
    victim.settimeout(WAIT_S)
    recv_until(victim, lambda got: b"for b" in got, "edge-b was disconnected before its desired state came", size=4096)
    victim.close()
    fleet.close()


@pytest.mark.trust("a device parks QoS 2 messages it never releases in the broker")
def test_qos2_publishes_never_released_are_capped_and_go_with_the_device(broker):
    b, port = broker(max_inflight_messages=5)
    sent = _flood(port, proto.topic(DEVICE, "telemetry"), 400, clean=False)  # a saved session, too
    assert sent < 400, "the broker took 400 x 250 KiB QoS 2 publishes it was never told to release"
    wait_for(lambda: b.held()["connections"] == 0, WAIT_S, "the device's connection closed")
    held = b.held()
    assert held["inflight_in"] == 0 and held["inflight_in_bytes"] == 0, held


@pytest.mark.trust("saved sessions never expire")
def test_a_saved_session_expires(broker):
    b, port = broker(session_expiry_s=1)
    raw_connect(port, DEVICE, DEVICE, PASSWORD, clean=False).close()
    wait_for(lambda: b.held()["connections"] == 0, WAIT_S, "the device's connection closed")
    wait_for(lambda: b.held()["sessions"] == 0, WAIT_S, "the saved session expired")


def test_an_mqtt5_connect_is_refused_and_closed(broker):
    b, port = broker()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(connect_packet(DEVICE, DEVICE, PASSWORD, version=5))
        s.settimeout(WAIT_S)
        answer = s.recv(4)  # amqtt reads the properties' length as the client id's: no CONNACK, or a refusal
        assert answer in (b"", b"\x20\x02\x00\x01"), answer
        assert _closed_by_peer(s)
    wait_for(lambda: b.held()["connections"] == 0, WAIT_S, "the connection forgotten")
    assert b.held()["sessions"] == 0


@pytest.mark.trust("a refused login whose client hangs up writes a traceback")
def test_refused_logins_that_hang_up_write_no_traceback(broker, caplog):
    b, port = broker()
    caplog.set_level(logging.DEBUG)
    for i in range(50):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        s.sendall(connect_packet(DEVICE, DEVICE, f"wrong-{i}") if i % 2 else connect_packet("anon-" + str(i)))
        s.close()
    wait_for(lambda: b.held()["connections"] == 0, WAIT_S, "every refused connection closed")
    raw_connect(port, DEVICE, DEVICE, PASSWORD).close()  # and the broker still takes a healthy device
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()
                  or (r.name == "asyncio" and r.levelno >= logging.ERROR)]
    assert not tracebacks, [r.getMessage()[:200] for r in tracebacks[:3]]


def test_a_fleet_passes_its_broker_limits_to_the_embedded_broker_and_keeps_serving(tmp_path):
    """Through a real fleet (FleetConfig.embedded_mqtt_limits): a silent connection to its broker is closed at the
    fleet's CONNECT deadline, while the fleet's health and its own broker connection carry on."""
    import httpx

    from tests.fleet_harness import running_fleet

    with running_fleet(tmp_path, None, embedded_mqtt_limits=BrokerLimits(connect_timeout_s=1.0)) as (fs, url):
        assert fs.broker is not None and fs.broker.limits.connect_timeout_s == 1.0
        with socket.create_connection(("127.0.0.1", fs.broker.port)) as s:
            assert _closed_by_peer(s), "the fleet's broker kept a connection that sent no CONNECT"
        health = httpx.get(f"{url}/api/v1/health", timeout=WAIT_S).json()
        assert health["mqtt_connected"] is True, health
