"""Installs wait for the device's maintenance window (issue 43.4): a desired state with an ``install_window``
(protocol.window) is downloaded at once, then installed only once the time the box trusts (agent/link/clock.py: the
fleet's signed time carried on the monotonic clock, not the box's clock alone) is inside the window. A window that
closes mid-install does not stop that install: only its start waits."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable

from ...protocol.window import MaintenanceWindow, next_window

__all__ = ["POLL_S", "wait_for_window"]

log = logging.getLogger("edgefleet.agent")

POLL_S = 1.0  # the trusted time is read again at least this often while waiting (a clock set meanwhile is seen)
MAX_WAIT_S = 8 * 86400.0  # a window opens within 8 days (one day a week at least); the wait's bound


def wait_for_window(window: MaintenanceWindow, now: Callable[[], dt.datetime], stop: threading.Event,
                    superseded: Callable[[], bool], poll_s: float = POLL_S) -> bool:
    """Return True once ``now()`` is inside ``window``; False when stopping or a newer desired state arrived."""
    said = None
    for _ in range(int(MAX_WAIT_S / poll_s) + 1):
        t = now()
        opens, closes = next_window(window, t)
        if opens <= t < closes:
            if said is not None:
                log.info("maintenance window open (until %s): installing", closes.isoformat())
            return True
        if said != opens:
            log.info("downloaded; the install waits for the maintenance window opening at %s (trusted time %s)",
                     opens.isoformat(), t.isoformat())
            said = opens
        if stop.wait(min(poll_s, max(0.0, (opens - t).total_seconds()))) or superseded():
            return False
    return False
