"""Device identity on MQTT, enforced by a real Mosquitto: per-device credentials from enrollment,
topic ACLs (password + ACL files reloaded on SIGHUP), TLS and mutual TLS with a CA made here.

Every probe is an attempt by one device to act as another; each must be refused. A publish the
broker drops is proven dropped by a later, allowed message on the same connection arriving alone
(MQTT keeps order per connection), never by waiting for a time.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import queue
import shutil
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from sqlalchemy import create_engine

from edgefleet.agent.link.mqtt import MqttLink, MqttSecurity
from edgefleet.agent.link.spool import Spool
from edgefleet.fleet.acl import FLEET_USER, allowed, mosquitto_conf, reload_mosquitto, write_mosquitto_files
from edgefleet.fleet.enroll import Enrollment
from edgefleet.fleet.errors import BadRequest
from edgefleet.protocol import mqtt as proto
from tests.conftest import free_port, wait_port
from tests.test_crash_random import record_figures
from tests.waiting import wait_for

FLEET_PASSWORD = "fleet-secret-for-tests"
# Mosquitto started as root drops to its own user, which cannot read files the (root) test wrote 0640
MOSQUITTO_USER = "user root\n" if os.geteuid() == 0 else ""


@dataclass
class Broker:
    dir: Path
    port: int
    tls_port: int
    mtls_port: int
    fleet_port: int  # the fleet's own listener: its account only, any client id
    proc: subprocess.Popen
    enroll: Enrollment
    pki: dict[str, Path]
    probes: list[tuple[str, bool]] = field(default_factory=list)  # (what, refused)

    def probe(self, what: str, refused: bool) -> None:
        self.probes.append((what, refused))
        assert refused, f"ACL probe not refused: {what}"


def _pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, client certificates for edge-a and (from another
    CA) an impostor, all made here with the cryptography package."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def save(stem: str, key, cert) -> None:
        (d / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
        (d / f"{stem}.key").chmod(0o600)
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(cn: str, issuer, server: bool):
        ikey, icert = issuer
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(icert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return key, b.sign(ikey, hashes.SHA256())

    d.mkdir(parents=True, exist_ok=True)
    good, evil = ca("edgefleet test CA"), ca("impostor CA")
    save("ca", *good)
    save("evil-ca", *evil)
    save("server", *leaf("127.0.0.1", good, True))
    save("edge-a", *leaf("edge-a", good, False))
    save("impostor-b", *leaf("edge-b", evil, False))
    return {n: d / f"{n}.pem" for n in ("ca", "evil-ca", "server", "edge-a", "impostor-b")}


@pytest.fixture
def broker(tmp_path) -> Broker:
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    passwd, acl, fleet_passwd = tmp_path / "passwd", tmp_path / "acl", tmp_path / "fleet.passwd"
    holder: list[subprocess.Popen] = []

    def on_change(accounts) -> None:  # what the fleet does when credentials change
        write_mosquitto_files(accounts, passwd, acl, fleet_passwd)
        if holder:
            reload_mosquitto(holder[0].pid)

    enroll = Enrollment(create_engine(f"sqlite:///{tmp_path / 'fleet.db'}"), on_change)
    enroll.set_fleet_password(FLEET_PASSWORD)
    pki = _pki(tmp_path / "pki")
    port, tls_port, mtls_port, fleet_port = free_port(), free_port(), free_port(), free_port()
    conf = tmp_path / "mosquitto.conf"
    tls = f"cafile {pki['ca']}\ncertfile {pki['server']}\nkeyfile {pki['server'].with_suffix('.key')}\n"
    conf.write_text(f"{MOSQUITTO_USER}persistence false\n" + mosquitto_conf(  # as the README tells operators
        passwd, acl, fleet_passwd, fleet_listener=f"{fleet_port} 127.0.0.1", device_listeners=[
            f"{port} 127.0.0.1", f"{tls_port} 127.0.0.1\n{tls}",
            f"{mtls_port} 127.0.0.1\n{tls}require_certificate true\nuse_identity_as_username true"]))
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder.append(proc)
    for p in (port, tls_port, mtls_port, fleet_port):
        wait_port(p)
    b = Broker(tmp_path, port, tls_port, mtls_port, fleet_port, proc, enroll, pki)
    yield b
    proc.terminate()
    proc.wait(10)
    record_figures("acl", {"tried": len(b.probes), "refused": sum(r for _, r in b.probes)})


class Client:
    """A paho client that records what it receives, in order."""

    def __init__(self, port: int, username: str | None, password: str | None, client_id: str,
                 tls: dict | None = None):
        self.got: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.connack: queue.Queue[mqtt.ReasonCode] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        if username is not None:
            self.c.username_pw_set(username, password)
        if tls is not None:
            self.c.tls_set(**tls, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        self.c.on_message = lambda c, u, m: self.got.put((m.topic, bytes(m.payload)))
        self.c.on_connect = lambda c, u, f, rc, p: self.connack.put(rc)
        # closed before any CONNACK (a client certificate refused after a TLS 1.3 handshake): refused
        self.c.on_disconnect = lambda c, u, f, rc, p: self.connack.put(
            rc if rc.is_failure else mqtt.ReasonCode(mqtt.PacketTypes.CONNACK, "Unspecified error"))
        self.port = port

    def connect(self) -> bool:
        """True if the broker accepted the connection (a refused TLS handshake counts as refused)."""
        try:
            self.c.connect("127.0.0.1", self.port, keepalive=10)
        except (ssl.SSLError, OSError):
            return False
        self.c.loop_start()
        try:
            rc = self.connack.get(timeout=20)
        except queue.Empty:
            return False
        return not rc.is_failure

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def subscribe(self, *filters: str) -> None:
        done = threading.Event()
        self.c.on_subscribe = lambda *a: done.set()
        self.c.subscribe([(f, 1) for f in filters])
        assert done.wait(10)

    def next(self) -> tuple[str, bytes]:
        return self.got.get(timeout=20)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def _fleet(b: Broker) -> Client:
    f = Client(b.fleet_port, FLEET_USER, FLEET_PASSWORD, "edgefleet-fleet-test")
    assert f.connect()
    f.subscribe(*(proto.subscription(k) for k in ("status", "reported", "telemetry")))  # as fleet/bridge.py does
    return f


def _device(b: Broker, device_id: str) -> tuple[Client, str]:
    creds = b.enroll.redeem(b.enroll.issue_token(device_id))
    _wait_reload(b, creds.username, creds.password, True)  # before it connects: a probe would replace it
    c = Client(b.port, creds.username, creds.password, device_id)
    assert c.connect(), f"{device_id} could not connect with its own credentials"
    return c, creds.password


def _wait_reload(b: Broker, username: str, password: str, accepted: bool) -> None:
    """SIGHUP is asynchronous: poll (bounded) until Mosquitto has the new files."""
    def probe() -> bool:
        c = Client(b.port, username, password, f"probe-{time.monotonic_ns()}")
        ok = c.connect()
        c.close()
        return ok == accepted

    wait_for(probe, 10, f"Mosquitto {'accepting' if accepted else 'refusing'} {username}")


def test_a_device_can_neither_publish_as_nor_read_another(broker: Broker):
    fleet = _fleet(broker)
    a, _ = _device(broker, "edge-a")
    b, _ = _device(broker, "edge-b")

    # anonymous and wrong-password connections are refused
    broker.probe("anonymous connect", not Client(broker.port, None, None, "anon").connect())
    broker.probe("edge-a with a wrong password", not Client(broker.port, "edge-a", "guess", "x").connect())
    broker.probe("edge-a's password as edge-b", not Client(broker.port, "edge-b", "nope", "y").connect())

    # edge-a publishes as edge-b (reported, telemetry, status) and sets desired states: all dropped
    for kind in ("reported", "telemetry", "status", "desired"):
        a.publish(proto.topic("edge-b", kind), b'{"spoofed": true}', retain=True)
    a.publish(proto.topic("edge-a", "desired"), b'{"spoofed": true}', retain=True)  # its own desired: fleet only
    a.publish(proto.topic("edge-a", "ack"), b'{"spoofed": true}')
    a.publish("elsewhere/topic", b"x")
    a.publish(proto.topic("edge-a", "status"), b"allowed")  # then one allowed message on the same connection
    first = fleet.next()
    assert first == (proto.topic("edge-a", "status"), b"allowed"), f"a spoofed publish got through: {first}"
    for what in ("reported", "telemetry", "status", "desired"):
        broker.probe(f"edge-a publishes edge-b's {what}", True)
    for what in ("own desired", "own ack", "a topic outside edgefleet"):
        broker.probe(f"edge-a publishes its {what}", True)

    # edge-a subscribes to edge-b's topics and to everything; the fleet publishes to edge-b, then to edge-a
    a.subscribe(proto.topic("edge-b", "desired"), proto.topic("edge-b", "ack"), proto.topic("edge-b", "reported"),
                f"{proto.PREFIX}/#", "#", f"{proto.PREFIX}/+/desired", proto.topic("edge-a", "desired"))
    fleet.publish(proto.topic("edge-b", "desired"), b"for b only", retain=True)
    fleet.publish(proto.topic("edge-b", "ack"), b"for b only")
    b.publish(proto.topic("edge-b", "reported"), b"b's report")
    assert fleet.next() == (proto.topic("edge-b", "reported"), b"b's report")  # edge-b itself may
    fleet.publish(proto.topic("edge-a", "desired"), b"for a")
    got = a.next()
    assert got == (proto.topic("edge-a", "desired"), b"for a"), f"edge-a read another device's topic: {got}"
    for what in ("desired", "ack", "reported (via edgefleet/#)", "anything (via #)"):
        broker.probe(f"edge-a reads edge-b's {what}", True)
    b.subscribe(proto.topic("edge-b", "desired"))
    assert b.next() == (proto.topic("edge-b", "desired"), b"for b only")  # while edge-b reads its own

    for c in (fleet, a, b):
        c.close()


def test_decommissioned_device_cannot_connect(broker: Broker):
    _, pw = _device(broker, "edge-c")
    broker.enroll.decommission("edge-c")
    _wait_reload(broker, "edge-c", pw, False)
    broker.probe("decommissioned edge-c connects", not Client(broker.port, "edge-c", pw, "c2").connect())
    token = broker.enroll.issue_token("edge-d")
    broker.enroll.redeem(token)
    with pytest.raises(BadRequest, match="already used"):
        broker.enroll.redeem(token)  # a token works once
    broker.probe("an enrollment token redeemed twice", True)
    with pytest.raises(BadRequest, match="unknown"):
        broker.enroll.redeem("eft_guessed")
    broker.probe("a guessed enrollment token", True)
    with pytest.raises(BadRequest, match="expired"):
        broker.enroll.redeem(broker.enroll.issue_token("edge-e", ttl=dt.timedelta(seconds=-1)))
    broker.probe("an expired enrollment token", True)


def test_the_agent_link_uses_its_credentials_over_tls(broker: Broker, tmp_path):
    fleet = _fleet(broker)
    creds = broker.enroll.redeem(broker.enroll.issue_token("edge-t"))
    _wait_reload(broker, "edge-t", creds.password, True)
    link = MqttLink("edge-t", f"mqtts://127.0.0.1:{broker.tls_port}", Spool(tmp_path / "spool"), "http://x", print,
                    security=MqttSecurity(creds.username, creds.password, ca_file=broker.pki["ca"]))
    link.start()
    try:
        topic, payload = fleet.next()
        assert topic == proto.topic("edge-t", "status") and b'"online"' in payload
    finally:
        link.stop()
    # plain MQTT to the TLS port, and TLS trusting another CA, both fail
    broker.probe("plain MQTT on the TLS listener",
                 not Client(broker.tls_port, creds.username, creds.password, "plain").connect())
    broker.probe("TLS with a client that trusts another CA", not Client(
        broker.tls_port, creds.username, creds.password, "wrong-ca", tls={"ca_certs": str(broker.pki["evil-ca"])}
    ).connect())
    fleet.close()


def test_mutual_tls_identity_is_the_certificate(broker: Broker):
    fleet = _fleet(broker)
    ca = str(broker.pki["ca"])
    a = Client(broker.mtls_port, None, None, "edge-a", tls={
        "ca_certs": ca, "certfile": str(broker.pki["edge-a"]),
        "keyfile": str(broker.pki["edge-a"].with_suffix(".key"))})
    assert a.connect(), "edge-a's certificate was refused"
    a.publish(proto.topic("edge-b", "reported"), b"spoofed")
    a.publish(proto.topic("edge-a", "reported"), b"mine")
    assert fleet.next() == (proto.topic("edge-a", "reported"), b"mine")
    broker.probe("edge-a (by certificate) publishes as edge-b", True)
    broker.probe("mTLS without a client certificate", not Client(
        broker.mtls_port, "edge-b", "x", "nocert", tls={"ca_certs": ca}).connect())
    broker.probe("mTLS with a certificate from another CA", not Client(broker.mtls_port, None, None, "impostor", tls={
        "ca_certs": ca, "certfile": str(broker.pki["impostor-b"]),
        "keyfile": str(broker.pki["impostor-b"].with_suffix(".key"))}).connect())
    a.close()
    fleet.close()


@pytest.mark.parametrize(("user", "topic", "action", "ok"), [
    ("edge-a", "edgefleet/v1/devices/edge-a/telemetry", "publish", True),
    ("edge-a", "edgefleet/v1/devices/edge-b/telemetry", "publish", False),
    ("edge-a", "edgefleet/v1/devices/edge-a/desired", "publish", False),
    ("edge-a", "edgefleet/v1/devices/edge-a/desired", "subscribe", True),
    ("edge-a", "edgefleet/v1/devices/+/desired", "subscribe", False),
    ("edge-a", "#", "subscribe", False),
    (None, "edgefleet/v1/devices/edge-a/status", "publish", False),
    (FLEET_USER, "$share/g/edgefleet/v1/devices/+/telemetry", "subscribe", True),
    (FLEET_USER, "elsewhere", "publish", False),
])
def test_the_rule_the_embedded_broker_applies(user, topic, action, ok):
    assert allowed(user, topic, action) is ok


def test_the_fleet_connects_over_tls_and_refuses_a_broker_it_cannot_verify(broker: Broker):
    from edgefleet.fleet.bridge import MqttBridge

    good = MqttBridge(f"mqtts://127.0.0.1:{broker.tls_port}", username=FLEET_USER, password=FLEET_PASSWORD,
                      ca_file=broker.pki["ca"])
    good.start()
    try:
        assert good.connected.wait(20), "the fleet did not connect to the TLS listener"
    finally:
        good.stop()
    wrong = MqttBridge(f"mqtts://127.0.0.1:{broker.tls_port}", username=FLEET_USER, password=FLEET_PASSWORD,
                       ca_file=broker.pki["evil-ca"])
    wrong.start()
    try:
        assert not wrong.connected.wait(3), "the fleet trusted a broker certificate from another CA"
    finally:
        wrong.stop()
    broker.probe("fleet link to a broker signed by another CA", True)


def test_the_readme_sample_config_sets_the_generated_size_limits():
    """The Mosquitto sample the docs give (docs/security.md; the README links it) is what operators copy: it carries
    the limits mosquitto_conf writes."""
    from edgefleet.fleet.acl import MAX_PACKET_BYTES, MAX_PAYLOAD_BYTES

    conf = mosquitto_conf(Path("/p"), Path("/a"), Path("/f")).splitlines()
    readme = [line.split("#")[0].strip() for line in (Path(__file__).parent.parent / "docs" / "security.md").read_text()
              .splitlines()]
    for line in (f"max_packet_size {MAX_PACKET_BYTES}", f"message_size_limit {MAX_PAYLOAD_BYTES}"):
        assert line in conf and line in readme, line
    assert MAX_PAYLOAD_BYTES == proto.MAX_MESSAGE_BYTES < MAX_PACKET_BYTES <= proto.MAX_MESSAGE_BYTES + 4096
