"""A device is shown online only while it is heard from (issue 33: "a dropped offline will leaves a device shown
online").

A device's last will (status offline, retained) is the fleet's only word that its connection died, and the will
can be lost: a stock broker drops it when the fleet's queue is full, a broker that restarts publishes no will for the
connections it lost, and a retained "online" kept in the broker's persistence (or on a cluster's core while an edge
died) says online for good. These tests take the will away from outside: a real Mosquitto with persistence is
killed (SIGKILL: it publishes nothing), one simulated device is gone when it comes back, and its retained "online"
survives in the broker's store. The fleet must show that device offline once it has not been heard from within its
staleness bound (a number of its telemetry intervals, at least ``presence_min_s``), keep showing it offline when the
status read-back finds the stale retained "online", and keep the device that came back online.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import running_mosquitto, wait_for
from tests.fleet_harness import api, running_fleet
from tests.waiting import watch

PRESENCE_MIN_S = 2.0  # the fleet's floor under a device's staleness bound, in these tests
TELEMETRY_S = 0.3  # the simulated devices' telemetry interval: their bound is max(2.0, 3 x 0.3) = 2 s


def _online(url: str, device_id: str, registered: bool = True) -> bool:
    """Whether the fleet shows the device online; ``registered=False`` while waiting for its first message (the
    fleet registers a device when it first hears from it: until then, 404 means "not yet")."""
    r = api.get(f"{url}/api/v1/devices/{device_id}")
    if r.status_code == 404 and not registered:
        return False
    assert r.status_code == 200, r.text
    return bool(r.json()["online"])


def _persistent_broker_conf(folder: Path) -> str:
    store = folder / "mosquitto-store"
    store.mkdir()
    # saved every second, so a SIGKILL leaves the retained messages of a second ago in the store
    # (as root, Mosquitto drops to its own user unless told not to: that user could not write the test's folder)
    user = "user root\n" if os.geteuid() == 0 else ""
    return f"persistence true\npersistence_location {store}/\nautosave_interval 1\nautosave_on_changes false\n{user}"


def test_a_device_whose_will_is_never_published_is_shown_offline(tmp_path, sims):
    with running_mosquitto(tmp_path, _persistent_broker_conf(tmp_path)) as broker, \
            running_fleet(tmp_path, broker.url, presence_min_s=PRESENCE_MIN_S, report_reconcile_after_s=1.0) \
            as (fs, url):
        fs.reconciler.status_cycle_s = 1.0
        sim = sims(mqtt_url=broker.url, devices=2, telemetry_interval_s=TELEMETRY_S)
        gone, stays = "sim-00000", "sim-00001"
        wait_for(lambda: _online(url, gone, False) and _online(url, stays, False), 60,
                 "both devices online in the fleet")
        wait_for(lambda: api.get(f"{url}/api/v1/devices/{gone}").json()["telemetry"] is not None, 30,
                 "telemetry of the device that will go")
        # the broker saves its retained messages every second: both "online" statuses are in its store now
        wait_for(lambda: (tmp_path / "mosquitto-store" / "mosquitto.db").exists(), 10, "the broker's store saved")

        # the broker dies without a word (no will goes out) and comes back from its store; one device does not
        assert broker.proc is not None
        broker.proc.kill()
        broker.proc.wait(10)
        broker.proc = None
        sim.kill([0])  # its connection is already gone with the broker: it only stops trying
        broker.start()
        wait_for(lambda: sim.stats.connected == 1, 60, "the other device back on the restarted broker")
        wait_for(lambda: fs.bridge.connected.is_set(), 60, "the fleet back on the restarted broker")

        wait_for(lambda: not _online(url, gone), 60, f"{gone} (not heard from since the broker died) shown offline")
        assert _online(url, stays)
        # the status read-back of the devices held offline finds the stale retained "online": it stays offline
        asked = fs.reconciler.status_requested
        wait_for(lambda: fs.reconciler.status_requested > asked, 60, "a read-back of the offline devices' status")
        assert watch(lambda: _online(url, gone), 3 * PRESENCE_MIN_S) is False, f"{gone} came back online"
        assert _online(url, stays)


def test_a_device_that_is_heard_from_stays_online(tmp_path, mosquitto, sims):
    """The bound only takes away devices that went quiet: devices sending telemetry stay online through several
    bounds, and one that was taken as gone while it could not be heard comes back with its next record."""
    with running_fleet(tmp_path, mosquitto.url, presence_min_s=PRESENCE_MIN_S) as (fs, url):
        sims(mqtt_url=mosquitto.url, devices=3, telemetry_interval_s=TELEMETRY_S)
        ids = [f"sim-{i:05d}" for i in range(3)]
        wait_for(lambda: all(_online(url, d, False) for d in ids), 60, "the devices online in the fleet")
        went_offline = watch(lambda: [d for d in ids if not _online(url, d)], 3 * PRESENCE_MIN_S)
        assert went_offline == [], f"{went_offline} shown offline while sending telemetry"
