"""Presence: a device is shown online only while it is heard from.

A device's last will (status ``offline``, retained) is the broker's word that its connection died, and it can be
lost on the way: a stock broker drops it when the fleet's queue is full, a broker that restarts publishes no will
for the connections it lost, the fleet misses it while it reconnects, and a retained ``online`` kept in a broker's
persistence (or on a cluster's core while the edge the device used died) goes on saying online. So the will is not
the only way offline:

- **The bound.** Each live telemetry record gives the device a staleness bound of ``intervals`` times its telemetry
  interval (the record's ``interval_s``), at least ``min_s`` (FleetConfig ``presence_intervals``, 3, and
  ``presence_min_s``, 30 s: an agent's default 10 s interval gives 30 s). A live message (a telemetry record, an
  ``online`` status) holds the device online until ``presence_until`` = now + its bound; this sweeper takes a device
  past it offline. A device that never sent telemetry has no bound: its will alone takes it offline, as before.
- **Retained copies are not signs of life.** A status the broker sends because the fleet subscribed (on connect,
  or the reconciler's read-back, fleet.reconcile) carries the retain flag; a retained ``online`` brings a device
  back online only while its bound has not passed (or it has none), and never extends it. A retained ``offline``
  (the will, when its live copy was dropped) takes it offline like the live one.
- **Telemetry brings back a device taken offline by the bound** (its presence had only lapsed: the fleet or the
  broker was behind), never one a status said was offline: a record still queued from before its will does not
  revive it.

The sweep skips while the fleet's own ingest is more than a batch behind, and counts a device as silent only once
the fleet has been connected to the broker for a whole bound of that device (after the fleet's own outage, its
devices get a bound's time to be heard again). Replicas share the database: any of them may sweep; each device's
row is locked in id order (the lock order of fleet.rollout.moves), skipping rows an ingest holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Table, select, update
from sqlalchemy.orm import Session, sessionmaker

from .db import Device

__all__ = ["PresenceSweeper", "bound_s"]

log = logging.getLogger("edgefleet.fleet.presence")

SWEEP_BATCH = 5000  # devices taken offline per sweep at most (the rest at the next)


def bound_s(interval_s: float, min_s: float, intervals: float) -> float:
    """A device's staleness bound from its telemetry interval."""
    return max(min_s, intervals * max(0.0, interval_s))


class PresenceSweeper:
    def __init__(self, sessions: sessionmaker[Session], connected_for: Callable[[], float],
                 backlog: Callable[[], int] | None = None, busy_above: int = 400):
        self.sessions = sessions
        self.connected_for = connected_for  # seconds the fleet has been connected to its broker without a break
        self.backlog = backlog  # messages received and not stored yet (IngestWorker.backlog)
        self.busy_above = busy_above
        self.expired = 0  # devices taken offline because their bound passed
        self.skipped_busy = 0  # sweeps skipped while the ingest was behind

    def sweep(self, now: float | None = None) -> int:
        """Take the devices whose bound has passed offline; returns how many."""
        if self.backlog is not None and self.backlog() > self.busy_above:
            self.skipped_busy += 1
            return 0
        connected = self.connected_for()
        if connected <= 0:
            return 0
        now = time.time() if now is None else now
        dev: Table = Device.__table__  # type: ignore[assignment]
        stale = (dev.c.online.is_(True), dev.c.presence_until < now, dev.c.presence_s <= connected)
        with self.sessions.begin() as s:
            ids = list(s.scalars(select(dev.c.id).where(*stale).order_by(dev.c.id).limit(SWEEP_BATCH)
                                 .with_for_update(skip_locked=True)))
            if not ids:
                return 0
            n = s.connection().execute(update(dev).where(dev.c.id.in_(ids), *stale).values(online=False)).rowcount
        self.expired += n
        log.info("%d devices not heard from within their bound are offline (%s%s)", n, ", ".join(ids[:5]),
                 " ..." if len(ids) > 5 else "")
        return n

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            try:
                self.sweep()
            except Exception:
                log.exception("presence sweep failed; trying again at the next one")
