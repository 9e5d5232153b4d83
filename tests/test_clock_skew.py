"""A box whose clock is wrong, faked with libfaketime (Debian's ``libfaketime``) on a real agent process against a
real fleet (in this process, on the real clock) and a real Mosquitto.

- 2 days fast: python-tuf on the local clock saw "timestamp.json is expired" (the timestamp lives a day) and the
  box could never update. Now its expiry checks use the fleet's signed time: it installs, and reports the skew.
- 400 days slow: on the local clock it accepted timestamp metadata that expired long ago (the freeze protection
  expiry gives was gone). Now the fleet's signed time says it is expired: refused, the skew reported.

Skipped, with the reason, where libfaketime is not installed (``.ci/ensure-system-deps`` installs it).
"""

from __future__ import annotations

import datetime as dt
import glob
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import edgefleet.fleet.tuf_repo as tuf_repo
from tests.conftest import REPO, running_mosquitto
from tests.fleet_harness import api, running_fleet
from tests.waiting import stop_process, wait_for

LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)
pytestmark = pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime is not installed (Debian: apt-get install "
                                                           "libfaketime; .ci/ensure-system-deps does)")
DAY_S = 86400.0
TOLERANCE_S = 3600.0  # of the skew the device reports, against the offset faked (the test's own run time is less)


@dataclass
class World:
    fs: Any
    url: str
    mqtt_url: str
    tmp: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory, digits_bundle) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("clock")
    with running_mosquitto(tmp) as broker, running_fleet(tmp, broker.url, rollout_tick_s=0.05) as (fs, url):
        fs.service.devices.register_device("clock-fast")
        fs.service.devices.register_device("clock-slow")
        fs.service.models.upload_bundle(digits_bundle)
        yield World(fs, url, broker.url, tmp)


@contextmanager
def agent_with_clock(w: World, device: str, offset: str) -> Iterator[Path]:
    """The agent as a process of its own whose wall clock is ``offset`` (libfaketime's FAKETIME: "+2d", "-400d")
    off; its monotonic clock is left true. Yields its log file."""
    data = w.tmp / device
    cfg = w.tmp / f"{device}.yaml"
    cfg.write_text(f"device_id: {device}\nfleet_url: {w.url}\ndata_dir: {data}\n"
                   f"trusted_root: {w.tmp / 'keys' / 'root.json'}\nhttp_port: 0\ntelemetry_interval_s: 0.5\n"
                   "install_retries: 0\nruntime: onnxruntime\n"
                   "max_batch_size: 8\ninstances: 1\nintra_op_threads: 1\n")  # nothing timed at install: faster
    env = {**os.environ, "LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    log = w.tmp / f"{device}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgefleet", "agent", "--config", str(cfg), "-v"], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield log
        finally:
            stop_process(proc)


def _skew(w: World, device: str) -> float:
    """The clock skew the device's newest telemetry reports (waits for one that carries it)."""
    def reported() -> float | None:
        d = w.fs.service.devices.get_device(device)
        return d.telemetry.clock_skew_s if d.telemetry else None

    skew = wait_for(reported, 60, f"{device} reports its clock skew")
    assert skew is not None
    return float(skew)


def test_a_box_two_days_fast_installs_on_the_fleets_signed_time_and_reports_its_skew(world: World):
    with agent_with_clock(world, "clock-fast", "+2d") as log:
        rid = world.fs.service.rollouts.create_rollout("digits", "1.0.0", ["clock-fast"]).id
        try:
            wait_for(lambda: world.fs.service.rollouts.get_rollout(rid).status in ("succeeded", "paused", "failed"),
                     120, "the rollout to the fast box ends")
        finally:
            print(log.read_text()[-4000:])
        d = world.fs.service.devices.get_device("clock-fast")
        assert world.fs.service.rollouts.get_rollout(rid).status == "succeeded", d.last_error
        assert (d.running_model, d.running_version) == ("digits", "1.0.0")
        skew = _skew(world, "clock-fast")
        assert abs(skew - 2 * DAY_S) < TOLERANCE_S, skew
        page = api.get(f"{world.url}/devices/clock-fast").text
        assert "clock 2.0 days ahead of the fleet&#39;s time" in page or "clock 2.0 days ahead of the fleet's time" \
            in page, page[:2000]
        assert "this box's clock is 2.0 days ahead of the fleet's signed time" in log.read_text()


def test_a_box_400_days_slow_refuses_expired_metadata_and_reports_its_skew(world: World, monkeypatch):
    # the fleet signs (and keeps re-signing) a timestamp that expired a minute ago: frozen metadata
    monkeypatch.setitem(tuf_repo.EXPIRY, "timestamp", dt.timedelta(seconds=-60))
    world.fs.repo.refresh_expiring(margin=10.0)
    with agent_with_clock(world, "clock-slow", "-400d") as log:
        world.fs.service.rollouts.create_rollout("digits", "1.0.0", ["clock-slow"])

        def refused() -> str | None:
            d = world.fs.service.devices.get_device("clock-slow")
            return d.last_error if d.last_state == "failed" else None

        try:
            err = wait_for(refused, 120, "the slow box refuses the expired metadata")
        finally:
            print(log.read_text()[-4000:])
        assert err is not None and "timestamp.json is expired" in err, err
        assert world.fs.service.devices.get_device("clock-slow").running_model is None
        skew = _skew(world, "clock-slow")
        assert abs(skew + 400 * DAY_S) < TOLERANCE_S, skew
        assert "clock 400.0 days behind" in api.get(f"{world.url}/devices/clock-slow").text


def test_the_fleets_signed_time_needs_no_token_and_a_well_formed_nonce(world: World):
    import httpx
    from tuf.api.metadata import Metadata, Root

    from edgefleet.protocol.signed_time import verify_time

    nonce = "0123456789abcdef" * 2
    r = httpx.get(f"{world.url}/api/v1/time", params={"nonce": nonce}, timeout=10)  # no Authorization
    root = Metadata[Root].from_bytes((world.tmp / "keys" / "root.json").read_bytes()).signed
    when = verify_time(r.content, root, nonce)
    assert abs((when - dt.datetime.now(dt.timezone.utc)).total_seconds()) < 60
    for bad in ("", "abc", "Z" * 32, "0" * 65, "../" * 12):
        assert httpx.get(f"{world.url}/api/v1/time", params={"nonce": bad}, timeout=10).status_code == 422, bad
    assert httpx.get(f"{world.url}/api/v1/health", timeout=10).status_code == 200
