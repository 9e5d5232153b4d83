"""Mosquitto with the generated config (fleet.acl.mosquitto_conf) bounds what one client holds (issue 45,
finding 5), tried against Debian's real Mosquitto:

- the config is accepted (Mosquitto starts on it and serves);
- a device's QoS 2 publishes it never releases (MQTT 3.1.1 and 5) end its connection: devices take QoS 1
  only (``max_qos 1``); before, 4,000 x 250 KB over MQTT 5 took Mosquitto from 9 to 500 MB, kept after the
  device left;
- QoS 1 messages for an absent device are queued within ``max_queued_bytes`` (+ ``max_inflight_bytes``), and
  the fleet's retained desired state still reaches the device (nothing relies on the queue).

Counts, never sleeps: what the device receives before a marker the fleet publishes once it is back.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from bench.mqtt_probe import publish_packet, raw_connect
from edgefleet.fleet.acl import FLEET_USER, Account, hash_password, mosquitto_conf, write_mosquitto_files
from edgefleet.fleet.broker_limits import BrokerLimits
from edgefleet.protocol import mqtt as proto
from tests.conftest import free_port, wait_port
from tests.waiting import wait_for

DEVICE, PASSWORD, FLEET_PASSWORD = "edge-a", "device-secret", "fleet-secret"
WAIT_S = 20.0


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[int, int, subprocess.Popen]]:
    """(device port, fleet port, process) of a Mosquitto on the generated config."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    passwd, acl, fleet_passwd = tmp_path / "passwd", tmp_path / "acl", tmp_path / "fleet.passwd"
    accounts = [Account(DEVICE, hash_password(PASSWORD)), Account(FLEET_USER, hash_password(FLEET_PASSWORD))]
    write_mosquitto_files(accounts, passwd, acl, fleet_passwd)
    port, fleet_port = free_port(), free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(("user root\n" if os.geteuid() == 0 else "") + "persistence false\n" + mosquitto_conf(
        passwd, acl, fleet_passwd, device_listeners=[f"{port} 127.0.0.1"], fleet_listener=f"{fleet_port} 127.0.0.1"))
    log = (tmp_path / "mosquitto.log").open("w")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        wait_port(fleet_port)
        assert proc.poll() is None, (tmp_path / "mosquitto.log").read_text()
        yield port, fleet_port, proc
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _client(port: int, user: str, password: str, client_id: str, clean: bool = True) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                    clean_session=clean, reconnect_on_failure=False)
    c.username_pw_set(user, password)
    connected: queue.Queue[bool] = queue.Queue()
    c.on_connect = lambda cl, u, flags, rc, p: connected.put(not rc.is_failure)
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    assert connected.get(timeout=WAIT_S), f"{user} could not connect"
    return c


@pytest.mark.trust("a device parks QoS 2 messages it never releases in Mosquitto")
@pytest.mark.parametrize("version", [4, 5], ids=["mqtt311", "mqtt5"])
def test_unreleased_qos2_publishes_end_the_connection(broker, version: int):
    port, _, proc = broker
    s = raw_connect(port, DEVICE, DEVICE, PASSWORD, version=version)
    sent, closed = 0, False
    try:
        for i in range(200):  # 50 MB never released, on the device's own telemetry topic
            s.sendall(publish_packet(proto.topic(DEVICE, "telemetry"), b"x" * 250 * 1024, qos=2, packet_id=i + 1,
                                     version=version))
            sent += 1
        s.settimeout(WAIT_S)
        while s.recv(65536):  # PUBRECs, until the broker ends the connection
            pass
        closed = True
    except OSError:
        closed = True
    finally:
        s.close()
    assert closed and sent < 200, f"Mosquitto took {sent} QoS 2 publishes of 250 KiB it was never told to release"
    assert proc.poll() is None


@pytest.mark.trust("Mosquitto queues without a byte limit for an absent device")
def test_a_qos1_flood_for_an_absent_device_is_queued_within_the_byte_limit(broker):
    port, fleet_port, _ = broker
    lim, size, count = BrokerLimits(), 100 * 1024, 600  # 60 MB, over max_queued_bytes (32 MiB)
    desired = proto.topic(DEVICE, "desired")
    got: queue.Queue[bytes] = queue.Queue()
    device = _client(port, DEVICE, PASSWORD, DEVICE, clean=False)
    device.on_message = lambda c, u, m: got.put(bytes(m.payload[:16]))
    device.subscribe(desired, qos=1)
    fleet = _client(fleet_port, FLEET_USER, FLEET_PASSWORD, "edgefleet-fleet-test")
    fleet.publish(desired, b"warm-up", qos=1).wait_for_publish(WAIT_S)
    assert got.get(timeout=WAIT_S) == b"warm-up"  # the device's saved session is subscribed
    device.disconnect()
    device.loop_stop()
    for i in range(count):
        info = fleet.publish(desired, f"{i:08d}".encode() + b"x" * (size - 8), qos=1, retain=i == count - 1)
    info.wait_for_publish(WAIT_S)

    back = _client(port, DEVICE, PASSWORD, DEVICE, clean=False)  # the saved session: what was queued comes now
    received: list[bytes] = []
    back.on_message = lambda c, u, m: got.put(bytes(m.payload[:16]))

    def marker_arrived() -> bool:  # a marker behind what was queued: the queue has been delivered when it arrives
        fleet.publish(desired, b"marker", qos=1)
        while True:
            try:
                item = got.get(timeout=0.2)
            except queue.Empty:
                return False
            if item == b"marker":
                return True
            received.append(item)

    wait_for(marker_arrived, WAIT_S * 3, "the marker behind the queued messages")
    most = (lim.max_queued_bytes + lim.max_inflight_bytes) // size + lim.max_inflight_messages
    assert 0 < len(received) <= most, f"{len(received)} of {count} x 100 KiB queued for an absent device (<= {most})"
    back.disconnect()
    back.loop_stop()
    # the fleet's retained desired state reaches the device all the same
    fresh = _client(port, DEVICE, PASSWORD, DEVICE)
    latest: queue.Queue[bytes] = queue.Queue()
    fresh.on_message = lambda c, u, m: latest.put(bytes(m.payload[:8])) if m.retain else None
    fresh.subscribe(desired, qos=1)
    assert latest.get(timeout=WAIT_S) == f"{count - 1:08d}".encode()
    fresh.disconnect()
    fresh.loop_stop()
    fleet.disconnect()
    fleet.loop_stop()


def test_the_generated_config_and_the_docs_sample_set_every_flow_limit():
    """What operators copy (docs/security.md's sample) carries the limits mosquitto_conf writes."""
    conf = mosquitto_conf(Path("/p"), Path("/a"), Path("/f")).splitlines()
    docs = [line.split("#")[0].strip() for line in (Path(__file__).parent.parent / "docs" / "security.md").read_text()
            .splitlines()]
    for option in ("max_inflight_messages", "max_inflight_bytes", "max_queued_messages", "max_queued_bytes",
                   "persistent_client_expiration", "max_keepalive", "max_qos", "max_connections"):
        lines = [line for line in conf if line.startswith(option + " ")]
        assert lines and all(line in docs for line in lines), option
