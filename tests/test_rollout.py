"""Rollouts in waves against a real Mosquitto, a real fleet (HTTP on loopback, SQLite) and simulated agents."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import event

from edgefleet.fleet.rollout import (
    TRANSITIONS,
    Gates,
    RolloutSpec,
    WaveFigures,
    evaluate_gates,
    install_gate_lost,
    plan_waves,
)
from edgefleet.fleet.simulator import fails
from edgefleet.protocol import mqtt as proto
from tests.conftest import wait_for
from tests.fleet_harness import api, running_fleet


# -- pure parts --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "waves", "sizes"), [
    (1000, ("1%", "10%", "50%", "100%"), [10, 90, 400, 500]),
    (10, ("1%", "10%", "50%", "100%"), [1, 4, 5]),  # 1% and 10% of 10 both round up to 1 device
    (7, ("2", "100%"), [2, 5]),
    (3, ("5",), [3]),
    (5, ("20%",), [1, 4]),  # the last wave always reaches everyone
])
def test_plan_waves(n, waves, sizes):
    assert plan_waves(n, waves) == sizes
    assert sum(sizes) == n


@pytest.mark.parametrize("bad", [("0%",), ("150%",), ("x",), ("0",), ("-5",)])
def test_bad_waves_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=bad[0].replace("%", "")):
        RolloutSpec(waves=bad)


def test_gates_are_pure_functions_of_the_figures():
    g = Gates(install_success_min=0.9, error_rate_max=0.01, p99_ratio_max=1.5)
    ok = WaveFigures(size=10, installed=10, failed=0, requests=1000, errors=5, p99_before_ms=10, p99_after_ms=12,
                     p99_devices=10)
    assert all(r.passed for r in evaluate_gates(ok, g))
    slow = WaveFigures(10, 10, 0, 1000, 5, 10, 16, 10)
    assert [r.name for r in evaluate_gates(slow, g) if not r.passed] == ["p99_latency_ratio"]
    errors = WaveFigures(10, 10, 0, 1000, 20, 10, 10, 10)
    assert [r.name for r in evaluate_gates(errors, g) if not r.passed] == ["error_rate"]
    broken = WaveFigures(10, 7, 3, 0, 0, None, None, 0)
    res = evaluate_gates(broken, g)
    assert [r.name for r in res if not r.passed] == ["install_success"]
    assert [r.value for r in res if r.name != "install_success"] == [None, None]  # no data: not judged
    assert install_gate_lost(WaveFigures(10, 0, 2, 0, 0, None, None, 0), g)  # 2 of 10 failed: 0.9 unreachable
    assert not install_gate_lost(WaveFigures(10, 0, 1, 0, 0, None, None, 0), g)


def test_transition_table_is_closed():
    assert set().union(*TRANSITIONS.values()) <= set(TRANSITIONS)
    assert TRANSITIONS["rolled_back"] == frozenset()
    assert "in_progress" not in TRANSITIONS["failed"] | TRANSITIONS["aborted"] | TRANSITIONS["succeeded"]


def test_simulated_failures_are_spread_evenly():
    assert [i for i in range(10) if fails(i, 0.3)] == [3, 6, 9]
    assert sum(fails(i, 0.3) for i in range(1000)) == 300
    assert not any(fails(i, 0.0) for i in range(100))


# -- against the real thing ------------------------------------------------------------------------------
@pytest.fixture
def fleet(tmp_path, mosquitto, fleet_db):
    with running_fleet(tmp_path, mosquitto.url, rollout_tick_s=0.05, db_url=fleet_db) as (fs, url):
        yield fs, url, mosquitto


def upload(url, *bundles):
    for b in bundles:
        r = api.post(f"{url}/api/v1/bundles", content=b.read_bytes())
        assert r.status_code == 201, r.text


def online(url, n):
    return wait_for(lambda: sum(d["online"] for d in api.get(f"{url}/api/v1/devices").json()) == n, 30,
                    f"{n} devices online")


def rollout(url, **body):
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", **body})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def status(url, rid):
    return api.get(f"{url}/api/v1/rollouts/{rid}?targets=false").json()


def until(url, rid, *states, timeout_s=60):
    return wait_for(lambda: (r := status(url, rid))["status"] in states and r, timeout_s, f"rollout in {states}")


def audit_log(url, rid):
    """Oldest first."""
    return list(reversed(api.get(f"{url}/api/v1/rollouts/{rid}/audit").json()))


def actions(url, rid):
    """The rollout's and its waves' audit actions, oldest first; the targets' own rows ("targets_<state>",
    written as devices report, so interleaved with the rest by timing) are left out."""
    return [a["action"] for a in audit_log(url, rid) if not a["action"].startswith("targets_")]


def target_moves(url, rid, action):
    """(device, wave) of every target move the audit log records with ``action``, e.g. targets_failed."""
    return sorted((d, a["detail"]["wave"]) for a in audit_log(url, rid) if a["action"] == action
                  for d in a["detail"]["devices"])


def test_waves_advance_through_their_gates_to_every_device(fleet, sims, digits_bundle):
    fs, url, broker = fleet
    upload(url, digits_bundle)
    sim = sims(mqtt_url=broker.url, devices=20, install_s=0.01)
    online(url, 20)
    rid = rollout(url, version="1.0.0", profile="x86-cpu", waves=["5%", "25%", "100%"], soak_s=[0.1],
                  gates={"install_success_min": 0.9})
    r = until(url, rid, "succeeded")
    assert [(w["size"], w["state"], w["installed"]) for w in r["waves"]] == [(1, "passed", 1), (4, "passed", 4),
                                                                            (15, "passed", 15)]
    assert r["counts"] == {"installed": 20} and sim.stats.installed == 20
    log = actions(url, rid)
    assert log[0] == "rollout_created" and log[-1] == "rollout_succeeded"
    assert log.count("wave_started") == 3 and log.count("wave_passed") == 3
    assert target_moves(url, rid, "targets_installed") == sorted((f"sim-{i:05d}", w) for i, w in zip(
        range(20), [0] + [1] * 4 + [2] * 15, strict=True))  # every device's install, in its wave
    assert all(d["running_version"] == "1.0.0" for d in api.get(f"{url}/api/v1/devices").json())


def test_install_failures_halt_the_rollout_before_its_next_wave_and_roll_the_wave_back(
        fleet, sims, digits_bundle, digits_bundle_v2):
    fs, url, broker = fleet
    upload(url, digits_bundle, digits_bundle_v2)
    sim = sims(mqtt_url=broker.url, devices=20, install_s=0.01, failure_rate_by_version={"1.1.0": 0.3})
    online(url, 20)
    until(url, rollout(url, version="1.0.0", profile="x86-cpu"), "succeeded")
    rid = rollout(url, version="1.1.0", profile="x86-cpu", waves=["10", "100%"], gates={"install_success_min": 0.9},
                  on_failure="pause", rollback_on_failure=True)
    r = until(url, rid, "paused")
    w1, w2 = r["waves"]
    assert w1["state"] == "failed" and w2["state"] == "pending"  # wave 2 never started
    gate = w1["gates"][0]
    assert gate["name"] == "install_success" and not gate["passed"] and gate["threshold"] == 0.9
    assert "install_success" in r["reason"] and "wave 1" in r["reason"]
    targets = api.get(f"{url}/api/v1/rollouts/{rid}").json()["targets"]
    assert all(t["state"] == "pending" for t in targets if t["wave"] == 1)  # no desired state went out
    # the wave's devices that installed 1.1.0 are sent back to 1.0.0 and say so
    wait_for(lambda: {t["state"] for t in api.get(f"{url}/api/v1/rollouts/{rid}").json()["targets"]
                      if t["wave"] == 0} <= {"rolled_back", "failed"}, 30, "wave 1 rolled back")
    devs = {d["device_id"]: d for d in api.get(f"{url}/api/v1/devices").json()}
    assert all(devs[f"sim-{i:05d}"]["running_version"] == "1.0.0" for i in range(20))
    assert sim.stats.failed == 3  # devices 3, 6 and 9 of wave 1
    log = actions(url, rid)
    assert "wave_failed" in log and "rollback_sent" in log and log[-1] == "rollout_paused"
    failed = [a for a in audit_log(url, rid) if a["action"] == "targets_failed"]
    assert sorted(d for a in failed for d in a["detail"]["devices"]) == ["sim-00003", "sim-00006", "sim-00009"]
    assert all(a["actor"] == "devices" and a["detail"]["cause"] == "report" and "simulated install failure"
               in str(a["detail"].get("error")) + str(a["detail"].get("errors")) for a in failed)
    assert [d for d, _ in target_moves(url, rid, "targets_rolling_back")] == [f"sim-{i:05d}" for i in range(10)]
    assert [d for d, _ in target_moves(url, rid, "targets_rolled_back")] == [f"sim-{i:05d}" for i in range(10)]
    # an operator aborts it; a later resume is refused by the state machine
    r = api.post(f"{url}/api/v1/rollouts/{rid}/abort")
    assert r.status_code == 200 and r.json()["status"] == "aborted"
    r = api.post(f"{url}/api/v1/rollouts/{rid}/resume")
    assert r.status_code == 409 and "aborted" in r.json()["error"]
    assert api.get(f"{url}/api/v1/rollouts/{rid}/audit").json()[0]["actor"] == "admin"  # newest first


def test_a_slower_model_fails_the_p99_gate_against_the_same_devices_previous_model(
        fleet, sims, digits_bundle, digits_bundle_v2):
    fs, url, broker = fleet
    upload(url, digits_bundle, digits_bundle_v2)
    sim = sims(mqtt_url=broker.url, devices=6, install_s=0.01, p99_ms=10.0, p99_factor_by_version={"1.1.0": 3.0})
    online(url, 6)
    until(url, rollout(url, version="1.0.0", profile="x86-cpu"), "succeeded")
    sim.send_telemetry()  # the baseline: p99 10 ms on 1.0.0
    wait_for(lambda: fs.service.devices.telemetry_count() == 6, 20, "baseline telemetry stored")
    rid = rollout(url, version="1.1.0", profile="x86-cpu", waves=["2", "100%"], require_telemetry=True,
                  gates={"install_success_min": 1.0, "p99_ratio_max": 1.5, "error_rate_max": 0.05},
                  on_failure="abort")
    wait_for(lambda: status(url, rid)["waves"][0]["state"] == "soaking", 20, "wave 1 soaking")
    assert status(url, rid)["status"] == "in_progress"  # no figures yet: it waits for them
    sim.send_telemetry()  # now on 1.1.0 for the two devices of wave 1: p99 30 ms
    r = until(url, rid, "failed")
    gates = {g["name"]: g for g in r["waves"][0]["gates"]}
    assert not gates["p99_latency_ratio"]["passed"] and gates["p99_latency_ratio"]["value"] == pytest.approx(3.0)
    assert gates["error_rate"]["passed"] and gates["install_success"]["passed"]
    assert r["waves"][1]["state"] == "pending"


def test_an_offline_device_converges_when_it_returns(fleet, sims, digits_bundle):
    fs, url, broker = fleet
    upload(url, digits_bundle)
    sim = sims(mqtt_url=broker.url, devices=5, install_s=0.01)
    online(url, 5)
    sim.kill([4])  # dies without a goodbye: the broker publishes its last will
    wait_for(lambda: not api.get(f"{url}/api/v1/devices/sim-00004").json()["online"], 20, "sim-00004 offline")
    rid = rollout(url, version="1.0.0", profile="x86-cpu", waves=["2", "100%"], offline_grace_s=0)
    r = until(url, rid, "succeeded")
    assert r["counts"] == {"installed": 4, "pending": 1}
    assert "wave_offline_deferred" in actions(url, rid)
    sim.revive([4])  # back: its retained desired state is waiting for it
    wait_for(lambda: status(url, rid)["counts"] == {"installed": 5}, 20, "sim-00004 converged")
    assert api.get(f"{url}/api/v1/devices/sim-00004").json()["running_version"] == "1.0.0"


def test_a_fleet_restart_mid_rollout_resumes_where_it_was(tmp_path, mosquitto, sims, digits_bundle):
    with running_fleet(tmp_path, mosquitto.url, rollout_tick_s=0.05) as (fs, url):
        upload(url, digits_bundle)
        sims(mqtt_url=mosquitto.url, devices=6, install_s=0.01)
        online(url, 6)
        # wave 1 soaks a second, so the pause lands inside it even on a loaded machine
        rid = rollout(url, version="1.0.0", profile="x86-cpu", waves=["2", "100%"], soak_s=[1.0])
        assert api.post(f"{url}/api/v1/rollouts/{rid}/pause").json()["status"] == "paused"
        wait_for(lambda: status(url, rid)["waves"][0]["installed"] == 2, 20, "wave 1 installed")
    with running_fleet(tmp_path, mosquitto.url, rollout_tick_s=0.05) as (fs, url):
        r = status(url, rid)
        assert r["status"] == "paused" and r["current_wave"] == 0 and r["waves"][1]["state"] == "pending"
        assert api.post(f"{url}/api/v1/rollouts/{rid}/resume").status_code == 200
        r = until(url, rid, "succeeded")
        assert r["counts"] == {"installed": 6}
        log = actions(url, rid)
        assert log.count("wave_started") == 2  # wave 1 was not started again after the restart
        # paused inside wave 1: before or after its two devices installed and it began to soak (a loaded machine
        # may get there before the pause request is served), but before wave 2 started
        assert log[:2] == ["rollout_created", "wave_started"]
        assert log.index("rollout_paused") < log.index("wave_started", 2)


def test_targets_by_group_and_tags_and_refusals_that_name_the_problem(fleet, digits_bundle):
    fs, url, broker = fleet
    upload(url, digits_bundle)
    for i, (group, tags, prof) in enumerate([("north", ["cam"], None), ("north", ["cam", "lab"], "x86-cpu"),
                                             ("south", ["cam"], "x86-cpu"), ("south", [], "jetson-orin-nano")]):
        r = api.post(f"{url}/api/v1/devices", json={"device_id": f"d{i}", "group": group, "tags": tags,
                                                    "profile": prof})
        assert r.status_code == 201, r.text
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "group": "east"})
    assert r.status_code == 404 and "unknown group 'east'" in r.json()["error"] and "north, south" in r.json()["error"]
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "group": "south"})
    assert r.status_code == 422
    assert "no bundle of digits 1.0.0 for profile jetson-orin-nano (devices d3)" in r.json()["error"]
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "profile": "jetson-orin-nano"})
    assert r.status_code == 422 and "profile 'jetson-orin-nano' has no bundle" in r.json()["error"]
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "tags": ["lab", "cam"]})
    assert r.status_code == 201 and [t["device_id"] for t in r.json()["targets"]] == ["d1"]
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "group": "north"})
    assert r.status_code == 201 and [t["device_id"] for t in r.json()["targets"]] == ["d0", "d1"]
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "waves": ["0%"],
                                                 "devices": ["d0"]})
    assert r.status_code == 422 and "0%" in r.text
    assert api.get(f"{url}/api/v1/groups").json() == [{"group": "north", "devices": 2, "online": 0},
                                                      {"group": "south", "devices": 2, "online": 0}]


def test_tokens_and_roles(fleet):
    fs, url, broker = fleet
    assert api.get(f"{url}/api/v1/health", token=None).status_code == 200
    r = api.get(f"{url}/api/v1/devices", token=None)
    assert r.status_code == 401 and "no API token" in r.json()["error"]
    assert api.get(f"{url}/api/v1/devices", token="eft_nope").status_code == 401
    tokens = {}
    for role in ("viewer", "operator"):
        r = api.post(f"{url}/api/v1/tokens", json={"name": f"{role}-1", "role": role})
        assert r.status_code == 201
        tokens[role] = r.json()["token"]
    assert api.get(f"{url}/api/v1/devices", token=tokens["viewer"]).status_code == 200
    r = api.post(f"{url}/api/v1/devices", json={"device_id": "x"}, token=tokens["viewer"])
    assert r.status_code == 403 and "role viewer" in r.json()["error"] and "needs operator" in r.json()["error"]
    assert api.post(f"{url}/api/v1/devices", json={"device_id": "x"}, token=tokens["operator"]).status_code == 201
    r = api.post(f"{url}/api/v1/tokens", json={"name": "sneaky", "role": "admin"}, token=tokens["operator"])
    assert r.status_code == 403
    stored = [t["name"] for t in api.get(f"{url}/api/v1/tokens").json()]
    assert stored == ["admin", "viewer-1", "operator-1"]
    from sqlalchemy import select

    from edgefleet.fleet.db import ApiToken
    with fs.sessions() as s:  # only digests are kept
        assert tokens["viewer"] not in {t.token_sha256 for t in s.scalars(select(ApiToken))}
    assert api.delete(f"{url}/api/v1/tokens/viewer-1").status_code == 204
    wait_for(lambda: api.get(f"{url}/api/v1/devices", token=tokens["viewer"]).status_code == 401, 10, "revoked")
    rej = api.get(f"{url}/api/v1/stats").json()["rejected"]
    assert rej["api_unauthorized"] >= 3 and rej["api_forbidden"] == 2
    # every fleet endpoint but health, bootstrap and the signed time wants a token (enroll: the enrollment token, in
    # the body; time: open like bootstrap, a device asks it before it can trust anything, signed, rate-capped)
    spec = api.get(f"{url}/openapi.json", token=None).json()
    for path, ops in spec["paths"].items():
        for method in ops:
            open_paths = ("/api/v1/health", "/api/v1/bootstrap", "/api/v1/enroll", "/api/v1/time")
            if path in open_paths or not path.startswith("/api/"):
                continue
            r = api.request(method.upper(), url + path.replace("{rollout_id}", "1").replace("{device_id}", "x")
                            .replace("{action}", "pause").replace("{name}", "x"), token=None)
            assert r.status_code == 401, (method, path, r.status_code)


def test_a_device_reporting_on_a_rollout_that_does_not_target_it_is_rejected_and_counted(fleet, digits_bundle):
    import paho.mqtt.client as mqtt

    fs, url, broker = fleet
    upload(url, digits_bundle)
    api.post(f"{url}/api/v1/devices", json={"device_id": "inside"})
    api.post(f"{url}/api/v1/devices", json={"device_id": "outside"})
    rid = rollout(url, version="1.0.0", devices=["inside"])
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="outside")
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    for _ in range(3):
        rep = proto.ReportedState(device_id="outside", ts=time.time(), state="installed", rollout_id=rid,
                                  model="digits", version="1.0.0", running_model="digits", running_version="1.0.0")
        c.publish(proto.topic("outside", "reported"), proto.encode(rep), qos=1).wait_for_publish(5)
    wait_for(lambda: api.get(f"{url}/api/v1/stats").json()["rejected"].get("report_not_a_target") == 3, 20,
             "three rejections counted")
    assert status(url, rid)["counts"] == {"pending": 1}  # nothing moved
    c.loop_stop()


def test_cost_of_a_report_does_not_grow_with_the_fleet(tmp_path):
    """Statements per report are the same in a rollout of 10 and of 2,000 devices (SQLite, no broker)."""
    from edgefleet.fleet.db import Device, Model, make_engine
    from edgefleet.fleet.service import FleetService

    class Sink:
        def publish(self, topic, payload, retain):
            pass

    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    svc = FleetService(sessions, None, Sink())  # type: ignore[arg-type]
    with sessions.begin() as s:
        s.add(Model(id=1, name="m", version="1.0.0", profile="x86-cpu", backend="onnxruntime", precision="int8",
                    target_path="m/1.0.0/x86-cpu.tar", sha256="a" * 64, size_bytes=1, accuracy=1.0, manifest={}))
        s.add_all(Device(id=f"d{i:05d}", labels={}, registered_via="api", profile="x86-cpu") for i in range(2010))
    small = svc.rollouts.create_rollout("m", "1.0.0", devices=[f"d{i:05d}" for i in range(10)]).id
    big = svc.rollouts.create_rollout("m", "1.0.0", devices=[f"d{i:05d}" for i in range(10, 2010)]).id
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))

    def per_report(rid: int, dev: str) -> int:
        statements.clear()
        svc.ingest.handle_reported(proto.ReportedState(device_id=dev, ts=time.time(), state="installed", rollout_id=rid,
                                                model="m", version="1.0.0", running_model="m",
                                                running_version="1.0.0"))
        return len(statements)

    a, b = per_report(small, "d00001"), per_report(big, "d01000")
    assert a == b, (a, b)
    assert not any("count(" in q.lower() for q in statements)  # counters move by one; nothing is recounted
    assert svc.rollouts.get_rollout(big, with_targets=False).waves[0].installed == 1
    engine.dispose()


def test_a_shadow_wave_promotes_an_agreeing_candidate_and_stops_a_disagreeing_one_before_any_install(
        fleet, sims, digits_bundle, digits_bundle_v2):
    """Each wave first runs the candidate in shadow (devices keep serving, mirror requests, report
    agreement); it installs only above the threshold. A disagreeing candidate never reaches a device."""
    fs, url, broker = fleet
    upload(url, digits_bundle, digits_bundle_v2)
    sim = sims(mqtt_url=broker.url, devices=6, install_s=0.01, telemetry_interval_s=0.1,
               running=("digits", "1.0.0"), shadow_agreement_by_version={"1.1.0": 0.62})
    online(url, 6)
    shadow = {"agreement_min": 0.95, "min_samples": 30}
    rid = rollout(url, version="1.1.0", profile="x86-cpu", waves=["2", "100%"], shadow=shadow, on_failure="pause")
    r = until(url, rid, "paused")
    assert r["waves"][0]["state"] == "failed" and r["waves"][1]["state"] == "pending"
    gate = r["waves"][0]["gates"][0]
    assert gate["name"] == "shadow_agreement" and gate["value"] == pytest.approx(0.62) and not gate["passed"]
    assert "before any install" in r["reason"]
    assert sim.stats.installed == 0, "a candidate that failed in shadow was installed somewhere"
    assert all(d.running == ("digits", "1.0.0") for d in sim.devices)
    wave1 = [t["device_id"] for t in api.get(f"{url}/api/v1/rollouts/{rid}").json()["targets"] if t["wave"] == 0]
    for d in wave1:  # they shadowed it and said so, running 1.0.0 all along
        dev = api.get(f"{url}/api/v1/devices/{d}").json()
        assert dev["last_state"] == "shadowing" and dev["running_version"] == "1.0.0", dev
    api.post(f"{url}/api/v1/rollouts/{rid}/abort")

    good = rollout(url, version="1.0.0", profile="x86-cpu", waves=["2", "100%"], shadow=shadow)
    r = until(url, good, "succeeded")  # every device already runs 1.0.0: shadow agrees (1.0), then "installs"
    assert [w["state"] for w in r["waves"]] == ["passed", "passed"]
    assert all(w["gates"][0]["name"] == "shadow_agreement" and w["gates"][0]["passed"] for w in r["waves"])
    log = actions(url, good)
    assert log.count("wave_shadow_started") == 2 and log.count("wave_shadow_passed") == 2
