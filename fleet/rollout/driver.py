"""The driver: a rollout's life from creation through its waves (shadow, install, soak, gates) to its end,
driven by device reports and telemetry (``on_reports``, ``on_telemetry_batch``) and by the tick (``advance``);
leases let several replicas share the rollouts. It drives rollouts and runs no model (an engine, in the glossary, is
a built model).

The driver is the service of the package's layers: it loads rows (fleet.rollout.queries), asks the rules what to do
(fleet.rollout.step: ``step`` for a wave, ``next_target_state`` for a report), applies their moves (fleet.rollout.moves
and ``transition``, each with its audit row) and publishes the devices' desired states after the commit."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict
from typing import Any, Protocol

from sqlalchemy import BigInteger, Float, Table, bindparam, case, func, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from ...protocol import mqtt as proto
from .. import schemas as out
from ..audit import ENGINE_ACTOR, audit
from ..db import Device, Model, Rollout, RolloutShadow, RolloutTarget, RolloutWave, utcnow
from ..drift import DriftBook
from ..errors import BadRequest, Conflict, DeviceInputRejected, NotFound
from ..states import TARGET_DONE, TARGET_FINAL, RolloutStatus, TargetState, WaveState
from . import queries as q
from .gates import ShadowWaveFigures, WaveFigures
from .moves import (
    AUDIT_DEVICES_PER_ROW,
    ROLLBACK_FROM,
    TargetMove,
    apply,
    desired_message,
    lock_rows,
    move_rollout,
    move_targets,
    rollback_targets,
)
from .queries import (
    ModelCache,
    ModelInfo,
    RolloutRow,
    WaveRow,
    cpu_fallback,
    lock_rollout,
    names,
    select_devices,
)
from .spec import RolloutSpec, Selector, plan_waves
from .status import failure, rollout_status
from .step import next_target_state, step

__all__ = ["REPORT_ACTOR", "ROLLBACK_FROM", "TELE_COUNT_CAP", "ModelInfo", "Publisher", "RolloutDriver", "cpu_fallback",
           "desired_message"]

log = logging.getLogger("edgefleet.fleet.rollout")

class Publisher(Protocol):
    def publish(self, topic: str, payload: bytes, retain: bool) -> None: ...


# a target's telemetry counters stop here (exact in a double; protocol.mqtt.MAX_COUNT per record, so ~8,000 records
# of the largest counts a device may send): adding to them never overflows a BIGINT, whatever the device sends
TELE_COUNT_CAP = 2**53
REPORT_ACTOR = "devices"  # the actor of moves the devices' own reports make


class _WaveFigures:
    """A wave's figures for the rules (fleet.rollout.step.Figures), each read from the database when first asked."""

    def __init__(self, driver: RolloutDriver, s: Session, w: RolloutWave):
        self._driver, self._s, self._w = driver, s, w
        self._wave: WaveFigures | None = None

    def wave(self) -> WaveFigures:
        if self._wave is None:
            self._wave = self._driver.figures(self._s, self._w)
        return self._wave

    def shadow(self) -> ShadowWaveFigures:
        return q.shadow_figures(self._s, self._w.rollout_id, self._w.idx)

    def outstanding_online(self) -> int:
        return q.outstanding_online(self._s, self._w.rollout_id, self._w.idx)

    def downloads(self) -> tuple[int, int]:
        return q.downloads(self._s, self._w.rollout_id, self._w.idx)


class RolloutDriver:
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
        self.bundles = ModelCache()
        self._failing: dict[int, tuple[int, float]] = {}  # rollout -> (failures in a row, monotonic next try)
        self.drift = DriftBook()  # drift scores: stored from telemetry, read by the max_drift_psi gate

    # -- models (immutable rows, cached: fleet.rollout.queries.ModelCache) -----------------------------------
    def model(self, s: Session, model_id: int | None) -> ModelInfo | None:
        return self.bundles.get(s, model_id)

    def models(self, s: Session, model_ids: set[int | None]) -> None:
        """Read the models of ``model_ids`` not cached yet in one query, so that ``model`` finds them."""
        self.bundles.load(s, model_ids)

    # -- transitions -----------------------------------------------------------------------------
    @staticmethod
    def transition(s: Session, r: Rollout, new: RolloutStatus, actor: str, reason: str | None = None,
                   **detail: Any) -> None:
        """The only way a rollout's status changes (fleet.rollout.moves.move_rollout: as ``TRANSITIONS`` allows,
        else ``Conflict``; audited)."""
        move_rollout(s, r, new, actor, reason, **detail)

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
            devices = select_devices(s, sel)
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
                                 f"these devices have no known hardware profile: {names(unknown_profile)}; set "
                                 "their profile or say which build with 'profile'", 422)
            if no_bundle:
                raise BadRequest("no bundle of " + f"{name} {version} for " + "; ".join(
                    f"profile {p} (devices {names(ids)})"
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
            theirs: list[tuple[str, bytes]] = []
            try:
                with s.begin_nested():
                    self._advance_in(s, rid, theirs)
            except Exception as exc:
                self._mark_failed(s, rid, exc)
            else:
                msgs.extend(theirs)

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
        rows = q.lock_targets(s, list({(m.rollout_id or 0, m.device_id) for m in msgs}))
        now_at: dict[tuple[int, str], tuple[TargetState, str | None]] = {k: (r.state, r.error) for k, r in rows.items()}
        rejected: list[tuple[DeviceInputRejected, proto.ReportedState]] = []
        moves: list[TargetMove] = []
        new_errors: dict[tuple[int, str], dict[str, Any]] = {}
        for m in msgs:
            key = (m.rollout_id or 0, m.device_id)
            row = rows.get(key)
            if row is None:
                rejected.append((DeviceInputRejected("report_not_a_target", f"device {m.device_id} reported on "
                                                     f"rollout {m.rollout_id}, which does not target it"), m))
                continue
            old, err = now_at[key]
            new = next_target_state(old, m, self.model(s, row.model_id), self.model(s, row.previous_model_id))
            if new is None or (new is old and m.error == err):
                continue
            now_at[key] = (new, m.error)
            if new is old:  # the same state with another error: not a transition
                new_errors[key] = {"b_r": key[0], "b_d": key[1], "error": m.error, "updated_at": utcnow()}
            else:
                moves.append(TargetMove(key[0], key[1], row.wave, old, new, m.error))
                new_errors.pop(key, None)
        move_targets(s, moves, REPORT_ACTOR, "report")
        if new_errors:
            s.connection().execute(update(t).where(t.c.rollout_id == bindparam("b_r"),
                                                   t.c.device_id == bindparam("b_d")), list(new_errors.values()))
        return rejected

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
            q.keys_in(sh.rollout_id, sh.device_id, [(rid, dev) for rid, dev, _ in rows])))}
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
        keys = list({(rid, m.device_id) for m in msgs
                     if (rid := rollout_of.get(m.device_id)) is not None and m.version is not None})
        if not keys:
            return
        models = {(r.rollout_id, r.device_id): r.model_id for r in s.execute(
            select(t.c.rollout_id, t.c.device_id, t.c.model_id).where(q.keys_in(t.c.rollout_id, t.c.device_id, keys)))}
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
            ids = q.in_progress(s)
        for gone in self._failing.keys() - set(ids):
            self._failing.pop(gone, None)
        n = 0
        for rid in ids:
            failing = self._failing.get(rid)
            if failing is not None and time.monotonic() < failing[1]:
                continue  # its last evaluation failed: it waits its turn, the others go on
            with self.sessions.begin() as s:
                held = q.claim_lease(s, rid, self.owner, now, self.LEASE_S)
            if held and self.advance_isolated(rid):
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
        r = lock_rollout(s, rollout_id)
        why = failure(exc)
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
        """Step the rollout (fleet.rollout.step) and apply its moves until one ends the pass (bounded: each step
        moves one wave one step or ends)."""
        r = lock_rollout(s, rollout_id)
        if r is None or r.status != RolloutStatus.IN_PROGRESS:
            return
        if r.engine_error is not None:  # it was failing; this time it is evaluated (or this raises again)
            audit(s, ENGINE_ACTOR, "rollout_engine_recovered", r.id, error=r.engine_error)
            r.engine_error = r.engine_error_at = None
        spec = RolloutSpec.model_validate(r.spec or {})
        for _ in range(64):
            w = s.get(RolloutWave, (r.id, r.current_wave))
            row = RolloutRow.of(r, spec)
            if w is None:
                moves = step(row, None, _NO_WAVE, utcnow())
            else:
                moves = step(row, WaveRow.of(w), _WaveFigures(self, s, w), utcnow())
            for move in moves:
                apply(s, self.bundles, r, w, row, move, msgs)
            if moves[-1].ends:
                return

    def figures(self, s: Session, w: RolloutWave) -> WaveFigures:
        """The wave's gate figures: its counters, its telemetry (fleet.rollout.queries) and, when its rollout
        gates on drift, its drift against the previous version."""
        tele = q.telemetry_figures(s, w.rollout_id, w.idx)
        drift_psi, drift_detail = q.drift_figure(s, self.drift, w)
        return WaveFigures(w.size, w.n_installed, w.n_failed, tele.requests, tele.errors, tele.p99_before_ms,
                           tele.p99_after_ms, tele.p99_devices, drift_psi, drift_detail)

    # -- operator actions ----------------------------------------------------------------------------
    def act(self, rollout_id: int, action: str, actor: str) -> None:
        msgs: list[tuple[str, bytes]] = []
        with self.sessions.begin() as s:
            r = lock_rollout(s, rollout_id)
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
                back, stuck = rollback_targets(s, self.bundles, r, actor, msgs)
                self.transition(s, r, RolloutStatus.ROLLED_BACK, actor, f"rolled back by {actor}: {back} devices "
                                "sent to their previous model" + (f", {stuck} had none" if stuck else ""))
            else:
                raise BadRequest(f"unknown action {action!r}: pause, resume, abort or rollback")
        self._publish(msgs)
        if action == "resume":
            self.advance_isolated(rollout_id)

    # -- reading ---------------------------------------------------------------------------------
    def status(self, rollout_id: int, with_targets: bool = True, profiles: bool = True,
               live_gates: bool = True) -> out.Rollout:
        """A rollout as the API shows it (fleet.rollout.status: the API's schema model, the fields left out unset)."""
        with self.sessions() as s:
            return rollout_status(s, rollout_id, self.model, self.figures, with_targets, profiles, live_gates)


_NO_WAVE: Any = None  # no wave left: the rules ask for no figures
