"""Reports the broker dropped are read back from its retained copies: a rollout never waits forever on one.

A device publishes each report at QoS 1 and retained, so the broker holds every device's latest report even
when it dropped the copy meant for the fleet (a stock Mosquitto queues at most ``max_queued_messages``, 1,000,
for a subscriber that is behind, and drops the rest silently). Every second this asks the broker again for the
retained reports of targets that have waited ``after_s`` or longer in a wave that is running (or that are being
rolled back), at most ``batch`` devices a tick, so that reading them back cannot overflow the same queue. What
comes back goes through the bridge and the ingest like any report (reports are idempotent: a target's state
and its wave's counters move once).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session, sessionmaker

from edgefleet.fleet.db import Rollout, RolloutTarget, RolloutWave

__all__ = ["Reconciler"]

log = logging.getLogger("edgefleet.fleet.reconcile")

WAITING = ("pending", "downloading", "installing")  # a target whose desired state is out and unanswered
RUNNING_WAVES = ("installing", "shadowing")


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Reconciler:
    def __init__(self, sessions: sessionmaker[Session], reread: Callable[[list[str]], object], after_s: float,
                 batch: int = 200):
        self.sessions = sessions
        self.reread = reread  # asks the broker for these devices' retained reports (MqttBridge.reread_reported)
        self.after_s = after_s
        self.batch = batch
        self.requested = 0  # devices whose retained report was asked for again
        self._asked: dict[str, float] = {}  # device -> monotonic time it was last asked for

    def stale_devices(self) -> list[str]:
        """Devices of targets that waited ``after_s`` or longer for a report, oldest first."""
        cutoff = _utcnow() - dt.timedelta(seconds=self.after_s)
        q = (select(RolloutTarget.device_id)
             .join(Rollout, Rollout.id == RolloutTarget.rollout_id)
             .join(RolloutWave, and_(RolloutWave.rollout_id == RolloutTarget.rollout_id,
                                     RolloutWave.idx == RolloutTarget.wave))
             .where(RolloutTarget.updated_at < cutoff,
                    or_(and_(Rollout.status == "in_progress", RolloutWave.state.in_(RUNNING_WAVES),
                             RolloutTarget.state.in_(WAITING)),
                        RolloutTarget.state == "rolling_back"))
             .order_by(RolloutTarget.updated_at)
             .limit(self.batch * 4))
        with self.sessions() as s:
            return list(dict.fromkeys(s.scalars(q)))

    def tick(self) -> int:
        now = time.monotonic()
        due = [d for d in self.stale_devices() if now - self._asked.get(d, -1e18) >= self.after_s][:self.batch]
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

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Tick every ``interval_s``: at most ``batch`` devices a second are asked again (each at most once per
        ``after_s``), few enough for a stock broker's queue, many enough to catch up with a large wave."""
        while not stop.wait(interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("report reconciliation failed; trying again at the next tick")
