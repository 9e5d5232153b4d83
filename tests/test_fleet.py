"""The fleet server over real HTTP, a real Mosquitto and a real database (SQLite; PostgreSQL when reachable)."""

from __future__ import annotations

import json
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from edgefleet.protocol import mqtt as proto
from tests.conftest import postgres_db
from tests.fleet_harness import api, running_fleet
from tests.waiting import wait_for, watch


def device_client(broker_port: int, device_id: str) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-{device_id}")
    c.connect("127.0.0.1", broker_port)
    c.loop_start()
    return c


def listening(broker_port: int, device_id: str, topic: str, decode=lambda m: m) -> tuple[mqtt.Client, list]:
    """A client subscribed to ``topic``, its SUBACK received -> (the client, the messages it gets, each through
    ``decode``)."""
    c = device_client(broker_port, device_id)
    got: list = []
    subscribed = threading.Event()
    c.on_message = lambda cl, u, m: got.append(decode(m))
    c.on_subscribe = lambda *a: subscribed.set()
    c.subscribe(topic, qos=1)
    assert subscribed.wait(10), f"the broker never acknowledged the subscription to {topic}"
    return c, got


@pytest.fixture
def fleet(tmp_path, mosquitto, fleet_db):
    with running_fleet(tmp_path, mosquitto.url, db_url=fleet_db) as (fs, url):
        yield fs, url, mosquitto


def test_upload_register_rollout_and_desired_state(fleet, digits_bundle):
    fs, url, broker = fleet
    r = api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
    assert r.status_code == 201, r.text
    assert r.json()["target"] == "digits/1.0.0/x86-cpu.tar"
    assert api.post(f"{url}/api/v1/devices", json={"device_id": "cam-1"}).status_code == 201
    got = []
    c = device_client(broker.port, "cam-1")
    c.on_message = lambda cl, u, m: got.append(m)
    c.subscribe(proto.topic("cam-1", "desired"), qos=1)
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["cam-1"]})
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    wait_for(lambda: got)
    desired = proto.decode(proto.DesiredState, got[0].payload, "test")
    assert desired.rollout_id == rid and desired.target == "digits/1.0.0/x86-cpu.tar"
    # the device reports; the rollout finishes
    rep = proto.ReportedState(device_id="cam-1", ts=time.time(), state="installed", rollout_id=rid, model="digits",
                              version="1.0.0", running_model="digits", running_version="1.0.0")
    c.publish(proto.topic("cam-1", "reported"), proto.encode(rep), qos=1).wait_for_publish(5)
    wait_for(lambda: api.get(f"{url}/api/v1/rollouts/{rid}").json()["status"] == "succeeded")
    dev = api.get(f"{url}/api/v1/devices/cam-1").json()
    assert dev["running_version"] == "1.0.0" and dev["desired"]["version"] == "1.0.0"
    page = api.get(f"{url}/").text
    assert "cam-1" in page and "digits" in page and "succeeded" in page
    c.loop_stop()


def test_desired_state_is_retained_for_late_devices(fleet, digits_bundle):
    fs, url, broker = fleet
    api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
    api.post(f"{url}/api/v1/devices", json={"device_id": "late"})
    watcher, seen = listening(broker.port, "late-watcher", proto.topic("late", "desired"))
    api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["late"]})
    wait_for(lambda: seen, 10, "the desired state published (before the device subscribes)")
    watcher.loop_stop()
    got = []
    c = device_client(broker.port, "late")
    c.on_message = lambda cl, u, m: got.append(m)
    c.subscribe(proto.topic("late", "desired"), qos=1)
    wait_for(lambda: got)
    assert got[0].retain
    c.loop_stop()


def test_status_last_will_marks_device_offline(fleet):
    fs, url, broker = fleet
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dying")
    will = proto.StatusMessage(device_id="dying", ts=0, state="offline")
    c.will_set(proto.topic("dying", "status"), proto.encode(will), qos=1, retain=True)
    c.connect("127.0.0.1", broker.port, keepalive=5)
    c.loop_start()
    online = proto.StatusMessage(device_id="dying", ts=time.time(), state="online", agent_version="0.1.0")
    c.publish(proto.topic("dying", "status"), proto.encode(online), qos=1, retain=True).wait_for_publish(5)
    wait_for(lambda: api.get(f"{url}/api/v1/devices/dying").status_code == 200 and
             api.get(f"{url}/api/v1/devices/dying").json()["online"])
    c.loop_stop()
    c._sock.close()  # the device dies without a DISCONNECT: the broker publishes the will
    wait_for(lambda: not api.get(f"{url}/api/v1/devices/dying").json()["online"], timeout_s=20)


def telemetry(device_id: str, seq: int, stream: str = "0123456789abcdef") -> proto.Telemetry:
    return proto.Telemetry(device_id=device_id, ts=time.time(), stream=stream, seq=seq, interval_s=1, model=None,
                           version=None, requests=seq, errors=0,
                           latency=proto.LatencySummary(p50_ms=1.0, p95_ms=2.0, p99_ms=3.0, max_ms=4.0),
                           batches=1, batch_size_mean=1.0, batch_size_max=1, cpu_percent=1.0, rss_mb=10.0)


def ack_listener(broker_port: int, device_id: str) -> tuple[mqtt.Client, list[proto.TelemetryAck]]:
    """A fake device that collects the fleet's telemetry acks."""
    return listening(broker_port, device_id, proto.topic(device_id, "ack"),
                     lambda m: proto.decode(proto.TelemetryAck, m.payload, "ack"))


def test_telemetry_is_stored_once_and_acked(fleet):
    fs, url, broker = fleet
    c, acks = ack_listener(broker.port, "tele")
    for seq in (0, 1, 1, 2):  # QoS 1 may deliver a message twice
        c.publish(proto.topic("tele", "telemetry"), proto.encode(telemetry("tele", seq)), qos=1).wait_for_publish(5)
    # a re-imaged device starts a new spool: its seq 0 is a new record, not a duplicate
    c.publish(proto.topic("tele", "telemetry"), proto.encode(telemetry("tele", 0, "fedcba9876543210")),
              qos=1).wait_for_publish(5)
    wait_for(lambda: fs.service.devices.telemetry_count("tele") == 4)
    rows = api.get(f"{url}/api/v1/devices/tele/telemetry").json()
    assert [(r["stream"][:4], r["seq"]) for r in rows] == [("fedc", 0), ("0123", 2), ("0123", 1), ("0123", 0)]
    # every delivery is acked, duplicates too (the first ack may have been lost); records stored in one
    # batch share an ack per device and stream
    def acked() -> list[tuple[str, int]]:
        return sorted((a.stream[:4], seq) for a in list(acks) for seq in a.seqs)

    wait_for(lambda: len(acked()) == 5)
    assert acked() == [("0123", 0), ("0123", 1), ("0123", 1), ("0123", 2), ("fedc", 0)]
    assert api.get(f"{url}/api/v1/devices/tele").json()["telemetry"]["stream"] == "fedcba9876543210"
    assert "p95 latency" in api.get(f"{url}/").text
    c.loop_stop()


def test_a_decommissioned_device_is_not_heard_until_it_enrolls_again(fleet):
    """On a broker the fleet does not manage (an open lab Mosquitto), or in the moment before a managed one
    drops the session, a decommissioned device can still publish: the fleet stores none of it, counts it,
    and the device stays decommissioned. Enrolling it again takes it back."""
    fs, url, broker = fleet
    c = device_client(broker.port, "gone")
    c.publish(proto.topic("gone", "telemetry"), proto.encode(telemetry("gone", 0)), qos=1).wait_for_publish(5)
    wait_for(lambda: fs.service.devices.telemetry_count("gone") == 1)
    r = api.post(f"{url}/api/v1/devices/gone/decommission")
    assert r.status_code == 200 and r.json()["last_state"] == "decommissioned"

    c.publish(proto.topic("gone", "status"), proto.encode(proto.StatusMessage(
        device_id="gone", ts=time.time(), state="online", agent_version="9.9.9")), qos=1).wait_for_publish(5)
    c.publish(proto.topic("gone", "reported"), proto.encode(proto.ReportedState(
        device_id="gone", ts=time.time(), state="installed", rollout_id=None, model="digits", version="1.0.0",
        running_model="digits", running_version="1.0.0")), qos=1).wait_for_publish(5)
    c.publish(proto.topic("gone", "telemetry"), proto.encode(telemetry("gone", 1)), qos=1).wait_for_publish(5)
    wait_for(lambda: api.get(f"{url}/api/v1/stats").json()["rejected"].get("decommissioned_device", 0) >= 3)
    doc = api.get(f"{url}/api/v1/devices/gone").json()
    assert (doc["last_state"], doc["online"], doc["running_version"]) == ("decommissioned", False, None), doc
    assert doc["agent_version"] != "9.9.9"
    assert fs.service.devices.telemetry_count("gone") == 1

    fs.service.devices.device_enrolled("gone")  # what POST /api/v1/enroll does after trading a new token
    c.publish(proto.topic("gone", "telemetry"), proto.encode(telemetry("gone", 2)), qos=1).wait_for_publish(5)
    wait_for(lambda: fs.service.devices.telemetry_count("gone") == 2)
    c.loop_stop()


def test_malformed_and_spoofed_messages_are_dropped_and_the_fleet_keeps_going(fleet):
    fs, url, broker = fleet
    c = device_client(broker.port, "evil")
    bad = [
        (proto.topic("evil", "telemetry"), b"{not json"),
        (proto.topic("evil", "telemetry"), json.dumps({"device_id": "evil", "seq": "x"}).encode()),
        (proto.topic("evil", "status"), proto.encode(proto.StatusMessage(device_id="victim", ts=0, state="online"))),
        (proto.topic("evil", "reported"), b"\xff\xfe"),
        (proto.topic("evil", "telemetry"), b"x" * (proto.MAX_MESSAGE_BYTES + 1)),
    ]
    for t, p in bad:
        c.publish(t, p, qos=1).wait_for_publish(5)
    wait_for(lambda: fs.bridge.rejected >= len(bad))
    assert api.get(f"{url}/api/v1/devices/victim").status_code == 404
    ok = proto.StatusMessage(device_id="evil", ts=time.time(), state="online")
    c.publish(proto.topic("evil", "status"), proto.encode(ok), qos=1).wait_for_publish(5)
    wait_for(lambda: api.get(f"{url}/api/v1/devices/evil").status_code == 200)
    c.loop_stop()


BAD_REQUESTS = [
    ("post", "/api/v1/devices", {"device_id": "a/b"}, 400, "must be 1-64"),
    ("post", "/api/v1/devices", {"device_id": "ok", "colour": 1}, 422, "colour"),
    ("post", "/api/v1/rollouts", {"model": "nope", "version": "1.0.0", "devices": ["x"]}, 404, "no model nope"),
    ("post", "/api/v1/rollouts", {"model": "digits", "version": "1.0.0", "devices": []}, 422, "devices"),
    ("get", "/api/v1/devices/ghost", None, 404, "no device 'ghost'"),
    ("get", "/api/v1/rollouts/999", None, 404, "no rollout 999"),
    ("get", "/tuf/metadata/../../fleet.db", None, 404, ""),
]


@pytest.mark.parametrize(("method", "path", "doc", "status", "msg"), BAD_REQUESTS, ids=[b[1] + str(b[3]) for b in
                                                                                      BAD_REQUESTS])
def test_bad_requests_get_clear_errors(fleet, method, path, doc, status, msg):
    fs, url, broker = fleet
    r = api.request(method.upper(), f"{url}{path}", json=doc)
    assert r.status_code == status, r.text
    assert msg in r.text


def test_bad_uploads(fleet, digits_bundle):
    fs, url, broker = fleet
    r = api.post(f"{url}/api/v1/bundles", content=b"not a tar at all")
    assert r.status_code == 422 and "not a valid bundle" in r.json()["error"]
    r = api.post(f"{url}/api/v1/bundles", content=b"")
    assert r.status_code == 400 and "empty body" in r.json()["error"]
    assert api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes()).status_code == 201
    r = api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
    assert r.status_code == 409 and "bump the version" in r.json()["error"]
    assert len(api.get(f"{url}/api/v1/models").json()) == 1


def test_oversized_upload_is_413_and_nothing_is_kept(tmp_path, mosquitto, digits_bundle):
    with running_fleet(tmp_path, mosquitto.url, max_upload_bytes=10_000) as (fs, url):
        r = api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
        assert r.status_code == 413 and "exceeds the 10000-byte limit" in r.json()["error"]

        def chunks():  # no Content-Length: the limit is enforced while streaming
            data = digits_bundle.read_bytes()
            for i in range(0, len(data), 4096):
                yield data[i : i + 4096]

        r = api.post(f"{url}/api/v1/bundles", content=chunks())
        assert r.status_code == 413
        assert api.get(f"{url}/api/v1/models").json() == []
        assert not list((tmp_path / "fleet" / "tuf").glob("upload-*"))


def test_rollout_to_unknown_device(fleet, digits_bundle):
    fs, url, broker = fleet
    api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["ghost"]})
    assert r.status_code == 404 and "unknown devices: ghost" in r.json()["error"]


def test_state_survives_a_fleet_restart(tmp_path, mosquitto, digits_bundle):
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
        api.post(f"{url}/api/v1/devices", json={"device_id": "keep"})
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        assert [m["version"] for m in api.get(f"{url}/api/v1/models").json()] == ["1.0.0"]
        assert api.get(f"{url}/api/v1/devices/keep").status_code == 200
        assert api.get(f"{url}/tuf/metadata/timestamp.json").status_code == 200


def test_postgresql_backend(tmp_path, mosquitto, digits_bundle):
    db = postgres_db("edgefleet_test")
    if db is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth): "
                    "the SQLite runs above cover the same code")
    with running_fleet(tmp_path, mosquitto.url, db_url=db) as (fs, url):
        assert api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes()).status_code == 201
        assert api.post(f"{url}/api/v1/devices", json={"device_id": "pg-1"}).status_code == 201
        r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["pg-1"]})
        assert r.status_code == 201
        c = device_client(mosquitto.port, "pg-1")
        for seq in (0, 0, 1):
            t = telemetry("pg-1", seq)
            c.publish(proto.topic("pg-1", "telemetry"), proto.encode(t), qos=1).wait_for_publish(5)
        wait_for(lambda: fs.service.devices.telemetry_count("pg-1") == 2)
        c.loop_stop()


def test_a_new_rollout_supersedes_an_unfinished_one(fleet, digits_bundle, digits_bundle_v2):
    fs, url, broker = fleet
    for b in (digits_bundle, digits_bundle_v2):
        api.post(f"{url}/api/v1/bundles", content=b.read_bytes())
    api.post(f"{url}/api/v1/devices", json={"device_id": "busy"})
    first = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0",
                                                       "devices": ["busy"]}).json()
    api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.1.0", "devices": ["busy"]})
    r = api.get(f"{url}/api/v1/rollouts/{first['id']}").json()
    assert r["status"] == "failed" and r["targets"][0]["error"] == f"superseded by rollout {first['id'] + 1}"


def test_bundle_that_failed_its_gate_is_not_published(fleet, digits_bundle, tmp_path):
    import io
    import json as _json
    import tarfile

    fs, url, broker = fleet
    bad = tmp_path / "gate.tar"
    with tarfile.open(digits_bundle) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name == "manifest.json":
                doc = _json.loads(data)
                doc["accuracy"].update(candidate=0.5, drop=doc["accuracy"]["reference"] - 0.5, passed=False)
                data = _json.dumps(doc).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    r = api.post(f"{url}/api/v1/bundles", content=bad.read_bytes())
    assert r.status_code == 422 and "failed its accuracy gate" in r.json()["error"]


def test_two_replicas_split_telemetry_through_a_shared_subscription(tmp_path, mosquitto):
    """Two fleet servers on one database and one broker: each record is stored once and acked."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        replicas = [stack.enter_context(running_fleet(tmp_path, mosquitto.url, shared_subscription_group="fleet"))
                    for _ in range(2)]
        c, acks = ack_listener(mosquitto.port, "busy-cam")
        for seq in range(40):
            c.publish(proto.topic("busy-cam", "telemetry"), proto.encode(telemetry("busy-cam", seq)), qos=1)
        wait_for(lambda: {s for a in acks for s in a.seqs} == set(range(40)), 20, "all records acked")
        assert replicas[0][0].service.devices.telemetry_count("busy-cam") == 40
        per_replica = [fs.bridge.handled["telemetry"] for fs, _ in replicas]
        assert sum(per_replica) == 40 and min(per_replica) > 0, per_replica  # the load was split
        for _fs, url in replicas:  # both replicas serve the same state
            assert len(api.get(f"{url}/api/v1/devices/busy-cam/telemetry?limit=100").json()) == 40
        c.loop_stop()


ANOTHER_ACK_S = 0.3  # the time a second (wrong) ack is given to show: an absence, not a wait


def test_unreadable_but_identifiable_telemetry_is_acked_as_rejected(fleet):
    fs, url, broker = fleet
    c, acks = ack_listener(broker.port, "future")
    doc = telemetry("future", 7).model_dump(mode="json") | {"v": 99, "new_field": 1}  # from a newer agent
    c.publish(proto.topic("future", "telemetry"), json.dumps(doc).encode(), qos=1).wait_for_publish(5)
    c.publish(proto.topic("future", "telemetry"), b"garbage", qos=1).wait_for_publish(5)  # not identifiable
    wait_for(lambda: acks)
    watch(lambda: len(acks) > 1, ANOTHER_ACK_S)
    assert len(acks) == 1
    assert acks[0].rejected == (7,) and acks[0].seqs == () and "newer" in acks[0].reason
    assert fs.service.devices.telemetry_count("future") == 0
    c.loop_stop()


def test_a_database_from_another_schema_is_refused(tmp_path):
    import sqlite3

    from edgefleet.fleet.db import make_engine
    from edgefleet.protocol.errors import ConfigError

    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE telemetry (id INTEGER PRIMARY KEY, device_id TEXT, seq INTEGER)")
    with pytest.raises(ConfigError, match="fresh --data-dir"):
        make_engine(f"sqlite:///{db}")
    fresh = f"sqlite:///{tmp_path / 'new.db'}"
    make_engine(fresh)[0].dispose()
    make_engine(fresh)[0].dispose()  # reopening its own schema is fine


def test_a_newer_schema_is_refused(tmp_path):
    import sqlite3

    from edgefleet.fleet.db import make_engine
    from edgefleet.protocol.errors import ConfigError

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    make_engine(url)[0].dispose()
    with sqlite3.connect(tmp_path / "fleet.db") as conn:
        conn.execute("UPDATE edgefleet_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(ConfigError, match=r"database schema 99.*cannot migrate it"):
        make_engine(url)
    with sqlite3.connect(tmp_path / "fleet.db") as conn:  # a revision of a newer edgefleet, schema number kept
        conn.execute("UPDATE edgefleet_meta SET value = '3' WHERE key = 'schema_version'")
        conn.execute("UPDATE alembic_version SET version_num = '0099'")
    with pytest.raises(ConfigError, match=r"revision 0099.*cannot migrate it"):
        make_engine(url)


def test_every_request_body_is_bounded_and_bad_ones_are_one_line_json(tmp_path, mosquitto):
    from edgefleet.fleet.api import MAX_BODY_BYTES

    with running_fleet(tmp_path, mosquitto.url) as (_, url):
        big = b'{"device_id": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
        r = api.post(f"{url}/api/v1/devices", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"], r.text

        def chunks():  # no Content-Length: the limit holds while the body streams
            for _ in range(20):
                yield b" " * (MAX_BODY_BYTES // 10)

        r = api.post(f"{url}/api/v1/devices", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        r = api.post(f"{url}/api/v1/devices", json={"labels": {}})
        assert r.status_code == 422 and r.json()["error"].startswith("invalid request: body.device_id"), r.text
        r = api.post(f"{url}/api/v1/devices", json={"device_id": "edge-ok"})  # the fleet still serves
        assert r.status_code == 201, r.text
        rejected = api.get(f"{url}/api/v1/stats").json()["rejected"]
        assert rejected.get("api_body_too_large") == 2 and rejected.get("api_invalid_request") == 1, rejected
