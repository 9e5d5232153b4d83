"""Each rollout wave over time (issue 34.5): the rollout page charts every started wave's latency p99, throughput,
errors and drift with a time axis, and GET /api/v1/rollouts/{id}/series gives the same figures, summed by the ingest
per wave and minute (fleet.series). Real Mosquitto, a real fleet (MQTT ingest, database, console over HTTP); the
telemetry comes from simulated devices (fleet.simulator) and from the agent's own MQTT link."""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from pathlib import Path

import pytest

from edgefleet.agent.link.mqtt import MqttLink
from edgefleet.agent.link.spool import Spool
from edgefleet.fleet.series import RolloutSeries, window
from edgefleet.protocol import drift as D
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.bundle import read_manifest
from tests.fleet_harness import api, running_fleet
from tests.waiting import at_once, wait_for

CLOCK = re.compile(r">\d\d:\d\d(:\d\d)?</text>")  # a tick label of a chart's time axis (UTC clock time)


def _series(url: str, rid: int) -> dict:
    r = api.get(f"{url}/api/v1/rollouts/{rid}/series")
    assert r.status_code == 200, r.text
    return RolloutSeries.model_validate(r.json()).model_dump()


def _wave_charts(page: str, wave: int) -> list[tuple[str, str]]:
    """The SVG charts of one wave's section of the rollout page."""
    m = re.search(rf'<div class="grid wave-charts" data-wave="{wave}">(.*?)</div>\n', page, re.S)
    assert m, f"no charts of wave {wave} on the page"
    charts = [re.match(r"<h3>(.*?)</h3>(.*)", part, re.S) for part in m.group(1).split('<div class="chart">')[1:]]
    assert all(charts), m.group(1)[:500]
    return [(c.group(1), c.group(2)) for c in charts if c]


def _console(url: str, path: str) -> str:
    r = api.get(f"{url}{path}", token=False, cookies={"edgefleet_token": api.token})
    assert r.status_code == 200, r.text
    return r.text


@pytest.mark.timeout(300)
def test_the_rollout_page_charts_each_wave_over_time(tmp_path, mosquitto, sims, digits_bundle, digits_bundle_v2):
    """Two waves of simulated devices move from digits 1.0.0 (p99 10 ms, no errors) to 1.1.0 (p99 30 ms, a quarter
    of the requests failing): each wave's series has the new version's figures, and the page a chart of each with
    a time axis."""
    devices = [f"wv-{i:05d}" for i in range(4)]
    with running_fleet(tmp_path / "fleet", mosquitto.url, rollout_tick_s=0.05) as (_, url):
        for bundle in (digits_bundle, digits_bundle_v2):
            assert api.post(f"{url}/api/v1/bundles", content=bundle.read_bytes()).status_code == 201
        sims(mqtt_url=mosquitto.url, devices=4, prefix="wv", running=("digits", "1.0.0"), telemetry_interval_s=0.3,
             requests_per_interval=100, p99_ms=10.0, p99_factor_by_version={"1.1.0": 3.0},
             error_rate_by_version={"1.1.0": 0.25})
        wait_for(lambda: len([d for d in api.get(f"{url}/api/v1/devices").json() if d["online"]]) == 4, 30,
                 "the simulated devices online")
        rid = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.1.0", "devices": devices,
                                                       "waves": ["2", "100%"], "soak_s": [1.0]}).json()["id"]
        page = _console(url, f"/rollouts/{rid}")  # at once: the first wave may not have started
        assert "Waves over time" in page

        def both_waves() -> dict | None:
            s = _series(url, rid)
            new = [[p for p in w["points"] if p["version"] == "1.1.0"] for w in s["waves"]]
            return s if all(sum(p["records"] for p in n) >= 6 for n in new) else None

        wait_for(lambda: api.get(f"{url}/api/v1/rollouts/{rid}").json()["status"] == "succeeded", 60,
                 "the rollout done")
        s = wait_for(both_waves, 90, "both waves' 1.1.0 telemetry in the series", interval_s=0.3)
        page = _console(url, f"/rollouts/{rid}")
    assert s["bucket_s"] == s["step_s"] == 60 and s["start"] % 60 == 0 and s["start"] <= time.time() <= s["end"] + 5
    assert [w["index"] for w in s["waves"]] == [0, 1] and [w["size"] for w in s["waves"]] == [2, 2]
    for w in s["waves"]:
        new = [p for p in w["points"] if p["version"] == "1.1.0"]
        assert all(p["model"] == "digits" for p in w["points"])
        assert all(p["p99_ms"] == pytest.approx(30.0) and p["p99_max_ms"] == pytest.approx(30.0) for p in new), new
        assert all(p["requests"] == 100 * p["records"] and p["errors"] == 25 * p["records"] for p in new), new
        assert all(p["error_rate"] == pytest.approx(0.25) for p in new), new
        assert all(p["throughput_rps"] == pytest.approx(p["requests"] / p["span_s"], rel=1e-4) for p in new), new
        assert all(p["psi"] is None and p["drift_level"] is None for p in w["points"])  # the simulator sends none
        assert all(p["p99_ms"] == pytest.approx(10.0) for p in w["points"] if p["version"] == "1.0.0")
    # each wave: its four charts, each with a time axis and a line (or a point) of 1.1.0; drift says why it is empty
    for wave in (0, 1):
        charts = _wave_charts(page, wave)
        titles = [re.sub(r"<[^>]+>.*", "", t).strip() for t, _ in charts]
        assert titles == [f"wave {wave + 1}: latency p99", f"wave {wave + 1}: throughput", f"wave {wave + 1}: errors",
                          f"wave {wave + 1}: drift (PSI)"], titles
        for title, body in charts[:3]:
            assert "time UTC" in title and "<svg" in body and CLOCK.search(body), (title, body[:300])
            assert re.search(r"<polyline|<circle", body) and "1.1.0" in body, body
        assert "no score yet" in charts[3][1]


def _link(tmp: Path, device: str, broker: str, installs: bool) -> MqttLink:
    """The agent's own MQTT link; ``installs``: it reports each desired version installed at once."""
    link: MqttLink

    def on_desired(d: proto.DesiredState) -> None:
        if installs:
            link.report(proto.ReportedState(device_id=device, ts=time.time(), state="installed",
                                            rollout_id=d.rollout_id, model=d.model, version=d.version,
                                            running_model=d.model, running_version=d.version))

    link = MqttLink(device, broker, Spool(tmp / device), "http://127.0.0.1:1", on_desired, ack_timeout_s=0.3)
    link.start()
    wait_for(link.connected.is_set, 10, f"{device}'s link connected")
    return link


def _telemetry(link: MqttLink, seq: int, version: str, drift: D.DriftCounts | None = None,
               stages: dict[str, proto.StageFigures] | None = None) -> bytes:
    return proto.encode(proto.Telemetry(
        device_id=link.device_id, ts=time.time(), stream=link.spool.stream, seq=seq, interval_s=1.0, model="digits",
        version=version, requests=300, errors=0, latency=proto.LatencySummary(p50_ms=2.0, p95_ms=3.0, p99_ms=4.0,
                                                                              max_ms=5.0),
        batches=300, batch_size_mean=1.0, batch_size_max=1, cpu_percent=5.0, rss_mb=90.0, drift=drift, stages=stages))


@pytest.mark.timeout(300)
def test_a_wave_s_drift_over_time_from_the_agent_link(tmp_path, mosquitto, digits_bundle):
    """A device whose answers all fall in one class (a camera that sees one digit) sends drift counts with its
    telemetry through the agent's MQTT link: its wave's drift series scores the pooled answers against the
    version's compile-time reference (PSI far above 0.25), and the page's drift chart draws it."""
    ref = read_manifest(digits_bundle).drift
    assert ref is not None, "the digits bundle has a drift reference (manifest version 6)"
    counts = tuple(D.FeatureCounts(name=f.name, counts=tuple(300 if i == 0 else 0 for i in range(f.bins)))
                   for f in ref.features)
    dc = D.DriftCounts(model="digits", version="1.0.0", samples=300, features=counts)
    with running_fleet(tmp_path / "fleet", mosquitto.url, rollout_tick_s=0.05) as (_, url):
        assert api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes()).status_code == 201
        link = _link(tmp_path, "cam-one", mosquitto.url, installs=True)
        try:
            wait_for(lambda: api.get(f"{url}/api/v1/devices/cam-one").status_code == 200, 30, "cam-one registered")
            rid = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0",
                                                           "devices": ["cam-one"]}).json()["id"]
            wait_for(lambda: api.get(f"{url}/api/v1/rollouts/{rid}").json()["status"] == "succeeded", 60,
                     "the rollout done")
            for _ in range(2):
                link.spool.append(lambda seq: _telemetry(link, seq, "1.0.0", dc))

            def scored() -> dict | None:
                pts = [p for p in _series(url, rid)["waves"][0]["points"] if p["drift_samples"]]
                return pts[-1] if pts and sum(p["drift_samples"] for p in pts) >= 600 else None

            point = wait_for(scored, 60, "the wave's drift counts in its series", interval_s=0.3)
            page = _console(url, f"/rollouts/{rid}")
        finally:
            link.stop()
    assert point["version"] == "1.0.0" and point["drift_level"] == "drift" and point["psi"] > 0.25, point
    want = D.score(ref, {f.name: list(f.counts) for f in counts}, 300)  # the same shares: the same PSI
    assert point["psi"] == pytest.approx(want.psi) and point["drift_feature"] == want.feature
    drift_chart = _wave_charts(page, 0)[3]
    assert "drift (PSI)" in drift_chart[0] and CLOCK.search(drift_chart[1])
    assert re.search(r"<polyline|<circle", drift_chart[1]) and "watch 0.1" in drift_chart[1]


def test_a_read_takes_the_finest_rows_that_keep_it_bounded():
    """Whatever a rollout's age, a read takes at most 180 rows per wave and version, in at most 60 buckets of whole
    steps: a minute's rows for 2 h, ten minutes' for a day, hours' for a week (and the newest week of a month)."""
    now = 1_800_000_000.0
    for age_s, step, width in ((300, 60, 60), (2 * 3600, 60, 120), (24 * 3600, 600, 1800),
                               (7 * 86400, 3600, 3 * 3600), (30 * 86400, 3600, 3 * 3600)):
        created = dt.datetime.fromtimestamp(now - age_s, dt.UTC).replace(tzinfo=None)
        t0, t1, w, st = window(created, None, now)
        assert (st, w) == (step, width), age_s
        assert t0 % st == 0 and (t1 - t0) / st <= 180 + 1 and math.ceil((t1 - t0) / w) <= 60
    # a rollout that ended a day ago: its life and the hour after it
    created = dt.datetime.fromtimestamp(now - 3 * 86400, dt.UTC).replace(tzinfo=None)
    ended = dt.datetime.fromtimestamp(now - 86400, dt.UTC).replace(tzinfo=None)
    t0, t1, _, _ = window(created, ended, now)
    assert t0 <= now - 3 * 86400 and t1 == math.ceil(now - 86400 + 3600)


@pytest.mark.timeout(300)
def test_replicas_storing_one_wave_s_telemetry_at_once_neither_deadlock_nor_lose_a_record(tmp_path, digits_bundle,
                                                                                          digits_bundle_v2):
    """Four threads (two replicas' worth each way) store records of the same wave's devices at once, in their own
    orders and batches: every batch adds to the same rows of the minute, ten minutes and hour, upserted in key order;
    none deadlocks, and each row's sums are exactly the records'. PostgreSQL (SQLite takes one lock for all)."""
    import random

    from sqlalchemy import select

    from edgefleet.fleet.db import WaveSeriesRow, make_engine
    from edgefleet.fleet.keys import init_keys
    from edgefleet.fleet.service import FleetService
    from edgefleet.fleet.tuf_repo import KeyStore, Repository
    from edgefleet.fleet.tuf_store import SqlStore
    from tests.conftest import postgres_db
    from tests.fleet_harness import RecordingPublisher

    db = postgres_db("edgefleet_wave_series")
    if db is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth)")
    engine, sessions = make_engine(db)
    try:
        init_keys(tmp_path / "keys")
        repo = Repository(SqlStore(engine), KeyStore(tmp_path / "keys"), upload_dir=tmp_path / "up")
        repo.init()
        svc = FleetService(sessions, repo, RecordingPublisher())
        for bundle in (digits_bundle, digits_bundle_v2):
            svc.models.upload_bundle(bundle)
        ids = [f"dev-{i:04d}" for i in range(200)]
        svc.devices.register_devices([{"device_id": d, "profile": "x86-cpu"} for d in ids])
        svc.ingest.handle_statuses([proto.StatusMessage(device_id=d, ts=1.0, state="online") for d in ids])
        rid = svc.rollouts.create_rollout("digits", "1.1.0", devices=ids).id
        svc.driver.tick()
        assert all(d.desired and d.desired.rollout_id == rid for d in svc.devices.list_devices())
        now = time.time()

        def writer(k: int) -> None:
            order = ids[:]
            random.Random(k).shuffle(order)
            stream = f"{k:016x}"
            for seq in range(3):
                for i in range(0, len(order), 45):
                    svc.ingest.store_telemetry([proto.Telemetry(
                        device_id=d, ts=now, stream=stream, seq=seq, interval_s=10.0, model="digits",
                        version="1.1.0", requests=7, errors=1,
                        latency=proto.LatencySummary(p50_ms=1.0, p95_ms=2.0, p99_ms=3.0, max_ms=4.0), batches=7,
                        batch_size_mean=1.0, batch_size_max=1, cpu_percent=1.0, rss_mb=1.0)
                        for d in order[i:i + 45]])

        threads, errors = at_once([lambda k=k: writer(k) for k in range(4)], join_s=120)
        assert not any(t.is_alive() for t in threads), "a writer is still waiting: a deadlock nobody detected"
        assert not errors, [f"{type(e).__name__}: {e}"[:300] for e in errors]
        with sessions() as s:
            rows = list(s.scalars(select(WaveSeriesRow).where(WaveSeriesRow.rollout_id == rid)))
        records = 4 * 3 * len(ids)
        assert sorted(r.step for r in rows) == [60, 600, 3600]  # one wave, one version, one time: a row per step
        for r in rows:
            assert (r.wave, r.model, r.version, r.t % r.step) == (0, "digits", "1.1.0", 0)
            assert (r.records, r.requests, r.errors, r.p99_n) == (records, 7 * records, records, records), r.step
            assert r.p99_sum == pytest.approx(3.0 * records) and r.p99_max == 3.0
    finally:
        engine.dispose()
