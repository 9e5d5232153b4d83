"""The web console at 100,000 devices on PostgreSQL, timed in headless Chromium.

    .venv/bin/python bench/console_scale.py                  # 1,000 devices (baseline), then 100,000; 5 rounds each
    .venv/bin/python bench/console_scale.py --devices 10000 --rounds 3 --telemetry-per-device 2

What it does, in one run:

1. A scratch PostgreSQL database (127.0.0.1:5432, user postgres, trust auth), dropped at the end.
2. A private Mosquitto on a free port and ``edgefleet fleet serve --db-url ...`` as its own process on loopback
   (the real server; it creates its schema at start).
3. Seeds the database straight through COPY (seconds, where the API would take minutes): ``--devices`` devices
   (a third offline, ten groups, each with a last telemetry record, CPU features and a self-test, as devices that
   have reported carry), ``--telemetry-per-device`` telemetry rows each (plus 200 for the device whose page is
   timed), and a paused rollout of digits 1.0.0 to every device in two waves (10% installed; the rest 60% installed,
   20% failed, 20% pending) created ``--series-hours`` ago, with its waves' telemetry of that long summed per wave
   and time step as the ingest keeps it (fleet.series: wave_series, and wave_drift_bins against a drift reference in
   the build's manifest), which the rollout page charts; then VACUUM ANALYZE (what autovacuum does to a table this size
   within minutes). A tree without fleet.series (an older checkout, timed as a before) gets no series rows.
4. Signs in to the console in Chromium (Debian's, driven by Playwright) and loads each page ``--rounds`` times:
   the overview, the device list (a deep page and a filtered page), the rollout page (its first page of targets
   and a page of its failed ones) and a device's page. Per load, from the browser's Navigation Timing: navigation
   start to the load event, and the server's part (request sent to first byte); and the wall time of Playwright's
   ``page.goto`` (the load event plus the driver's round trips). Median and max per page,
   and the CPU each load cost the fleet's process, the database's backends and Chromium (the box's load stretches
   wall times; CPU is what the page costs).
5. The same for ``--baseline`` devices (1,000) first, on the same box: each page's load time at 100,000 is also
   given as a ratio to that baseline's.

The fleet, PostgreSQL, Mosquitto and Chromium share the machine: on a busy 2-core box the figures are noisy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import say  # noqa: E402
from bench.fleet_scale import fleet, mosquitto  # noqa: E402
from tests.conftest import postgres_db  # noqa: E402

DB_NAME = "edgefleet_bench_console"
STATES = ("installed", "installed", "installed", "failed", "pending")  # wave 2's targets, by index mod 5
GOAL_S = 0.5


def _telemetry(device_id: str, seq: int, ts: float) -> dict:
    """A telemetry record as an agent sends it (protocol.mqtt.Telemetry, with a device summary and how it serves)."""
    from edgefleet.protocol import mqtt as proto

    return proto.Telemetry(
        device_id=device_id, ts=ts, stream="0123456789abcdef", seq=seq, interval_s=10.0, model="digits",
        version="1.0.0", requests=120 + seq % 7, errors=0,
        latency=proto.LatencySummary(p50_ms=0.41, p95_ms=0.62, p99_ms=0.9 + (seq % 5) / 10, max_ms=2.1),
        batches=118, batch_size_mean=1.02, batch_size_max=2, cpu_percent=3.4, rss_mb=91.2,
        device=proto.DeviceSummary(cpu_percent=12.0, memory_used_mb=1800.0, memory_total_mb=7800.0,
                                   temperature_c=51.0),
        serving=proto.ServingChoice(precision="int8", precision_source="bundle", max_batch_size=8,
                                    batch_source="measured", instances=1, threads=2)).model_dump(mode="json")


HARDWARE = {"arch": "x86_64", "cpu_features": ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni"]}
SELFTEST = {"model": "digits", "version": "1.0.0", "samples": 64, "top1": 0.9844, "top1_agreement": 1.0, "drift": 0.0,
            "build": {"profile": "x86-cpu", "precision": "int8", "top1": 0.9861, "accuracy": 0.9861,
                      "metric": "top1", "eval_samples": 360}}
MANIFEST = {"accuracy": {"candidate": 0.9861, "reference": 0.9861, "metric": "top1", "eval_samples": 360},
            "cpu_features": ["avx2"], "quantization": {"scheme": "static qdq", "weight_bits": 8},
            "selftest_summary": {"top1": 0.9861}}


def _unix(t: dt.datetime) -> float:
    return t.replace(tzinfo=dt.UTC).timestamp()


def _one(conn, sql: str, args: tuple) -> int:
    row = conn.execute(sql, args).fetchone()
    assert row is not None
    return int(row[0])


def _drift_reference() -> dict:
    """A classification drift reference (protocol.drift), as a digits build's manifest holds one."""
    import numpy as np

    from edgefleet.protocol import drift as D

    rng = np.random.default_rng(7)
    x = rng.normal(size=(2000, 10)).astype(np.float32)
    x[np.arange(2000), rng.integers(0, 10, 2000)] += 5.0
    return D.build_reference("classification", "out", x).model_dump(mode="json")


def seed_series(cur, rid: int, waves: list[tuple[int, int]], start: float, hours: float, manifest: dict) -> int:
    """A rollout's per-wave series as the ingest sums it (fleet.series): rows of each of its time steps since
    ``start``, each with drift counts in the reference's bins, the devices of ``waves`` ((index, size)) sending a
    record every 10 s. Returns the rows written (0 in a tree without fleet.series: its tables do not exist)."""
    try:
        from edgefleet.fleet.series import STEPS
    except ImportError:
        return 0
    ref = manifest["drift"]
    series, bins = [], []
    for step in STEPS:
        first = int(start // step) * step
        for w, size in waves:
            rec = size * step // 10
            for m in range(int(hours * 3600 // step)):
                t = first + m * step
                series.append((rid, step, w, t, "digits", "1.0.0", rec, 12 * rec, rec // 100, 10.0 * rec,
                               (0.9 + (m % 5) / 10) * rec, rec, 2.1, 12 * rec))
                bins.extend((rid, step, w, t, "digits", "1.0.0", f["name"], b, round(12 * rec * share))
                            for f in ref["features"] for b, share in enumerate(f["shares"]))
    with cur.copy("COPY wave_series (rollout_id, step, wave, t, model, version, records, requests, errors, "
                  "interval_s, p99_sum, p99_n, p99_max, drift_samples) FROM STDIN") as cp:
        for row in series:
            cp.write_row(row)
    with cur.copy("COPY wave_drift_bins (rollout_id, step, wave, t, model, version, feature, bin, count) "
                  "FROM STDIN") as cp:
        for row in bins:
            cp.write_row(row)
    return len(series) + len(bins)


def seed(dbname: str, n: int, per_device: int, finished: int = 0, series_hours: float = 24.0) -> dict:
    """Devices, telemetry rows and a paused two-wave rollout to every device, through COPY, after ``finished``
    earlier rollouts to every device that succeeded (history the overview lists too). Returns what a page must
    show (the paused rollout's id, a device with a page of telemetry)."""
    import psycopg

    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    t_now = time.time()
    began = now - dt.timedelta(hours=series_hours)  # the paused rollout's creation
    manifest = {**MANIFEST, "drift": _drift_reference()}
    rnd = random.Random(7)
    ids = [f"bulk-{i:06d}" for i in range(n)]
    first_wave = n // 10
    with psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={dbname}") as conn:
        model_id = _one(conn,
            "INSERT INTO models (name, version, profile, backend, precision, target_path, sha256, size_bytes, "
            "accuracy, manifest, uploaded_at) VALUES ('digits', '1.0.0', 'x86-cpu', 'onnxruntime', 'int8', "
            "'digits/1.0.0/x86-cpu.tar', %s, 123456, 0.9861, %s, %s) RETURNING id",
            ("0" * 64, json.dumps(manifest), now))
        cur = conn.cursor()
        for _ in range(finished):
            old = _one(conn,
                "INSERT INTO rollouts (model_id, status, created_at, finished_at, model_name, model_version, spec, "
                "current_wave, created_by) VALUES (%s, 'succeeded', %s, %s, 'digits', '1.0.0', %s, 0, 'bench') "
                "RETURNING id", (model_id, now, now, json.dumps({"waves": ["100%"]})))
            conn.execute("INSERT INTO rollout_waves (rollout_id, idx, size, soak_s, state, n_installed, n_failed, "
                         "started_at, finished_at) VALUES (%s, 0, %s, 0, 'passed', %s, 0, %s, %s)",
                         (old, n, n, now, now))
            with cur.copy("COPY rollout_targets (rollout_id, device_id, state, updated_at, wave, model_id, "
                          "tele_requests, tele_errors) FROM STDIN") as cp:
                for d in ids:
                    cp.write_row((old, d, "installed", now, 0, model_id, 1200, 0))
        rid = _one(conn,
            "INSERT INTO rollouts (model_id, status, created_at, model_name, model_version, spec, current_wave, "
            "created_by, reason) VALUES (%s, 'paused', %s, 'digits', '1.0.0', %s, 1, 'bench', 'paused by bench') "
            "RETURNING id", (model_id, began, json.dumps({"waves": ["10%", "100%"]})))
        n_inst = sum(1 for i in range(first_wave, n) if STATES[i % 5] == "installed")
        n_fail = sum(1 for i in range(first_wave, n) if STATES[i % 5] == "failed")
        conn.execute("INSERT INTO rollout_waves (rollout_id, idx, size, soak_s, state, n_installed, n_failed, "
                     "started_at) VALUES (%s, 0, %s, 0, 'passed', %s, 0, %s), (%s, 1, %s, 0, 'installing', %s, %s, %s)",
                     (rid, first_wave, first_wave, began, rid, n - first_wave, n_inst, n_fail, began))
        series_rows = seed_series(cur, rid, [(0, first_wave), (1, n - first_wave)], _unix(began), series_hours,
                                  manifest)
        last_tel = json.dumps(_telemetry("@ID@", per_device, t_now))
        hardware, selftest = json.dumps(HARDWARE), json.dumps(SELFTEST)
        with cur.copy("COPY devices (id, labels, registered_via, created_at, online, last_seen, agent_version, "
                      "inference_url, running_model, running_version, last_state, last_error, desired_model_id, "
                      "desired_rollout_id, last_telemetry, hardware, selftest, group_name, tags, profile, "
                      "last_report_ts) FROM STDIN") as cp:
            for i, d in enumerate(ids):
                state = "installed" if i < first_wave else STATES[i % 5]
                seen = now - dt.timedelta(seconds=rnd.uniform(0, 30))
                cp.write_row((d, json.dumps({"site": f"s{i % 50}"}), "api", now, i % 3 != 0, seen, "0.9.0",
                              f"http://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8080", "digits", "1.0.0",
                              state, "install failed: self-test drift" if state == "failed" else None, model_id, rid,
                              last_tel.replace("@ID@", d), hardware, selftest, f"g{i % 10}",
                              json.dumps(["cam", f"line{i % 4}"]), "x86-cpu",
                              t_now))
        with cur.copy("COPY rollout_targets (rollout_id, device_id, state, error, updated_at, wave, model_id, "
                      "previous_model_id, p99_before, p99_after, tele_requests, tele_errors) FROM STDIN") as cp:
            for i, d in enumerate(ids):
                wave = 0 if i < first_wave else 1
                state = "installed" if wave == 0 else STATES[i % 5]
                cp.write_row((rid, d, state, "install failed: self-test drift" if state == "failed" else None, now,
                              wave, model_id, None, 1.0, 1.1 if state == "installed" else None,
                              1200 if state == "installed" else 0, 0))
        paged = ids[min(n - 1, 12345)]  # the device whose page is timed: 200 records, as its charts read
        # one JSON text per seq, the device's id put in by replace: COPY, not Python, sets the pace
        template = {seq: json.dumps(_telemetry("@ID@", seq, t_now - 10 * (per_device - seq)))
                    for seq in range(max(per_device, 200))}
        with cur.copy("COPY telemetry (device_id, stream, seq, ts, received_at, payload) FROM STDIN") as cp:
            for d in ids:
                for seq in range(200 if d == paged else per_device):
                    cp.write_row((d, "0123456789abcdef", seq, t_now - 10 * (per_device - seq), now,
                                  template[seq].replace("@ID@", d)))
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE")
        sizes = {t: _one(conn, "SELECT pg_total_relation_size(%s)", (t,))
                 for t in ("devices", "rollout_targets", "telemetry")}
    return {"rollout": rid, "device": paged, "first_wave": first_wave, "failed": n_fail, "series_rows": series_rows,
            "mb": {t: round(b / 2**20) for t, b in sizes.items()}}


class CpuMeter:
    """CPU seconds (user + system) of the fleet's process, of the PostgreSQL backends serving the scratch database and
    of this process's Chromium processes: what a page costs whatever the box's load (which stretches wall times)."""

    def __init__(self, fleet_pid: int, dbname: str):
        import psutil

        self.psutil = psutil
        self.fleet = psutil.Process(fleet_pid)
        self.dbname = dbname
        self._procs: dict[int, object] = {}  # pid -> psutil.Process, kept so cpu_times() reads the same process

    def _proc(self, pid: int):
        p = self._procs.get(pid)
        if p is None:
            p = self._procs[pid] = self.psutil.Process(pid)
        return p

    def _cpu(self, pids: list[int]) -> float:
        total = 0.0
        for pid in pids:
            try:
                t = self._proc(pid).cpu_times()
                total += t.user + t.system
            except self.psutil.Error:
                pass
        return total

    def backends(self) -> list[int]:
        import psycopg

        with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True) as c:
            return [r[0] for r in c.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> "
                                            "pg_backend_pid()", (self.dbname,))]

    def browsers(self) -> list[int]:
        return [c.pid for c in self.psutil.Process().children(recursive=True) if "chrom" in c.name().lower()]

    def sample(self, backends: list[int], browsers: list[int]) -> tuple[float, float, float]:
        return self._cpu([self.fleet.pid]), self._cpu(backends), self._cpu(browsers)


def time_pages(url: str, token: str, pages: dict[str, str], rounds: int, meter: CpuMeter) -> dict[str, dict]:
    """Each page ``rounds`` times in headless Chromium, from the browser's Navigation Timing: navigation start to
    the load event, and the server's part (request sent to the response's first byte); and the wall time of
    Playwright's ``page.goto`` (the load event plus the driver's round trips). Per page: median and max (s), and the
    CPU seconds per load of the fleet, its database backends and Chromium (the fleet's includes its background
    threads: ``idle`` is that rate alone, measured over a second with no page loading)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("error: Debian's chromium is not installed (apt-get install chromium; "
                         ".ci/ensure-system-deps installs it)")
    loads: dict[str, list[tuple[float, float, float]]] = {k: [] for k in pages}
    cpu: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in pages}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=["--no-sandbox"] if os.geteuid() == 0 else [])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/")
            page.fill("input[name=token]", token)
            page.click("button[type=submit]")
            if page.locator("h1").count() == 0 or "sign in" in page.title():
                raise RuntimeError(f"signing in to the console failed: {page.inner_text('body')[:500]}")
            backends, browsers = meter.backends(), meter.browsers()
            idle0, t_idle = meter.sample(backends, browsers), time.perf_counter()
            time.sleep(2.0)
            idle1 = meter.sample(backends, browsers)
            idle = [(b - a) / (time.perf_counter() - t_idle) for a, b in zip(idle0, idle1, strict=True)]
            for r in range(rounds):
                for name, path in pages.items():
                    before = meter.sample(backends, browsers)
                    t = time.perf_counter()
                    resp = page.goto(f"{url}{path}", wait_until="load", timeout=120_000)
                    wall = time.perf_counter() - t
                    after = meter.sample(backends, browsers)
                    if resp is None or resp.status != 200:
                        raise RuntimeError(f"{path}: HTTP {resp.status if resp else '?'}")
                    nav = page.evaluate("() => { const e = performance.getEntriesByType('navigation')[0]; "
                                        "return [e.startTime, e.requestStart, e.responseStart, e.loadEventEnd]; }")
                    loads[name].append(((nav[3] - nav[0]) / 1000, (nav[2] - nav[1]) / 1000, wall))
                    for i in range(3):
                        cpu[name][i] += after[i] - before[i]
                say(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.3f} s" for k, v in loads.items()))
            for name in ("overview", "rollout"):
                page.goto(f"{url}{pages[name]}")
                say(f"{name}: {page.inner_text('.summary')[:200]!r}".replace("\n", " "))
        finally:
            browser.close()

    def stat(v: list[tuple[float, float, float]], i: int) -> tuple[float, float]:
        return round(statistics.median(x[i] for x in v), 3), round(max(x[i] for x in v), 3)

    out: dict[str, dict] = {}
    for k, v in loads.items():
        (lm, lx), (sm, sx), (gm, gx) = stat(v, 0), stat(v, 1), stat(v, 2)
        out[k] = {"load_median_s": lm, "load_max_s": lx, "server_median_s": sm, "server_max_s": sx,
                  "goto_median_s": gm, "goto_max_s": gx,
                  "cpu_ms": {w: round(1000 * c / len(v), 1) for w, c in zip(("fleet", "db", "chromium"), cpu[k],
                                                                            strict=True)}}
    out["idle"] = {"cpu_ms_per_s": {w: round(1000 * c, 1) for w, c in zip(("fleet", "db", "chromium"), idle,
                                                                         strict=True)}}
    return out


def run(n: int, per_device: int, rounds: int, finished: int, keep: bool, series_hours: float = 24.0) -> dict:
    """One fleet of ``n`` devices: seeded, its pages timed; the database dropped after unless ``keep``."""
    load_before = os.getloadavg()
    db_url = postgres_db(DB_NAME)
    if db_url is None:
        raise SystemExit("error: PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth)")
    db_name = db_url.rsplit("/", 1)[1]  # DB_NAME and this checkout's tag (tests/conftest.postgres_db)
    work = Path(tempfile.mkdtemp(prefix="console-scale-"))
    try:
        with mosquitto(work, devices=0) as mq, fleet(work, mq, None, "--db-url", db_url) as client:
            t = time.monotonic()
            seeded = seed(db_name, n, per_device, finished, series_hours)
            seed_s = time.monotonic() - t
            say(f"seeded {n} devices, {n * per_device} telemetry rows and a {n}-target rollout (after {finished} "
                f"finished ones; {seeded['series_rows']} rows of its waves' series over {series_hours:g} h) in "
                f"{seed_s:.1f} s (VACUUM ANALYZE included); sizes {seeded['mb']} MB")
            rid = seeded["rollout"]
            pages = {"overview": "/",
                     "device list, page 1,000": f"/?offset={min(n - 50, 49_950) // 50 * 50}",
                     "device list, filtered": "/?group=g7&state=offline&q=99",
                     "rollout": f"/rollouts/{rid}",
                     "rollout, failed, page 2": f"/rollouts/{rid}?state=failed&offset=50",
                     "device": f"/devices/{seeded['device']}"}
            token = (work / "fleet" / "admin-token").read_text().strip()
            took = time_pages(str(client.base_url).rstrip("/"), token, pages, rounds,
                              CpuMeter(client.pid, db_name))  # type: ignore[attr-defined]
    finally:
        if not keep:
            import psycopg

            with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True) as c:
                c.execute(f"DROP DATABASE IF EXISTS {db_name} WITH (FORCE)")
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"kept: database {db_name}, work folder {work}")
    return {"devices": n, "rounds": rounds, "finished_rollouts": finished, "seed_s": round(seed_s, 1),
            "series_rows": seeded["series_rows"],
            "mb": seeded["mb"], "idle": took.pop("idle"), "pages": took,
            "loadavg": [round(load_before[0], 1), round(os.getloadavg()[0], 1)]}


def show(res: dict, base: dict | None) -> None:
    pages = res["pages"]
    width = max(len(k) for k in pages)
    print(f"\n{res['devices']} devices (load average {res['loadavg'][0]} -> {res['loadavg'][1]}; the box's other work "
          "stretches every wall time)")
    print(f"{'page':<{width}}  load event med / max  server med / max  page.goto med / max  "
          f"CPU ms per load: fleet / db / chromium" + ("  load vs baseline" if base else "")
          + f"   (goal < {GOAL_S} s)")
    for k, v in pages.items():
        flag = "ok" if v["load_max_s"] < GOAL_S else "OVER"
        c = v["cpu_ms"]
        ratio = f"  {v['load_median_s'] / base['pages'][k]['load_median_s']:>6.2f}x" if base else ""
        print(f"{k:<{width}}  {v['load_median_s']:>7.3f} / {v['load_max_s']:<7.3f}  "
              f"{v['server_median_s']:>6.3f} / {v['server_max_s']:<6.3f}  "
              f"{v['goto_median_s']:>6.3f} / {v['goto_max_s']:<6.3f}  "
              f"{c['fleet']:>7.1f} / {c['db']:>6.1f} / {c['chromium']:>6.1f}{ratio}   {flag}")
    print(f"idle CPU ms per s (fleet's background threads / db / chromium): {res['idle']['cpu_ms_per_s']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=100_000)
    ap.add_argument("--baseline", type=int, default=1000,
                    help="devices of a baseline run first, the same pages timed on the same box (0: none)")
    ap.add_argument("--telemetry-per-device", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--finished-rollouts", type=int, default=0,
                    help="earlier rollouts to every device (succeeded) before the paused one: the overview lists them")
    ap.add_argument("--series-hours", type=float, default=24.0,
                    help="the paused rollout's age: its waves' per-minute series rows (fleet.series) cover it")
    ap.add_argument("--keep", action="store_true", help="keep the database and the work folder (printed)")
    a = ap.parse_args()
    base = run(a.baseline, a.telemetry_per_device, a.rounds, a.finished_rollouts, False,
               a.series_hours) if a.baseline else None
    res = run(a.devices, a.telemetry_per_device, a.rounds, a.finished_rollouts, a.keep, a.series_hours)
    if base:
        show(base, None)
    show(res, base)
    print(json.dumps({"baseline": base, "run": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
