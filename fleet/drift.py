"""The fleet's drift scores: each device's live answers against its model's compile-time reference, each wave's, and a
wave's new version against the version its devices ran before (the rollout gate ``max_drift_psi``).

Scores are protocol.drift's: PSI per feature against the reference, the largest one the score, levels stable (below
0.1), watch (below 0.25), drift, or insufficient under 200 answers. A device's telemetry record carries the counts of
its interval (``Telemetry.drift``); each is stored as one ``drift_scores`` row with the device's score at that time:
the record's own counts when they hold 200 answers, else added to the device's previous records of the same version
(at most ``WINDOW_RECORDS`` of the last ``WINDOW_S``) until they do, so a quiet device still gets a verdict and a
busy one shows a change within one telemetry interval. A batch of records is scored at once, in a few statements
whatever its size (the windows of all its devices in one query, its rows in one insert): a device's records in ts
order, each seeing the batch's records before it, the same rows as storing them one at a time.

A wave's drift gate compares, on the wave's devices, the counts of the new version since the wave started with those
of the version each device ran before, in the ``BEFORE_S`` before it started (rows of each side at most
``MAX_ROWS``; protocol.drift.compare puts them on common bins). Either side under 200 answers: not judged.

Everything here is a pure function of rows, called by the ingest (service.ingest.store_telemetry) and the rollout driver
inside their own transactions.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, insert, select, tuple_
from sqlalchemy.orm import Session

from ..protocol import drift as D
from ..protocol import mqtt as proto
from .db import DriftScoreRow, Model, RolloutTarget, utcnow

__all__ = ["BEFORE_S", "MAX_ROWS", "WINDOW_RECORDS", "WINDOW_S", "DriftBook", "DriftRecord", "RolloutDrift",
           "WaveDrift", "add_counts", "device_drift", "rollout_drift"]

log = logging.getLogger("edgefleet.fleet.drift")

WINDOW_S = 600.0  # a device's records added together for its score reach back at most this far
WINDOW_RECORDS = 30  # and at most this many records
BEFORE_S = 3600.0  # the previous version's answers a wave is compared with: this long before the wave started
MAX_ROWS = 20_000  # rows read for one side of a comparison (newest first)
MAX_LIST = 1000  # rows one API call lists


def add_counts(into: dict[str, list[int]], counts: dict[str, Sequence[int]]) -> None:
    """Add ``counts`` (feature -> bins) into ``into``; a feature whose bins differ is left out of both."""
    for name, c in counts.items():
        have = into.get(name)
        if have is None:
            into[name] = [int(x) for x in c]
        elif len(have) == len(c):
            for i, x in enumerate(c):
                have[i] += int(x)
        else:
            into.pop(name)


class WaveDrift:
    """What a rollout's wave shows: its new version against the reference and against the previous version."""

    def __init__(self, vs_reference: D.DriftScore | None, vs_previous: D.DriftScore | None, detail: str):
        self.vs_reference, self.vs_previous, self.detail = vs_reference, vs_previous, detail

    def as_json(self) -> dict[str, Any]:
        return {"vs_reference": self.vs_reference.as_json() if self.vs_reference else None,
                "vs_previous": self.vs_previous.as_json() if self.vs_previous else None, "detail": self.detail}


class DriftBook:
    """Stores and reads drift scores; caches the references of model versions (immutable rows)."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, str], D.DriftReference] = {}
        self._lock = threading.Lock()

    def reference(self, s: Session, name: str, version: str) -> D.DriftReference | None:
        return self.references(s, [(name, version)])[(name, version)]

    def references(self, s: Session, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str],
                                                                                D.DriftReference | None]:
        """The reference of each (model, version): those not cached yet read in one query (per 500)."""
        out: dict[tuple[str, str], D.DriftReference | None] = {}
        with self._lock:
            for key in keys:
                out[key] = self._refs.get(key)
        missing = sorted(k for k, v in out.items() if v is None)
        found: dict[tuple[str, str], D.DriftReference] = {}
        m = Model
        for i in range(0, len(missing), 500):
            for name, version, manifest in s.execute(select(m.name, m.version, m.manifest).where(
                    tuple_(m.name, m.version).in_(missing[i:i + 500])).order_by(m.id)):
                key = (name, version)
                raw = (manifest or {}).get("drift") if isinstance(manifest, dict) else None
                if raw is None or key in found:
                    continue
                try:
                    found[key] = D.DriftReference.model_validate(raw)
                except ValueError as exc:  # stored by a fleet that checked it: log, never fail the ingest
                    log.warning("model %s %s: its drift reference does not parse: %s", name, version, exc)
        if found:  # a version without one is looked up again (it may be uploaded later)
            with self._lock:
                if len(self._refs) + len(found) > 4096:
                    self._refs.clear()
                self._refs.update(found)
            out.update(found)
        return out

    # -- ingest ------------------------------------------------------------------------------------------------------
    def on_telemetry(self, s: Session, msgs: list[proto.Telemetry]) -> list[tuple[str, str]]:
        """One row per record with drift counts, with the device's score then. Returns (device, why) for records whose
        counts do not fit their model version's reference (left out, never an error for the others).

        A few statements per batch, whatever its size: the references of its versions (those not cached), the
        windows of the (device, model, version) keys with a record under ``D.MIN_SAMPLES`` answers (one query), and
        the rows' insert (one executemany). A device's records in the batch are scored in ts order, each window
        seeing the batch's records before it (kept here, in the order their rows are inserted) ahead of the stored
        rows, as if each record had been stored on its own."""
        refused: list[tuple[str, str]] = []
        now = utcnow()
        todo = sorted((m for m in msgs if m.drift is not None), key=lambda m: (m.device_id, m.ts))
        if not todo:
            return refused
        refs = self.references(s, {(m.drift.model, m.drift.version) for m in todo if m.drift is not None})
        scored: list[tuple[proto.Telemetry, D.DriftCounts, D.DriftReference]] = []
        for m in todo:
            dc = m.drift
            assert dc is not None
            ref = refs.get((dc.model, dc.version))
            if ref is None:
                refused.append((m.device_id, f"drift counts for {dc.model} {dc.version}, which has no drift reference"))
                continue
            why = dc.matches(ref)
            if why is not None:
                refused.append((m.device_id, f"drift counts for {dc.model} {dc.version}: {why}"))
                continue
            scored.append((m, dc, ref))
        # each key with a record that needs its window: that key's rows, newest first (the batch's own go in front)
        windows = self._windows(s, {(m.device_id, dc.model, dc.version) for m, dc, _ in scored
                                    if dc.samples < D.MIN_SAMPLES}, now)
        rows = []
        for m, dc, ref in scored:
            counts: dict[str, list[int]] = {f.name: list(f.counts) for f in dc.features}
            earlier = windows.get((m.device_id, dc.model, dc.version))
            total, n = _window(counts, dc.samples, earlier or ())
            sc = D.score(ref, total, n)
            rows.append({"device_id": m.device_id, "received_at": now, "ts": m.ts, "model": dc.model,
                         "version": dc.version, "samples": dc.samples, "skipped": dc.skipped, "scored_samples": n,
                         "psi": sc.psi, "feature": sc.feature, "level": sc.level, "noise": sc.noise,
                         "counts": counts, "features": sc.features})
            if earlier is not None:  # the device's next record of the version sees this one
                earlier.appendleft((counts, dc.samples))
        if rows:  # in this order, so ids grow as the records' (device, ts), as the windows read them
            s.execute(insert(DriftScoreRow), rows)
        return refused

    @staticmethod
    def _windows(s: Session, keys: set[tuple[str, str, str]], now: dt.datetime
                 ) -> dict[tuple[str, str, str], deque[tuple[Any, Any]]]:
        """Each (device, model, version) key's stored rows (counts, samples) of the last ``WINDOW_S``, newest first,
        at most ``WINDOW_RECORDS``: one query per 500 devices (ROW_NUMBER over each key's rows; the rows of other
        versions of those devices it reads too are left out here)."""
        out: dict[tuple[str, str, str], deque[tuple[Any, Any]]] = {
            k: deque(maxlen=WINDOW_RECORDS) for k in keys}
        devices = sorted({k[0] for k in keys})
        models, versions = sorted({k[1] for k in keys}), sorted({k[2] for k in keys})
        r = DriftScoreRow
        for i in range(0, len(devices), 500):
            rn = func.row_number().over(partition_by=(r.device_id, r.model, r.version),
                                        order_by=r.id.desc()).label("rn")
            q = select(r.device_id, r.model, r.version, r.counts, r.samples, rn).where(
                r.device_id.in_(devices[i:i + 500]), r.model.in_(models), r.version.in_(versions),
                r.received_at >= now - dt.timedelta(seconds=WINDOW_S)).subquery()
            for d, model, version, c, k in s.execute(
                    select(q.c.device_id, q.c.model, q.c.version, q.c.counts, q.c.samples)
                    .where(q.c.rn <= WINDOW_RECORDS).order_by(q.c.device_id, q.c.model, q.c.version, q.c.rn)):
                window = out.get((d, model, version))
                if window is not None:
                    window.append((c, k))
        return out

    # -- reading -------------------------------------------------------------------------------------------------------
    @staticmethod
    def device_rows(s: Session, device_id: str, limit: int = 200) -> list[dict[str, Any]]:
        r = DriftScoreRow
        rows = s.scalars(select(r).where(r.device_id == device_id).order_by(r.id.desc())
                         .limit(max(1, min(limit, MAX_LIST))))
        return [row_json(x) for x in rows]

    def wave(self, s: Session, rollout_id: int, wave: int, name: str, version: str,
             started_at: dt.datetime | None) -> WaveDrift:
        """The wave's new version against its reference and against what its devices ran before."""
        t = RolloutTarget
        targets = list(s.execute(select(t.device_id, t.previous_model_id).where(t.rollout_id == rollout_id,
                                                                                  t.wave == wave)))
        if not targets or started_at is None:
            return WaveDrift(None, None, "the wave has not started")
        devices = [d for d, _ in targets]
        new_ref = self.reference(s, name, version)
        if new_ref is None:
            return WaveDrift(None, None, f"{name} {version} has no drift reference (a bundle from before manifest "
                                         "version 6): not judged")
        new_counts, new_n = self._sum(s, devices, name, version, started_at, None)
        vs_ref = D.score(new_ref, new_counts, new_n) if new_n else None
        prev_ids = Counter(p for _, p in targets if p is not None)
        prev_versions: Counter[str] = Counter()
        for pid, k in prev_ids.items():
            row = s.get(Model, pid)
            if row is not None and row.name == name:
                prev_versions[row.version] += k
        if not prev_versions:
            return WaveDrift(vs_ref, None, "no device of the wave ran an earlier version of the model: nothing to "
                                           "compare with")
        old_version = prev_versions.most_common(1)[0][0]
        old_ref = self.reference(s, name, old_version)
        if old_ref is None:
            return WaveDrift(vs_ref, None, f"the previous version {old_version} has no drift reference: not judged")
        old_counts, old_n = self._sum(s, devices, name, old_version, started_at - dt.timedelta(seconds=BEFORE_S),
                                      started_at)
        vs_prev = D.compare(old_ref, old_counts, new_ref, new_counts, old_n, new_n)
        detail = (f"{new_n} answers of {version} since the wave started vs {old_n} of {old_version} in the "
                  f"{BEFORE_S / 3600:g} h before, on the wave's {len(devices)} devices")
        if vs_prev.level == "insufficient":
            detail += f"; fewer than {D.MIN_SAMPLES} answers on a side: not judged"
        elif vs_prev.feature is not None:
            detail += f"; most moved: {vs_prev.feature}"
        if not new_ref.sure or not old_ref.sure:
            detail += "; the answers are read as a task the compiler inferred without being sure"
        return WaveDrift(vs_ref, vs_prev, detail)

    @staticmethod
    def _sum(s: Session, devices: list[str], name: str, version: str, since: dt.datetime,
             until: dt.datetime | None) -> tuple[dict[str, list[int]], int]:
        r = DriftScoreRow
        total: dict[str, list[int]] = {}
        n = 0
        for i in range(0, len(devices), 500):
            q = select(r.counts, r.samples).where(r.device_id.in_(devices[i:i + 500]), r.model == name,
                                                   r.version == version, r.received_at >= since)
            if until is not None:
                q = q.where(r.received_at <= until)
            for c, k in s.execute(q.order_by(r.id.desc()).limit(MAX_ROWS)):
                if isinstance(c, dict):
                    add_counts(total, c)
                    n += int(k or 0)
        return total, n


def _window(counts: dict[str, list[int]], samples: int, earlier: Iterable[tuple[Any, Any]]
            ) -> tuple[dict[str, list[int]], int]:
    """A record's counts, added to the device's ``earlier`` records (counts, samples; newest first) until they hold
    ``D.MIN_SAMPLES`` answers."""
    total = {k: list(v) for k, v in counts.items()}
    n = samples
    if n >= D.MIN_SAMPLES:
        return total, n
    for c, k in earlier:
        if isinstance(c, dict):
            add_counts(total, c)
            n += int(k or 0)
        if n >= D.MIN_SAMPLES:
            break
    return total, n


def row_json(x: DriftScoreRow) -> dict[str, Any]:
    return {"ts": x.ts, "received_at": None if x.received_at is None else x.received_at.replace(
        tzinfo=dt.UTC).isoformat(), "model": x.model, "version": x.version, "samples": x.samples,
        "skipped": x.skipped, "scored_samples": x.scored_samples, "psi": x.psi, "feature": x.feature,
        "level": x.level, "noise": x.noise, "features": x.features}



def device_drift(sessions: Any, book: DriftBook, device_id: str, limit: int = 200) -> list[dict[str, Any]]:
    """A device's drift rows, newest first (NotFound for an unknown device)."""
    from .db import Device
    from .errors import NotFound

    with sessions() as s:
        if s.get(Device, device_id) is None:
            raise NotFound(f"no device {device_id!r}")
        return book.device_rows(s, device_id, limit)


def rollout_drift(sessions: Any, book: DriftBook, rollout_id: int) -> dict[str, Any]:
    """Each wave of a rollout: its new version against the reference and against the previous version."""
    from .db import Rollout, RolloutWave
    from .errors import NotFound

    with sessions() as s:
        r = s.get(Rollout, rollout_id)
        if r is None:
            raise NotFound(f"no rollout {rollout_id}")
        waves = list(s.scalars(select(RolloutWave).where(RolloutWave.rollout_id == r.id).order_by(RolloutWave.idx)))
        return {"rollout_id": r.id, "model": r.model_name, "version": r.model_version, "waves": [
            {"index": w.idx, "state": w.state, **book.wave(s, r.id, w.idx, r.model_name or "", r.model_version or "",
                                                           w.started_at).as_json()} for w in waves]}


# -- what the REST API answers (GET /api/v1/devices/{id}/drift, GET /api/v1/rollouts/{id}/drift) --------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class DriftRecord(_Out):
    """A device's drift score at one telemetry record: ``psi`` the largest feature PSI of its recent answers against
    the compile-time reference (``scored_samples`` answers), ``level`` stable/watch/drift/insufficient."""

    ts: float
    received_at: str | None
    model: str
    version: str
    samples: int
    skipped: int
    scored_samples: int
    psi: float | None
    feature: str | None
    level: str
    noise: float
    features: dict[str, float] | None


class DriftFigure(_Out):
    psi: float | None
    feature: str | None
    features: dict[str, float]
    samples: int
    noise: float
    level: str


class WaveDriftOut(_Out):
    index: int
    state: str
    vs_reference: DriftFigure | None
    vs_previous: DriftFigure | None
    detail: str


class RolloutDrift(_Out):
    rollout_id: int
    model: str | None
    version: str | None
    waves: list[WaveDriftOut]
