"""A rollout's per-wave cap on concurrent downloads (issue 43.2, fleet side): the driver sends desired states to at
most ``max_concurrent_downloads`` devices of a wave at a time and releases more as those finish. Driven through the
real driver on a real (SQLite) database, the devices simulated by their reports; and end to end, a real fleet
over a real Mosquitto to 1,000 simulated devices (fleet.simulator), each counting on its own side what it has been
told to install and not yet reported done."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from edgefleet.fleet.db import Device, Rollout, RolloutTarget, make_engine
from edgefleet.fleet.rollout import RolloutDriver, RolloutSpec, Selector
from edgefleet.fleet.states import RolloutStatus, TargetState
from edgefleet.protocol import mqtt as proto
from tests.fleet_harness import RecordingPublisher
from tests.test_rollout_states import seed

N, CAP = 1000, 50
INSTALL_S = 0.5  # each simulated install's time (over MQTT): long enough for 50 to overlap
UNDONE = [TargetState.PENDING.value, TargetState.DOWNLOADING.value, TargetState.INSTALLING.value]


def _in_flight(sessions, rid: int) -> int:
    """Targets whose desired state went out and that have not finished: the fleet's own count."""
    with sessions() as s:
        return int(s.scalar(select(func.count()).select_from(RolloutTarget).join(
            Device, Device.id == RolloutTarget.device_id).where(
            RolloutTarget.rollout_id == rid, RolloutTarget.state.in_(UNDONE), Device.desired_rollout_id == rid)))


def _report(rid: int, dev: str, state: str) -> proto.ReportedState:
    return proto.ReportedState(device_id=dev, ts=time.time(), state=state, rollout_id=rid,  # type: ignore[arg-type]
                               model="m", version="1.0.0", running_model="m",
                               running_version="1.0.0" if state == "installed" else "0.9.0")


def test_a_wave_of_1000_with_a_cap_of_50_never_has_more_than_50_in_flight_and_completes(tmp_path):
    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    seed(sessions, N)
    pub = RecordingPublisher()
    driver = RolloutDriver(sessions, pub)
    rid = driver.create("m", "1.0.0", Selector(profile="x86-cpu"),
                     RolloutSpec(max_concurrent_downloads=CAP), "op")
    seen: set[str] = set()  # devices that were sent their desired state
    stage: dict[str, str] = {}  # each simulated box's last report
    peak = 0
    for rounds in range(1, 200):  # bounded: 1000 / 50 waves of releases, two reports each
        peak = max(peak, _in_flight(sessions, rid))
        sent_now = {t.split("/")[-2] for t in pub.sent if t.endswith("/desired")}
        new = sorted(sent_now - seen)
        seen |= sent_now
        reports = []
        for dev in sorted(seen):  # each box moves one step a round: downloading, installing, installed
            nxt = {None: "downloading", "downloading": "installing", "installing": "installed"}.get(stage.get(dev))
            if nxt is not None:
                stage[dev] = nxt
                reports.append(_report(rid, dev, nxt))
        assert new or reports or rounds > 1
        with sessions.begin() as s:
            assert driver.on_reports(s, reports) == []
        peak = max(peak, _in_flight(sessions, rid))
        driver.advance(rid)
        with sessions() as s:
            if s.get(Rollout, rid).status == RolloutStatus.SUCCEEDED:
                break
    with sessions() as s:
        states = dict(s.execute(select(RolloutTarget.state, func.count()).where(RolloutTarget.rollout_id == rid)
                                .group_by(RolloutTarget.state)).all())
    engine.dispose()
    assert states == {TargetState.INSTALLED.value: N}
    assert len(seen) == N
    assert peak == CAP  # the cap was reached, never passed


@pytest.mark.parametrize("bad", [0, -1, 1_000_001])
def test_the_cap_is_bounded(bad):
    with pytest.raises(ValidationError, match="max_concurrent_downloads"):
        RolloutSpec(max_concurrent_downloads=bad)


def test_a_device_that_downloaded_and_waits_for_its_window_frees_its_place_under_the_cap(tmp_path):
    """A capped wave outside its devices' maintenance windows goes on downloading: a device whose newest telemetry
    says its download is whole (the agent waits for the window) no longer counts as downloading."""
    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    seed(sessions, 5)
    pub = RecordingPublisher()
    driver = RolloutDriver(sessions, pub)
    rid = driver.create("m", "1.0.0", Selector(profile="x86-cpu"), RolloutSpec(max_concurrent_downloads=2), "op")
    first = sorted({t.split("/")[-2] for t in pub.sent if t.endswith("/desired")})
    assert len(first) == 2
    with sessions.begin() as s:
        assert driver.on_reports(s, [_report(rid, d, "downloading") for d in first]) == []
    driver.advance(rid)
    assert _in_flight(sessions, rid) == 2 and len(pub.sent) == 2  # still downloading: nothing more released
    with sessions.begin() as s:
        s.get(Device, first[0]).last_telemetry = {"download": {"target": "m/1.0.0/x86-cpu.tar", "bytes_done": 1,
                                                               "bytes_total": 1, "bytes_per_s": 0.0, "eta_s": 0.0}}
        s.get(Device, first[1]).last_telemetry = {"download": {"target": "m/1.0.0/x86-cpu.tar", "bytes_done": 0,
                                                               "bytes_total": 1, "bytes_per_s": 0.0, "eta_s": None}}
    driver.advance(rid)
    sent = [t.split("/")[-2] for t in pub.sent if t.endswith("/desired")]
    assert len(sent) == 3 and sent[2] not in first  # the whole one's place went to the next device
    engine.dispose()


@pytest.mark.timeout(300)
def test_1000_simulated_boxes_over_mqtt_never_hold_more_than_50_desired_states_at_once(tmp_path, mosquitto,
                                                                                       digits_bundle, monkeypatch):
    """The count the goal names, taken at the boxes: a simulated device holds a desired state from the moment it
    arrives until it reports the install's end (downloading, then installed or failed after INSTALL_S); the peak over
    all 1,000 at any instant is at most the cap, and the cap is used. 5% of the installs fail (the gate allows it):
    a failed device frees its place too."""
    from edgefleet.fleet.simulator import SimConfig, SimDevice, Simulator
    from tests.fleet_harness import running_fleet
    from tests.waiting import wait_for

    held = {"now": 0, "peak": 0, "told": 0}
    apply = SimDevice._apply

    async def counted(self: SimDevice, d: proto.DesiredState) -> None:  # on the simulator's one event loop
        if d.mode == "shadow" or self.installed_sha == d.sha256:
            return await apply(self, d)
        held["now"] += 1
        held["told"] += 1
        held["peak"] = max(held["peak"], held["now"])
        try:
            await apply(self, d)
        finally:
            held["now"] -= 1

    monkeypatch.setattr(SimDevice, "_apply", counted)
    with running_fleet(tmp_path, mosquitto.url, rollout_tick_s=0.05) as (fs, url):
        fs.service.models.upload_bundle(digits_bundle)
        sim = Simulator(SimConfig(mqtt_url=mosquitto.url, devices=N, install_s=INSTALL_S, failure_rate=0.05,
                                  progress_reports=True, prefix="cap"))
        sim.start()
        try:
            wait_for(lambda: fs.service.devices.device_counts().online == N, 120,
                     f"{N} simulated devices online at the fleet", interval_s=0.5)
            spec = RolloutSpec(max_concurrent_downloads=CAP, gates={"install_success_min": 0.9})
            rid = fs.service.rollouts.create_rollout("digits", "1.0.0", profile="x86-cpu", spec=spec).id
            wait_for(lambda: fs.service.rollouts.get_rollout(rid, with_targets=False).status != "in_progress",
                     240, "the capped wave done", interval_s=0.5)
            r = fs.service.rollouts.get_rollout(rid, with_targets=False)
        finally:
            sim.stop()
    print(f"\n{N} boxes, cap {CAP}: at most {held['peak']} held a desired state at once; {held['told']} told, "
          f"{sim.stats.installed} installed, {sim.stats.failed} failed")
    assert r.status == "succeeded", r
    assert (sim.stats.installed, sim.stats.failed) == (N - N // 20, N // 20)
    assert held["told"] == N  # each told once
    assert held["peak"] == CAP  # the cap was reached at the boxes, never passed


