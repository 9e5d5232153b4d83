"""The fleet says it is connected to its broker only once the broker has taken its subscriptions: from its CONNACK
to its SUBACK a device's report is not delivered to the fleet, so health saying "connected" there claimed more than
was true (CI, 2026-11-29: a report published in that window, not retained, never reached the fleet).

- A broker that holds its SUBACK (a hand-built one on loopback, which reads the fleet's SUBSCRIBE and answers when
  told): the bridge is not connected while it waits, and is once the SUBACK grants every filter.
- A real broker whose ACL refuses the subscriptions (the embedded one, the fleet given a device's account, as a
  careless operator might): the bridge stays not connected. A fleet server whose broker refuses them (the hand-built
  one, answering 0x80) says so in its health, naming the filters and what to do. (Mosquitto 2.0.11 grants a
  subscription its ACL denies and then delivers nothing: no SUBACK tells the fleet, so no test uses it here.)
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from edgefleet.fleet.acl import Account, ActiveAccounts, hash_password
from edgefleet.fleet.app import FleetConfig, FleetServer
from edgefleet.fleet.bridge import MqttBridge
from edgefleet.fleet.broker import EmbeddedBroker
from edgefleet.fleet.keys import init_keys
from edgefleet.protocol import mqtt as proto
from tests.conftest import free_port
from tests.waiting import wait_for, watch

WAIT_S = 20.0
FILTERS = {proto.subscription(k) for k in ("status", "reported", "telemetry")}
HELD_S = 1.5  # how long the broker holds its SUBACK: the window in which "connected" would be the wrong answer


def _read_packet(conn: socket.socket) -> tuple[int, bytes]:
    """One MQTT packet: (its first byte, its body)."""
    first = conn.recv(1)
    if not first:
        raise ConnectionError("the fleet closed the connection")
    length, shift = 0, 0
    for _ in range(4):
        byte = conn.recv(1)[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise ConnectionError("the fleet closed the connection mid-packet")
        body += chunk
    return first[0], body


class SlowSubackBroker:
    """Accepts one client, answers its CONNECT, reads its SUBSCRIBE and sends the SUBACK only when ``release``
    is set, with one return code for every filter. PINGREQs are answered; anything else is read and ignored."""

    def __init__(self, code: int = 0x01) -> None:
        self.code = code  # the SUBACK's return code for every filter: 0x01 (QoS 1 granted) or 0x80 (refused)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(WAIT_S)
        self.port = int(self.listener.getsockname()[1])
        self.release = threading.Event()
        self.subscribed_filters: list[str] = []
        self.subscribe_seen = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(WAIT_S)
        with conn:
            try:
                kind, _ = _read_packet(conn)
                assert kind >> 4 == 1, f"first packet {kind:#x}, not a CONNECT"
                conn.sendall(b"\x20\x02\x00\x00")
                while True:
                    kind, body = _read_packet(conn)
                    if kind >> 4 == 8:  # SUBSCRIBE
                        mid = body[:2]
                        at = 2
                        while at < len(body):
                            (n,) = struct.unpack("!H", body[at:at + 2])
                            self.subscribed_filters.append(body[at + 2:at + 2 + n].decode())
                            at += 2 + n + 1
                        self.subscribe_seen.set()
                        self.release.wait(WAIT_S)
                        codes = bytes([self.code]) * len(self.subscribed_filters)
                        conn.sendall(bytes([0x90, 2 + len(codes)]) + mid + codes)
                    elif kind >> 4 == 12:  # PINGREQ
                        conn.sendall(b"\xd0\x00")
            except (ConnectionError, OSError):
                return

    def close(self) -> None:
        self.release.set()
        self.listener.close()


def test_the_fleet_is_connected_only_once_the_broker_took_its_subscriptions():
    broker = SlowSubackBroker()
    bridge = MqttBridge(f"mqtt://127.0.0.1:{broker.port}")
    bridge.start()
    try:
        assert broker.subscribe_seen.wait(WAIT_S), "the fleet never subscribed"
        early = watch(bridge.connected.is_set, HELD_S)
        assert not early, "the fleet said it was connected before the broker acknowledged its subscriptions"
        assert bridge.connected_for() == 0.0
        broker.release.set()
        wait_for(bridge.connected.is_set, WAIT_S, "the fleet connected once its SUBACK came")
        assert bridge.refused_subscriptions == []
        assert set(broker.subscribed_filters) == FILTERS
    finally:
        bridge.stop()
        broker.close()


@pytest.fixture
def broker_with_a_device() -> Iterator[EmbeddedBroker]:
    accounts = ActiveAccounts()
    accounts.update([Account("edge-a", hash_password("device-secret"))])
    b = EmbeddedBroker("127.0.0.1", free_port(), accounts)
    b.start()
    yield b
    b.stop()


def test_subscriptions_a_real_broker_refuses_leave_the_fleet_not_connected(broker_with_a_device):
    """The embedded broker's ACL refuses a device's account the fleet's wildcard filters (a fleet configured with a
    device's credentials): the bridge reads the refusal from the SUBACK and does not call itself connected."""
    bridge = MqttBridge(broker_with_a_device.url, client_id="edge-a", username="edge-a", password="device-secret")
    bridge.start()
    try:
        refused = wait_for(lambda: bridge.refused_subscriptions, WAIT_S, "the broker's SUBACK read")
        assert set(refused) == FILTERS
        assert not watch(bridge.connected.is_set, HELD_S), "connected although every subscription was refused"
    finally:
        bridge.stop()


def test_a_fleet_whose_subscriptions_are_refused_says_so_in_its_health(tmp_path):
    broker = SlowSubackBroker(code=0x80)
    broker.release.set()
    init_keys(tmp_path / "keys")
    cfg = FleetConfig(data_dir=tmp_path / "fleet", keys_dir=tmp_path / "keys", port=free_port(),
                      mqtt_url=f"mqtt://127.0.0.1:{broker.port}", embedded_mqtt_port=free_port())
    fs = FleetServer(cfg)
    fs.start_background()
    try:
        wait_for(lambda: fs.bridge.refused_subscriptions, WAIT_S, "the broker's SUBACK read")
        health = fs.health()
        assert health["status"] == "degraded" and health["mqtt_connected"] is False, health
        problem = next(p for p in health["problems"] if "refused the fleet's subscriptions" in p)
        assert all(f in problem for f in FILTERS) and "read access" in problem, problem
    finally:
        fs.stop_background()
        broker.close()
