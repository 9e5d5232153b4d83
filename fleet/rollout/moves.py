"""The only ways a rollout's, a wave's or a target's state changes: ``move_rollout``, ``move_wave`` and
``move_targets`` refuse a transition fleet.states does not list (``Conflict``) and write the audit rows in the same
transaction; ``apply`` writes a move of fleet.rollout.step through them (a wave started, its shadow dropped, its
targets rolled back, each with the devices' desired states it sends, published by the driver after the commit).
The row locks they rely on (``lock_rows``, in the one lock order: see fleet.rollout) are fleet.rollout.queries',
re-exported here."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from ...protocol import mqtt as proto
from ...protocol.window import MaintenanceWindow
from ..audit import ENGINE_ACTOR, audit
from ..db import Device, Model, Rollout, RolloutTarget, RolloutWave, utcnow
from ..errors import Conflict
from ..states import (
    TARGET_TRANSITIONS,
    TRANSITIONS,
    WAVE_TRANSITIONS,
    RolloutStatus,
    TargetState,
    WaveState,
)
from ..windows import effective as effective_windows
from .queries import ModelCache, ModelInfo, RolloutRow, cpu_fallback, lock_rows, lock_wave_rows
from .step import (
    FailShadow,
    FailWave,
    Finish,
    Move,
    NextWave,
    PassShadow,
    PassWave,
    Release,
    SetGates,
    Soak,
    StartWave,
    Wait,
    failure_status,
    gate_failure,
    previous_bundle,
    shadow_failure,
)

__all__ = ["AUDIT_DEVICES_PER_ROW", "AUDIT_ERROR_CHARS", "ROLLBACK_FROM", "WAVE_ACTIONS", "Messages", "TargetMove",
           "apply", "desired_message", "lock_rows", "lock_wave_rows", "move_rollout", "move_targets", "move_wave",
           "rollback_targets", "start_wave"]

Messages = list[tuple[str, bytes]]  # (topic, payload) of desired states, published once the transaction commits
# a rollback sends back the targets that were sent something (pending ones only if their desired state went out)
ROLLBACK_FROM = frozenset({TargetState.PENDING, TargetState.DOWNLOADING, TargetState.INSTALLING, TargetState.INSTALLED,
                           TargetState.FAILED})

WAVE_ACTIONS: dict[WaveState, str] = {  # the audit action of entering each state
    WaveState.SHADOWING: "wave_shadow_started", WaveState.INSTALLING: "wave_started",
    WaveState.SOAKING: "wave_soaking", WaveState.PASSED: "wave_passed", WaveState.FAILED: "wave_failed"}
AUDIT_DEVICES_PER_ROW = 1000  # a bulk move names every device, in audit rows of at most this many (~15 KB)
AUDIT_ERROR_CHARS = 200  # of each device's error, in an audit row (the target row keeps all of it)


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


def desired_message(device_id: str, m: ModelInfo, rollout_id: int | None, now: float,
                    mode: str | None = None, download_max_bytes_per_s: int | None = None,
                    window: MaintenanceWindow | None = None) -> tuple[str, bytes]:
    msg = proto.DesiredState(device_id=device_id, ts=now, rollout_id=rollout_id, model=m.name, version=m.version,
                             target=m.target_path, sha256=m.sha256, size_bytes=m.size_bytes,
                             mode=mode, download_max_bytes_per_s=download_max_bytes_per_s,  # type: ignore[arg-type]
                             install_window=window)
    return proto.topic(device_id, "desired"), proto.encode(msg)


def move_rollout(s: Session, r: Rollout, new: RolloutStatus, actor: str, reason: str | None = None,
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


def apply(s: Session, models: ModelCache, r: Rollout, w: RolloutWave | None, row: RolloutRow, move: Move,
          msgs: Messages) -> None:
    """One move of ``step``, written through the rollout's, the wave's or the targets' one transition function."""
    if isinstance(move, Finish):
        move_rollout(s, r, move.status, ENGINE_ACTOR, None)
        return
    assert w is not None
    match move:
        case Wait():
            pass
        case StartWave(shadow=shadow):
            start_wave(s, models, r, w, msgs, shadow=shadow)
        case Release(n=n):
            sent = _send_installs(s, models, r, w, msgs, n)
            audit(s, ENGINE_ACTOR, "wave_released", r.id, wave=w.idx, devices=sent)
        case SetGates(gates=gates):
            w.gates = list(gates)
        case PassShadow():
            audit(s, ENGINE_ACTOR, "wave_shadow_passed", r.id, wave=w.idx, gates=w.gates)
        case FailShadow(result=result):
            _drop_shadow(s, models, r, w, msgs)
            move_rollout(s, r, failure_status(row), ENGINE_ACTOR, shadow_failure(w.idx, result))
        case Soak(deferred=deferred):
            if deferred:
                audit(s, ENGINE_ACTOR, "wave_offline_deferred", r.id, wave=w.idx, devices=deferred)
            move_wave(s, w, WaveState.SOAKING, now=utcnow(), installed=w.n_installed, failed=w.n_failed,
                      soak_s=w.soak_s)
        case FailWave(results=results):
            w.gates = [g.as_json() for g in results]
            move_wave(s, w, WaveState.FAILED, gates=w.gates)
            if row.spec.rollback_on_failure:
                rollback_targets(s, models, r, ENGINE_ACTOR, msgs, wave=w.idx)
            move_rollout(s, r, failure_status(row), ENGINE_ACTOR, gate_failure(w.idx, results))
        case PassWave():
            move_wave(s, w, WaveState.PASSED, now=utcnow(), gates=w.gates)
            r.current_wave += 1
        case NextWave():
            r.current_wave += 1


def start_wave(s: Session, models: ModelCache, r: Rollout, w: RolloutWave, msgs: Messages,
               shadow: bool = False) -> None:
    """Send the wave its desired states: in shadow (the devices keep what they run) or to install."""
    lock_wave_rows(s, r.id, RolloutTarget.wave == w.idx)  # its devices, then its targets: the lock order
    pairs = list(s.execute(select(RolloutTarget, Device).join(Device, Device.id == RolloutTarget.device_id)
                           .where(RolloutTarget.rollout_id == r.id, RolloutTarget.wave == w.idx)))
    pairs.sort(key=lambda td: (not td[1].online, td[1].id))  # online devices first, when a cap sends only some
    if shadow:
        # a shadow downloads the bundle as an install does: held to the rollout's rate cap, and under a download
        # cap only that many devices shadow (the shadow's sample; the rest join at the install). No maintenance
        # window: a shadow changes no answer, and it judges the candidate on live requests (docs/rollouts.md)
        spec = r.spec or {}
        cap, pace = spec.get("max_concurrent_downloads"), spec.get("download_max_bytes_per_s")
        now_ts = time.time()
        n = 0
        for t, d in pairs:
            if t.state != TargetState.PENDING:
                continue
            if cap is not None and n >= cap:
                break
            m = models.get(s, t.model_id)
            assert m is not None
            msgs.append(desired_message(d.id, m, r.id, now_ts, mode="shadow", download_max_bytes_per_s=pace))
            n += 1
        move_wave(s, w, WaveState.SHADOWING, devices=n)
        return
    sent = _send_installs(s, models, r, w, msgs, (r.spec or {}).get("max_concurrent_downloads"), pairs)
    move_wave(s, w, WaveState.INSTALLING, devices=sent)


def _send_installs(s: Session, models: ModelCache, r: Rollout, w: RolloutWave, msgs: Messages, limit: int | None,
                   pairs: list[Any] | None = None) -> int:
    """Send up to ``limit`` (None: all) of the wave's targets not sent yet their desired state to install, online
    devices first (a rollout's download cap, RolloutSpec.max_concurrent_downloads); returns how many."""
    if pairs is None:
        unsent = RolloutTarget.state.in_([TargetState.PENDING.value, TargetState.SHADOWING.value])
        lock_wave_rows(s, r.id, RolloutTarget.wave == w.idx, unsent)
        pairs = list(s.execute(select(RolloutTarget, Device).join(Device, Device.id == RolloutTarget.device_id)
                               .where(RolloutTarget.rollout_id == r.id, RolloutTarget.wave == w.idx, unsent)
                               .order_by(Device.online.desc(), Device.id)))
        pairs = [(t, d) for t, d in pairs if d.desired_rollout_id != r.id]
    pace = (r.spec or {}).get("download_max_bytes_per_s")  # the rollout's download rate cap (RolloutSpec), if any
    # each device's maintenance window goes with its desired state, unless the rollout is urgent
    windows = {} if (r.spec or {}).get("urgent") else effective_windows(s, (d for _, d in pairs))
    running = {(m.name, m.version, m.profile): m.id for m in s.scalars(
        select(Model).where(Model.name.in_({d.running_model for _, d in pairs if d.running_model})))}
    now, sent_at = time.time(), utcnow()
    sent = 0
    for t, d in pairs:
        if t.state not in (TargetState.PENDING, TargetState.SHADOWING):
            continue  # superseded meanwhile
        if limit is not None and sent >= limit:
            break
        m = models.get(s, t.model_id)
        assert m is not None
        if d.running_model:  # what a rollback sends it back to
            prof = d.profile or m.profile
            fb = cpu_fallback(prof)
            t.previous_model_id = previous_bundle(d.running_model, d.running_version or "",
                                                  models.get(s, d.desired_model_id), (prof, *([fb] if fb else [])),
                                                  running)
        else:
            t.previous_model_id = None
        tel = d.last_telemetry or {}
        if (tel.get("model"), tel.get("version")) == (d.running_model, d.running_version) and d.running_model:
            t.p99_before = (tel.get("latency") or {}).get("p99_ms")
        d.desired_model_id = m.id
        d.desired_rollout_id = r.id
        t.updated_at = sent_at  # its wait for a report starts now (fleet.reconcile reads back what waited too long)
        msgs.append(desired_message(d.id, m, r.id, now, download_max_bytes_per_s=pace, window=windows.get(d.id)))
        sent += 1
    return sent


def _drop_shadow(s: Session, models: ModelCache, r: Rollout, w: RolloutWave, msgs: Messages) -> None:
    """The candidate disagreed in shadow: the wave fails, nothing was installed; its devices drop the shadow
    (their desired state goes back to what they run)."""
    move_wave(s, w, WaveState.FAILED, gates=w.gates)
    now = time.time()
    dropped = []
    for dev, state, d in s.execute(select(RolloutTarget.device_id, RolloutTarget.state, Device)
                                   .join(Device, Device.id == RolloutTarget.device_id)
                                   .where(RolloutTarget.rollout_id == r.id, RolloutTarget.wave == w.idx)):
        if state == TargetState.SHADOWING:
            dropped.append(TargetMove(r.id, dev, w.idx, TargetState.SHADOWING, TargetState.PENDING))
        cur = models.get(s, d.desired_model_id) if d.desired_model_id else None
        if cur is not None:
            msgs.append(desired_message(d.id, cur, d.desired_rollout_id, now))
    move_targets(s, dropped, ENGINE_ACTOR, "shadow_failed")


def rollback_targets(s: Session, models: ModelCache, r: Rollout, actor: str, msgs: Messages,
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
        prev = models.get(s, prev_id)
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
