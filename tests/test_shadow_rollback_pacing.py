"""What shadow phases and rollbacks do with maintenance windows and the download caps (issue 43.2 x 43.4; the
decision and why: docs/rollouts.md), through the real rollout driver on a real (SQLite) database, the desired states
as they would be published:

- a shadow downloads the bundle as an install does: it is held to the rollout's rate cap, and under a download cap
  only that many devices shadow; it waits for no window (it changes no answer, and it judges the candidate on live
  requests, which a night window would not have);
- a rollback goes at once: to every started device in one go, with no window and no rate cap."""

from __future__ import annotations

import time

from edgefleet.fleet import windows
from edgefleet.fleet.db import Device, make_engine
from edgefleet.fleet.rollout import RolloutDriver, RolloutSpec, Selector
from edgefleet.fleet.rollout.spec import ShadowGate
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.window import MaintenanceWindow
from tests.test_rollout_states import seed

N, CAP, PACE = 5, 2, 8192
NIGHT = MaintenanceWindow(days=("sun",), start="02:00", duration_min=60, tz="Europe/Berlin")


class Keeping:
    """The desired states the driver publishes, decoded."""

    def __init__(self) -> None:
        self.sent: list[proto.DesiredState] = []

    def publish(self, topic: str, payload: bytes, retain: bool) -> None:
        if topic.endswith("/desired"):
            self.sent.append(proto.decode(proto.DesiredState, payload, source=topic))

    def take(self) -> list[proto.DesiredState]:
        out, self.sent = self.sent, []
        return out


def _fleet(tmp_path):
    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    seed(sessions, N)  # d00000..d00004, running m 0.9.0; m 1.0.0 to roll out
    with sessions.begin() as s:
        for d in s.query(Device):
            d.group_name, d.online = "stores", True
        windows.set_window(s, "group", "stores", NIGHT, "op")
    pub = Keeping()
    return engine, sessions, pub, RolloutDriver(sessions, pub)


def _report(rid: int, dev: str, state: str) -> proto.ReportedState:
    return proto.ReportedState(device_id=dev, ts=time.time(), state=state, rollout_id=rid,  # type: ignore[arg-type]
                               model="m", version="1.0.0", running_model="m",
                               running_version="1.0.0" if state == "installed" else "0.9.0")


def test_a_shadow_phase_is_held_to_the_download_caps_and_waits_for_no_window(tmp_path):
    """Before: every device of the wave was sent its shadow at once (5 under a cap of 2), none with the rate cap."""
    engine, sessions, pub, driver = _fleet(tmp_path)
    spec = RolloutSpec(shadow=ShadowGate(agreement_min=0.9, min_samples=10), max_concurrent_downloads=CAP,
                       download_max_bytes_per_s=PACE)
    driver.create("m", "1.0.0", Selector(group="stores"), spec, "op")
    shadows = pub.take()
    assert [m.mode for m in shadows] == ["shadow"] * CAP, shadows
    assert all(m.download_max_bytes_per_s == PACE and m.install_window is None for m in shadows)
    engine.dispose()


def test_a_rollback_goes_to_every_device_at_once_with_no_window_and_no_rate_cap(tmp_path):
    engine, sessions, pub, driver = _fleet(tmp_path)
    rid = driver.create("m", "1.0.0", Selector(group="stores"),
                     RolloutSpec(max_concurrent_downloads=CAP, download_max_bytes_per_s=PACE), "op")
    installs: list[proto.DesiredState] = []
    for _ in range(2 * N):  # bounded: the cap releases two at a time, each installs in one report
        sent = pub.take()
        installs += sent
        if not sent:
            break
        with sessions.begin() as s:
            assert driver.on_reports(s, [_report(rid, m.device_id, "installed") for m in sent]) == []
        driver.advance(rid)
    assert len(installs) == N and all(m.install_window == NIGHT and m.download_max_bytes_per_s == PACE
                                      for m in installs)  # the installs: paced, capped, in the window
    driver.act(rid, "rollback", "op")
    back = pub.take()
    assert sorted(m.device_id for m in back) == [f"d{i:05d}" for i in range(N)]  # all at once, past the cap of 2
    assert all(m.version == "0.9.0" and m.install_window is None and m.download_max_bytes_per_s is None
               for m in back), back
    engine.dispose()
