"""Each rollout wave's telemetry over time (issue 34.5): latency p99, throughput, errors and drift (PSI) of a wave's
devices, for the console's per-wave charts and GET /api/v1/rollouts/{id}/series.

A wave of 90,000 devices sends millions of telemetry records over its life: neither the page nor the API reads them.
The ingest adds each record to its wave's rows of its minute, ten minutes and hour (``STEPS``; ``wave_series``: one
per rollout, step, wave, time and the model version the record came from; records, requests, errors, intervals and
p99 summed, the largest p99) and its drift counts to ``wave_drift_bins`` (one row per feature and bin), in the
ingest's own transaction, as upserts in key order. A record counts for the rollout its device's
``desired_rollout_id`` names when it is stored (set when the device's wave started it; kept through a rollback), in
the wave of its target there: a wave's series begins when the wave started. Its time is the record's ``ts`` (the
device's clock), at most the fleet's now.

A read groups those rows in SQL into at most ``MAX_BUCKETS`` buckets over the rollout's life, from its creation
until now, or until ``AFTER_S`` after it ended, at most the last ``MAX_SPAN_S``: the rows of the finest step that
needs at most ``MAX_STEPS_READ`` of them per series (a 24 h rollout: ten-minute rows, 144 per wave and version, in
buckets of 30 min), so a read's rows are bounded whatever the rollout's age; at most ``MAX_GROUPS`` groups are read
(``truncated`` says when more matched). Per wave the rollout's own version is one series, the two other versions
with the most records one each, any further ones summed as "other". Per bucket: throughput (requests over the
bucket's time: from its start, or the wave's if later, to its end, or now for the newest; at least the records' mean
interval), error rate (errors over requests), p99 (the mean and the largest of the records' p99) and drift: PSI of
the bucket's pooled answers against the version's compile-time reference (protocol.drift.score; under 200 answers
"insufficient"), the wave-level figure GET /api/v1/rollouts/{id}/drift gives since the wave started.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Table, case, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ..protocol import drift as D
from ..protocol import mqtt as proto
from .db import Rollout, RolloutWave, WaveDriftBinRow, WaveSeriesRow
from .drift import DriftBook
from .errors import NotFound

__all__ = ["AFTER_S", "MAX_BUCKETS", "MAX_GROUPS", "MAX_SPAN_S", "STEPS", "RolloutSeries", "on_telemetry",
           "rollout_series", "window"]

STEPS = (60, 600, 3600)  # the rows' time steps: each record is added to one row of each (wave, version)
MAX_STEPS_READ = 180  # a read takes the finest step with at most this many rows per wave and version
MAX_BUCKETS = 60  # buckets a read gives over the rollout's life
AFTER_S = 3600.0  # a finished rollout's series goes on this long after it ended (its versions settling)
MAX_SPAN_S = 7 * 86400.0  # a read covers at most this long (the newest part)
MAX_GROUPS = 20_000  # (wave, version, bucket) groups one read takes; drift bins: 64 times this
SERIES_PER_WAVE = 3  # versions with a series of their own per wave (the rollout's first); the rest are "other"
COUNT_CAP = 2**53  # sums stop here (exact in a double; protocol.mqtt.MAX_COUNT per record)


# -- ingest -------------------------------------------------------------------------------------------------------
def _insert(s: Session, table: Table) -> Any:
    return sqlite_insert(table) if s.get_bind().dialect.name == "sqlite" else pg_insert(table)


def _saturating(col: Any, add: Any) -> Any:
    return case((col > COUNT_CAP - add, COUNT_CAP), else_=col + add)


def on_telemetry(s: Session, waves: dict[str, tuple[int, int]], msgs: list[proto.Telemetry], book: DriftBook) -> None:
    """Add freshly stored records to their waves' rows (``waves``: each device's desired rollout and its target's wave
    there, as the ingest read them with the devices; a device in none is left out). One or two upserts per batch,
    whatever its size."""
    now = time.time()
    # each record into its minute's sums (records, requests, errors, intervals, p99 sum, p99 count, largest p99, drift
    # answers), then the minutes into the coarser steps' rows: the per-record work is done once, not once per step
    minutes: dict[tuple[int, int, int, str, str], list[Any]] = {}
    minute_bins: dict[tuple[tuple[int, int, int, str, str], str, int], int] = {}
    refs = book.references(s, {(dc.model, dc.version) for m in msgs if m.device_id in waves and (dc := m.drift)
                               is not None and (dc.model, dc.version) == (m.model, m.version)})  # one query, if any
    for m in msgs:
        if m.device_id not in waves:
            continue
        rid, wave = waves[m.device_id]
        ts = min(m.ts, now) if math.isfinite(m.ts) else now
        key = (rid, wave, int(ts // STEPS[0]) * STEPS[0], m.model or "", m.version or "")
        a = minutes.get(key)
        if a is None:
            a = minutes[key] = [0, 0, 0, 0.0, 0.0, 0, None, 0]
        a[0] += 1
        a[1] += m.requests
        a[2] += m.errors
        a[3] += m.interval_s
        p99 = m.latency.p99_ms
        if p99 is not None:
            a[4] += p99
            a[5] += 1
            if a[6] is None or p99 > a[6]:
                a[6] = p99
        dc = m.drift
        if dc is None or (dc.model, dc.version) != (m.model, m.version):
            continue
        ref = refs.get((dc.model, dc.version))
        if ref is None or dc.matches(ref) is not None:  # refused by fleet.drift too (and counted there)
            continue
        a[7] += dc.samples
        for f in dc.features:
            for i, c in enumerate(f.counts):
                if c:
                    minute_bins[(key, f.name, i)] = minute_bins.get((key, f.name, i), 0) + c
    rows: dict[tuple[int, int, int, int, str, str], list[Any]] = {}
    bins: dict[tuple[int, int, int, int, str, str, str, int], int] = {}
    for step in STEPS:
        for (rid, wave, t, model, version), a in minutes.items():
            k = (rid, step, wave, t // step * step, model, version)
            have = rows.get(k)
            if have is None:
                rows[k] = list(a)
                continue
            for i in range(6):
                have[i] += a[i]
            if a[6] is not None and (have[6] is None or a[6] > have[6]):
                have[6] = a[6]
            have[7] += a[7]
        for ((rid, wave, t, model, version), feature, i), c in minute_bins.items():
            kb = (rid, step, wave, t // step * step, model, version, feature, i)
            bins[kb] = bins.get(kb, 0) + c
    if not rows:
        return
    ws: Table = WaveSeriesRow.__table__  # type: ignore[assignment]
    ins = _insert(s, ws)
    x = ins.excluded
    # one upsert of every row of the batch, in key order (the lock order between replicas adding to the same rows)
    s.connection().execute(ins.on_conflict_do_update(
        index_elements=["rollout_id", "step", "wave", "t", "model", "version"],
        set_={"records": _saturating(ws.c.records, x.records), "requests": _saturating(ws.c.requests, x.requests),
              "errors": _saturating(ws.c.errors, x.errors), "interval_s": ws.c.interval_s + x.interval_s,
              "p99_sum": ws.c.p99_sum + x.p99_sum, "p99_n": ws.c.p99_n + x.p99_n,
              "p99_max": case((x.p99_max > ws.c.p99_max, x.p99_max), else_=func.coalesce(ws.c.p99_max, x.p99_max)),
              "drift_samples": _saturating(ws.c.drift_samples, x.drift_samples)}),
        [{"rollout_id": k[0], "step": k[1], "wave": k[2], "t": k[3], "model": k[4], "version": k[5],
          "records": min(a[0], COUNT_CAP), "requests": min(a[1], COUNT_CAP), "errors": min(a[2], COUNT_CAP),
          "interval_s": a[3], "p99_sum": a[4], "p99_n": a[5], "p99_max": a[6], "drift_samples": min(a[7], COUNT_CAP)}
         for k, a in sorted(rows.items())])
    if bins:
        wb: Table = WaveDriftBinRow.__table__  # type: ignore[assignment]
        bi = _insert(s, wb)
        s.connection().execute(bi.on_conflict_do_update(
            index_elements=["rollout_id", "step", "wave", "t", "model", "version", "feature", "bin"],
            set_={"count": _saturating(wb.c.count, bi.excluded.count)}),
            [{"rollout_id": k[0], "step": k[1], "wave": k[2], "t": k[3], "model": k[4], "version": k[5],
              "feature": k[6], "bin": k[7], "count": min(c, COUNT_CAP)} for k, c in sorted(bins.items())])


# -- reading ------------------------------------------------------------------------------------------------------
def _unix(t: dt.datetime) -> float:
    return t.replace(tzinfo=dt.UTC).timestamp()


def window(created_at: dt.datetime, finished_at: dt.datetime | None, now: float) -> tuple[int, int, int, int]:
    """The span a rollout's series covers and how it is read, as (start, end, bucket width, row step) in whole
    seconds: the finest step with at most ``MAX_STEPS_READ`` rows over the span (the coarsest past it), start a
    multiple of it, at most ``MAX_BUCKETS`` buckets of a whole number of steps between start and end."""
    end = now if finished_at is None else min(now, _unix(finished_at) + AFTER_S)
    start = min(_unix(created_at), end)
    start = max(start, end - MAX_SPAN_S)
    step = next((st for st in STEPS if (end - start) / st <= MAX_STEPS_READ), STEPS[-1])
    t0 = int(start // step) * step
    t1 = max(math.ceil(end), t0 + 1)
    width = step * max(1, math.ceil((t1 - t0) / MAX_BUCKETS / step))
    return t0, t1, width, step


def rollout_series(sessions: Any, book: DriftBook, rollout_id: int, now: float | None = None) -> dict[str, Any]:
    """Each wave's series (RolloutSeries' shape), read in two grouped queries whatever the rollout's size."""
    now = time.time() if now is None else now
    with sessions() as s:
        r = s.get(Rollout, rollout_id)
        if r is None:
            raise NotFound(f"no rollout {rollout_id}")
        waves = list(s.scalars(select(RolloutWave).where(RolloutWave.rollout_id == r.id).order_by(RolloutWave.idx)))
        t0, t1, width, step = window(r.created_at, r.finished_at, now)
        ws, wb = WaveSeriesRow, WaveDriftBinRow
        b = ((ws.t - t0) // width).label("b")
        groups = list(s.execute(
            select(ws.wave, ws.model, ws.version, b, func.sum(ws.records), func.sum(ws.requests),
                   func.sum(ws.errors), func.sum(ws.interval_s), func.sum(ws.p99_sum), func.sum(ws.p99_n),
                   func.max(ws.p99_max), func.sum(ws.drift_samples))
            .where(ws.rollout_id == r.id, ws.step == step, ws.t >= t0, ws.t < t1)
            .group_by(ws.wave, ws.model, ws.version, b).order_by(ws.wave, b).limit(MAX_GROUPS + 1)))
        truncated = len(groups) > MAX_GROUPS
        groups = groups[:MAX_GROUPS]
        counts: dict[tuple[int, str, str, int], dict[str, dict[int, int]]] = {}
        if any(g[11] for g in groups):
            bb = ((wb.t - t0) // width).label("b")
            for w, mo, ve, bk, feat, bn, c in s.execute(
                    select(wb.wave, wb.model, wb.version, bb, wb.feature, wb.bin, func.sum(wb.count))
                    .where(wb.rollout_id == r.id, wb.step == step, wb.t >= t0, wb.t < t1)
                    .group_by(wb.wave, wb.model, wb.version, bb, wb.feature, wb.bin).limit(64 * MAX_GROUPS)):
                counts.setdefault((w, mo, ve, int(bk)), {}).setdefault(feat, {})[int(bn)] = int(c or 0)
        refs = {(mo, ve): book.reference(s, mo, ve) for mo, ve in {(g[1], g[2]) for g in groups if g[11]}}
        name, version = r.model_name or "", r.model_version or ""
        by_wave: dict[int, list[Any]] = {}
        for g in groups:
            by_wave.setdefault(int(g[0]), []).append(g)
        out_waves = []
        for w in waves:
            out_waves.append({"index": w.idx, "state": w.state, "size": w.size,
                              "started_at": None if w.started_at is None else w.started_at.replace(
                                  tzinfo=dt.UTC).isoformat(),
                              "points": _points(w.idx, by_wave.get(w.idx, []), counts, refs, (name, version), t0,
                                                width, now, None if w.started_at is None else _unix(w.started_at))})
        return {"rollout_id": r.id, "model": r.model_name, "version": r.model_version, "start": float(t0),
                "end": float(t1), "bucket_s": float(width), "step_s": float(step), "truncated": truncated,
                "waves": out_waves}


def _points(wave: int, groups: list[Any], counts: dict[tuple[int, str, str, int], dict[str, dict[int, int]]],
            refs: dict[tuple[str, str], D.DriftReference | None], rollout: tuple[str, str], t0: int, width: int,
            now: float, since: float | None) -> list[dict[str, Any]]:
    """One wave's points: a series per version (the rollout's, then the most recorded), the rest as "other".
    ``since``: when the wave started (its records begin then: the time of the bucket it started in counts from
    there)."""
    records: dict[tuple[str, str], int] = {}
    for g in groups:
        records[(g[1], g[2])] = records.get((g[1], g[2]), 0) + int(g[4] or 0)
    own = set(sorted(records, key=lambda k: (k != rollout, -records[k], k))[:SERIES_PER_WAVE])
    merged: dict[tuple[str, str, int], dict[str, Any]] = {}
    for g in groups:
        mv = (g[1], g[2]) if (g[1], g[2]) in own else ("other", "")
        a = merged.setdefault((*mv, int(g[3])), {"n": 0, "req": 0, "err": 0, "interval": 0.0, "p99_sum": 0.0,
                                                 "p99_n": 0, "p99_max": None, "ds": 0})
        for k, v in zip(("n", "req", "err", "interval", "p99_sum", "p99_n"), g[4:10], strict=True):
            a[k] += float(v or 0) if k in ("interval", "p99_sum") else int(v or 0)  # PostgreSQL's sums: Decimal
        if g[10] is not None:
            a["p99_max"] = float(g[10]) if a["p99_max"] is None else max(a["p99_max"], float(g[10]))
        if mv != ("other", ""):  # several versions' drift counts are on different bins: never pooled
            a["ds"] += int(g[11] or 0)
    points = []
    for (mo, ve, bk), a in sorted(merged.items(), key=lambda kv: (kv[0][2], kv[0][:2] != rollout, kv[0][:2])):
        n, req, err = int(a["n"]), int(a["req"]), int(a["err"])
        start = t0 + bk * width
        # the bucket's time: from its start, or the wave's if later, to its end, or now for the newest bucket; at
        # least the records' mean interval (a record counts its whole interval's requests)
        span = round(max(min(start + width, now) - max(start, since or start),
                         float(a["interval"]) / n if n else 0.0, 1.0), 3)
        psi = feature = level = None
        ref, c = refs.get((mo, ve)), counts.get((wave, mo, ve, bk))
        if a["ds"] and ref is not None and c:
            sc = D.score(ref, {f.name: [c.get(f.name, {}).get(i, 0) for i in range(f.bins)] for f in ref.features},
                         a["ds"])
            psi, feature, level = sc.psi, sc.feature, sc.level
        points.append({"t": float(start), "span_s": span, "model": mo, "version": ve, "records": n,
                       "requests": req, "errors": err, "throughput_rps": round(req / span, 6),
                       "error_rate": round(err / req, 6) if req else None,
                       "p99_ms": round(float(a["p99_sum"]) / a["p99_n"], 6) if a["p99_n"] else None,
                       "p99_max_ms": a["p99_max"], "drift_samples": int(a["ds"]), "psi": psi,
                       "drift_feature": feature, "drift_level": level})
    return points


# -- what the REST API answers (GET /api/v1/rollouts/{id}/series) ----------------------------------------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class SeriesPoint(_Out):
    """One bucket of a wave, for the devices that sent records from one model version (``model`` "other": the
    versions past the wave's three with most records, summed; no drift)."""

    t: float  # the bucket's start (unix seconds)
    span_s: float  # the time its throughput is over: the bucket's, from the wave's start and until now
    model: str
    version: str
    records: int
    requests: int
    errors: int
    throughput_rps: float  # requests / span_s: the wave's devices together
    error_rate: float | None  # errors / requests (None: no requests)
    p99_ms: float | None  # the mean of the records' p99
    p99_max_ms: float | None  # the largest record p99
    drift_samples: int  # answers counted in the version's drift bins
    psi: float | None  # the pooled answers' largest feature PSI against the version's reference (protocol.drift)
    drift_feature: str | None
    drift_level: str | None  # stable/watch/drift/insufficient; None: no drift counts


class WaveSeries(_Out):
    index: int
    state: str
    size: int
    started_at: str | None
    points: list[SeriesPoint]  # by time, then the rollout's version first


class RolloutSeries(_Out):
    rollout_id: int
    model: str | None
    version: str | None
    start: float  # unix seconds: the rollout's creation (or the newest MAX_SPAN_S), a whole step
    end: float  # now, or AFTER_S after it ended
    bucket_s: float  # each bucket's width: a whole number of steps, at most 60 buckets between start and end
    step_s: float  # the stored rows' step it was read from (60, 600 or 3600 s)
    truncated: bool  # more (wave, version, bucket) groups matched than one read takes
    waves: list[WaveSeries]
