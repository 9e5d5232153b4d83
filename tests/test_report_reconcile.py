"""A rollout never waits forever on a report the broker dropped (issue 20).

Mosquitto queues at most ``max_queued_messages`` QoS 1 messages for a subscriber that is behind (1,000 by
default) and drops the rest without telling anyone. A wave's burst of reports can exceed that; the devices'
reports still reach the broker, which keeps each device's latest one retained. The fleet reconciles: it
reads the retained reports of the wave's devices that are still pending after a while, a few hundred at a
time. Tested with a broker that drops for certain: a stock Mosquitto with a tiny queue and inflight window.
"""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import running_mosquitto, wait_for
from tests.fleet_harness import api, running_fleet
from tests.test_rollout import rollout, status, until, upload

DEVICES = 150


def _barrier(port: int, url: str) -> None:
    """Publish a marker status after the burst until the fleet stored one: the broker forwards messages to the
    fleet in the order it received them, so once a marker arrived, every earlier report was forwarded or
    dropped."""
    import paho.mqtt.client as mqtt

    from edgefleet.protocol import mqtt as proto

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="marker")
    c.connect("127.0.0.1", port)
    c.loop_start()
    tries = itertools.count(1)

    def marker_stored() -> bool:
        msg = proto.StatusMessage(device_id="marker", ts=float(next(tries)), state="online")
        c.publish(proto.topic("marker", "status"), proto.encode(msg), qos=1).wait_for_publish(5)
        return api.get(f"{url}/api/v1/devices/marker").status_code == 200

    try:
        wait_for(marker_stored, 30, "a marker status stored by the fleet", interval_s=0.5)
    finally:
        c.loop_stop()
        c.disconnect()


@pytest.fixture
def dropping_broker(tmp_path):
    # a stock broker but for the queue: 5 queued and 2 in flight per subscriber instead of 1,000 and 20
    with running_mosquitto(tmp_path, "max_queued_messages 5\nmax_inflight_messages 2\n") as m:
        yield m


@pytest.mark.parametrize("reconcile", [True, False], ids=["reconciled", "without-reconciliation"])
def test_a_wave_completes_although_the_broker_dropped_reports(tmp_path, dropping_broker, sims, digits_bundle,
                                                              reconcile):
    ids = [f"sim-{i:05d}" for i in range(DEVICES)]
    with running_fleet(tmp_path, dropping_broker.url, report_reconcile_after_s=2.0 if reconcile else 0.0,
                       rollout_tick_s=0.1) as (fs, url):
        upload(url, digits_bundle)
        for d in ids:  # registered up front: their status messages may be dropped too
            assert api.post(f"{url}/api/v1/devices", json={"device_id": d, "profile": "x86-cpu"}).status_code == 201
        sim = sims(mqtt_url=dropping_broker.url, devices=DEVICES, install_s=0.0, progress_reports=True)
        wait_for(lambda: sim.stats.connected == DEVICES, 60, "every simulated device connected")
        rid = rollout(url, version="1.0.0", devices=ids)
        wait_for(lambda: sim.stats.installed == DEVICES, 120, "every device installed and reported")
        if not reconcile:  # the control: the broker dropped reports and nothing brings them back
            _barrier(dropping_broker.port, url)  # whatever the broker forwards of the burst has arrived
            r = status(url, rid)
            assert r["status"] == "in_progress" and r["counts"].get("installed", 0) < DEVICES, r["counts"]
            return
        r = until(url, rid, "succeeded", timeout_s=120)
        assert r["counts"] == {"installed": DEVICES}
        assert fs.reconciler.requested > 0  # it had to read retained reports back


def test_a_wave_completes_although_the_fleets_connection_was_cut_in_the_middle(tmp_path, mosquitto, sims,
                                                                               digits_bundle):
    """The fleet's MQTT connection drops while a wave's reports come in (its session is clean: what the broker
    got meanwhile is not queued for it). The wave still completes: on reconnecting, the fleet subscribes again
    and the broker sends every device's retained report (and what that misses, the reconciler reads back)."""
    import socket

    ids = [f"sim-{i:05d}" for i in range(100)]
    with running_fleet(tmp_path, mosquitto.url, report_reconcile_after_s=2.0, rollout_tick_s=0.1) as (fs, url):
        upload(url, digits_bundle)
        for d in ids:
            assert api.post(f"{url}/api/v1/devices", json={"device_id": d, "profile": "x86-cpu"}).status_code == 201
        sim = sims(mqtt_url=mosquitto.url, devices=len(ids), install_s=1.0, progress_reports=True)
        wait_for(lambda: sim.stats.connected == len(ids), 60, "every simulated device connected")
        rid = rollout(url, version="1.0.0", devices=ids)
        wait_for(lambda: sim.stats.desired == len(ids), 60, "every device got its desired state")
        sock = fs.bridge._client.socket()  # the reports come 1 s after the desired state: cut the line now
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: sim.stats.installed == len(ids), 60, "every device installed and reported")
        r = until(url, rid, "succeeded", timeout_s=90)
        assert r["counts"] == {"installed": len(ids)}
        assert fs.bridge.restarts == 0  # a lost connection is paho's to handle: no loop died


@pytest.mark.parametrize("reconcile", [True, False], ids=["reconciled", "without-reconciliation"])
def test_devices_are_known_online_although_the_broker_dropped_their_status(tmp_path, dropping_broker, sims,
                                                                           reconcile):
    """Issue 33.5: a burst of devices connecting at once overflows the fleet's queue on a stock broker, which drops
    some of their (retained) online status messages. The fleet reads the status of the devices it holds as offline
    back from the retained copies: every connected device is known as online."""
    from edgefleet.fleet.db import Device

    ids = [f"sim-{i:05d}" for i in range(DEVICES)]
    with running_fleet(tmp_path, dropping_broker.url, report_reconcile_after_s=1.0 if reconcile else 0.0) \
            as (fs, url):
        fs.reconciler.status_cycle_s = 1.0
        fs.reconciler.batch = 5  # read back no more a tick than this broker's queue holds (5 queued, 2 in flight)
        r = api.post(f"{url}/api/v1/devices/batch", json={"devices": [{"device_id": d} for d in ids]})
        assert r.status_code == 201 and r.json() == {"registered": DEVICES, "updated": 0}, r.text
        sim = sims(mqtt_url=dropping_broker.url, devices=DEVICES, install_s=0.0)
        wait_for(lambda: sim.stats.connected == DEVICES, 60, "every simulated device connected")

        def online() -> int:
            with fs.sessions() as s:
                return sum(1 for d in s.query(Device).filter(Device.id.in_(ids)) if d.online)

        if not reconcile:  # the control: the broker dropped status messages and nothing brings them back
            _barrier(dropping_broker.port, url)
            assert online() < DEVICES
            return
        wait_for(lambda: online() == DEVICES, 60, "every connected device known as online")
        assert fs.reconciler.status_requested > 0
        sim.kill([0])  # its will says offline: read back or not, it stays offline
        wait_for(lambda: online() == DEVICES - 1, 60, "the device that left known as offline")
        asked = fs.reconciler.status_requested
        wait_for(lambda: fs.reconciler.status_requested > asked, 60, "the next walk over the offline devices")
        assert online() == DEVICES - 1


def test_nothing_is_read_back_while_the_fleets_own_ingest_is_behind(tmp_path):
    """A report or status that is only queued in the fleet's own ingest is not missing: while more than a batch
    waits there, the reconciler asks the broker for nothing (reading back would only lengthen the queue)."""
    from edgefleet.fleet.db import Device, make_engine
    from edgefleet.fleet.reconcile import Reconciler

    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    with sessions.begin() as s:
        s.add_all([Device(id=f"d-{i}", labels={}, registered_via="api") for i in range(5)])
    asked: list[list[str]] = []
    backlog = [1000]
    r = Reconciler(sessions, asked.append, after_s=1.0, batch=10, reread_status=asked.append,
                   backlog=lambda: backlog[0])
    assert r.tick() == 0 and asked == [] and r.skipped_busy == 1
    backlog[0] = 3  # caught up
    r.tick()
    assert asked == [[f"d-{i}" for i in range(5)]]  # the offline devices' statuses, read back now
    engine.dispose()


def test_nothing_is_read_back_while_its_live_stream_flows(tmp_path):
    """A report (status) not here yet while more than a batch of live ones arrived in the last after_s is most likely
    queued in the broker, not lost: that kind is not read back until its stream slows (a 20,000-device wave read back
    8,255 reports, 6,625 of them still on their way), and a stream that never slows defers it at most defer_max_s."""
    import time

    from edgefleet.fleet.db import Device, make_engine
    from edgefleet.fleet.reconcile import Reconciler

    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    with sessions.begin() as s:
        s.add_all([Device(id=f"d-{i}", labels={}, registered_via="api") for i in range(5)])
    asked: list[list[str]] = []
    live = {"reported": 0, "status": 0}
    r = Reconciler(sessions, asked.append, after_s=1.0, batch=10, reread_status=asked.append, status_cycle_s=0.0,
                   intake=live.__getitem__, defer_max_s=3600.0)
    live["status"] += 11  # a connect burst: more than a batch of live statuses within after_s
    assert r.tick() == 0 and asked == [] and r.deferred["status"] == 1
    time.sleep(1.1)  # the burst is over: nothing new arrived in the last after_s
    r.tick()
    assert asked == [[f"d-{i}" for i in range(5)]] and r.deferred["status"] == 1

    asked.clear()
    r = Reconciler(sessions, asked.append, after_s=1.0, batch=10, reread_status=asked.append, status_cycle_s=0.0,
                   intake=live.__getitem__, defer_max_s=0.5)
    time.sleep(0.6)  # the stream never slows: it defers the statuses no longer than defer_max_s
    live["status"] += 11
    r.tick()
    assert asked == [[f"d-{i}" for i in range(5)]] and r.deferred["status"] == 0
    engine.dispose()


def test_a_report_is_read_back_once_it_waited_after_s_since_the_reconciler_first_saw_it(tmp_path):
    """A wave's desired states go out only after the transaction that sent them commits (tens of seconds for a large
    wave): a target's wait is counted from when the reconciler first saw it waiting, so what it reads back at the start
    of a wave is not the first reports, still on their way."""
    import datetime as dt
    import time

    from edgefleet.fleet.db import Device, Model, Rollout, RolloutTarget, RolloutWave, make_engine
    from edgefleet.fleet.reconcile import Reconciler

    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    long_ago = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(seconds=60)
    with sessions.begin() as s:
        s.add(Device(id="d-0", labels={}, registered_via="api"))
        m = Model(name="m", version="1", profile="x86-cpu", backend="onnxruntime", precision="int8", target_path="t",
                  sha256="0" * 64, size_bytes=1, accuracy=1.0, manifest={})
        s.add(m)
        s.flush()
        r = Rollout(model_id=m.id, model_name="m", model_version="1", spec={}, current_wave=0, created_by="t",
                    status="in_progress")
        s.add(r)
        s.flush()
        s.add(RolloutWave(rollout_id=r.id, idx=0, size=1, soak_s=0, state="installing"))
        s.add(RolloutTarget(rollout_id=r.id, device_id="d-0", state="pending", wave=0, model_id=m.id,
                            updated_at=long_ago))  # sent a minute ago, as far as the database says
    asked: list[list[str]] = []
    rec = Reconciler(sessions, asked.append, after_s=0.5, batch=10)
    assert rec.tick() == 0 and asked == []  # first seen waiting now
    time.sleep(0.6)
    assert rec.tick() == 1 and asked == [["d-0"]]
    engine.dispose()
