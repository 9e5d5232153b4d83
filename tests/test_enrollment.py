"""Enrollment through the fleet, end to end: one-time tokens over the REST API, the agent trading its token
for credentials, the embedded broker (what ``edgefleet demo`` runs) enforcing the same ACL as Mosquitto,
and the fleet keeping a real Mosquitto's password and ACL files current (SIGHUP).

A publish the broker drops is proven dropped by a later allowed message of the same connection arriving
at the fleet (MQTT keeps order per connection), never by waiting for a time.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import time

import pytest

from edgefleet.agent.config import AgentConfig
from edgefleet.agent.link.enroll import CREDENTIALS_FILE, EnrollmentRefused, mqtt_security
from edgefleet.fleet.acl import FLEET_USER, Account, hash_password, write_mosquitto_files
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.errors import ConfigError
from tests.conftest import free_port, wait_port
from tests.fleet_harness import api, running_fleet
from tests.test_mqtt_acl import MOSQUITTO_USER, Client
from tests.waiting import wait_for


def _token(url: str, device_id: str, ttl_s: float = 60.0) -> str:
    r = api.post(f"{url}/api/v1/devices/{device_id}/enrollment-token", json={"ttl_s": ttl_s})
    assert r.status_code == 201, r.text
    return r.json()["token"]


def _enroll(url: str, device_id: str) -> dict:
    r = api.post(f"{url}/api/v1/enroll", token=None, json={"token": _token(url, device_id)})
    assert r.status_code == 200, r.text
    return r.json()


def _device(port: int, creds: dict) -> Client:
    c = Client(port, creds["mqtt_username"], creds["mqtt_password"], creds["device_id"])
    assert c.connect(), f"{creds['device_id']} could not connect with its own credentials"
    return c


def _suback(c: Client, topic_filter: str) -> bool:
    """True if the broker granted the subscription."""
    got: queue.Queue = queue.Queue()
    c.c.on_subscribe = lambda client, userdata, mid, codes, props: got.put(codes)
    c.c.subscribe(topic_filter, qos=1)
    return not any(rc.is_failure for rc in got.get(timeout=10))


def _status(device_id: str) -> bytes:
    return proto.encode(proto.StatusMessage(device_id=device_id, ts=time.time(), state="online",
                                            agent_version=f"probe-{time.monotonic_ns()}"))


def _device_doc(url: str, device_id: str) -> dict:
    r = api.get(f"{url}/api/v1/devices/{device_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _barrier(url: str, c: Client, device_id: str) -> None:
    """Publish an allowed status and wait until the fleet stored it: everything the connection sent
    before has been delivered or dropped by then."""
    payload = _status(device_id)
    want = proto.decode(proto.StatusMessage, payload, "test").agent_version
    c.publish(proto.topic(device_id, "status"), payload)
    wait_for(lambda: _device_doc(url, device_id)["agent_version"] == want, 20, "the fleet storing the barrier status")


def test_the_embedded_broker_takes_only_enrolled_devices_each_on_its_own_topics(tmp_path):
    with running_fleet(tmp_path, None) as (fs, url):
        assert fs.broker is not None
        port = fs.broker.port
        assert api.get(f"{url}/api/v1/bootstrap", token=None).json()["mqtt_auth"] is True
        assert not Client(port, None, None, "anon").connect(), "an anonymous client got in"
        a, b = _enroll(url, "edge-a"), _enroll(url, "edge-b")
        assert not Client(port, "edge-a", "not-the-password", "guess").connect()
        assert not Client(port, FLEET_USER, "guess", "fleet-guess").connect()

        ca = _device(port, a)
        spoof = proto.ReportedState(device_id="edge-b", ts=time.time(), state="failed", rollout_id=None,
                                    model="digits", version="9", running_model=None, running_version=None,
                                    error="spoofed")
        ca.publish(proto.topic("edge-b", "reported"), proto.encode(spoof))
        ca.publish(proto.topic("edge-b", "status"), proto.encode(
            proto.StatusMessage(device_id="edge-b", ts=time.time(), state="offline")))
        _barrier(url, ca, "edge-a")
        edge_b = _device_doc(url, "edge-b")
        assert edge_b["last_state"] is None and edge_b["last_error"] is None, edge_b

        assert _suback(ca, proto.topic("edge-a", "desired")), "a device may read its own desired state"
        assert not _suback(ca, proto.topic("edge-b", "desired"))
        assert not _suback(ca, f"{proto.PREFIX}/+/desired")
        assert not _suback(ca, "#")
        ca.close()

        # a will is a publish at a later time: it may only name the device's own topics
        will = Client(port, a["mqtt_username"], a["mqtt_password"], "edge-a")  # its own id: only the will is wrong
        will.c.will_set(proto.topic("edge-b", "status"), b"{}", qos=1, retain=True)
        assert not will.connect(), "a will on another device's topic was accepted"

        # a token works once; a decommissioned device cannot connect
        token = _token(url, "edge-c")
        assert api.post(f"{url}/api/v1/enroll", token=None, json={"token": token}).status_code == 200
        again = api.post(f"{url}/api/v1/enroll", token=None, json={"token": token})
        assert again.status_code == 401 and "already used" in again.json()["error"]
        cb = _device(port, b)  # connected when it is decommissioned
        r = api.post(f"{url}/api/v1/devices/edge-b/decommission")
        assert r.status_code == 200 and r.json()["last_state"] == "decommissioned"
        assert not Client(port, b["mqtt_username"], b["mqtt_password"], "edge-b").connect()
        assert not _suback(cb, proto.topic("edge-b", "desired")), "a decommissioned session still subscribes"
        cb.publish(proto.topic("edge-b", "status"), _status("edge-b"))  # dropped by the broker
        ca2 = _device(port, a)
        _barrier(url, ca2, "edge-a")
        assert _device_doc(url, "edge-b")["last_state"] == "decommissioned"
        assert not _device_doc(url, "edge-b")["agent_version"], "a decommissioned session's status got through"
        cb.close()
        ca2.close()
        assert api.get(f"{url}/api/v1/stats").json()["rejected"].get("enroll_refused", 0) >= 1


def test_enrollment_needs_a_token_and_the_operator_role(tmp_path):
    with running_fleet(tmp_path, None) as (_, url):
        r = api.post(f"{url}/api/v1/devices/edge-a/enrollment-token", token=None, json={})
        assert r.status_code == 401
        viewer = api.post(f"{url}/api/v1/tokens", json={"name": "watcher", "role": "viewer"}).json()["token"]
        r = api.post(f"{url}/api/v1/devices/edge-a/enrollment-token", token=viewer, json={})
        assert r.status_code == 403 and "operator" in r.json()["error"]
        operator = api.post(f"{url}/api/v1/tokens", json={"name": "ops", "role": "operator"}).json()["token"]
        _token(url, "edge-a")
        r = api.post(f"{url}/api/v1/devices/edge-a/decommission", token=operator)
        assert r.status_code == 403 and "admin" in r.json()["error"]
        assert api.post(f"{url}/api/v1/enroll", token=None, json={"token": "eft_" + "x" * 40}).status_code == 401
        actions = [e["action"] for e in api.get(f"{url}/api/v1/audit").json()]
        assert "enrollment_token_issued" in actions


def test_the_agent_trades_its_token_once_and_keeps_the_credentials(tmp_path):
    with running_fleet(tmp_path, None) as (_, url):
        def cfg(device_id: str, **kw: object) -> AgentConfig:
            return AgentConfig(device_id=device_id, fleet_url=url, data_dir=tmp_path / device_id, **kw)

        with pytest.raises(ConfigError, match="--enroll-token"):
            mqtt_security(cfg("edge-a"), mqtt_auth=True)
        with pytest.raises(EnrollmentRefused, match="edgefleet fleet enroll edge-a"):
            mqtt_security(cfg("edge-a", enroll_token="eft_" + "y" * 40), mqtt_auth=True)
        with pytest.raises(EnrollmentRefused, match="issued for device 'edge-b'"):
            mqtt_security(cfg("edge-a", enroll_token=_token(url, "edge-b")), mqtt_auth=True)
        assert not (tmp_path / "edge-a" / CREDENTIALS_FILE).exists()

        sec = mqtt_security(cfg("edge-a", enroll_token=_token(url, "edge-a")), mqtt_auth=True)
        stored = tmp_path / "edge-a" / CREDENTIALS_FILE
        assert sec.username == "edge-a" and sec.password and stored.stat().st_mode & 0o777 == 0o600
        assert mqtt_security(cfg("edge-a"), mqtt_auth=True) == sec, "a restart must not need the token again"
        explicit = mqtt_security(cfg("edge-a", mqtt_username="u", mqtt_password="p"), mqtt_auth=True)
        assert (explicit.username, explicit.password) == ("u", "p")
        assert mqtt_security(cfg("edge-z"), mqtt_auth=False).username is None  # an open lab broker
        with pytest.raises(ValueError, match="go together"):
            cfg("edge-a", mqtt_cert_file=tmp_path / "c.pem")


def test_the_fleet_keeps_mosquittos_accounts_current(tmp_path):
    """Mosquitto with allow_anonymous false: the fleet writes its password and ACL files and SIGHUPs it."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    passwd, acl, pid_file = tmp_path / "passwd", tmp_path / "acl", tmp_path / "mosquitto.pid"
    fleet_password = "fleet-password-for-this-test"
    write_mosquitto_files([Account(FLEET_USER, hash_password(fleet_password))], passwd, acl)
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"{MOSQUITTO_USER}allow_anonymous false\npassword_file {passwd}\nacl_file {acl}\n"
                    f"persistence false\nlistener {port} 127.0.0.1\n")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        pid_file.write_text(str(proc.pid))  # Mosquitto writes its own only when it daemonizes
        with running_fleet(tmp_path, f"mqtt://127.0.0.1:{port}", mqtt_username=FLEET_USER,
                           mqtt_password=fleet_password, mosquitto_password_file=passwd, mosquitto_acl_file=acl,
                           mosquitto_pid_file=pid_file) as (_, url):
            assert api.get(f"{url}/api/v1/bootstrap", token=None).json()["mqtt_auth"] is True
            assert not Client(port, None, None, "anon").connect()
            creds = _enroll(url, "edge-m")
            assert "edge-m:" in passwd.read_text() and os.stat(passwd).st_mode & 0o777 == 0o640
            # Mosquitto rereads the files when it handles the SIGHUP
            wait_for(lambda: Client(port, creds["mqtt_username"], creds["mqtt_password"], "edge-m").connect(), 10,
                     "Mosquitto accepting the enrolled device", interval_s=0.1)
            c = _device(port, creds)
            _barrier(url, c, "edge-m")  # the fleet (its own account) hears the device
            c.close()
            assert api.post(f"{url}/api/v1/devices/edge-m/decommission").status_code == 200
            wait_for(lambda: not Client(port, creds["mqtt_username"], creds["mqtt_password"], "edge-m2").connect(), 10,
                     "the decommissioned device refused", interval_s=0.1)
    finally:
        proc.terminate()
        proc.wait(10)



def test_simulated_devices_enroll_and_connect_to_the_embedded_broker(tmp_path):
    from edgefleet.fleet.simulator import SimConfig, Simulator, enroll_all

    with running_fleet(tmp_path, None) as (fs, url):
        assert fs.broker is not None
        ids = [f"sim-{i:05d}" for i in range(3)]
        with pytest.raises(ConnectionError, match="refused"):  # without accounts: refused at connect
            Simulator(SimConfig(mqtt_url=fs.broker.url, devices=1, prefix="anon")).start(timeout_s=30)
        sim = Simulator(SimConfig(mqtt_url=fs.broker.url, devices=3,
                                  passwords=enroll_all(url, ids, api.token)))
        sim.start(timeout_s=30)
        try:
            wait_for(lambda: all(_device_doc(url, d)["online"] for d in ids), 20,
                     "the enrolled simulated devices online", interval_s=0.1)
        finally:
            sim.stop()
