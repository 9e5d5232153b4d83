"""The time the agent trusts for TUF's expiry checks, when its own clock may be wrong.

A box without a real-time clock (a Raspberry Pi) believes, until NTP answers, the time it last saved; an RTC or
NTP set up wrong is common in the field. Its local clock alone would make it refuse every update when it runs
days ahead (the timestamp metadata lives a day) and accept long-expired metadata when it runs behind (the
freeze protection expiry gives is gone). So the agent trusts, in this order:

1. the fleet's signed time (protocol/signed_time.py), verified with the trusted root and a nonce of its own,
   carried forward on the monotonic clock since it was verified;
2. never earlier than ``floor``: the newest signed time it ever verified, kept on disk across restarts;
3. the local clock only within ``tolerance_s`` of those (it is finer; it may be ahead of an old floor).

``reading()`` gives the trusted time and how far the local clock is from it (``skew_s``, None when nothing
better than the local clock is known); the agent reports the skew in telemetry. ``TrustedClock`` does no I/O:
``load_floor``/``save_floor`` keep the floor in a file.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...protocol.fsutil import atomic_write

__all__ = ["ClockReading", "TrustedClock", "load_floor", "save_floor"]

UTC = dt.timezone.utc


@dataclass(frozen=True)
class ClockReading:
    trusted: dt.datetime  # what TUF's expiry checks use
    source: str  # "signed" (the fleet's, this run), "floor" (the newest ever verified), or "local"
    skew_s: float | None  # local clock minus the trusted time; None when only the local clock is known


class TrustedClock:
    def __init__(self, floor: dt.datetime | None = None, tolerance_s: float = 300.0,
                 wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic):
        self.floor = floor
        self.tolerance_s = tolerance_s
        self._wall, self._mono = wall, monotonic
        self._signed: tuple[dt.datetime, float] | None = None  # (verified signed time, monotonic then)

    def observe_signed(self, when: dt.datetime) -> None:
        """A signed time just verified: the anchor from now on, and the floor if it is newer."""
        self._signed = (when, self._mono())
        if self.floor is None or when > self.floor:
            self.floor = when

    def reading(self) -> ClockReading:
        local = dt.datetime.fromtimestamp(self._wall(), UTC)
        floor = self.floor
        if self._signed is not None:
            when, at = self._signed
            anchor = when + dt.timedelta(seconds=max(0.0, self._mono() - at))
            skew = (local - anchor).total_seconds()
            trusted = max(anchor, floor) if floor is not None else anchor
            if abs(skew) <= self.tolerance_s:
                trusted = max(trusted, local)
            return ClockReading(trusted, "signed", skew)
        if floor is not None:
            if local >= floor - dt.timedelta(seconds=self.tolerance_s):
                return ClockReading(max(local, floor), "local", None)
            return ClockReading(floor, "floor", (local - floor).total_seconds())
        return ClockReading(local, "local", None)


def load_floor(path: Path) -> dt.datetime | None:
    """The floor kept in ``path``; None when there is none or it is unreadable (a fresh box, a torn file)."""
    try:
        doc = json.loads(path.read_bytes()[:4096])
        return dt.datetime.fromtimestamp(float(doc["floor_unix_s"]), UTC)
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None


def save_floor(path: Path, floor: dt.datetime) -> None:
    atomic_write(path, json.dumps({"floor_unix_s": floor.timestamp(),
                                   "floor": floor.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode())
