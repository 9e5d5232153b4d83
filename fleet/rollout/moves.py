"""The only ways a wave's or a target's state changes: ``move_wave`` and ``move_targets`` refuse a transition
fleet.states does not list (``Conflict``) and write the audit rows in the same transaction. The row locks they rely on
(``lock_rows``, in the one lock order: see fleet.rollout) are fleet.rollout.queries', re-exported here."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, bindparam, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from edgefleet.fleet.audit import ENGINE_ACTOR, audit
from edgefleet.fleet.db import RolloutTarget, RolloutWave, utcnow
from edgefleet.fleet.errors import Conflict
from edgefleet.fleet.rollout.queries import lock_rows, lock_wave_rows
from edgefleet.fleet.states import (
    TARGET_TRANSITIONS,
    WAVE_TRANSITIONS,
    TargetState,
    WaveState,
)

__all__ = ["AUDIT_DEVICES_PER_ROW", "AUDIT_ERROR_CHARS", "WAVE_ACTIONS", "TargetMove", "lock_rows", "lock_wave_rows",
           "move_targets", "move_wave"]

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
