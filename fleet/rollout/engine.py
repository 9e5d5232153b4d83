"""The engine: a rollout's life from creation through its waves (shadow, install, soak, gates) to its end,
driven by device reports and telemetry (``on_reports``, ``on_telemetry_batch``) and by the tick (``advance``);
leases let several replicas share the rollouts."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from sqlalchemy import BigInteger, Float, Table, and_, bindparam, case, cast, func, insert, or_, select, tuple_, update
from sqlalchemy.orm import Session, sessionmaker

from edgefleet.fleet.audit import ENGINE_ACTOR, audit
from edgefleet.fleet.db import Device, Model, Rollout, RolloutShadow, RolloutTarget, RolloutWave, utcnow
from edgefleet.fleet.drift import DriftBook
from edgefleet.fleet.errors import BadRequest, Conflict, DeviceInputRejected, NotFound
from edgefleet.fleet.rollout.gates import (
    GateResult,
    ShadowWaveFigures,
    WaveFigures,
    evaluate_gates,
    evaluate_shadow,
    install_gate_lost,
)
from edgefleet.fleet.rollout.moves import (
    AUDIT_DEVICES_PER_ROW,
    TargetMove,
    lock_rows,
    lock_wave_rows,
    move_targets,
    move_wave,
)
from edgefleet.fleet.rollout.spec import (
    RolloutSpec,
    Selector,
    plan_waves,
)
from edgefleet.fleet.states import (
    TARGET_DONE,
    TARGET_FINAL,
    TARGET_TRANSITIONS,
    TRANSITIONS,
    RolloutStatus,
    TargetState,
    WaveState,
)
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.errors import EdgefleetError
from edgefleet.protocol.profile import load_profile

log = logging.getLogger("edgefleet.fleet.rollout")

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


# a target's telemetry counters stop here (exact in a double; protocol.mqtt.MAX_COUNT per record, so ~8,000 records
# of the largest counts a device may send): adding to them never overflows a BIGINT, whatever the device sends
TELE_COUNT_CAP = 2**53
REPORT_ACTOR = "devices"  # the actor of moves the devices' own reports make
# a rollback sends back the targets that were sent something (pending ones only if their desired state went out)
ROLLBACK_FROM = frozenset({TargetState.PENDING, TargetState.DOWNLOADING, TargetState.INSTALLING, TargetState.INSTALLED,
                           TargetState.FAILED})




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

    def models(self, s: Session, model_ids: set[int | None]) -> None:
        """Read the models of ``model_ids`` not cached yet in one query, so that ``model`` finds them."""
        with self._lock:
            missing = sorted(i for i in model_ids if i is not None and i not in self._models)
        if not missing:
            return
        found = {row.id: ModelInfo(row.id, row.name, row.version, row.profile, row.target_path, row.sha256,
                                   row.size_bytes) for row in s.scalars(select(Model).where(Model.id.in_(missing)))}
        with self._lock:
            self._models.update(found)

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
        """Shadow figures of devices whose target is shadowing a candidate: the newest per device is kept (the
        targets, their rows stored before and models not cached read in one query each, whatever the batch)."""
        newest = {m.device_id: m.shadow for m in msgs if m.shadow is not None}
        if not newest:
            return
        t, sh = RolloutTarget, RolloutShadow
        rows = s.execute(select(t.rollout_id, t.device_id, t.model_id).where(
            t.device_id.in_(list(newest)), t.state == TargetState.SHADOWING.value)).all()
        if not rows:
            return
        now = utcnow()
        self.models(s, {model_id for _, _, model_id in rows})
        # the rows stored before, in one query (not one per target)
        have = {(x.rollout_id, x.device_id): x for x in s.scalars(select(sh).where(
            tuple_(sh.rollout_id, sh.device_id).in_([(rid, dev) for rid, dev, _ in rows])))}
        for rid, dev, model_id in rows:
            fig = newest[dev]
            info = self.model(s, model_id)
            if fig is None or info is None or (info.name, info.version) != (fig.model, fig.version):
                continue
            row = have.get((rid, dev))
            if row is None:
                row = RolloutShadow(rollout_id=rid, device_id=dev)
                s.add(row)
            row.samples, row.agreement = fig.samples, fig.top1_agreement
            row.max_abs_error, row.p99_ms, row.updated_at = fig.max_abs_error, fig.p99_ms, now

    def on_telemetry_batch(self, s: Session, rollout_of: dict[str, int | None], msgs: list[proto.Telemetry]) -> None:
        """Figures for the gates: requests, errors and newest p99 on the rollout's model, per target (the targets
        and the models not cached read in one query each, the counters in one executemany, whatever the batch)."""
        t: Table = RolloutTarget.__table__  # type: ignore[assignment]
        keys = list({(rollout_of[m.device_id], m.device_id) for m in msgs
                     if rollout_of.get(m.device_id) is not None and m.version is not None})
        if not keys:
            return
        models = {(r.rollout_id, r.device_id): r.model_id for r in s.execute(
            select(t.c.rollout_id, t.c.device_id, t.c.model_id).where(tuple_(t.c.rollout_id, t.c.device_id).in_(keys)))}
        self.models(s, set(models.values()))  # those not cached, in one query
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
    def status(self, rollout_id: int, with_targets: bool = True, profiles: bool = True,
               live_gates: bool = True) -> dict[str, Any]:
        """A rollout as the API shows it. Each part that reads all of a large rollout's targets can be left out where
        it is not shown (the console): ``profiles`` (the bundles' profiles sent: empty when left out) and
        ``live_gates`` (the running wave's gate values so far)."""
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
            sent = sorted({p for (p,) in s.execute(
                select(Model.profile).join(RolloutTarget, RolloutTarget.model_id == Model.id)
                .where(RolloutTarget.rollout_id == r.id).distinct())}) if profiles else []
            out: dict[str, Any] = {
                "id": r.id, "model": r.model_name or first.name, "version": r.model_version or first.version,
                "profile": first.profile, "profiles": sent, "status": r.status, "reason": r.reason,
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
                if live_gates:
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
