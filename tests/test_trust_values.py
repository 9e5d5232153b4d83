"""Bounded in value, and one bad rollout cannot stop the others (issue 30, the fleet's side), tried from outside:
one device on a real Mosquitto publishing what its schema admits, a real fleet (HTTP on loopback, SQLite and
PostgreSQL), an operator's REST calls.

Each test here failed on the main of 2026-11-26 (issue 30): telemetry records with ``requests = 2**62 - 1``
overflowed SQLite's integer ``sum()`` and stopped every rollout (the tick raised for good; listing and the overview
answered 500); counts an earlier release stored did the same, and on PostgreSQL a record added to them was lost; a
rollout whose stored spec could not be read stopped the others too; ``?offset=2**63`` answered 500; a gate of
``1e400`` was stored as Infinity and shown as null ("no gate"); a 200 KB label or tag was accepted; a report older
than the stored one rolled the device's recorded state back and was acked.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from edgefleet.fleet.errors import BadRequest
from edgefleet.protocol import mqtt as proto
from tests.conftest import wait_for
from tests.fleet_harness import api, fleet_with_digits
from tests.test_mqtt_acl import Client

STREAM = "0123456789abcdef"


def _status(device_id: str) -> bytes:
    return json.dumps({"v": 1, "device_id": device_id, "ts": time.time(), "kind": "status",
                       "state": "online"}).encode()


def _reported(device_id: str, rollout_id: int | None, state: str = "installed", version: str = "1.0.0",
              ts: float | None = None) -> bytes:
    return json.dumps({"v": 1, "device_id": device_id, "ts": time.time() if ts is None else ts, "kind": "reported",
                       "state": state, "rollout_id": rollout_id, "model": "digits", "version": version,
                       "running_model": "digits", "running_version": version}).encode()


def _telemetry(device_id: str, seq: int, requests: int, errors: int = 0, **extra: object) -> bytes:
    return json.dumps({"v": 1, "device_id": device_id, "ts": time.time(), "kind": "telemetry", "stream": STREAM,
                       "seq": seq, "interval_s": 10.0, "model": "digits", "version": "1.0.0",
                       "requests": requests, "errors": errors,
                       "latency": {"p50_ms": 1.0, "p95_ms": 2.0, "p99_ms": 3.0, "max_ms": 4.0},
                       "batches": 1, "batch_size_mean": 1.0, "batch_size_max": 1, "cpu_percent": 1.0,
                       "rss_mb": 100.0, **extra}).encode()


def _device(port: int) -> Client:
    c = Client(port, None, None, f"probe-{time.monotonic_ns()}")
    assert c.connect()
    return c


def _rollout(url: str, **body: object) -> int:
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", **body})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _get(url: str, rid: int) -> dict:
    r = api.get(f"{url}/api/v1/rollouts/{rid}?targets=false")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def fleet(tmp_path, mosquitto, fleet_db, digits_bundle) -> Iterator[tuple[object, str, Client]]:
    """A fleet (SQLite or PostgreSQL) with digits 1.0.0 uploaded and a client that publishes as any device."""
    with fleet_with_digits(tmp_path, mosquitto.url, fleet_db, digits_bundle, lambda: _device(mosquitto.port)) as f:
        yield f


def _online(url: str, dev: Client, *devices: str) -> None:
    for d in devices:
        dev.publish(proto.topic(d, "status"), _status(d), retain=True)
    wait_for(lambda: {d["device_id"] for d in api.get(f"{url}/api/v1/devices").json() if d["online"]} >= set(devices),
             20, f"{devices} online")


def _soaking_rollout(url: str, dev: Client, *devices: str) -> int:
    """A rollout whose one wave installs on ``devices`` and then soaks on, reading its figures at every tick: its
    p99 gate can never be judged (no device ran a model before) and telemetry is required."""
    rid = _rollout(url, devices=list(devices), gates={"error_rate_max": 0.5, "p99_ratio_max": 2.0},
                   require_telemetry=True)
    for d in devices:
        dev.publish(proto.topic(d, "reported"), _reported(d, rid))
    wait_for(lambda: _get(url, rid)["waves"][0]["state"] == "soaking", 20, f"rollout {rid}'s wave soaking")
    return rid


def _later_rollout_succeeds(url: str, dev: Client, device: str) -> int:
    rid = _rollout(url, devices=[device])
    dev.publish(proto.topic(device, "reported"), _reported(device, rid))
    wait_for(lambda: _get(url, rid)["status"] == "succeeded", 20, f"the later rollout {rid} succeeded")
    return rid


def _rejected(url: str) -> dict[str, int]:
    return api.get(f"{url}/api/v1/stats").json()["rejected"]


@pytest.mark.trust("telemetry counters near 2**62 from one device in a wave (the other rollouts go on)")
def test_huge_telemetry_counters_from_one_device_stop_no_rollout(fleet):
    fs, url, dev = fleet
    _online(url, dev, "edge-bad", "edge-ok", "edge-later")
    bad = _soaking_rollout(url, dev, "edge-bad", "edge-ok")
    dev.publish(proto.topic("edge-ok", "telemetry"), _telemetry("edge-ok", 0, 100))
    for seq in (0, 1):  # each within the per-message bound of the main of 2026-11-26 (2**62)
        dev.publish(proto.topic("edge-bad", "telemetry"), _telemetry("edge-bad", seq, 2**62 - 1))
    wait_for(lambda: fs.service.devices.telemetry_count() + _rejected(url).get("malformed_telemetry", 0) >= 3, 20,
             "the records stored or refused")
    later = _later_rollout_succeeds(url, dev, "edge-later")
    r = api.get(f"{url}/api/v1/rollouts")
    assert r.status_code == 200, r.text
    assert {x["id"] for x in r.json()} == {bad, later}
    assert api.get(f"{url}/").status_code == 200
    r = api.post(f"{url}/api/v1/rollouts/{bad}/abort")
    assert r.status_code == 200 and r.json()["status"] == "aborted", r.text
    assert _rejected(url).get("malformed_telemetry") == 2  # refused where they enter: past protocol.mqtt.MAX_COUNT


@pytest.mark.trust("counts near 2**62 stored by an earlier release: sums and additions cannot overflow")
def test_counts_an_earlier_release_stored_cannot_overflow_a_sum_or_an_addition(fleet):
    fs, url, dev = fleet
    _online(url, dev, "edge-a", "edge-b", "edge-later")
    rid = _soaking_rollout(url, dev, "edge-a", "edge-b")
    with fs.sessions.begin() as s:  # what the earlier release let devices store (each under its 2**62 bound)
        s.execute(text("UPDATE rollout_targets SET tele_requests = :n, tele_errors = :n WHERE rollout_id = :r"),
                  {"n": 2**62, "r": rid})
    # the sum over the wave's two targets, read by every tick (which stores the gates it judged) and the API
    def judged() -> dict | None:
        gates = {g["name"]: g for g in _get(url, rid)["waves"][0]["gates"] or []}
        return gates if gates.get("error_rate", {}).get("value") == pytest.approx(1.0) else None

    gates = wait_for(judged, 20, "the gates judged on the stored counts")
    assert "9223372036854775808 requests" in gates["error_rate"]["detail"], gates  # 2 * 2**62, past int64
    assert _get(url, rid).get("engine_error") is None
    with fs.sessions.begin() as s:
        s.execute(text("UPDATE rollout_targets SET tele_requests = :n WHERE rollout_id = :r"),
                  {"n": 2**63 - 16, "r": rid})
    # a record on top of a count near the limit is stored (PostgreSQL's BIGINT addition raised: the record was lost)
    dev.publish(proto.topic("edge-a", "telemetry"), _telemetry("edge-a", 0, 1000, errors=10))
    wait_for(lambda: fs.service.devices.telemetry_count("edge-a") == 1, 20, "the record stored")
    assert not any(k.startswith("ingest_failed") for k in _rejected(url)), _rejected(url)
    _later_rollout_succeeds(url, dev, "edge-later")
    assert api.get(f"{url}/api/v1/rollouts").status_code == 200
    assert api.get(f"{url}/").status_code == 200


@pytest.mark.trust("a rollout whose evaluation raises (its stored spec unreadable) stops no other")
def test_a_rollout_that_cannot_be_evaluated_is_marked_and_the_others_go_on(fleet):
    fs, url, dev = fleet
    _online(url, dev, "edge-a", "edge-later")
    rid = _soaking_rollout(url, dev, "edge-a")
    with fs.sessions.begin() as s:  # a row this release cannot read (written by hand, or by a newer release)
        s.execute(text("UPDATE rollouts SET spec = :spec WHERE id = :r"), {"spec": '{"waves": 5}', "r": rid})
    later = _later_rollout_succeeds(url, dev, "edge-later")
    # the broken one is marked, with the reason, in the API (list and rollout), the console and the audit log
    listed = {x["id"]: x for x in api.get(f"{url}/api/v1/rollouts").json()}
    assert listed[later]["status"] == "succeeded" and listed[later].get("engine_error") is None
    err = wait_for(lambda: _get(url, rid).get("engine_error"), 20, "the rollout marked")
    assert "ValidationError" in err and "waves" in err, err
    assert listed[rid]["status"] == "in_progress"
    assert _get(url, rid)["engine_error_at"]
    assert "ValidationError" in api.get(f"{url}/").text
    page = api.get(f"{url}/rollouts/{rid}")
    assert page.status_code == 200 and "cannot evaluate this rollout" in page.text and "ValidationError" in page.text
    log = api.get(f"{url}/api/v1/rollouts/{rid}/audit").json()
    assert [a["action"] for a in log].count("rollout_engine_error") == 1  # once per distinct reason, not per tick
    # the operator aborts it: answered, and the mark goes with the state change
    r = api.post(f"{url}/api/v1/rollouts/{rid}/abort")
    assert r.status_code == 200 and r.json()["status"] == "aborted" and r.json().get("engine_error") is None, r.text


@pytest.mark.trust("REST query numbers past 64 bits and non-finite or out-of-range gate thresholds")
def test_query_numbers_and_gate_thresholds_have_ranges(fleet):
    fs, url, dev = fleet
    _online(url, dev, "edge-a")
    for path in ("/api/v1/devices?offset=9223372036854775808", "/api/v1/devices?limit=1&offset=-1",
                 "/api/v1/rollouts?limit=9223372036854775808", "/api/v1/audit?limit=0",
                 "/api/v1/devices/edge-a/telemetry?limit=9223372036854775808",
                 "/api/v1/rollouts/1?targets_offset=9223372036854775808"):
        r = api.get(url + path)
        assert r.status_code == 422, (path, r.status_code, r.text)
        assert "less than or equal" in r.json()["error"] or "greater than" in r.json()["error"], r.text
    body = b'{"model": "digits", "version": "1.0.0", "devices": ["edge-a"], "gates": {"p99_ratio_max": 1e400}}'
    r = api.post(f"{url}/api/v1/rollouts", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "p99_ratio_max" in r.json()["error"] and "finite" in r.json()["error"], r.text
    for gates in ({"p99_ratio_max": 1e6}, {"error_rate_max": 2}, {"install_success_min": -1}):
        r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["edge-a"],
                                                      "gates": gates})
        assert r.status_code == 422 and next(iter(gates)) in r.json()["error"], r.text
    for extra in ({"offline_grace_s": 1e12}, {"soak_s": [1e9]}, {"waves": ["1" * 5000]},
                  {"shadow": {"max_abs_error": 1e300}}):
        r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["edge-a"],
                                                      **extra})
        assert r.status_code == 422, (extra, r.text)
    # the console's form says so too, and stores nothing
    page = api.post(f"{url}/console/rollouts", content="model_version=digits+1.0.0&devices=edge-a&p99_ratio_max=1e400"
                    "&shadow=1&shadow_samples=1e400", headers={"Origin": url,
                                                              "Content-Type": "application/x-www-form-urlencoded"})
    assert page.status_code == 400 and "rollout not started" in page.text, page.text[:500]
    assert api.get(f"{url}/api/v1/rollouts").json() == []


@pytest.mark.trust("a 200 KB label or tag value (and a long label name) on a device")
def test_labels_and_tags_are_bounded(fleet):
    fs, url, dev = fleet
    big = "x" * 200_000
    for body in ({"device_id": "edge-l", "labels": {"site": big}}, {"device_id": "edge-l", "labels": {big: "a"}},
                 {"device_id": "edge-l", "tags": [big]}, {"device_id": "edge-l", "tags": [""]},
                 {"device_id": "edge-l", "labels": {f"k{i}": "v" for i in range(100)}}):
        r = api.post(f"{url}/api/v1/devices", json=body)
        assert r.status_code == 422 and len(r.text) < 2000, (r.status_code, r.text[:300])
    assert api.post(f"{url}/api/v1/devices", json={"device_id": "edge-l", "labels": {"site": "a" * 256},
                                                   "tags": ["t" * 64]}).status_code == 201
    r = api.patch(f"{url}/api/v1/devices/edge-l", json={"tags": [big]})
    assert r.status_code == 422, r.text[:300]
    assert api.get(f"{url}/api/v1/devices/edge-l").json()["tags"] == ["t" * 64]
    # the service itself (the console and the CLI call it)
    with pytest.raises(BadRequest, match="has 200000 characters: 1 to 64"):
        fs.service.rollouts.create_rollout("digits", "1.0.0", tags=[big])


@pytest.mark.trust("a device's report older than the one stored (a replay): dropped, not acked")
def test_a_stale_report_is_dropped_and_not_acked(fleet, mosquitto):
    fs, url, dev = fleet
    acks: queue.Queue[proto.TelemetryAck] = queue.Queue()
    watcher = _device(mosquitto.port)
    watcher.c.on_message = lambda c, u, m: acks.put(proto.decode(proto.TelemetryAck, m.payload, "ack"))
    watcher.subscribe(proto.topic("edge-s", "ack"))
    now = time.time()
    dev.publish(proto.topic("edge-s", "reported"), _reported("edge-s", None, ts=now))
    assert acks.get(timeout=20).report_ts == pytest.approx(now)
    dev.publish(proto.topic("edge-s", "reported"), _reported("edge-s", None, state="downloading", version="0.9.0",
                                                             ts=now - 60))

    def dropped_or_acked() -> bool:
        return _rejected(url).get("stale_report", 0) == 1 or not acks.empty()

    wait_for(dropped_or_acked, 20, "the stale report dropped or acked")
    doc = api.get(f"{url}/api/v1/devices/edge-s").json()
    assert (doc["last_state"], doc["running_version"]) == ("installed", "1.0.0"), doc
    # a newer report is stored and acked; nothing acked the stale one before it (acks go out in order)
    dev.publish(proto.topic("edge-s", "reported"), _reported("edge-s", None, ts=now + 1))
    got = acks.get(timeout=20)
    assert got.report_ts == pytest.approx(now + 1), f"the stale report (ts {now - 60}) was acked: {got}"
    watcher.c.loop_stop()


def test_a_device_clock_that_ran_ahead_does_not_silence_it(fleet, monkeypatch):
    """Report order trusts the device's clock only up to the fleet's own (``REPORT_CLOCK_AHEAD_S``, 0 here): a
    device whose clock ran a day ahead and was set back is heard again at once, not a day later."""
    from edgefleet.fleet.service import ingest as svc

    monkeypatch.setattr(svc, "REPORT_CLOCK_AHEAD_S", 0.0)
    fs, url, dev = fleet
    now = time.time()
    dev.publish(proto.topic("edge-c", "reported"), _reported("edge-c", None, state="downloading", ts=now + 86400))
    wait_for(lambda: api.get(f"{url}/api/v1/devices/edge-c").json().get("last_state") == "downloading", 20,
             "the report from the future stored")
    dev.publish(proto.topic("edge-c", "reported"), _reported("edge-c", None, ts=time.time() + 1))  # clock set right
    wait_for(lambda: api.get(f"{url}/api/v1/devices/edge-c").json().get("last_state") == "installed", 20,
             "the next report stored")
    assert "stale_report" not in _rejected(url)
