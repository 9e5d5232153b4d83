"""The telemetry ingest scores drift per batch (fleet.drift.DriftBook.on_telemetry): a batch gives the same
drift_scores rows and the same refusals as its records stored one at a time, in ts order (a device twice in a batch,
a window reaching into earlier batches, rows aged out of the window, the WINDOW_RECORDS cap across batches), and the
SQL statements a batch costs do not grow with its records. Real SQLite and PostgreSQL (tests.conftest.fleet_db)."""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, func, select, update

from edgefleet.fleet import drift as FD
from edgefleet.fleet.db import DriftScoreRow, RolloutShadow, RolloutTarget, utcnow
from edgefleet.protocol import mqtt as proto
from tests.drift_fleet import DriftFleet, counts, drift_fleet, mixed_batch, record

DEVICES = 40


@pytest.fixture
def fleet(tmp_path, fleet_db) -> Iterator[DriftFleet]:
    url = fleet_db or f"sqlite:///{tmp_path / 'fleet.db'}"
    ids = [f"{side}-{i:03d}" for side in "ab" for i in range(DEVICES)] + \
          [f"{side}-{k}" for side in "ab" for k in ("span", "tiny", "aged")]
    f = drift_fleet(url, tmp_path, ids)
    yield f
    f.close()


def _refusals(f: DriftFleet, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(device, why) of each drift refusal, as the ingest counts them."""
    got: list[tuple[str, str]] = []
    add = f.svc.rejections.add

    def recording(kind: str, subject: str, message: str) -> None:
        if kind == "drift_counts_refused":
            got.append((subject, message))
        add(kind, subject, message)

    monkeypatch.setattr(f.svc.rejections, "add", recording)
    return got


def _as(side: str, msgs: list[proto.Telemetry]) -> list[proto.Telemetry]:
    return [m.model_copy(update={"device_id": side + m.device_id[1:]}) for m in msgs]


def _rows(f: DriftFleet, side: str) -> dict[str, list[tuple[Any, ...]]]:
    """Each device's rows (its name without the side), in the order they were stored, all but id and received_at."""
    r = DriftScoreRow
    out: dict[str, list[tuple[Any, ...]]] = {}
    with f.svc.sessions() as s:
        for x in s.scalars(select(r).where(r.device_id.like(f"{side}-%")).order_by(r.id)):
            out.setdefault(x.device_id[1:], []).append(
                (x.ts, x.model, x.version, x.samples, x.skipped, x.scored_samples, x.psi, x.feature, x.level,
                 x.noise, x.counts, x.features))
    return out


def test_a_batch_scores_as_its_records_one_at_a_time(fleet, monkeypatch):
    """Side a stores each batch at once, side b the same records one by one (by device and ts): the same rows, the
    same scores, the same refusals; and the windows add what they should."""
    f = fleet
    refused = _refusals(f, monkeypatch)
    rng = random.Random(11)
    plain = [f"a-{i:03d}" for i in range(DEVICES)]
    seq = 0
    batches = []
    for b in range(3):
        batch = mixed_batch(f.ref, rng, plain, 60, seq, 1000.0 + 100 * b)
        seq += len(batch)
        extra = []
        if b < 2:  # 20 records of 5 answers a batch: the window's WINDOW_RECORDS cap reaches into the batch before
            extra += [record("a-tiny", seq + i, 1000.0 + 100 * b + i, counts(f.ref, rng, 5)) for i in range(20)]
        if b == 0:  # 80 answers here, twice 80 in the next batch: its window spans both
            extra += [record("a-span", seq + 20, 1000.0, counts(f.ref, rng, 80)),
                      record("a-aged", seq + 21, 1000.0, counts(f.ref, rng, 80))]
        if b == 1:
            extra += [record("a-span", seq + 21, 1101.0, counts(f.ref, rng, 80)),
                      record("a-span", seq + 20, 1100.0, counts(f.ref, rng, 80)),
                      record("a-aged", seq + 22, 1100.0, counts(f.ref, rng, 80))]
        seq += 30
        batches.append(batch + extra)
    for i, batch in enumerate(batches):
        assert f.svc.ingest.store_telemetry(batch) == len(batch)
        for m in sorted(_as("b", batch), key=lambda m: (m.device_id, m.ts)):
            assert f.svc.ingest.store_telemetry([m]) == 1
        if i == 0:  # both sides' first rows of a-aged (and a few others) older than the window
            with f.svc.sessions.begin() as s:
                s.execute(update(DriftScoreRow).where(DriftScoreRow.device_id.in_(
                    ["a-aged", "b-aged", "a-001", "b-001", "a-002", "b-002"])).values(
                    received_at=utcnow() - dt.timedelta(seconds=FD.WINDOW_S + 60)))
    a = _rows(f, "a")
    assert a == _rows(f, "b")
    assert sum(len(v) for v in a.values()) > 150
    assert sorted((d[2:], why) for d, why in refused if d.startswith("a-")) == \
           sorted((d[2:], why) for d, why in refused if d.startswith("b-"))
    assert {why.split(":")[0] for _, why in refused} >= {"drift counts for dm 0.9.0, which has no drift reference",
                                                         "drift counts for dm 1.1.0"}
    scored = {k: [x[5] for x in v] for k, v in a.items()}
    assert scored["-span"] == [80, 160, 240]  # in ts order, the batch before added
    assert scored["-aged"] == [80, 80]  # its first record is older than the window
    # 5 answers a record: its own, and of the device's records before it (the batch's own, then the batch before's)
    # at most WINDOW_RECORDS
    assert scored["-tiny"] == [5 * (i + 1) for i in range(20)] + [5 * (1 + min(20 + i, FD.WINDOW_RECORDS))
                                                                 for i in range(20)]
    levels = {x[8] for v in a.values() for x in v}
    assert "insufficient" in levels and len(levels) >= 2, levels
    with f.svc.sessions() as s:  # the rollout driver's figures of the same telemetry: the same on both sides
        t = {d: (n, e, p) for d, n, e, p in s.execute(select(
            RolloutTarget.device_id, RolloutTarget.tele_requests, RolloutTarget.tele_errors, RolloutTarget.p99_after))}
    assert all(t[d] == t["b" + d[1:]] for d in t if d.startswith("a-")) and t["a-span"][0] == 300


def test_statements_per_batch_do_not_grow_with_its_records(fleet):
    """A warm fleet: a batch of 20 records and one of 200, each with devices twice, records scored alone and with
    their window, refusals of both kinds, and shadow figures of targets shadowing the rollout's version (stored
    before and new), cost the same SQL statements (a count, not a timing)."""
    f = fleet
    rng = random.Random(3)
    ids = [f"{side}-{i:03d}" for side in "ab" for i in range(DEVICES)]
    with f.svc.sessions.begin() as s:
        s.execute(update(RolloutTarget).where(RolloutTarget.device_id.in_(ids)).values(state="shadowing"))
    statements = [0]

    @event.listens_for(f.engine, "before_cursor_execute")
    def _count(*_a: object) -> None:
        statements[0] += 1

    def batch(n: int, seq: int, ts: float) -> list[proto.Telemetry]:
        out = mixed_batch(f.ref, rng, ids, n - 4, seq, ts)
        out += [record("a-tiny", seq + n, ts, counts(f.ref, rng, 30)),
                record("a-tiny", seq + n + 1, ts + 1, counts(f.ref, rng, 30)),
                record("a-span", seq + n + 2, ts, counts(f.ref, rng, 30, version="0.9.0")),
                record("a-aged", seq + n + 3, ts, counts(f.ref, rng, 30, bins_off=True))]
        fig = proto.ShadowFigures(model="dm", version="1.1.0", samples=50, top1_agreement=0.99, p99_ms=3.0)
        return [m.model_copy(update={"shadow": fig}) if i % 3 == 0 else m for i, m in enumerate(out)]

    def cost(msgs: list[proto.Telemetry]) -> int:
        statements[0] = 0
        assert f.svc.ingest.store_telemetry(msgs) == len(msgs)
        return statements[0]

    cost(batch(200, 0, 1000.0))  # the caches warm, each device a history
    small, large = cost(batch(20, 1000, 1100.0)), cost(batch(200, 2000, 1200.0))
    assert small == large, (small, large)
    assert large <= 20, large
    with f.svc.sessions() as s:
        assert s.scalar(select(func.count()).select_from(RolloutShadow)) > 40
