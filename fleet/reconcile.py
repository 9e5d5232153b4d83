"""Reports the broker dropped are read back from its retained copies: a rollout never waits forever on one.

A device publishes each report at QoS 1 and retained, so the broker holds every device's latest report even
when it dropped the copy meant for the fleet (a stock Mosquitto queues at most ``max_queued_messages``, 1,000,
for a subscriber that is behind, and drops the rest silently). Every second this asks the broker again for the
retained reports of targets that have waited ``after_s`` or longer in a wave that is running (or that are being
rolled back), at most ``batch`` devices a tick, so that reading them back cannot overflow the same queue. What
comes back goes through the bridge and the ingest like any report (reports are idempotent: a target's state
and its wave's counters move once).

Status messages are read back the same way: a device's ``online`` status is retained too, and a burst of
devices connecting at once loses some of them on the same queue. With what a tick leaves of its ``batch``, the
reconciler walks the devices the fleet holds as offline (by id, a window a tick, a new walk at most every
``status_cycle_s``) and asks for their retained status: a device that is online is known as online after at most
one walk; one that is really offline answers with its retained will (or nothing) and stays offline, and is asked
again after ``after_s``, then twice that, ... up to ``STATUS_MAX_S`` (so a fleet with many devices off costs a
trickle, not a constant stream of rereads).

Neither is read back while its live stream flows: while more than ``batch`` live reports (statuses) arrived in the
last ``after_s`` (``intake``, the bridge's count of live messages), a report not here yet is most likely on its way
(queued in the broker, which forwards to the fleet in order), and reading it back would only send it twice and slow
the stream; once the stream slows, whatever is still missing is read back. A stream that never slows defers them at
most ``defer_max_s``. (A 20,000-device wave through the bridged cluster read back 8,255 reports, 6,625 of them
duplicates of reports still on their way, and a connect burst of 20,000 devices asked for 15,600 statuses a replica;
docs/scaling.md.) A target's wait is counted from when its desired state was sent (fleet.rollout.moves stamps it)
and from when this reconciler first saw it waiting, whichever is later: a wave's desired states go out after the
transaction that stamps them commits, which takes a while for a large wave.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from sqlalchemy import ColumnElement, Subquery, TextClause, or_, select, union_all
from sqlalchemy.orm import Session, sessionmaker

from .db import TARGET_ROLLING_BACK, TARGET_WAITING, Device, Rollout, RolloutTarget, RolloutWave
from .queries.devices import DECOMMISSIONED  # such a device's messages are dropped anyway

__all__ = ["Reconciler"]

log = logging.getLogger("edgefleet.fleet.reconcile")

RUNNING_WAVES = ("installing", "shadowing")
STATUS_MAX_S = 600.0  # a device held as offline has its retained status read at least this often
MAX_REMEMBERED = 200_000  # devices whose last reread is remembered (bounded memory at any fleet size)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Reconciler:
    def __init__(self, sessions: sessionmaker[Session], reread: Callable[[list[str]], object], after_s: float,
                 batch: int = 400, reread_status: Callable[[list[str]], object] | None = None,
                 status_cycle_s: float = 5.0, backlog: Callable[[], int] | None = None,
                 intake: Callable[[str], int] | None = None, defer_max_s: float = 60.0):
        self.sessions = sessions
        self.reread = reread  # asks the broker for these devices' retained reports (MqttBridge.reread_reported)
        self.reread_status = reread_status  # ... and their retained status (MqttBridge.reread_status); None: not
        self.after_s = after_s
        self.batch = batch
        self.status_cycle_s = status_cycle_s  # a walk over the offline devices starts at most this often
        self.requested = 0  # devices whose retained report was asked for again
        self.status_requested = 0  # devices whose retained status was asked for again
        # messages received and not yet stored (IngestWorker.backlog): while more than a batch wait, what looks
        # missing may only be queued here, and reading it back would add to the queue, not shorten it
        self.backlog = backlog
        self.skipped_busy = 0  # ticks skipped for that reason
        # live messages of a kind ("reported", "status") received so far (MqttBridge.received): while more than a batch
        # arrived in the last after_s, that kind is not read back (at most defer_max_s in a row)
        self.intake = intake
        self.defer_max_s = defer_max_s
        self.deferred = {"reported": 0, "status": 0}  # ticks that did not read a kind back because its stream flowed
        now = time.monotonic()
        self._seen: dict[str, deque[tuple[float, int]]] = {  # (monotonic time, intake then), from the start
            k: deque([(now, intake(k))] if intake is not None else []) for k in self.deferred}
        self._read_at = dict.fromkeys(self.deferred, now)  # when each kind was last free to be read back
        self._asked: dict[str, float] = {}  # device -> monotonic time it was last asked for
        self._status_after: str | None = None  # the walk's position (a device id); None: no walk under way
        self._status_walk_at = -1e18  # monotonic time the last walk started
        self._status_next: dict[str, tuple[float, float]] = {}  # device -> (monotonic time due again, pause)

    def stale_devices(self) -> list[str]:
        """Devices of targets that waited ``after_s`` or longer for a report, oldest first: those still waiting in a
        running wave of a rollout in progress, and those being rolled back in any rollout.

        Read as the running waves first, then the oldest ``4 x batch`` of each running wave's waiting targets and of
        the targets being rolled back (each an ordered range of a partial index, ``ix_rollout_targets_waiting`` and
        ``ix_rollout_targets_rolling_back``), merged in one statement: the same devices in the same order as one
        query over every target, at a cost that follows the batch and the running waves, not the fleet, the waves
        yet to come or the rollouts kept. (That one query, its wave and rollout filters in other tables and ORed with
        the rollback's, scanned every target: 17 ms a call at 50,000 devices on PostgreSQL; issue 44.)"""
        cutoff = _utcnow() - dt.timedelta(seconds=self.after_s)
        limit = self.batch * 4

        def oldest(*where: ColumnElement[bool] | TextClause) -> Subquery:
            return (select(RolloutTarget.updated_at, RolloutTarget.device_id)
                    .where(RolloutTarget.updated_at < cutoff, *where)
                    .order_by(RolloutTarget.updated_at).limit(limit).subquery())

        running = (select(RolloutWave.rollout_id, RolloutWave.idx)
                   .join(Rollout, Rollout.id == RolloutWave.rollout_id)
                   .where(Rollout.status == "in_progress", RolloutWave.state.in_(RUNNING_WAVES)))
        with self.sessions() as s:
            parts = [oldest(TARGET_ROLLING_BACK)]
            parts += [oldest(RolloutTarget.rollout_id == rid, RolloutTarget.wave == wave, TARGET_WAITING)
                      for rid, wave in s.execute(running).all()]
            merged = union_all(*(select(p.c.updated_at, p.c.device_id) for p in parts)).subquery()
            q = select(merged.c.device_id).order_by(merged.c.updated_at).limit(limit)
            return list(dict.fromkeys(s.scalars(q)))

    def offline_devices(self, after: str, limit: int) -> list[str]:
        """The next ``limit`` devices by id after ``after`` that the fleet holds as offline (decommissioned ones
        aside, and only those whose last message is ``after_s`` old or older, so a walk does not chase a device
        that has just said something)."""
        cutoff = _utcnow() - dt.timedelta(seconds=self.after_s)
        q = (select(Device.id)
             .where(Device.id > after, Device.online.is_(False),
                    or_(Device.last_state.is_(None), Device.last_state != DECOMMISSIONED),
                    or_(Device.last_seen.is_(None), Device.last_seen < cutoff))
             .order_by(Device.id).limit(limit))
        with self.sessions() as s:
            return list(s.scalars(q))

    def status_tick(self, budget: int) -> int:
        """Ask for the retained status of the next ``budget`` offline devices of the walk; returns how many."""
        if self.reread_status is None or budget <= 0:
            return 0
        now = time.monotonic()
        if self._status_after is None:
            if now - self._status_walk_at < self.status_cycle_s:
                return 0
            self._status_after, self._status_walk_at = "", now
        window = self.offline_devices(self._status_after, budget * 4)
        self._status_after = window[-1] if len(window) == budget * 4 else None  # a short window: the walk is over
        due = []
        for d in window:
            at, pause = self._status_next.get(d, (-1e18, self.after_s / 2))
            if now >= at:
                due.append(d)
                # paused longer each time it stays offline; after a long quiet spell (it was online meanwhile)
                # it starts over from after_s
                pause = self.after_s if now - at > 2 * STATUS_MAX_S else min(pause * 2, STATUS_MAX_S)
                self._status_next[d] = (now + pause, pause)
                if len(due) == budget:
                    self._status_after = d
                    break
        if len(self._status_next) > MAX_REMEMBERED:  # forget the oldest
            for d in sorted(self._status_next, key=lambda k: self._status_next[k][0])[:MAX_REMEMBERED // 2]:
                del self._status_next[d]
        if not due:
            return 0
        self.reread_status(due)
        self.status_requested += len(due)
        log.info("asked the broker again for the retained status of %d devices held as offline", len(due))
        return len(due)

    def flowing(self, kind: str, now: float) -> bool:
        """More than ``batch`` live messages of ``kind`` arrived in the last ``after_s`` (and it was last free to be
        read back less than ``defer_max_s`` ago): it is not read back this tick."""
        if self.intake is None:
            return False
        seen = self._seen[kind]
        count = self.intake(kind)
        seen.append((now, count))
        while len(seen) > 1 and seen[1][0] <= now - self.after_s:  # keep one sample at or before the window's start
            seen.popleft()
        if count - seen[0][1] > self.batch and now - self._read_at[kind] < self.defer_max_s:
            self.deferred[kind] += 1
            return True
        self._read_at[kind] = now
        return False

    def tick(self) -> int:
        """Reports first (a rollout waits on them), then statuses with what is left of ``batch``; nothing while the
        fleet's own ingest is more than a batch behind, and neither kind while its live stream flows."""
        if self.backlog is not None and self.backlog() > self.batch:
            self.skipped_busy += 1
            return 0
        now = time.monotonic()
        reports_flow, statuses_flow = self.flowing("reported", now), self.flowing("status", now)
        due: list[str] = []
        for d in [] if reports_flow else self.stale_devices():
            at = self._asked.get(d)
            if at is None:  # first seen waiting: its wait is counted from here (its desired state may only now be out)
                self._asked[d] = now
            elif now - at >= self.after_s and len(due) < self.batch:
                due.append(d)
        if len(due) < self.batch and not statuses_flow:
            self.status_tick(self.batch - len(due))
        if not due:
            return 0
        for d in due:
            self._asked[d] = now
        if len(self._asked) > 100_000:  # forget the oldest: bounded memory at any fleet size
            for d in sorted(self._asked, key=self._asked.__getitem__)[:50_000]:
                del self._asked[d]
        self.reread(due)
        self.requested += len(due)
        log.info("asked the broker again for the retained reports of %d devices still pending after %.0fs",
                 len(due), self.after_s)
        return len(due)

    def run(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        """Tick every ``interval_s``: at most ``batch`` devices a tick are asked again (each at most once per
        ``after_s``), few enough for a stock broker's queue (1,000 messages), many enough to catch up with a large
        wave (800 a second: a 10,000-device wave that lost half its reports catches up in ~6 s, not 25)."""
        while not stop.wait(interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("report reconciliation failed; trying again at the next tick")
