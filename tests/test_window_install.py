"""A device installs only inside its maintenance window (issue 43.4), end to end: a real Mosquitto, a real fleet and
a real agent. The device's window goes out with its desired state; the agent downloads at once and waits; setting
the box's own clock into the window does not start the install (the agent judges on the fleet's signed time carried
on its monotonic clock, agent/link/clock.py); time passing into the window (the clock's monotonic source moved on,
not hours waited) does. An urgent rollout's desired state carries no window."""

from __future__ import annotations

import datetime as dt
import logging
import time

from edgefleet.agent.link.clock import TrustedClock
from tests.waiting import wait_for

DEVICE = "edge-window"
AHEAD_S = 6 * 3600  # the window opens about this far ahead of now


def test_a_device_downloads_outside_its_window_and_installs_once_time_enters_it(tmp_path, digits_bundle, caplog):
    from tests.agent_harness import installed_agent, served_version
    from tests.conftest import running_mosquitto
    from tests.fleet_harness import api, running_fleet
    from tests.test_tuf_bundles import rebundle

    caplog.set_level(logging.INFO, logger="edgefleet.agent")
    new = rebundle(digits_bundle, tmp_path / "v110.tar", version="1.1.0")
    opens = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=AHEAD_S)).replace(second=0, microsecond=0)
    window = {"days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"], "start": opens.strftime("%H:%M"),
              "duration_min": 60, "tz": "UTC"}
    with running_mosquitto(tmp_path) as broker, \
            running_fleet(tmp_path, broker.url, rollout_tick_s=0.05) as (fs, url):
        fs.service.devices.register_device(DEVICE, group="stores")
        fs.service.models.upload_bundle(new)
        assert api.request("PUT", f"{url}/api/v1/windows/group/stores", json=window).status_code == 200
        bad = api.request("PUT", f"{url}/api/v1/windows/group/stores", json={**window, "duration_min": 1431})
        assert bad.status_code == 422 and "duration_min" in bad.text
        with installed_agent(tmp_path / "agent", digits_bundle, device_id=DEVICE, fleet_url=url,
                             trusted_root=tmp_path / "keys" / "root.json", max_batch_size=8, instances=1,
                             intra_op_threads=1) as (agent, agent_url):
            wait_for(lambda: fs.service.devices.get_device(DEVICE).online and agent.fetcher is not None, 30,
                     "agent online")
            shift = {"wall": 0.0, "mono": 0.0}  # the box's clock and its monotonic clock, moved by the test
            assert agent.fetcher is not None
            agent.fetcher.clock = TrustedClock(agent.fetcher.clock.floor, agent.fetcher.clock.tolerance_s,
                                               wall=lambda: time.time() + shift["wall"],
                                               monotonic=lambda: time.monotonic() + shift["mono"])
            rid = fs.service.rollouts.create_rollout("digits", "1.1.0", [DEVICE]).id

            def waiting() -> bool:
                return any("waits for the maintenance window" in r.getMessage() for r in caplog.records)

            wait_for(waiting, 60, "the bundle downloaded and its install waiting for the window")
            said = next(r.getMessage() for r in caplog.records if "waits for the maintenance window" in r.getMessage())
            assert opens.isoformat() in said, said
            assert served_version(agent_url) == "1.0.0"
            target = api.get(f"{url}/api/v1/rollouts/{rid}").json()["targets"][0]
            assert target["state"] == "downloading", target

            def whole() -> bool:  # its telemetry: the download at its end while it waits (the cap counts it out)
                d = api.get(f"{url}/api/v1/rollouts/{rid}").json()["targets"][0].get("download")
                return bool(d) and d["bytes_done"] == d["bytes_total"] == new.stat().st_size

            wait_for(whole, 30, "telemetry saying the download is whole")
            # the console: the device's window and its next opening; where the wave waits
            first = opens.isoformat(timespec="minutes")
            page = api.get(f"{url}/devices/{DEVICE}").text
            assert 'id="window"' in page and f"next opens {first}" in page and "60 min" in page, page[:2000]
            page = api.get(f"{url}/rollouts/{rid}").text
            assert f"waits: 1 device outside their maintenance window (the first opens {first})" in page
            # the box's own clock set into the window: not trusted (beyond the tolerance from the signed time)
            shift["wall"] = AHEAD_S + 60.0
            time.sleep(3 * 1.0)  # three of the agent's reads of the trusted time (agent.install.window.POLL_S)
            assert served_version(agent_url) == "1.0.0"
            assert not any("window open (until" in r.getMessage() for r in caplog.records)
            # time passes into the window: the signed time carried forward on the monotonic clock enters it
            shift["mono"] = AHEAD_S + 60.0
            wait_for(lambda: served_version(agent_url) == "1.1.0", 120, "1.1.0 installed inside the window")
            wait_for(lambda: api.get(f"{url}/api/v1/rollouts/{rid}").json()["targets"][0]["state"] == "installed",
                     30, "the fleet told")


def test_the_desired_state_carries_the_devices_window_unless_the_rollout_is_urgent(tmp_path):
    from edgefleet.fleet import windows
    from edgefleet.fleet.db import Device, make_engine
    from edgefleet.fleet.rollout import RolloutDriver, RolloutSpec, Selector
    from edgefleet.protocol import mqtt as proto
    from edgefleet.protocol.window import MaintenanceWindow
    from tests.test_rollout_states import seed

    class Keeping:
        def __init__(self) -> None:
            self.sent: list[proto.DesiredState] = []

        def publish(self, topic: str, payload: bytes, retain: bool) -> None:
            self.sent.append(proto.decode(proto.DesiredState, payload, source=topic))

    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    seed(sessions, 3)  # d00000..d00002
    group = MaintenanceWindow(days=("sat",), start="22:00", duration_min=240, tz="Europe/Berlin")
    own = MaintenanceWindow(days=("sun",), start="03:00", duration_min=60, tz="UTC")
    with sessions.begin() as s:
        for d in s.query(Device):
            d.group_name = "stores"
        windows.set_window(s, "group", "stores", group, "op")
        windows.set_window(s, "device", "d00001", own, "op")  # a device's own window wins over its group's
    pub = Keeping()
    driver = RolloutDriver(sessions, pub)
    driver.create("m", "1.0.0", Selector(group="stores"), RolloutSpec(), "op")
    assert {m.device_id: m.install_window for m in pub.sent} == {"d00000": group, "d00001": own, "d00002": group}
    pub.sent.clear()
    driver.create("m", "1.0.0", Selector(group="stores"), RolloutSpec(urgent=True), "op")
    desired = [m for m in pub.sent if m.model == "m" and m.rollout_id == 2]
    assert len(desired) == 3 and all(m.install_window is None for m in desired)
    engine.dispose()
