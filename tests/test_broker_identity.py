"""One identity per device on the broker, tried from the outside by one enrolled device (or nobody),
against a real Mosquitto and the real embedded broker (amqtt), each on its own loopback port.

- retained messages: a device that subscribes to nothing, or whose wildcard subscription is refused,
  gets no retained desired, reported or status of another device;
- the client id is bound to the account: an anonymous connection, or another device's credentials,
  using a victim's client id never touch the victim's session (it stays connected and subscribed).

Absence is proven by order, never by waiting: a later, allowed message on the same connection must
arrive first (MQTT keeps order per connection); every wait is bounded.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from sqlalchemy import create_engine

from edgefleet.agent.link.mqtt import MqttLink, MqttSecurity
from edgefleet.agent.link.spool import Spool
from edgefleet.fleet.acl import (
    FLEET_USER,
    LEGACY_AGENT_PREFIX,
    Account,
    ActiveAccounts,
    mosquitto_conf,
    reload_mosquitto,
    write_mosquitto_files,
)
from edgefleet.fleet.broker import EmbeddedBroker
from edgefleet.fleet.enroll import Enrollment
from edgefleet.protocol import mqtt as proto
from tests.conftest import free_port, wait_for, wait_port

FLEET_PASSWORD = "fleet-secret-for-identity-tests"
MOSQUITTO_USER = "user root\n" if os.geteuid() == 0 else ""
WAIT_S = 20.0


class Conn:
    """A paho client that records, in order, what it receives and whether the broker dropped it."""

    def __init__(self, port: int, username: str | None, password: str | None, client_id: str,
                 clean: bool = True):
        self.port = port
        self.got: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.events: queue.Queue[tuple[str, object]] = queue.Queue()
        self.subacks: queue.Queue[list[mqtt.ReasonCode]] = queue.Queue()
        self.accepted = False
        self.dropped = False
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                             clean_session=clean, reconnect_on_failure=False)  # a dropped victim stays dropped
        if username is not None:
            self.c.username_pw_set(username, password)
        self.c.on_message = lambda c, u, m: self.got.put((m.topic, bytes(m.payload)))
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_subscribe = lambda c, u, mid, codes, p: self.subacks.put(list(codes))

    def _on_connect(self, c, u, flags, rc, p) -> None:
        self.accepted = not rc.is_failure
        self.events.put(("connack", rc))

    def _on_disconnect(self, c, u, flags, rc, p) -> None:
        if self.accepted:
            self.dropped = True
        self.events.put(("disconnect", rc))

    def connect(self) -> bool:
        """True if the broker accepted the connection (a CONNACK without failure)."""
        try:
            self.c.connect("127.0.0.1", self.port, keepalive=30)
        except OSError:
            return False
        self.c.loop_start()
        try:
            kind, _ = self.events.get(timeout=WAIT_S)
        except queue.Empty:
            return False
        if kind == "connack" and self.accepted:
            return True
        self.close()
        return False

    def subscribe(self, *filters: str) -> list[mqtt.ReasonCode]:
        self.c.subscribe([(f, 1) for f in filters])
        return self.subacks.get(timeout=WAIT_S)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        info = self.c.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(WAIT_S)
        assert info.is_published(), f"publish to {topic} not acknowledged"

    def next(self) -> tuple[str, bytes]:
        return self.got.get(timeout=WAIT_S)

    def wait_dropped(self) -> bool:
        """Wait (bounded) for the broker to close this connection: for a drop that must happen."""
        try:
            wait_for(lambda: self.dropped, timeout_s=WAIT_S, what="drop")
        except AssertionError:
            return False
        return True

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@dataclass
class Env:
    kind: str
    device_port: int  # where devices connect
    fleet_port: int  # where the fleet's replicas connect (any client id)
    enroll: Enrollment
    ready: object  # (username, password) -> None: wait (bounded) until the broker knows the account
    conns: list[Conn]
    broker_pid: int  # the broker's process (the embedded one runs in this one, as in the fleet)

    def conn(self, port: int, username: str | None, password: str | None, client_id: str,
             clean: bool = True) -> Conn:
        c = Conn(port, username, password, client_id, clean)
        self.conns.append(c)
        return c

    def fleet(self, client_id: str) -> Conn:
        f = self.conn(self.fleet_port, FLEET_USER, FLEET_PASSWORD, client_id)
        assert f.connect(), f"the fleet could not connect as {client_id}"
        return f

    def enrolled(self, device_id: str) -> str:
        creds = self.enroll.redeem(self.enroll.issue_token(device_id))
        self.ready(creds.username, creds.password)  # type: ignore[operator]
        return creds.password

    def device(self, device_id: str, password: str) -> Conn:
        c = self.conn(self.device_port, device_id, password, device_id)  # as agent/link/mqtt.py connects
        assert c.connect(), f"{device_id} could not connect with its own credentials and client id"
        return c


def _mosquitto(tmp_path: Path, enroll: Enrollment) -> Iterator[tuple[int, int, int]]:
    """Mosquitto configured as fleet.acl.mosquitto_conf says (what the README tells operators)."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    passwd, acl, fleet_passwd = tmp_path / "passwd", tmp_path / "acl", tmp_path / "fleet.passwd"
    port, fleet_port = free_port(), free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"{MOSQUITTO_USER}persistence false\n" + mosquitto_conf(
        passwd, acl, fleet_passwd, device_listeners=[f"{port} 127.0.0.1"], fleet_listener=f"{fleet_port} 127.0.0.1"))
    write_mosquitto_files(enroll.accounts(), passwd, acl, fleet_passwd)
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def on_change(accounts: list[Account]) -> None:
        write_mosquitto_files(accounts, passwd, acl, fleet_passwd)
        reload_mosquitto(proc.pid)

    enroll.on_change = on_change
    try:
        wait_port(port)
        wait_port(fleet_port)
        yield port, fleet_port, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(params=["mosquitto", "embedded"])
def env(request, tmp_path) -> Iterator[Env]:
    enroll = Enrollment(create_engine(f"sqlite:///{tmp_path / 'fleet.db'}"))
    enroll.set_fleet_password(FLEET_PASSWORD)
    conns: list[Conn] = []

    def ready(username: str, password: str) -> None:
        def accepted() -> bool:  # its own client id, before the device's real connection exists
            c = Conn(device_port, username, password, username)
            ok = c.connect()
            c.close()
            return ok
        wait_for(accepted, timeout_s=WAIT_S, what=f"the broker accepts {username}")

    if request.param == "mosquitto":
        gen = _mosquitto(tmp_path, enroll)
        device_port, fleet_port, broker_pid = next(gen)
    else:
        accounts = ActiveAccounts()  # the embedded broker's authorizer, as fleet/app.py feeds it
        enroll.on_change = accounts.update
        accounts.update(enroll.accounts())
        device_port = fleet_port = free_port()
        broker = EmbeddedBroker("127.0.0.1", device_port, accounts)
        broker.start()
        broker_pid = os.getpid()
    try:
        yield Env(request.param, device_port, fleet_port, enroll, ready, conns, broker_pid)
    finally:
        for c in conns:
            c.close()
        if request.param == "mosquitto":
            gen.close()
        else:
            broker.stop()


def _victim_ids(device_id: str) -> list[str]:
    """The client ids a victim may be known by: its device id (what the agent sends, and what
    Mosquitto's use_username_as_clientid makes it) and the one agents sent before."""
    return [device_id, LEGACY_AGENT_PREFIX + device_id]


# -- (a) retained messages ---------------------------------------------------------------------
@pytest.mark.trust("a device reads another device's retained messages")
@pytest.mark.parametrize("attack", ["subscribes to nothing", "wildcard subscription refused"])
def test_no_retained_message_of_another_device(env: Env, attack: str):
    pw_a, pw_b = env.enrolled("edge-a"), env.enrolled("edge-b")
    fleet = env.fleet("edgefleet-fleet-one")
    fleet.subscribe(*(proto.subscription(k) for k in ("status", "reported", "telemetry")))  # as fleet/bridge.py
    b = env.device("edge-b", pw_b)
    b.subscribe(proto.topic("edge-b", "desired"), proto.topic("edge-b", "ack"))
    b.publish(proto.topic("edge-b", "status"), b"b online", retain=True)
    b.publish(proto.topic("edge-b", "reported"), b"b installed", retain=True)
    fleet.publish(proto.topic("edge-b", "desired"), b"for b", retain=True)
    fleet.publish(proto.topic("edge-a", "desired"), b"for a", retain=True)
    # a second fleet connection sees all four retained: the broker holds them before edge-a comes
    witness = env.fleet("edgefleet-fleet-witness")
    witness.subscribe(f"{proto.PREFIX}/edge-b/#", proto.topic("edge-a", "desired"))
    want = {proto.topic("edge-b", k) for k in ("status", "reported", "desired")} | {proto.topic("edge-a", "desired")}
    held: set[str] = set()
    while held != want:
        held.add(witness.next()[0])

    a = env.device("edge-a", pw_a)
    if attack == "wildcard subscription refused":
        codes = a.subscribe(f"{proto.PREFIX}/+/#")
        # the embedded broker refuses it; Mosquitto grants any filter and checks each message it would deliver
        assert codes[0].is_failure or env.kind == "mosquitto", f"edge-a may subscribe to every device: {codes}"
    a.subscribe(proto.topic("edge-a", "desired"))  # then one allowed subscription on the same connection
    first = a.next()
    assert first == (proto.topic("edge-a", "desired"), b"for a"), f"edge-a got another device's message: {first}"


# -- (b) an anonymous connection with a victim's client id -------------------------------------
@pytest.mark.trust("an anonymous or wrong-password client takes a device's client id")
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "persistent"])
def test_anonymous_connection_with_a_victims_client_id_leaves_it_alone(env: Env, clean: bool):
    pw_b = env.enrolled("edge-b")
    fleet = env.fleet("edgefleet-fleet-one")
    b = env.device("edge-b", pw_b)
    b.subscribe(proto.topic("edge-b", "desired"))
    for cid in _victim_ids("edge-b"):
        for user, password in ((None, None), ("edge-b", "a guess")):
            intruder = env.conn(env.device_port, user, password, cid, clean)
            assert not intruder.connect(), f"{user or 'anonymous'} connected with client id {cid!r}"
    fleet.publish(proto.topic("edge-b", "desired"), b"after the attempts")
    # a dropped edge-b would not get it (it does not reconnect), nor would one whose subscription was wiped
    assert b.next() == (proto.topic("edge-b", "desired"), b"after the attempts"), "edge-b lost its subscription"
    assert not b.dropped


# -- (c) one device's credentials with another's client id --------------------------------------
@pytest.mark.trust("a device takes another device's client id")
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "persistent"])
def test_a_device_cannot_take_another_devices_client_id(env: Env, clean: bool):
    pw_a, pw_b = env.enrolled("edge-a"), env.enrolled("edge-b")
    fleet = env.fleet("edgefleet-fleet-one")
    b = env.device("edge-b", pw_b)
    b.subscribe(proto.topic("edge-b", "desired"), proto.topic("edge-b", "ack"))
    for cid in _victim_ids("edge-b"):
        holder = env.device("edge-a", pw_a)  # edge-a's own connection
        holder.subscribe(proto.topic("edge-a", "desired"))
        impostor = env.conn(env.device_port, "edge-a", pw_a, cid, clean)
        if not impostor.connect():
            fleet.publish(proto.topic("edge-a", "desired"), b"for a")  # and edge-a's own session is intact
            assert holder.next() == (proto.topic("edge-a", "desired"), b"for a")
        else:
            # Mosquitto (use_username_as_clientid) does not refuse: it binds the connection to edge-a's
            # own client id, so the only session it can replace is edge-a's; the embedded broker refuses
            assert env.kind == "mosquitto", f"edge-a's credentials connected with client id {cid!r}"
            assert holder.wait_dropped(), f"edge-a's credentials with client id {cid!r} did not act as edge-a"
        holder.close()
        impostor.close()
    if env.fleet_port != env.device_port:  # the fleet's listener (any client id) takes the fleet's account only
        for cid in _victim_ids("edge-b"):
            assert not env.conn(env.fleet_port, "edge-a", pw_a, cid, clean).connect(), \
                f"edge-a connected to the fleet's listener as {cid!r}"
    fleet.publish(proto.topic("edge-b", "ack"), b"ack for b")
    # a dropped edge-b would not get it (it does not reconnect), nor would one whose subscription was wiped
    assert b.next() == (proto.topic("edge-b", "ack"), b"ack for b"), "edge-b stopped getting acks"
    assert not b.dropped


# -- (d) one device's 50 MB retained messages ----------------------------------------------------------
HOSTILE_DEVICE = """
import sys, threading
import paho.mqtt.client as mqtt
port, user, password, topic, size = sys.argv[1:6]
done, how = threading.Event(), []
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv311, reconnect_on_failure=False)
c.username_pw_set(user, password)
c.on_publish = lambda *a: (how.append("acknowledged"), done.set())
c.on_disconnect = lambda *a: (how.append("disconnected"), done.set())
c.connect("127.0.0.1", int(port), keepalive=60)
c.loop_start()
c.publish(topic, b"x" * int(size), qos=1, retain=True)
done.wait(60)
print(how[0] if how else "no answer")
"""


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for process {pid}")


def _reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak becomes the current RSS (Linux 4.0+)


@pytest.mark.trust("a device publishes 50 MB retained messages on its own topics")
def test_a_message_over_the_protocols_limit_is_refused_by_the_broker(env: Env):
    from edgefleet.fleet.acl import MAX_PACKET_BYTES

    pw = env.enrolled("edge-a")
    fleet = env.fleet("edgefleet-fleet-one")
    fleet.subscribe(*(proto.subscription(k) for k in ("status", "reported", "telemetry")))  # as fleet/bridge.py
    peaks = {}
    for pid in {env.broker_pid, os.getpid()}:  # the broker's process and the fleet's (one, when embedded)
        _reset_peak_rss(pid)
        peaks[pid] = _peak_rss_kib(pid)
    size = 50 * 1024 * 1024
    out = subprocess.run([sys.executable, "-c", HOSTILE_DEVICE, str(env.device_port), "edge-a", pw,
                          proto.topic("edge-a", "reported"), str(size)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "disconnected", (out.stdout, out.stderr[-2000:])
    grown = {pid: _peak_rss_kib(pid) - before for pid, before in peaks.items()}
    print(f"{env.kind}: peak RSS growth (KiB) while a {size}-byte publish was refused: {grown}")
    assert all(g < size // 1024 // 4 for g in grown.values()), f"the {size}-byte message was read: {grown} KiB"

    # nothing of it was forwarded or retained: the device's next, small message is the first the fleet gets,
    # and a later subscriber gets no retained 'reported' before the 'status' it subscribed to after it
    a = env.device("edge-a", pw)
    a.publish(proto.topic("edge-a", "status"), b"small", retain=True)
    assert fleet.next() == (proto.topic("edge-a", "status"), b"small")
    witness = env.fleet("edgefleet-fleet-witness")
    witness.subscribe(proto.topic("edge-a", "reported"))
    witness.subscribe(proto.topic("edge-a", "status"))
    assert witness.next() == (proto.topic("edge-a", "status"), b"small")
    # the largest message the protocol allows still passes, both ways
    big = b"y" * proto.MAX_MESSAGE_BYTES
    assert len(big) + 100 < MAX_PACKET_BYTES
    a.publish(proto.topic("edge-a", "telemetry"), big)
    assert fleet.next() == (proto.topic("edge-a", "telemetry"), big)
    a.subscribe(proto.topic("edge-a", "desired"))
    fleet.publish(proto.topic("edge-a", "desired"), big)
    assert a.next() == (proto.topic("edge-a", "desired"), big) and not a.dropped and not fleet.dropped


# -- what must keep working ------------------------------------------------------------------------
def test_fleet_replicas_share_one_account_and_the_agent_connects(env: Env, tmp_path):
    pw = env.enrolled("edge-t")
    replicas = [env.fleet(f"edgefleet-fleet-{i}") for i in range(2)]
    for r in replicas:
        r.subscribe(proto.subscription("status"))
    link = MqttLink("edge-t", f"mqtt://127.0.0.1:{env.device_port}", Spool(tmp_path / "spool"), "http://x",
                    lambda d: None, security=MqttSecurity("edge-t", pw))
    link.start()
    try:
        for r in replicas:
            topic, payload = r.next()
            assert topic == proto.topic("edge-t", "status") and b'"online"' in payload
            assert not r.dropped
    finally:
        link.stop()


@pytest.mark.parametrize(("user", "client_id", "ok"), [
    ("edge-a", "edge-a", True),
    ("edge-a", LEGACY_AGENT_PREFIX + "edge-a", True),  # what agents sent before
    ("edge-a", "edge-b", False),
    ("edge-a", LEGACY_AGENT_PREFIX + "edge-b", False),
    ("edge-a", "", False),
    (None, "edge-a", False),
    (FLEET_USER, "edgefleet-fleet-0123abcd", True),  # replicas share the account, each with a random id
])
def test_the_client_id_rule_the_embedded_broker_applies(user, client_id, ok):
    from edgefleet.fleet.acl import client_id_allowed

    assert client_id_allowed(user, client_id) is ok
