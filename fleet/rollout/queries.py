"""The rollout driver's reads and locks: typed rows (frozen dataclasses, no ORM object leaves a caller's session
through them), the figures a wave's gates are judged on, and the row locks taken in the one lock order (see
fleet.rollout: rollouts, devices, targets, each sorted by key; FOR UPDATE, or FOR KEY SHARE for ingest).

Nothing here decides: fleet.rollout.step does, over these rows; the driver writes through fleet.rollout.moves."""

from __future__ import annotations

import datetime as dt
import functools
import re
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Float, Table, and_, case, cast, false, func, or_, select, update
from sqlalchemy.orm import Session

from ...protocol.errors import EdgefleetError
from ...protocol.profile import load_profile
from ..db import AuditRow, Device, Model, Rollout, RolloutShadow, RolloutTarget, RolloutWave
from ..drift import DriftBook
from ..errors import BadRequest, NotFound
from ..states import TARGET_DONE, RolloutStatus, TargetState, WaveState
from .gates import ShadowWaveFigures
from .spec import RolloutSpec, Selector


# -- typed rows ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    """A bundle the fleet holds (rows are immutable once uploaded, so the driver caches them)."""

    id: int
    name: str
    version: str
    profile: str
    target_path: str
    sha256: str
    size_bytes: int

    @classmethod
    def of(cls, row: Model) -> ModelInfo:
        return cls(row.id, row.name, row.version, row.profile, row.target_path, row.sha256, row.size_bytes)


class ModelCache:
    """The bundles the fleet holds, by id: read once (the rows never change once uploaded), then from memory."""

    def __init__(self) -> None:
        self._models: dict[int, ModelInfo] = {}
        self._lock = threading.Lock()

    def get(self, s: Session, model_id: int | None) -> ModelInfo | None:
        if model_id is None:
            return None
        m = self._models.get(model_id)
        if m is None:
            row = s.get(Model, model_id)
            if row is None:
                return None
            m = ModelInfo.of(row)
            with self._lock:
                self._models[model_id] = m
        return m

    def load(self, s: Session, model_ids: set[int | None]) -> None:
        """Read the models of ``model_ids`` not cached yet in one query, so that ``get`` finds them."""
        with self._lock:
            missing = sorted(i for i in model_ids if i is not None and i not in self._models)
        if not missing:
            return
        found = {row.id: ModelInfo.of(row) for row in s.scalars(select(Model).where(Model.id.in_(missing)))}
        with self._lock:
            self._models.update(found)


_PROFILE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


@functools.lru_cache(maxsize=256)
def cpu_fallback(profile: str) -> str | None:
    """The CPU profile whose bundle devices of ``profile`` run when a version has none of their own (its
    ``cpu_fallback`` in hw-profiles/); None for a profile without one or one this fleet does not know."""
    if not _PROFILE_NAME_RE.fullmatch(profile) or profile.endswith((".yaml", ".yml")):
        return None  # a device's profile is a name, never a path to read
    try:
        return load_profile(profile).cpu_fallback
    except (EdgefleetError, OSError):
        return None


@dataclass(frozen=True)
class RolloutRow:
    """What the rules read of a rollout: its id, status, current wave and parsed spec."""

    id: int
    status: RolloutStatus
    current_wave: int
    spec: RolloutSpec

    @classmethod
    def of(cls, r: Rollout, spec: RolloutSpec) -> RolloutRow:
        return cls(r.id, RolloutStatus(r.status), r.current_wave, spec)


@dataclass(frozen=True)
class WaveRow:
    """What the rules read of a wave: its state, clocks, counters and the gates judged so far."""

    rollout_id: int
    idx: int
    size: int
    soak_s: float
    state: WaveState
    n_installed: int
    n_failed: int
    started_at: dt.datetime | None
    soak_until: dt.datetime | None
    gates: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, w: RolloutWave) -> WaveRow:
        return cls(w.rollout_id, w.idx, w.size, w.soak_s, WaveState(w.state), w.n_installed, w.n_failed,
                   w.started_at, w.soak_until, tuple(w.gates or ()))

    @property
    def outstanding(self) -> int:
        """Targets that have reported neither an install nor a failure."""
        return self.size - self.n_installed - self.n_failed


@dataclass(frozen=True)
class TargetRow:
    """A target as a report is judged against it (read under its row lock)."""

    rollout_id: int
    device_id: str
    state: TargetState
    error: str | None
    model_id: int | None
    previous_model_id: int | None
    wave: int


def keys_in(rollout_col: Any, device_col: Any, keys: Sequence[tuple[int, str]]) -> Any:
    """``(rollout, device) IN keys`` as one ``rollout = r AND device IN (...)`` per rollout. PostgreSQL turns a row
    IN list into an OR of its pairs, a filter it tried on every target of the rollout (1,000 keys of a 20,000-target
    rollout: 336 ms; the keys of a wave come in batches, so a wave cost its targets squared); a plain IN list is one
    hashed ``= ANY`` (6 ms). Empty ``keys`` match nothing."""
    by_rollout: dict[int, list[str]] = {}
    for rid, dev in keys:
        by_rollout.setdefault(rid, []).append(dev)
    return or_(false(), *(and_(rollout_col == rid, device_col.in_(sorted(set(devs))))
                          for rid, devs in sorted(by_rollout.items())))


# -- locks -------------------------------------------------------------------------------------------------
def lock_rows(s: Session, rollouts: Sequence[int] = (), devices: Sequence[str] = (),
              targets: Sequence[tuple[int, str]] = (), rollouts_shared: bool = False) -> None:
    """Take row locks in the module's one order: rollouts, devices, targets, each sorted by key (FOR UPDATE; the
    rollouts FOR KEY SHARE when ``rollouts_shared``). A no-op on SQLite (it has no row locks)."""
    if s.get_bind().dialect.name != "postgresql":
        return
    if rollouts:
        s.execute(select(Rollout.id).where(Rollout.id.in_(sorted(set(rollouts)))).order_by(Rollout.id)
                  .with_for_update(read=rollouts_shared, key_share=rollouts_shared))
    if devices:
        s.execute(select(Device.id).where(Device.id.in_(sorted(set(devices)))).order_by(Device.id).with_for_update())
    if targets:
        t = RolloutTarget
        s.execute(select(t.rollout_id).where(keys_in(t.rollout_id, t.device_id, targets))
                  .order_by(t.rollout_id, t.device_id).with_for_update())


def lock_wave_rows(s: Session, rollout_id: int, *where: Any) -> None:
    """``lock_rows`` for the targets of one rollout that match ``where`` (and their devices), however many: the
    rows are picked by a join, not listed (the caller holds the rollout)."""
    if s.get_bind().dialect.name != "postgresql":
        return
    t = RolloutTarget
    s.execute(select(Device.id).join(t, t.device_id == Device.id).where(t.rollout_id == rollout_id, *where)
              .order_by(Device.id).with_for_update(of=Device))
    s.execute(select(t.device_id).where(t.rollout_id == rollout_id, *where).order_by(t.device_id)
              .with_for_update())


def lock_targets(s: Session, keys: Sequence[tuple[int, str]]) -> dict[tuple[int, str], TargetRow]:
    """The targets of ``keys`` (rollout, device), read FOR UPDATE in the lock order: replicas that both got a
    report on one target serialize here."""
    t: Table = RolloutTarget.__table__  # type: ignore[assignment]
    return {(r.rollout_id, r.device_id): TargetRow(r.rollout_id, r.device_id, TargetState(r.state), r.error,
                                                   r.model_id, r.previous_model_id, r.wave)
            for r in s.execute(select(t.c.rollout_id, t.c.device_id, t.c.state, t.c.error, t.c.model_id,
                                      t.c.previous_model_id, t.c.wave)
                               .where(keys_in(t.c.rollout_id, t.c.device_id, keys))
                               .order_by(t.c.rollout_id, t.c.device_id)
                               .with_for_update())}


def lock_rollout(s: Session, rollout_id: int) -> Rollout | None:
    """A rollout, FOR UPDATE (the first lock of the order)."""
    return s.get(Rollout, rollout_id, with_for_update=True)


def claim_lease(s: Session, rollout_id: int, owner: str, now: dt.datetime, lease_s: float) -> bool:
    """Take (or renew) the lease of an in-progress rollout unless another replica's lease still runs."""
    got = s.execute(update(Rollout).where(
        Rollout.id == rollout_id, Rollout.status == RolloutStatus.IN_PROGRESS.value,
        or_(Rollout.lease_owner.is_(None), Rollout.lease_owner == owner, Rollout.lease_until < now))
        .values(lease_owner=owner, lease_until=now + dt.timedelta(seconds=lease_s)))
    return got.rowcount == 1  # type: ignore[attr-defined]


def in_progress(s: Session) -> list[int]:
    return list(s.scalars(select(Rollout.id).where(Rollout.status == RolloutStatus.IN_PROGRESS.value)))


# -- what the rollout service reads (fleet.service.rollouts) ----------------------------------------------------
def newest(s: Session, limit: int) -> list[int]:
    """The newest rollouts' ids, newest first (``limit`` 1 to 1000)."""
    return list(s.scalars(select(Rollout.id).order_by(Rollout.id.desc()).limit(max(1, min(limit, 1000)))))


def target_count(s: Session, rollout_id: int, state: str | None = None) -> int:
    """How many targets the rollout has (in ``state``)."""
    where = [RolloutTarget.rollout_id == rollout_id] + ([RolloutTarget.state == state] if state else [])
    return int(s.scalar(select(func.count()).select_from(RolloutTarget).where(*where)) or 0)


def with_desired(s: Session) -> list[Device]:
    """The devices sent a desired model."""
    return list(s.scalars(select(Device).where(Device.desired_model_id.is_not(None))))


def audit_rows(s: Session, rollout_id: int | None, limit: int) -> list[AuditRow]:
    """The newest audit rows, newest first (of a rollout; ``limit`` 1 to 5000)."""
    q = select(AuditRow).order_by(AuditRow.id.desc()).limit(max(1, min(limit, 5000)))
    if rollout_id is not None:
        q = q.where(AuditRow.rollout_id == rollout_id)
    return list(s.scalars(q))


# -- selection -------------------------------------------------------------------------------------------------
def names(ids: list[str], limit: int = 10) -> str:
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def select_devices(s: Session, sel: Selector) -> list[Device]:
    """The devices a selector picks (NotFound for unknown devices or group, BadRequest when it picks none)."""
    if sel.devices:
        found = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(sel.devices)))}
        missing = [d for d in sel.devices if d not in found]
        if missing:
            raise NotFound(f"unknown devices: {', '.join(missing)}; register them first")
        devs = [found[d] for d in sel.devices]
        wrong = [d.id for d in devs if sel.profile and d.profile and d.profile != sel.profile]
        if wrong:
            raise BadRequest(f"devices {names(wrong)} are not {sel.profile} devices", 422)
    else:
        q = select(Device)
        if sel.group:
            if s.scalar(select(Device.id).where(Device.group_name == sel.group).limit(1)) is None:
                groups = sorted(g for g in s.scalars(select(Device.group_name).distinct()) if g)
                raise NotFound(f"unknown group {sel.group!r}: no device is in it (groups: "
                               f"{', '.join(groups) or 'none yet'})")
            q = q.where(Device.group_name == sel.group)
        if sel.profile:
            q = q.where(Device.profile == sel.profile)
        devs = list(s.scalars(q))
    if sel.tags:
        want = set(sel.tags)
        devs = [d for d in devs if want <= set(d.tags or [])]
    if sel.group and sel.devices:
        devs = [d for d in devs if d.group_name == sel.group]
    if not devs:
        raise BadRequest("the selector picks no device (" + ", ".join(
            f"{k}={v}" for k, v in asdict(sel).items() if v) + ")", 422)
    return devs


# -- a wave's figures ------------------------------------------------------------------------------------------
def outstanding_online(s: Session, rollout_id: int, wave: int) -> int:
    """Targets of the wave not done yet whose device is online."""
    return int(s.scalar(select(func.count()).select_from(RolloutTarget).join(
        Device, Device.id == RolloutTarget.device_id).where(
        RolloutTarget.rollout_id == rollout_id, RolloutTarget.wave == wave,
        RolloutTarget.state.not_in([x.value for x in TARGET_DONE]), Device.online.is_(True))) or 0)


def downloads(s: Session, rollout_id: int, wave: int) -> tuple[int, int]:
    """The wave's targets sent their desired state and not finished (pending, downloading or installing: a
    pending one's device holds this rollout's desired state), and those not sent it yet (pending or shadowing, the
    device's desired state from elsewhere): what a download cap counts. A device whose telemetry says its download
    is whole (it waits for its maintenance window) is not counted."""
    t = RolloutTarget
    sent = Device.desired_rollout_id == rollout_id
    row = s.execute(select(
        func.sum(case((and_(t.state.in_([TargetState.DOWNLOADING.value, TargetState.INSTALLING.value])), 1),
                      (and_(t.state == TargetState.PENDING.value, sent), 1), else_=0)),
        func.sum(case((and_(t.state.in_([TargetState.PENDING.value, TargetState.SHADOWING.value]),
                            or_(Device.desired_rollout_id.is_(None), ~sent)), 1), else_=0)))
        .join(Device, Device.id == t.device_id).where(t.rollout_id == rollout_id, t.wave == wave)).one()
    # a device that downloaded the whole bundle and waits for its maintenance window (its telemetry's download at its
    # end: agent/install/steps.py) downloads no more: it leaves the count
    fetched = select(Device.last_telemetry["download"]).join(t, t.device_id == Device.id).where(
        t.rollout_id == rollout_id, t.wave == wave, t.state == TargetState.DOWNLOADING.value)
    waiting = sum(1 for d in s.scalars(fetched)
                  if isinstance(d, dict) and isinstance(d.get("bytes_total"), int) and d["bytes_total"] > 0
                  and d.get("bytes_done") == d["bytes_total"])
    return max(0, int(row[0] or 0) - waiting), int(row[1] or 0)


def shadow_figures(s: Session, rollout_id: int, wave: int) -> ShadowWaveFigures:
    sh, t = RolloutShadow, RolloutTarget
    samples = cast(sh.samples, Float)  # summed as doubles: see telemetry_figures
    row = s.execute(select(
        func.count(), func.coalesce(func.sum(samples), 0.0),
        func.sum(case((sh.agreement.is_not(None), samples * sh.agreement))),
        func.sum(case((sh.agreement.is_not(None), samples))), func.max(sh.max_abs_error))
        .join(t, and_(t.rollout_id == sh.rollout_id, t.device_id == sh.device_id))
        .where(sh.rollout_id == rollout_id, t.wave == wave)).one()
    judged = float(row[3] or 0)
    return ShadowWaveFigures(int(row[0] or 0), int(row[1] or 0),
                             float(row[2]) / judged if judged else None,
                             None if row[4] is None else float(row[4]))


@dataclass(frozen=True)
class TelemetryFigures:
    requests: int
    errors: int
    p99_before_ms: float | None  # mean over the devices that have both figures
    p99_after_ms: float | None
    p99_devices: int


def telemetry_figures(s: Session, rollout_id: int, wave: int) -> TelemetryFigures:
    """The wave's telemetry for its gates. Counters are summed as doubles: an integer sum() overflows on SQLite (and
    becomes NUMERIC on PostgreSQL) once a few targets hold counts near 2**62, which rows stored before the
    counters were bounded may; a double sums any number of them (exactly up to 2**53)."""
    t = RolloutTarget
    both = and_(t.p99_before.is_not(None), t.p99_after.is_not(None), t.p99_before > 0)
    row = s.execute(select(
        func.coalesce(func.sum(cast(t.tele_requests, Float)), 0.0),
        func.coalesce(func.sum(cast(t.tele_errors, Float)), 0.0),
        func.sum(case((both, t.p99_before))), func.sum(case((both, t.p99_after))),
        func.sum(case((both, 1), else_=0))).where(t.rollout_id == rollout_id, t.wave == wave)).one()
    n = int(row[4] or 0)
    return TelemetryFigures(int(row[0]), int(row[1]), float(row[2]) / n if n else None,
                            float(row[3]) / n if n else None, n)


def drift_figure(s: Session, drift: DriftBook, w: RolloutWave) -> tuple[float | None, str]:
    """The wave's drift against the previous version, when its rollout gates on it (None: not judged)."""
    r = s.get(Rollout, w.rollout_id)
    if r is None or not r.model_name or not r.model_version:
        return None, ""
    if RolloutSpec.model_validate(r.spec or {}).gates.max_drift_psi is None:
        return None, ""
    wd = drift.wave(s, r.id, w.idx, r.model_name, r.model_version, w.started_at)
    vs = wd.vs_previous
    return (vs.psi if vs is not None and vs.level != "insufficient" else None), wd.detail
