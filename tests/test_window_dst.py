"""No box installs outside its maintenance window while the time it trusts moves across the window's edges and a
clock change (issue 43's goal), end to end: a real Mosquitto, a real fleet and a real agent, the window in
Europe/Berlin set on the device's group through the fleet's API, going out with the desired state.

The agent judges the window on the fleet's signed time carried forward on its monotonic clock (agent/link/clock.py);
the test moves that monotonic clock forward (time passing, not the box's clock set), to instants chosen around the
next spring and autumn changes of Europe/Berlin (found from today, so the test holds in any year). At each instant
outside the window the trusted time is held for three of the agent's reads (agent.install.window.POLL_S) and the
served version must not change; the first instant inside the window installs. Each step's outside instants are
those a wrong reading of the zone would take for inside:

- spring (02:00 CET -> 03:00 CEST), a window Sundays 01:00 for 120 minutes: 00:30 CET (inside if 01:00 were read as
  summer time that night), 30 s before 01:00 CET; then 03:30 CEST, 90 elapsed minutes in: inside (a window ending at
  03:00 on the wall clock would be over);
- autumn (03:00 CEST -> 02:00 CET), a window Sundays 02:30 for 60 minutes: 30 s before the first 02:30 (CEST), then
  30 s after the second 02:30 (CET), which the agent never saw inside (the clock jumped over the window): outside,
  its 60 minutes counted from the first 02:30 are over (inside if the start were read as the second); then the next
  Sunday's window: inside.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from zoneinfo import ZoneInfo

import pytest

from edgefleet.agent.install.window import POLL_S
from edgefleet.agent.link.clock import TrustedClock
from edgefleet.protocol.window import MaintenanceWindow, next_window
from tests.waiting import wait_for

DEVICE = "edge-dst"
BERLIN = ZoneInfo("Europe/Berlin")
UTC = dt.timezone.utc
HOLD_S = 3 * POLL_S + 0.5  # three reads of the trusted time at least


def next_changes(after: dt.datetime) -> dict[str, dt.datetime]:
    """The next spring and autumn clock changes of Europe/Berlin after ``after``, as the UTC hour they happen (01:00
    UTC both), found hour by hour (bounded: a year and a month)."""
    found: dict[str, dt.datetime] = {}
    t = after.replace(minute=0, second=0, microsecond=0)
    for _ in range(400 * 24):
        a, b = t.astimezone(BERLIN).utcoffset(), (t + dt.timedelta(hours=1)).astimezone(BERLIN).utcoffset()
        if a != b and a is not None and b is not None:
            found.setdefault("spring" if b > a else "autumn", t + dt.timedelta(hours=1))
            if len(found) == 2:
                return found
        t += dt.timedelta(hours=1)
    raise AssertionError(f"no clock change of Europe/Berlin within 400 days of {after}")


def test_no_install_outside_the_window_across_its_edges_and_both_clock_changes(tmp_path, digits_bundle, caplog):
    from tests.agent_harness import installed_agent, served_version
    from tests.conftest import running_mosquitto
    from tests.fleet_harness import api, running_fleet
    from tests.test_tuf_bundles import rebundle

    caplog.set_level(logging.INFO, logger="edgefleet.agent")
    changes = next_changes(dt.datetime.now(UTC))
    spring, autumn = changes["spring"], changes["autumn"]  # 01:00 UTC on the Sunday of each
    assert spring.astimezone(BERLIN).strftime("%H:%M %Z") == "03:00 CEST"  # the zone as this test reads it
    assert autumn.astimezone(BERLIN).strftime("%H:%M %Z") == "02:00 CET"
    steps = [
        # (version, window, [instants outside it], the instant inside it, when that window closes)
        ("1.1.0", {"days": ["sun"], "start": "01:00", "duration_min": 120, "tz": "Europe/Berlin"},
         [spring - dt.timedelta(minutes=90), spring - dt.timedelta(minutes=60, seconds=30)],
         spring + dt.timedelta(minutes=30), spring + dt.timedelta(hours=1)),
        ("1.2.0", {"days": ["sun"], "start": "02:30", "duration_min": 60, "tz": "Europe/Berlin"},
         [autumn - dt.timedelta(minutes=30, seconds=30), autumn + dt.timedelta(minutes=30, seconds=30)],
         autumn + dt.timedelta(days=7, minutes=45), autumn + dt.timedelta(days=7, minutes=90)),
    ]
    now = dt.datetime.now(UTC)
    for _v, window, *_ in steps:  # a download in real time inside the window installs at once, rightly
        opens, closes = next_window(MaintenanceWindow.model_validate(window), now)
        if opens <= now + dt.timedelta(minutes=5):
            pytest.skip(f"the window {window} is open in real time now (until {closes}): run it outside Sunday "
                        "01:00-03:30 Berlin time")
    with running_mosquitto(tmp_path) as broker, \
            running_fleet(tmp_path, broker.url, rollout_tick_s=0.05) as (fs, url):
        fs.service.devices.register_device(DEVICE, group="stores")
        for version, *_ in steps:
            fs.service.models.upload_bundle(rebundle(digits_bundle, tmp_path / f"v{version}.tar", version=version))
        with installed_agent(tmp_path / "agent", digits_bundle, device_id=DEVICE, fleet_url=url,
                             trusted_root=tmp_path / "keys" / "root.json", max_batch_size=8, instances=1,
                             intra_op_threads=1) as (agent, agent_url):
            wait_for(lambda: fs.service.devices.get_device(DEVICE).online and agent.fetcher is not None, 30,
                     "agent online")
            assert agent.fetcher is not None
            shift = {"mono": 0.0}  # how far the test moved the agent's monotonic clock on
            clock = TrustedClock(agent.fetcher.clock.floor, agent.fetcher.clock.tolerance_s,
                                 monotonic=lambda: time.monotonic() + shift["mono"])
            agent.fetcher.clock = clock

            def move_to(when: dt.datetime) -> None:
                """Time passes until the agent trusts ``when`` (never backwards: the monotonic clock moves on)."""
                ahead = (when - clock.reading().trusted).total_seconds()
                assert ahead >= 0, (when, clock.reading())
                shift["mono"] += ahead

            served = "1.0.0"
            for version, window, outside, inside, closes in steps:
                assert api.request("PUT", f"{url}/api/v1/windows/group/stores", json=window).status_code == 200
                rid = fs.service.rollouts.create_rollout("digits", version, [DEVICE]).id
                caplog.clear()
                # downloaded on the fleet's signed time (the fetch anchors the clock on it again), then waiting
                wait_for(lambda: any("waits for the maintenance window" in r.getMessage() for r in caplog.records),
                         60, f"{version} downloaded and waiting for its window")
                for t in outside:
                    move_to(t)
                    time.sleep(HOLD_S)
                    assert served_version(agent_url) == served, (version, t.isoformat(), "installed outside")
                    assert not any("window open (until" in r.getMessage() for r in caplog.records), t
                move_to(inside)
                wait_for(lambda v=version: served_version(agent_url) == v, 60, f"{version} installed inside")
                served = version
                opened = [r.getMessage() for r in caplog.records if "window open (until" in r.getMessage()]
                assert opened == [f"maintenance window open (until {closes.isoformat()}): installing"], opened
                wait_for(lambda r=rid: fs.service.rollouts.get_rollout(r).status == "succeeded", 30,
                         f"the fleet told of {version}")
            # the openings the agent waited for, as it said them: the autumn window skipped over (outside at
            # the second 02:30) made it wait for the next Sunday's
            waits = [r.getMessage() for r in caplog.records if "waits for the maintenance window" in r.getMessage()]
            assert any(f"opening at {(autumn + dt.timedelta(days=7, minutes=30)).isoformat()}" in w for w in waits), \
                waits
