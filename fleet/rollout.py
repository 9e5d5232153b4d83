"""Rollouts as a persisted state machine: targets, waves, soak times and health gates.

A rollout sends one model version to the devices a selector picks (a device list, a group, tags, a
hardware profile); each device gets the bundle built for its own profile, or, when the model version has
none, the bundle of the CPU profile its profile names as ``cpu_fallback`` (a Jetson runs the arm64-cpu build
on its CPU cores until a TensorRT build is uploaded). The targets are split into
waves (counts or cumulative percentages, e.g. ``1%,10%,50%,100%``), each with a soak time. A wave
starts by publishing the devices' desired state; it is *installed* when every target reported (or
its device has been offline for ``offline_grace_s``); it then soaks; at the end of the soak the
gates are evaluated against thresholds. A failed gate pauses or fails the rollout and, if asked,
sends the wave's devices back to the model they ran before.

A rollout, each of its waves and each of its targets (one device) is a state machine whose states and
allowed transitions are tables in fleet.states. Each changes only through one function here, which
refuses a transition its table does not list (``Conflict``) and writes the audit row in the same
transaction: ``RolloutEngine.transition`` (a rollout), ``move_wave`` (a wave) and ``move_targets`` (any
number of targets at once, as one UPDATE). A bulk move is audited in rows per wave and new state, each
naming its devices (at most ``AUDIT_DEVICES_PER_ROW``), how many there were, the states they left and
their errors: an operator reading a rollout's audit log sees which devices did what and why, while
100,000 targets moving together cost about 100 audit rows, not 100,000.

Cost per device report is constant: a report updates its target row and adds ±1 to its wave's
counters; nothing is recounted. The engine's tick (``advance``) reads only the wave's counters, and
scans a wave's targets only when its offline grace has run out or when its gates are evaluated.
All state is in the database, so a restarted fleet resumes every rollout where it was.

Lock order (PostgreSQL; SQLite locks the whole database): every transaction takes its row locks in one order,
so two writers never wait on each other in a circle (``lock_rows``): **rollouts** (by id; the engine and an
operator's action FOR UPDATE, report ingest FOR KEY SHARE, so replicas' ingest runs side by side but never while
the engine moves the same rollout), then **devices** (by id), then **targets** (by rollout and device), then
**waves** (the counters). Report ingest, telemetry, statuses, a rollback and a new rollout's supersede all follow
it; tests/test_pg_lock_order.py runs ingest and a rollback at once.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import BigInteger, Float, Table, and_, bindparam, case, cast, func, insert, or_, select, tuple_, update
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.attributes import set_committed_value

from edgefleet.fleet.audit import ENGINE_ACTOR, audit
from edgefleet.fleet.db import Device, Model, Rollout, RolloutShadow, RolloutTarget, RolloutWave, utcnow
from edgefleet.fleet.drift import DriftBook
from edgefleet.fleet.errors import BadRequest, Conflict, DeviceInputRejected, NotFound
from edgefleet.fleet.states import (
    TARGET_DONE,
    TARGET_FINAL,
    TARGET_TRANSITIONS,
    TRANSITIONS,
    WAVE_TRANSITIONS,
    RolloutStatus,
    TargetState,
    WaveState,
)
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.errors import EdgefleetError
from edgefleet.protocol.profile import load_profile

__all__ = ["AUDIT_DEVICES_PER_ROW", "TRANSITIONS", "WAVE_ACTIONS", "GateResult", "Gates", "RolloutEngine",
           "RolloutSpec", "TargetMove", "WaveFigures", "cpu_fallback", "evaluate_gates", "move_targets", "move_wave",
           "plan_waves", "target_json"]

log = logging.getLogger("edgefleet.fleet.rollout")

_WAVE_RE = re.compile(r"^(\d+(?:\.\d+)?)%$|^(\d+)$")
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


class Publisher(Protocol):
    def publish(self, topic: str, payload: bytes, retain: bool) -> None: ...


# -- the spec an operator gives ------------------------------------------------------------------
# every threshold and duration an operator gives is finite and within these limits (refused with a 422 naming it)
MAX_P99_RATIO = 1000.0
MAX_GRACE_S = 30 * 86400.0
MAX_ABS_ERROR = 1e30
MAX_DRIFT_PSI = 20.0  # PSI with protocol.drift's epsilon never exceeds 18.5 (every share swapped between two bins)


class Gates(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    install_success_min: float | None = Field(default=1.0, ge=0.0, le=1.0)  # installed / (installed + failed)
    error_rate_max: float | None = Field(default=None, ge=0.0, le=1.0)  # errors / requests on the new model
    p99_ratio_max: float | None = Field(default=None, gt=0.0, le=MAX_P99_RATIO)  # p99 new / p99 previous, same devices
    # PSI of the new version's answers against the previous version's on the same devices (fleet.drift; 0.1 watch,
    # 0.25 drift; a side with fewer than 200 answers is not judged); halts a wave whose model answers differently
    max_drift_psi: float | None = Field(default=None, gt=0.0, le=MAX_DRIFT_PSI)


class ShadowGate(BaseModel):
    """Run each wave's candidate in shadow first: devices keep serving their model, mirror a sample of live
    requests to the candidate and report agreement; the wave installs only once enough samples agree."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    agreement_min: float = Field(default=0.99, ge=0.0, le=1.0)  # top-1 agreement over the wave's samples
    min_samples: int = Field(default=100, ge=1, le=10_000_000)  # mirrored requests, summed over the wave
    max_abs_error: float | None = Field(default=None, ge=0.0, le=MAX_ABS_ERROR)  # optional: the worst difference


class RolloutSpec(BaseModel):
    """How a rollout proceeds; stored with it. Defaults: one wave, no soak, every install must succeed."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    waves: tuple[str, ...] = Field(default=("100%",), min_length=1, max_length=20)  # cumulative: "1%", "10", "100%"
    soak_s: tuple[float, ...] = Field(default=(0.0,), min_length=1, max_length=20)  # per wave; the last repeats
    gates: Gates = Gates()
    shadow: ShadowGate | None = None  # None: no shadow phase
    on_failure: Literal["pause", "abort"] = "abort"
    rollback_on_failure: bool = False
    offline_grace_s: float = Field(default=300.0, ge=0.0, le=MAX_GRACE_S)  # then a wave stops waiting for offline ones
    # True: a wave whose telemetry gates have no figures yet keeps soaking until they do
    require_telemetry: bool = False

    @field_validator("waves")
    @classmethod
    def _waves(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for w in v:
            if len(w) > 16:
                raise ValueError(f"wave {w[:20]!r}...: at most 16 characters, a device count or a percentage")
            m = _WAVE_RE.match(w.strip())
            if m is None:
                raise ValueError(f"wave {w!r} must be a device count like '5' or a percentage like '10%'")
            if m.group(1) is not None and not 0 < float(m.group(1)) <= 100:
                raise ValueError(f"wave {w!r}: a percentage must be in (0, 100]")
            if m.group(2) is not None and int(m.group(2)) < 1:
                raise ValueError(f"wave {w!r}: a count must be at least 1")
        return tuple(w.strip() for w in v)

    @field_validator("soak_s")
    @classmethod
    def _soak(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 <= s <= 7 * 86400 for s in v):
            raise ValueError("soak times must be between 0 and 604800 s")
        return v

    def soak_for(self, idx: int) -> float:
        return self.soak_s[min(idx, len(self.soak_s) - 1)]


def plan_waves(n: int, waves: tuple[str, ...]) -> list[int]:
    """Sizes of the waves for ``n`` targets. Each entry is a cumulative end (count or percentage,
    rounded up); ends that add nobody are dropped, and the last wave always reaches every target."""
    sizes, done = [], 0
    for w in waves:
        w = w.strip()
        end = math.ceil(n * float(w[:-1]) / 100 - 1e-9) if w.endswith("%") else int(w)
        end = min(max(end, 1), n)
        if end > done:
            sizes.append(end - done)
            done = end
    if done < n:
        sizes.append(n - done)
    return sizes


# -- gates: pure functions of recorded figures ---------------------------------------------------
@dataclass(frozen=True)
class WaveFigures:
    size: int
    installed: int
    failed: int
    requests: int  # on the new model, summed over the wave's devices
    errors: int
    p99_before_ms: float | None  # mean over the devices that have both figures
    p99_after_ms: float | None
    p99_devices: int
    drift_psi: float | None = None  # new version vs previous on the wave's devices (None: not judged)
    drift_detail: str = ""


@dataclass(frozen=True)
class GateResult:
    name: str
    value: float | None
    threshold: float
    passed: bool
    detail: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShadowWaveFigures:
    devices: int  # devices of the wave that reported shadow figures
    samples: int
    agreement: float | None  # sample-weighted top-1 agreement
    max_abs_error: float | None


def evaluate_shadow(f: ShadowWaveFigures, gate: ShadowGate) -> GateResult | None:
    """None until the wave has mirrored enough requests; then the agreement against the threshold."""
    if f.samples < gate.min_samples:
        return None
    ok = f.agreement is not None and f.agreement >= gate.agreement_min
    detail = (f"{f.samples} live requests mirrored on {f.devices} devices; top-1 agreement with the active model "
              f"{'n/a' if f.agreement is None else f'{f.agreement:.4f}'}")
    if gate.max_abs_error is not None:
        ok = ok and f.max_abs_error is not None and f.max_abs_error <= gate.max_abs_error
        detail += f"; max abs error {f.max_abs_error}"
    return GateResult("shadow_agreement", f.agreement, gate.agreement_min, ok, detail)


def install_gate_lost(f: WaveFigures, gates: Gates) -> bool:
    """True once the failures alone make the install-success threshold unreachable."""
    if gates.install_success_min is None:
        return False
    allowed = math.floor((1.0 - gates.install_success_min) * f.size + 1e-9)
    return f.failed > allowed


def evaluate_gates(f: WaveFigures, gates: Gates) -> list[GateResult]:
    """Each configured gate against its threshold. A telemetry gate without data passes, saying so."""
    out = []
    if gates.install_success_min is not None:
        done = f.installed + f.failed
        ratio = f.installed / done if done else None
        ok = ratio is not None and ratio >= gates.install_success_min and not install_gate_lost(f, gates)
        out.append(GateResult("install_success", ratio, gates.install_success_min, ok,
                              f"{f.installed} of {done} reported installs succeeded ({f.size} in the wave)"))
    if gates.error_rate_max is not None:
        rate = f.errors / f.requests if f.requests else None
        out.append(GateResult("error_rate", rate, gates.error_rate_max, rate is None or rate <= gates.error_rate_max,
                              f"{f.errors} errors in {f.requests} requests on the new model"
                              if f.requests else "no requests on the new model yet: not judged"))
    if gates.p99_ratio_max is not None:
        if f.p99_before_ms and f.p99_after_ms is not None:
            ratio = f.p99_after_ms / f.p99_before_ms
            out.append(GateResult("p99_latency_ratio", ratio, gates.p99_ratio_max, ratio <= gates.p99_ratio_max,
                                  f"p99 {f.p99_after_ms:.2f} ms vs {f.p99_before_ms:.2f} ms on the previous model "
                                  f"(mean over {f.p99_devices} devices)"))
        else:
            out.append(GateResult("p99_latency_ratio", None, gates.p99_ratio_max, True,
                                  "no device has p99 figures on both models yet: not judged"))
    if gates.max_drift_psi is not None:
        if f.drift_psi is not None:
            out.append(GateResult("drift_psi", f.drift_psi, gates.max_drift_psi, f.drift_psi <= gates.max_drift_psi,
                                  f"answers of the new version vs the previous one: {f.drift_detail}"))
        else:
            out.append(GateResult("drift_psi", None, gates.max_drift_psi, True,
                                  f.drift_detail or "no drift figures yet: not judged"))
    return out


# -- the engine -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    id: int
    name: str
    version: str
    profile: str
    target_path: str
    sha256: str
    size_bytes: int


def desired_message(device_id: str, m: ModelInfo, rollout_id: int | None, now: float,
                    mode: str | None = None) -> tuple[str, bytes]:
    msg = proto.DesiredState(device_id=device_id, ts=now, rollout_id=rollout_id, model=m.name, version=m.version,
                             target=m.target_path, sha256=m.sha256, size_bytes=m.size_bytes,
                             mode=mode)  # type: ignore[arg-type]
    return proto.topic(device_id, "desired"), proto.encode(msg)


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=dt.UTC).isoformat()


@dataclass(frozen=True)
class Selector:
    devices: tuple[str, ...] = ()
    group: str | None = None
    tags: tuple[str, ...] = ()
    profile: str | None = None


# -- the only ways a wave's or a target's state changes ---------------------------------------------
WAVE_ACTIONS: dict[WaveState, str] = {  # the audit action of entering each state
    WaveState.SHADOWING: "wave_shadow_started", WaveState.INSTALLING: "wave_started",
    WaveState.SOAKING: "wave_soaking", WaveState.PASSED: "wave_passed", WaveState.FAILED: "wave_failed"}
AUDIT_DEVICES_PER_ROW = 1000  # a bulk move names every device, in audit rows of at most this many (~15 KB)
AUDIT_ERROR_CHARS = 200  # of each device's error, in an audit row (the target row keeps all of it)
# a target's telemetry counters stop here (exact in a double; protocol.mqtt.MAX_COUNT per record, so ~8,000 records
# of the largest counts a device may send): adding to them never overflows a BIGINT, whatever the device sends
TELE_COUNT_CAP = 2**53
REPORT_ACTOR = "devices"  # the actor of moves the devices' own reports make
# a rollback sends back the targets that were sent something (pending ones only if their desired state went out)
ROLLBACK_FROM = frozenset({TargetState.PENDING, TargetState.DOWNLOADING, TargetState.INSTALLING, TargetState.INSTALLED,
                           TargetState.FAILED})


def move_wave(s: Session, w: RolloutWave, new: WaveState, actor: str = ENGINE_ACTOR, now: dt.datetime | None = None,
              **detail: Any) -> None:
    """Move one wave to ``new`` if ``WAVE_TRANSITIONS`` allows it (else ``Conflict``), set the clock that
    state starts (started_at, soak_until or finished_at, from ``now``) and write its audit row."""
    old = WaveState(w.state)
    if new not in WAVE_TRANSITIONS[old]:
        raise Conflict(f"wave {w.idx + 1} of rollout {w.rollout_id} is {old}; it cannot become {new}")
    now = now or utcnow()
    w.state = new.value
    if new in (WaveState.SHADOWING, WaveState.INSTALLING):
        w.started_at = now
    elif new is WaveState.SOAKING:
        w.soak_until = now + dt.timedelta(seconds=w.soak_s)
    else:
        w.finished_at = now
    audit(s, actor, WAVE_ACTIONS[new], w.rollout_id, wave=w.idx, from_state=old.value, **detail)


@dataclass(frozen=True)
class TargetMove:
    """One target from ``old`` (what the caller read, under its lock) to ``new``; ``error`` is stored with it."""

    rollout_id: int
    device_id: str
    wave: int
    old: TargetState
    new: TargetState
    error: str | None = None


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
        s.execute(select(t.rollout_id).where(tuple_(t.rollout_id, t.device_id).in_(sorted(set(targets))))
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


def move_targets(s: Session, moves: Sequence[TargetMove], actor: str, cause: str, **detail: Any) -> None:
    """Move any number of targets, in order (one target may move several times), if ``TARGET_TRANSITIONS``
    allows every move (else ``Conflict`` and nothing is written). Costs one executemany UPDATE, one
    counter UPDATE per wave touched (±1 per move, never a recount) and one audit row per rollout, wave
    and new state for each ``AUDIT_DEVICES_PER_ROW`` devices. An UPDATE matches a target only in its
    ``old`` state: a target another writer moved meanwhile fails the whole call (``Conflict``), so the
    caller's transaction rolls back."""
    if not moves:
        return
    for m in moves:
        if m.new not in TARGET_TRANSITIONS[m.old]:
            raise Conflict(f"target {m.device_id} in rollout {m.rollout_id} is {m.old}; it cannot become {m.new}")
    s.flush()  # pending ORM changes first, so the writes land in the order they were made
    t: Table = RolloutTarget.__table__  # type: ignore[assignment]
    now = utcnow()
    done = s.connection().execute(
        update(t).where(t.c.rollout_id == bindparam("b_r"), t.c.device_id == bindparam("b_d"),
                        t.c.state == bindparam("b_old")),
        [{"b_r": m.rollout_id, "b_d": m.device_id, "b_old": m.old.value, "state": m.new.value, "error": m.error,
          "updated_at": now} for m in sorted(moves, key=lambda m: (m.rollout_id, m.device_id))]  # the lock order
    ).rowcount  # type: ignore[attr-defined]
    if done != len(moves):
        rids = sorted({m.rollout_id for m in moves})
        raise Conflict(f"rollout{'s' if len(rids) > 1 else ''} {', '.join(map(str, rids))}: {len(moves) - done} of "
                       f"{len(moves)} targets were not in the state the move started from; nothing was moved")
    deltas: dict[tuple[int, int], list[int]] = {}
    groups: dict[tuple[int, int, TargetState], list[TargetMove]] = {}
    for m in moves:
        d = deltas.setdefault((m.rollout_id, m.wave), [0, 0])
        d[0] += (m.new is TargetState.INSTALLED) - (m.old is TargetState.INSTALLED)
        d[1] += (m.new is TargetState.FAILED) - (m.old is TargetState.FAILED)
        groups.setdefault((m.rollout_id, m.wave, m.new), []).append(m)
        obj = s.identity_map.get(s.identity_key(RolloutTarget, (m.rollout_id, m.device_id)))
        if obj is not None:  # a row this session holds as an object: keep it in step with the table
            for attr, value in (("state", m.new.value), ("error", m.error), ("updated_at", now)):
                set_committed_value(obj, attr, value)
    for (rid, wave), (d_ok, d_bad) in sorted(deltas.items()):
        if d_ok or d_bad:
            s.execute(update(RolloutWave).where(RolloutWave.rollout_id == rid, RolloutWave.idx == wave)
                      .values(n_installed=RolloutWave.n_installed + d_ok, n_failed=RolloutWave.n_failed + d_bad))
    for (rid, wave, new), group in groups.items():
        for i in range(0, len(group), AUDIT_DEVICES_PER_ROW):
            chunk = group[i:i + AUDIT_DEVICES_PER_ROW]
            errors = {m.device_id: m.error[:AUDIT_ERROR_CHARS] for m in chunk if m.error}
            said: dict[str, Any] = {}
            if errors and len(errors) == len(chunk) and len(set(errors.values())) == 1:
                said["error"] = next(iter(errors.values()))  # the same for all (e.g. superseded): once
            elif errors:
                said["errors"] = errors
            audit(s, actor, f"targets_{new}", rid, chunk[0].device_id if len(chunk) == 1 else None, wave=wave,
                  cause=cause, count=len(chunk), devices=[m.device_id for m in chunk],
                  **{"from": dict(Counter(m.old.value for m in chunk))}, **said, **detail)


def _failure(exc: BaseException) -> str:
    """An exception as one line an operator can read (a database error without its SQL)."""
    orig = getattr(exc, "orig", None)  # SQLAlchemy's DBAPIError wraps the driver's
    text = f"{type(orig).__name__}: {orig}" if orig is not None else f"{type(exc).__name__}: {exc}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(
        ("For further information", "[SQL:", "[parameters:", "(Background on"))]
    return "; ".join(lines or [type(exc).__name__])[:500]


class RolloutEngine:
    """Fault isolation: a rollout whose evaluation raises is marked (``Rollout.engine_error``, with its time and an
    audit row, shown by the API and the console), retried with a growing pause (``RETRY_MAX_S`` at most), and
    never stops the others; the mark clears when it advances again or changes state."""

    LEASE_S = 15.0  # a replica that stops renewing loses its rollouts to another after this
    RETRY_MIN_S = 0.5  # a rollout whose evaluation failed is tried again after this, doubling per failure
    RETRY_MAX_S = 60.0

    def __init__(self, sessions: sessionmaker, publisher: Publisher, owner: str | None = None):
        self.sessions = sessions
        self.publisher = publisher
        self.owner = owner or f"fleet-{uuid.uuid4().hex[:12]}"
        self._models: dict[int, ModelInfo] = {}
        self._lock = threading.Lock()
        self._failing: dict[int, tuple[int, float]] = {}  # rollout -> (failures in a row, monotonic next try)
        self.drift = DriftBook()  # drift scores: stored from telemetry, read by the max_drift_psi gate

    # -- models (immutable rows, cached) ---------------------------------------------------------
    def model(self, s: Session, model_id: int | None) -> ModelInfo | None:
        if model_id is None:
            return None
        m = self._models.get(model_id)
        if m is None:
            row = s.get(Model, model_id)
            if row is None:
                return None
            m = ModelInfo(row.id, row.name, row.version, row.profile, row.target_path, row.sha256, row.size_bytes)
            with self._lock:
                self._models[model_id] = m
        return m

    # -- transitions -----------------------------------------------------------------------------
    @staticmethod
    def transition(s: Session, r: Rollout, new: RolloutStatus, actor: str, reason: str | None = None,
                   **detail: Any) -> None:
        """The only way a rollout's status changes: as ``TRANSITIONS`` allows (else ``Conflict``), audited."""
        old = RolloutStatus(r.status)
        if new not in TRANSITIONS[old]:
            raise Conflict(f"rollout {r.id} is {old}; it cannot become {new}")
        r.status = new.value
        r.reason = reason
        r.engine_error = r.engine_error_at = None  # whatever failed before, the rollout has moved on
        if new not in (RolloutStatus.IN_PROGRESS, RolloutStatus.PAUSED):
            r.finished_at = utcnow()
        audit(s, actor, f"rollout_{new}", r.id, from_state=old.value, reason=reason, **detail)

    # -- create ----------------------------------------------------------------------------------
    def create(self, name: str, version: str, sel: Selector, spec: RolloutSpec, actor: str) -> int:
        if not (sel.devices or sel.group or sel.tags or sel.profile):
            raise BadRequest("a rollout needs devices, a group, tags or a profile to target")
        if len(set(sel.devices)) != len(sel.devices):
            raise BadRequest("the device list names a device twice")
        with self.sessions.begin() as s:
            builds = {m.profile: m for m in s.scalars(select(Model).where(Model.name == name,
                                                                         Model.version == version))}
            if not builds:
                raise NotFound(f"no model {name} {version}" + (f" for {sel.profile}" if sel.profile else "")
                               + "; upload it first")
            if sel.profile and sel.profile not in builds and cpu_fallback(sel.profile) not in builds:
                fb = cpu_fallback(sel.profile)
                raise BadRequest(f"profile {sel.profile!r} has no bundle of {name} {version}"
                                 + (f", nor has its CPU fallback {fb!r}" if fb else "")
                                 + f" (built for {', '.join(sorted(builds))})", 422)
            devices = self._select(s, sel)
            chosen: list[tuple[Device, Model]] = []
            no_bundle: dict[str, list[str]] = {}
            by_fallback: dict[str, list[str]] = {}  # device profile -> devices that get its fallback's bundle
            unknown_profile: list[str] = []
            for d in devices:
                prof = d.profile or sel.profile or (next(iter(builds)) if len(builds) == 1 else None)
                if prof is None:
                    unknown_profile.append(d.id)
                elif prof in builds:  # a bundle of the device's own profile always wins
                    chosen.append((d, builds[prof]))
                elif (fb := cpu_fallback(prof)) is not None and fb in builds:
                    chosen.append((d, builds[fb]))
                    by_fallback.setdefault(prof, []).append(d.id)
                else:
                    no_bundle.setdefault(prof, []).append(d.id)
            if unknown_profile:
                raise BadRequest(f"{name} {version} exists for several profiles ({', '.join(sorted(builds))}) and "
                                 f"these devices have no known hardware profile: {_names(unknown_profile)}; set "
                                 "their profile or say which build with 'profile'", 422)
            if no_bundle:
                raise BadRequest("no bundle of " + f"{name} {version} for " + "; ".join(
                    f"profile {p} (devices {_names(ids)})"
                    + (f", nor for its CPU fallback {fb}" if (fb := cpu_fallback(p)) else "")
                    for p, ids in sorted(no_bundle.items()))
                    + f"; it is built for {', '.join(sorted(builds))}", 422)
            # online devices first, so an early wave is not spent waiting for boxes that are off
            chosen.sort(key=lambda dm: (not dm[0].online, dm[0].id))
            sizes = plan_waves(len(chosen), spec.waves)
            first = chosen[0][1]
            r = Rollout(model_id=first.id, model_name=name, model_version=version, spec=spec.model_dump(mode="json"),
                        current_wave=0, created_by=actor, status=RolloutStatus.IN_PROGRESS.value)
            s.add(r)
            s.flush()
            rid = r.id
            superseded_msgs: list[tuple[str, bytes]] = []
            self._supersede(s, {d.id for d, _ in chosen}, rid, actor, superseded_msgs)
            rows, i = [], 0
            for w, size in enumerate(sizes):
                s.add(RolloutWave(rollout_id=rid, idx=w, size=size, soak_s=spec.soak_for(w),
                                  state=WaveState.PENDING.value))
                for d, m in chosen[i:i + size]:
                    rows.append({"rollout_id": rid, "device_id": d.id, "state": TargetState.PENDING.value, "wave": w,
                                 "model_id": m.id, "updated_at": utcnow()})
                i += size
            s.flush()
            s.execute(insert(RolloutTarget), rows)
            audit(s, actor, "rollout_created", rid, model=name, version=version, targets=len(chosen), waves=sizes,
                  selector={k: v for k, v in asdict(sel).items() if v and k != "devices"} or None,
                  devices=len(sel.devices) or None, spec=spec.model_dump(mode="json"),
                  cpu_fallback={p: {"bundle": cpu_fallback(p), "count": len(ids),
                                    "devices": ids[:AUDIT_DEVICES_PER_ROW]}
                                for p, ids in sorted(by_fallback.items())} or None)
        self._publish(superseded_msgs)
        self.advance_isolated(rid)  # the first wave goes out now, not at the next tick
        return rid

    @staticmethod
    def _select(s: Session, sel: Selector) -> list[Device]:
        if sel.devices:
            found = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(sel.devices)))}
            missing = [d for d in sel.devices if d not in found]
            if missing:
                raise NotFound(f"unknown devices: {', '.join(missing)}; register them first")
            devs = [found[d] for d in sel.devices]
            wrong = [d.id for d in devs if sel.profile and d.profile and d.profile != sel.profile]
            if wrong:
                raise BadRequest(f"devices {_names(wrong)} are not {sel.profile} devices", 422)
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

    def _supersede(self, s: Session, devices: set[str], new_rollout: int, actor: str,
                   msgs: list[tuple[str, bytes]]) -> None:
        """A device has one desired state: its unfinished targets in older rollouts fail as superseded. Each older
        rollout then advances (its desired states go into ``msgs``, published after the commit), in a savepoint:
        one that cannot be evaluated is marked, not a reason to refuse the new rollout."""
        t = RolloutTarget
        why = f"superseded by rollout {new_rollout}"
        open_ = t.state.not_in([x.value for x in TARGET_DONE | TARGET_FINAL])
        older = set(s.scalars(select(t.rollout_id).where(t.rollout_id != new_rollout, open_).distinct()))
        lock_rows(s, rollouts=sorted(older))  # the lock order: their rollouts before their targets
        stale = [TargetMove(rid, dev, wave, TargetState(state), TargetState.FAILED, why)
                 for rid, dev, wave, state in s.execute(
                     select(t.rollout_id, t.device_id, t.wave, t.state).where(
                         t.rollout_id != new_rollout, t.state.not_in([x.value for x in TARGET_DONE | TARGET_FINAL])))
                 if dev in devices]
        move_targets(s, stale, actor, "superseded", by_rollout=new_rollout)
        s.flush()
        for rid in sorted({m.rollout_id for m in stale}):
            out: list[tuple[str, bytes]] = []
            try:
                with s.begin_nested():
                    self._advance_in(s, rid, out)
            except Exception as exc:
                self._mark_failed(s, rid, exc)
            else:
                msgs.extend(out)

    # -- ingest ----------------------------------------------------------------------------------
    def on_report(self, s: Session, msg: proto.ReportedState) -> None:
        for exc, _ in self.on_reports(s, [msg]):
            raise exc

    def on_reports(self, s: Session, msgs: list[proto.ReportedState]) -> list[tuple[DeviceInputRejected,
                                                                                   proto.ReportedState]]:
        """Reports on rollouts, in arrival order: one SELECT of their targets, then ``move_targets`` (one
        executemany UPDATE, one counter UPDATE per wave touched, audit rows per wave and state), whatever
        the size of the rollout or of the fleet."""
        if not msgs:
            return []
        t: Table = RolloutTarget.__table__  # type: ignore[assignment]
        keys = list({(m.rollout_id, m.device_id) for m in msgs})
        cur = {(r.rollout_id, r.device_id): [TargetState(r.state), r.error, r.model_id, r.previous_model_id, r.wave]
               for r in s.execute(select(t.c.rollout_id, t.c.device_id, t.c.state, t.c.error, t.c.model_id,
                                         t.c.previous_model_id, t.c.wave)
                                  .where(tuple_(t.c.rollout_id, t.c.device_id).in_(keys))
                                  .order_by(t.c.rollout_id, t.c.device_id)  # the lock order (lock_rows)
                                  .with_for_update())}  # replicas that both got a report serialize here
        rejected: list[tuple[DeviceInputRejected, proto.ReportedState]] = []
        moves: list[TargetMove] = []
        new_errors: dict[tuple[int, str], dict[str, Any]] = {}
        for m in msgs:
            key = (m.rollout_id or 0, m.device_id)
            row = cur.get(key)
            if row is None:
                rejected.append((DeviceInputRejected("report_not_a_target", f"device {m.device_id} reported on "
                                                     f"rollout {m.rollout_id}, which does not target it"), m))
                continue
            old, err, model_id, prev_id, wave = row
            new = self._next_state(old, m, self.model(s, model_id), self.model(s, prev_id))
            if new is None or (new is old and m.error == err):
                continue
            row[0], row[1] = new, m.error
            if new is old:  # the same state with another error: not a transition
                new_errors[key] = {"b_r": key[0], "b_d": key[1], "error": m.error, "updated_at": utcnow()}
            else:
                moves.append(TargetMove(key[0], key[1], wave, old, new, m.error))
                new_errors.pop(key, None)
        move_targets(s, moves, REPORT_ACTOR, "report")
        if new_errors:
            s.connection().execute(update(t).where(t.c.rollout_id == bindparam("b_r"),
                                                   t.c.device_id == bindparam("b_d")), list(new_errors.values()))
        return rejected

    @staticmethod
    def _next_state(old: TargetState, msg: proto.ReportedState, model: ModelInfo | None,
                    prev: ModelInfo | None) -> TargetState | None:
        """What a device's report makes of its target: a state ``TARGET_TRANSITIONS`` allows from ``old``,
        ``old`` itself (only its error may change), or None (ignored: late, replayed or about another model)."""
        if old is TargetState.ROLLING_BACK:
            if msg.state == "installed" and prev is not None and msg.running_version == prev.version:
                return TargetState.ROLLED_BACK
            return TargetState.ROLLBACK_FAILED if msg.state == "failed" else None
        new = TargetState.FAILED if msg.state == "rolled_back" else TargetState(msg.state)
        if (new is TargetState.INSTALLED and model is not None and msg.version is not None
                and msg.version != model.version):
            return None  # an install of something else (an older retained report)
        if new is old:
            return old
        if new not in TARGET_TRANSITIONS[old]:
            return None  # a late progress message must not reopen a finished target
        if old is TargetState.INSTALLED and (model is None or msg.running_version == model.version):
            return None  # still running what was installed: a replayed old failure must not flip it
        return new

    def on_shadow_batch(self, s: Session, msgs: list[proto.Telemetry]) -> None:
        """Shadow figures of devices whose target is shadowing a candidate: the newest per device is kept."""
        newest = {m.device_id: m.shadow for m in msgs if m.shadow is not None}
        if not newest:
            return
        t = RolloutTarget
        rows = s.execute(select(t.rollout_id, t.device_id, t.model_id).where(
            t.device_id.in_(list(newest)), t.state == TargetState.SHADOWING.value)).all()
        now = utcnow()
        for rid, dev, model_id in rows:
            fig = newest[dev]
            info = self.model(s, model_id)
            if fig is None or info is None or (info.name, info.version) != (fig.model, fig.version):
                continue
            row = s.get(RolloutShadow, (rid, dev))
            if row is None:
                row = RolloutShadow(rollout_id=rid, device_id=dev)
                s.add(row)
            row.samples, row.agreement = fig.samples, fig.top1_agreement
            row.max_abs_error, row.p99_ms, row.updated_at = fig.max_abs_error, fig.p99_ms, now

    def on_telemetry_batch(self, s: Session, rollout_of: dict[str, int | None], msgs: list[proto.Telemetry]) -> None:
        """Figures for the gates: requests, errors and newest p99 on the rollout's model, per target."""
        t: Table = RolloutTarget.__table__  # type: ignore[assignment]
        keys = list({(rollout_of[m.device_id], m.device_id) for m in msgs
                     if rollout_of.get(m.device_id) is not None and m.version is not None})
        if not keys:
            return
        models = {(r.rollout_id, r.device_id): r.model_id for r in s.execute(
            select(t.c.rollout_id, t.c.device_id, t.c.model_id).where(tuple_(t.c.rollout_id, t.c.device_id).in_(keys)))}
        acc: dict[tuple[int, str], dict[str, Any]] = {}
        for m in msgs:
            key = (rollout_of.get(m.device_id) or 0, m.device_id)
            info = self.model(s, models.get(key))
            if info is None or (info.name, info.version) != (m.model, m.version):
                continue
            a = acc.setdefault(key, {"b_r": key[0], "b_d": key[1], "dr": 0, "de": 0, "p99": None})
            a["dr"] = min(a["dr"] + m.requests, TELE_COUNT_CAP)
            a["de"] = min(a["de"] + m.errors, TELE_COUNT_CAP)
            if m.latency.p99_ms is not None:
                a["p99"] = m.latency.p99_ms

        def saturating(col: Any, delta: str) -> Any:  # col + delta, at most TELE_COUNT_CAP, never overflowing
            d = bindparam(delta, type_=BigInteger)
            return case((col > TELE_COUNT_CAP - d, TELE_COUNT_CAP), else_=col + d)

        if acc:
            s.connection().execute(
                update(t).where(t.c.rollout_id == bindparam("b_r"), t.c.device_id == bindparam("b_d")).values(
                    tele_requests=saturating(t.c.tele_requests, "dr"), tele_errors=saturating(t.c.tele_errors, "de"),
                    p99_after=func.coalesce(bindparam("p99", type_=Float), t.c.p99_after)),
                [acc[k] for k in sorted(acc)])  # the lock order

    # -- the tick ----------------------------------------------------------------------------------
    def tick(self) -> int:
        """Advance every in-progress rollout this replica holds the lease of; returns how many."""
        now = utcnow()
        with self.sessions() as s:
            ids = list(s.scalars(select(Rollout.id).where(Rollout.status == RolloutStatus.IN_PROGRESS.value)))
        for gone in self._failing.keys() - set(ids):
            self._failing.pop(gone, None)
        n = 0
        for rid in ids:
            failing = self._failing.get(rid)
            if failing is not None and time.monotonic() < failing[1]:
                continue  # its last evaluation failed: it waits its turn, the others go on
            with self.sessions.begin() as s:
                got = s.execute(update(Rollout).where(
                    Rollout.id == rid, Rollout.status == RolloutStatus.IN_PROGRESS.value,
                    or_(Rollout.lease_owner.is_(None), Rollout.lease_owner == self.owner, Rollout.lease_until < now))
                    .values(lease_owner=self.owner, lease_until=now + dt.timedelta(seconds=self.LEASE_S)))
            if got.rowcount == 1 and self.advance_isolated(rid):  # type: ignore[attr-defined]
                n += 1
        return n

    def advance_isolated(self, rollout_id: int) -> bool:
        """``advance``, but a failure marks this rollout (stored, audited, retried later) instead of raising:
        whatever one rollout's figures or rows hold, the caller (the tick, the others) goes on. False if it failed."""
        try:
            self.advance(rollout_id)
        except Exception as exc:
            n = self._failing.get(rollout_id, (0, 0.0))[0] + 1
            self._failing[rollout_id] = (n, time.monotonic() + min(self.RETRY_MIN_S * 2 ** min(n - 1, 16),
                                                                    self.RETRY_MAX_S))
            if n == 1:
                log.exception("rollout %d could not be evaluated; it is marked and tried again later", rollout_id)
            try:
                with self.sessions.begin() as s:
                    self._mark_failed(s, rollout_id, exc)
            except Exception:
                log.exception("could not mark rollout %d as failing to evaluate", rollout_id)
            return False
        self._failing.pop(rollout_id, None)
        return True

    @staticmethod
    def _mark_failed(s: Session, rollout_id: int, exc: BaseException) -> None:
        """Store why the rollout could not be evaluated (audited once per distinct reason)."""
        r = s.get(Rollout, rollout_id, with_for_update=True)
        why = _failure(exc)
        if r is None or r.engine_error == why:
            return
        r.engine_error, r.engine_error_at = why, utcnow()
        audit(s, ENGINE_ACTOR, "rollout_engine_error", rollout_id, error=why)

    def release_leases(self) -> None:
        with self.sessions.begin() as s:
            s.execute(update(Rollout).where(Rollout.lease_owner == self.owner).values(lease_owner=None,
                                                                                       lease_until=None))

    def advance(self, rollout_id: int) -> None:
        msgs: list[tuple[str, bytes]] = []
        with self.sessions.begin() as s:
            self._advance_in(s, rollout_id, msgs)
        self._publish(msgs)

    def _publish(self, msgs: list[tuple[str, bytes]]) -> None:
        for topic, payload in msgs:  # after commit: a device that answers at once finds its target row
            self.publisher.publish(topic, payload, retain=True)

    def _advance_in(self, s: Session, rollout_id: int, msgs: list[tuple[str, bytes]]) -> None:
        r = s.get(Rollout, rollout_id, with_for_update=True)
        if r is None or r.status != RolloutStatus.IN_PROGRESS:
            return
        if r.engine_error is not None:  # it was failing; this time it is evaluated (or this raises again)
            audit(s, ENGINE_ACTOR, "rollout_engine_recovered", r.id, error=r.engine_error)
            r.engine_error = r.engine_error_at = None
        spec = RolloutSpec.model_validate(r.spec or {})
        for _ in range(64):  # bounded: each pass moves one wave one step or returns
            w = s.get(RolloutWave, (r.id, r.current_wave))
            if w is None:
                self.transition(s, r, RolloutStatus.SUCCEEDED, ENGINE_ACTOR, None)
                return
            now = utcnow()
            if w.state == WaveState.PENDING:
                self._start_wave(s, r, w, msgs, shadow=spec.shadow is not None)
                continue
            if w.state == WaveState.SHADOWING:
                assert spec.shadow is not None
                result = evaluate_shadow(self._shadow_figures(s, w), spec.shadow)
                if result is None:
                    return  # not enough mirrored requests yet
                w.gates = [result.as_json()]
                if not result.passed:
                    self._fail_shadow(s, r, w, spec, result, msgs)
                    return
                audit(s, ENGINE_ACTOR, "wave_shadow_passed", r.id, wave=w.idx, gates=w.gates)
                self._start_wave(s, r, w, msgs, shadow=False)  # promote: the real install
                continue
            if w.state in (WaveState.INSTALLING, WaveState.SOAKING):
                f = WaveFigures(w.size, w.n_installed, w.n_failed, 0, 0, None, None, 0)
                if install_gate_lost(f, spec.gates):
                    self._fail_wave(s, r, w, spec, self._figures(s, w), msgs)
                    return
            if w.state == WaveState.INSTALLING:
                outstanding = w.size - w.n_installed - w.n_failed
                if outstanding > 0:
                    started = w.started_at or now
                    if (now - started).total_seconds() < spec.offline_grace_s or w.n_installed + w.n_failed == 0:
                        return
                    if self._outstanding_online(s, w) > 0:
                        return
                    audit(s, ENGINE_ACTOR, "wave_offline_deferred", r.id, wave=w.idx, devices=outstanding)
                move_wave(s, w, WaveState.SOAKING, now=now, installed=w.n_installed, failed=w.n_failed,
                          soak_s=w.soak_s)
            if w.state == WaveState.SOAKING:
                if w.soak_until is not None and now < w.soak_until:
                    return
                results = evaluate_gates(self._figures(s, w), spec.gates)
                w.gates = [g for g in (w.gates or []) if g["name"] == "shadow_agreement"] + [
                    g.as_json() for g in results]
                if spec.require_telemetry and any(g.value is None for g in results if g.name != "install_success"):
                    return  # not judged yet: soak on until the devices send figures
                if not all(g.passed for g in results):
                    self._fail_wave(s, r, w, spec, self._figures(s, w), msgs, results)
                    return
                move_wave(s, w, WaveState.PASSED, now=now, gates=w.gates)
                r.current_wave += 1
                continue
            if w.state in (WaveState.PASSED, WaveState.FAILED):
                r.current_wave += 1
                continue
            return

    def _start_wave(self, s: Session, r: Rollout, w: RolloutWave, msgs: list[tuple[str, bytes]],
                    shadow: bool = False) -> None:
        """Send the wave its desired states: in shadow (the devices keep what they run) or to install."""
        lock_wave_rows(s, r.id, RolloutTarget.wave == w.idx)  # its devices, then its targets: the lock order
        pairs = list(s.execute(select(RolloutTarget, Device).join(Device, Device.id == RolloutTarget.device_id)
                               .where(RolloutTarget.rollout_id == r.id, RolloutTarget.wave == w.idx)))
        if shadow:
            now_ts = time.time()
            n = 0
            for t, d in pairs:
                if t.state != TargetState.PENDING:
                    continue
                m = self.model(s, t.model_id)
                assert m is not None
                msgs.append(desired_message(d.id, m, r.id, now_ts, mode="shadow"))
                n += 1
            move_wave(s, w, WaveState.SHADOWING, devices=n)
            return
        running = {(m.name, m.version, m.profile): m.id for m in s.scalars(
            select(Model).where(Model.name.in_({d.running_model for _, d in pairs if d.running_model})))}
        now = time.time()
        sent = 0
        for t, d in pairs:
            if t.state not in (TargetState.PENDING, TargetState.SHADOWING):
                continue  # superseded meanwhile
            m = self.model(s, t.model_id)
            assert m is not None
            t.previous_model_id = self._previous_model(s, d, m, running)
            tel = d.last_telemetry or {}
            if (tel.get("model"), tel.get("version")) == (d.running_model, d.running_version) and d.running_model:
                t.p99_before = (tel.get("latency") or {}).get("p99_ms")
            d.desired_model_id = m.id
            d.desired_rollout_id = r.id
            msgs.append(desired_message(d.id, m, r.id, now))
            sent += 1
        move_wave(s, w, WaveState.INSTALLING, devices=sent)

    def _previous_model(self, s: Session, d: Device, m: ModelInfo,
                        running: dict[tuple[str, str, str], int]) -> int | None:
        """The bundle the device runs now (what a rollback sends it back to). A device reports the model's name
        and version, not which profile's bundle: the one it was last sent when that is the same name and version,
        else the bundle of its own profile, else its profile's CPU fallback's. The new bundle's profile says
        nothing: a Jetson moving from its arm64-cpu fallback to a TensorRT build (or back) changes profile."""
        if not d.running_model:
            return None
        last = self.model(s, d.desired_model_id)
        if last is not None and (last.name, last.version) == (d.running_model, d.running_version):
            return last.id
        prof = d.profile or m.profile
        fb = cpu_fallback(prof)
        for p in (prof, *([fb] if fb else [])):
            if (found := running.get((d.running_model, d.running_version or "", p))) is not None:
                return found
        return None

    @staticmethod
    def _outstanding_online(s: Session, w: RolloutWave) -> int:
        return int(s.scalar(select(func.count()).select_from(RolloutTarget).join(
            Device, Device.id == RolloutTarget.device_id).where(
            RolloutTarget.rollout_id == w.rollout_id, RolloutTarget.wave == w.idx,
            RolloutTarget.state.not_in([x.value for x in TARGET_DONE]), Device.online.is_(True))) or 0)

    @staticmethod
    def _shadow_figures(s: Session, w: RolloutWave) -> ShadowWaveFigures:
        sh, t = RolloutShadow, RolloutTarget
        samples = cast(sh.samples, Float)  # summed as doubles: see _figures
        row = s.execute(select(
            func.count(), func.coalesce(func.sum(samples), 0.0),
            func.sum(case((sh.agreement.is_not(None), samples * sh.agreement))),
            func.sum(case((sh.agreement.is_not(None), samples))), func.max(sh.max_abs_error))
            .join(t, and_(t.rollout_id == sh.rollout_id, t.device_id == sh.device_id))
            .where(sh.rollout_id == w.rollout_id, t.wave == w.idx)).one()
        judged = float(row[3] or 0)
        return ShadowWaveFigures(int(row[0] or 0), int(row[1] or 0),
                                 float(row[2]) / judged if judged else None,
                                 None if row[4] is None else float(row[4]))

    def _fail_shadow(self, s: Session, r: Rollout, w: RolloutWave, spec: RolloutSpec, result: GateResult,
                     msgs: list[tuple[str, bytes]]) -> None:
        """The candidate disagreed in shadow: nothing was installed; the devices drop the shadow (their
        desired state goes back to what they run)."""
        move_wave(s, w, WaveState.FAILED, gates=w.gates)
        now = time.time()
        dropped = []
        for dev, state, d in s.execute(select(RolloutTarget.device_id, RolloutTarget.state, Device)
                                       .join(Device, Device.id == RolloutTarget.device_id)
                                       .where(RolloutTarget.rollout_id == r.id, RolloutTarget.wave == w.idx)):
            if state == TargetState.SHADOWING:
                dropped.append(TargetMove(r.id, dev, w.idx, TargetState.SHADOWING, TargetState.PENDING))
            cur = self.model(s, d.desired_model_id) if d.desired_model_id else None
            if cur is not None:
                msgs.append(desired_message(d.id, cur, d.desired_rollout_id, now))
        move_targets(s, dropped, ENGINE_ACTOR, "shadow_failed")
        value = "n/a" if result.value is None else f"{result.value:.4g}"
        reason = (f"wave {w.idx + 1} failed in shadow, before any install: shadow_agreement {value} vs threshold "
                  f"{result.threshold:g} ({result.detail})")
        self.transition(s, r, RolloutStatus.PAUSED if spec.on_failure == "pause" else RolloutStatus.FAILED,
                        ENGINE_ACTOR, reason)

    def _figures(self, s: Session, w: RolloutWave) -> WaveFigures:
        """The wave's gate figures. Counters are summed as doubles: an integer sum() overflows on SQLite (and
        becomes NUMERIC on PostgreSQL) once a few targets hold counts near 2**62, which rows stored before the
        counters were bounded may; a double sums any number of them (exactly up to 2**53)."""
        both = and_(RolloutTarget.p99_before.is_not(None), RolloutTarget.p99_after.is_not(None),
                    RolloutTarget.p99_before > 0)
        row = s.execute(select(
            func.coalesce(func.sum(cast(RolloutTarget.tele_requests, Float)), 0.0),
            func.coalesce(func.sum(cast(RolloutTarget.tele_errors, Float)), 0.0),
            func.sum(case((both, RolloutTarget.p99_before))), func.sum(case((both, RolloutTarget.p99_after))),
            func.sum(case((both, 1), else_=0))).where(RolloutTarget.rollout_id == w.rollout_id,
                                                      RolloutTarget.wave == w.idx)).one()
        n = int(row[4] or 0)
        drift_psi, drift_detail = self._drift_figure(s, w)
        return WaveFigures(w.size, w.n_installed, w.n_failed, int(row[0]), int(row[1]),
                           float(row[2]) / n if n else None, float(row[3]) / n if n else None, n, drift_psi,
                           drift_detail)

    def _drift_figure(self, s: Session, w: RolloutWave) -> tuple[float | None, str]:
        """The wave's drift against the previous version, when its rollout gates on it (None: not judged)."""
        r = s.get(Rollout, w.rollout_id)
        if r is None or not r.model_name or not r.model_version:
            return None, ""
        if RolloutSpec.model_validate(r.spec or {}).gates.max_drift_psi is None:
            return None, ""
        wd = self.drift.wave(s, r.id, w.idx, r.model_name, r.model_version, w.started_at)
        vs = wd.vs_previous
        return (vs.psi if vs is not None and vs.level != "insufficient" else None), wd.detail

    def _fail_wave(self, s: Session, r: Rollout, w: RolloutWave, spec: RolloutSpec, f: WaveFigures,
                   msgs: list[tuple[str, bytes]], results: list[GateResult] | None = None) -> None:
        results = results or evaluate_gates(f, spec.gates)
        w.gates = [g.as_json() for g in results]
        bad = [g for g in results if not g.passed]
        reason = f"wave {w.idx + 1} failed its gates: " + "; ".join(
            f"{g.name} {'n/a' if g.value is None else f'{g.value:.4g}'} vs threshold {g.threshold:g} ({g.detail})"
            for g in bad)
        move_wave(s, w, WaveState.FAILED, gates=w.gates)
        if spec.rollback_on_failure:
            self._rollback_targets(s, r, ENGINE_ACTOR, msgs, wave=w.idx)
        self.transition(s, r, RolloutStatus.PAUSED if spec.on_failure == "pause" else RolloutStatus.FAILED,
                        ENGINE_ACTOR, reason)

    def _rollback_targets(self, s: Session, r: Rollout, actor: str, msgs: list[tuple[str, bytes]],
                          wave: int | None = None) -> tuple[int, int]:
        """Send the started targets back to their previous model; returns (sent back, without a previous)."""
        t = RolloutTarget
        q = select(t.device_id, t.state, t.wave, t.previous_model_id, Device).join(
            Device, Device.id == t.device_id).where(t.rollout_id == r.id, t.state.in_([x.value for x in ROLLBACK_FROM]))
        q = q.where(t.wave == wave) if wave is not None else q.where(t.wave <= r.current_wave)
        # the devices, then the targets, locked before their states are read (the lock order: the rollout is held):
        # a report ingested meanwhile waits, instead of moving a target under this move (a Conflict) or holding a
        # device this waits for (a deadlock)
        lock_wave_rows(s, r.id, t.state.in_([x.value for x in ROLLBACK_FROM]),
                       t.wave == wave if wave is not None else t.wave <= r.current_wave)
        now = time.time()
        moves: list[TargetMove] = []
        stuck = 0
        for dev, state, w, prev_id, d in s.execute(q):
            if state == TargetState.PENDING and d.desired_rollout_id != r.id:
                continue  # never sent
            prev = self.model(s, prev_id)
            if prev is None:
                stuck += 1
                continue
            moves.append(TargetMove(r.id, dev, w, TargetState(state), TargetState.ROLLING_BACK))
            if d.desired_rollout_id == r.id:
                d.desired_model_id = prev.id
                msgs.append(desired_message(d.id, prev, r.id, now))
        move_targets(s, moves, actor, "rollback")
        audit(s, actor, "rollback_sent", r.id, wave=wave, devices=len(moves), without_previous_model=stuck)
        return len(moves), stuck

    # -- operator actions ----------------------------------------------------------------------------
    def act(self, rollout_id: int, action: str, actor: str) -> None:
        msgs: list[tuple[str, bytes]] = []
        with self.sessions.begin() as s:
            r = s.get(Rollout, rollout_id, with_for_update=True)
            if r is None:
                raise NotFound(f"no rollout {rollout_id}")
            if action == "pause":
                self.transition(s, r, RolloutStatus.PAUSED, actor, f"paused by {actor}")
            elif action == "resume":
                w = s.get(RolloutWave, (r.id, r.current_wave))
                skipped = w is not None and w.state == WaveState.FAILED
                self.transition(s, r, RolloutStatus.IN_PROGRESS, actor, None,
                                overriding_failed_wave=(w.idx if w is not None and skipped else None))
            elif action == "abort":
                self.transition(s, r, RolloutStatus.ABORTED, actor, f"aborted by {actor}")
            elif action == "rollback":
                if r.status == RolloutStatus.ROLLED_BACK:
                    raise Conflict(f"rollout {rollout_id} is already rolled back")
                back, stuck = self._rollback_targets(s, r, actor, msgs)
                self.transition(s, r, RolloutStatus.ROLLED_BACK, actor, f"rolled back by {actor}: {back} devices "
                                "sent to their previous model" + (f", {stuck} had none" if stuck else ""))
            else:
                raise BadRequest(f"unknown action {action!r}: pause, resume, abort or rollback")
        self._publish(msgs)
        if action == "resume":
            self.advance_isolated(rollout_id)

    # -- reading ---------------------------------------------------------------------------------
    def status(self, rollout_id: int, with_targets: bool = True) -> dict[str, Any]:
        with self.sessions() as s:
            r = s.get(Rollout, rollout_id)
            if r is None:
                raise NotFound(f"no rollout {rollout_id}")
            first = self.model(s, r.model_id)
            assert first is not None
            counts = {st: int(n) for st, n in s.execute(
                select(RolloutTarget.state, func.count()).where(RolloutTarget.rollout_id == r.id)
                .group_by(RolloutTarget.state))}
            waves = list(s.scalars(select(RolloutWave).where(RolloutWave.rollout_id == r.id)
                                   .order_by(RolloutWave.idx)))
            profiles = sorted({p for (p,) in s.execute(
                select(Model.profile).join(RolloutTarget, RolloutTarget.model_id == Model.id)
                .where(RolloutTarget.rollout_id == r.id).distinct())})
            out: dict[str, Any] = {
                "id": r.id, "model": r.model_name or first.name, "version": r.model_version or first.version,
                "profile": first.profile, "profiles": profiles, "status": r.status, "reason": r.reason,
                "created_by": r.created_by, "created_at": _iso(r.created_at), "finished_at": _iso(r.finished_at),
                "current_wave": r.current_wave, "spec": r.spec if isinstance(r.spec, dict) else {},
                "counts": counts, "engine_error": r.engine_error, "engine_error_at": _iso(r.engine_error_at),
                "waves": [{"index": w.idx, "size": w.size, "soak_s": w.soak_s, "state": w.state,
                           "installed": w.n_installed, "failed": w.n_failed, "started_at": _iso(w.started_at),
                           "soak_until": _iso(w.soak_until), "gates": w.gates} for w in waves],
            }
            if with_targets:
                out["targets"] = [target_json(t, p) for t, p in s.execute(
                    select(RolloutTarget, Model.profile).outerjoin(Model, Model.id == RolloutTarget.model_id)
                    .where(RolloutTarget.rollout_id == r.id).order_by(RolloutTarget.device_id))]
            try:  # last: a failure here leaves the rest of the answer (and the listing) standing
                self._live_gates(s, r, waves, out["waves"])
            except Exception as exc:  # shown (while it runs) as the engine's own failure would be
                log.debug("rollout %d: its live gate figures could not be read: %s", r.id, _failure(exc))
                if r.status == RolloutStatus.IN_PROGRESS:
                    out["engine_error"] = out["engine_error"] or _failure(exc)
            return out

    def _live_gates(self, s: Session, r: Rollout, waves: list[RolloutWave], out: list[dict[str, Any]]) -> None:
        """Gates not judged yet: their values so far, into each wave's ``gates_live``."""
        spec = RolloutSpec.model_validate(r.spec or {})
        for wj, w in zip(out, waves, strict=True):
            if w.state == WaveState.SHADOWING and spec.shadow is not None:
                f = self._shadow_figures(s, w)
                g = evaluate_shadow(f, spec.shadow) or GateResult(
                    "shadow_agreement", f.agreement, spec.shadow.agreement_min, False,
                    f"{f.samples} of {spec.shadow.min_samples} mirrored requests so far")
                wj["gates_live"] = [g.as_json()]
            elif w.state in (WaveState.INSTALLING, WaveState.SOAKING) and not any(
                    g["name"] != "shadow_agreement" for g in (w.gates or [])):
                wj["gates_live"] = [g.as_json() for g in evaluate_gates(self._figures(s, w), spec.gates)]


def target_json(t: RolloutTarget, bundle_profile: str | None) -> dict[str, Any]:
    """A target as the API shows it; ``bundle_profile`` is the profile of the bundle it was sent (its device's
    own, or that profile's CPU fallback)."""
    return {"device_id": t.device_id, "state": t.state, "error": t.error, "wave": t.wave,
            "updated_at": _iso(t.updated_at), "bundle_profile": bundle_profile}


def _names(ids: list[str], limit: int = 10) -> str:
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")
