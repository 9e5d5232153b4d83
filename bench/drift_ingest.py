"""What drift counts cost the telemetry ingest: 1,000-record batches with and without drift counts, on SQLite and
on PostgreSQL, through the ingest's own entry point (FleetService.store_telemetry, as the MQTT worker calls it).

    .venv/bin/python bench/drift_ingest.py                      # 1,000 records a batch, 700 devices, 5 rounds
    .venv/bin/python bench/drift_ingest.py --records 200 --rounds 3 --backends sqlite

The fleet (tests/drift_fleet.py): models dm 1.0.0 and 1.1.0 with a drift reference and 0.9.0 without, every device a
target of an in-progress rollout of 1.1.0 (so the rollout engine's per-batch work runs too). Each batch
(tests.drift_fleet.mixed_batch): about a third of the devices twice, a third of the records with >= 200 answers
(scored alone), the rest fewer (their score adds the device's earlier records: the window), a few refused. Two
batches first build a history; then ``--rounds`` rounds of a batch with drift counts and the same records without,
alternating, so the machine's load hits both alike. Per batch: wall time of store_telemetry and the SQL statements
it sent (a SQLAlchemy before_cursor_execute count). Figures: median and max, and drift over no-drift.

PostgreSQL: a scratch database on 127.0.0.1:5432 (user postgres, trust auth), dropped at the end; skipped when not
reachable. The database shares the box with this process: on a busy 2-core box the times are noisy, the statement
counts are not.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sqlalchemy import event, func, select  # noqa: E402

from bench._common import say  # noqa: E402
from edgefleet.fleet.db import DriftScoreRow  # noqa: E402
from tests.conftest import postgres_db  # noqa: E402
from tests.drift_fleet import drift_fleet, mixed_batch  # noqa: E402

DB_NAME = "edgefleet_bench_drift"


def run(backend: str, url: str, work: Path, records: int, devices: int, rounds: int) -> dict[str, list[float]]:
    ids = [f"dev-{i:05d}" for i in range(devices)]
    f = drift_fleet(url, work, ids)
    statements = [0]

    @event.listens_for(f.engine, "before_cursor_execute")
    def _count(*_a: object) -> None:
        statements[0] += 1

    rng = random.Random(1)
    seq, ts = 0, time.time() - 3600
    out: dict[str, list[float]] = {"drift_s": [], "plain_s": [], "drift_stmts": [], "plain_stmts": []}
    try:
        for i in range(2 + 2 * rounds):
            with_drift = i < 2 or i % 2 == 0
            batch = mixed_batch(f.ref, rng, ids, records, seq, ts, drift=with_drift)
            seq, ts = seq + len(batch), ts + 10
            statements[0] = 0
            t0 = time.perf_counter()
            stored = f.svc.ingest.store_telemetry(batch)
            took = time.perf_counter() - t0
            assert stored == len(batch), (stored, len(batch))
            if i < 2:
                say(f"{backend}: history batch {i + 1}: {took:.2f} s, {statements[0]} statements")
                continue
            key = "drift" if with_drift else "plain"
            out[f"{key}_s"].append(took)
            out[f"{key}_stmts"].append(statements[0])
            say(f"{backend}: round {(i - 2) // 2 + 1} {key}: {took:.3f} s, {statements[0]} statements")
        with f.svc.sessions() as s:
            rows = s.scalar(select(func.count()).select_from(DriftScoreRow))
        say(f"{backend}: {rows} drift_scores rows in the end")
    finally:
        f.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1000, help="records a batch (the MQTT worker's max_batch)")
    ap.add_argument("--devices", type=int, default=700)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", default="sqlite,postgresql")
    a = ap.parse_args()
    logging.getLogger("edgefleet").setLevel(logging.ERROR)  # the refused counts, one warning each
    if not 10 <= a.records <= 10_000 or not 1 <= a.devices <= a.records or not 1 <= a.rounds <= 100:
        ap.error("--records 10..10000, --devices 1..records, --rounds 1..100")
    results = {}
    for backend in a.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if backend == "sqlite":
                url = f"sqlite:///{work / 'fleet.db'}"
            else:
                pg = postgres_db(DB_NAME)
                if pg is None:
                    say("postgresql: not reachable on 127.0.0.1:5432: skipped")
                    continue
                url = pg
            results[backend] = run(backend, url, work, a.records, a.devices, a.rounds)
            if backend != "sqlite":
                _drop(url)
    print(f"{a.records} records a batch ({a.devices} devices), {a.rounds} rounds with and without drift counts, "
          "alternating")
    for backend, r in results.items():
        d, p = statistics.median(r["drift_s"]), statistics.median(r["plain_s"])
        print(f"  {backend:10s} with drift    {d * 1000:8.0f} ms median, {max(r['drift_s']) * 1000:8.0f} max, "
              f"{statistics.median(r['drift_stmts']):5.0f} statements")
        print(f"  {backend:10s} without drift {p * 1000:8.0f} ms median, {max(r['plain_s']) * 1000:8.0f} max, "
              f"{statistics.median(r['plain_stmts']):5.0f} statements")
        print(f"  {backend:10s} drift / no drift {d / p:6.2f}")
    return 0


def _drop(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", connect_timeout=2) as conn:
        conn.autocommit = True
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    raise SystemExit(main())
