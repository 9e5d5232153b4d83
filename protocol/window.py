"""Maintenance windows (issue 43.4): when a device may install an update. A window recurs on some days of the week
at a local start time, lasts ``duration_min`` minutes (1-1,430, as AWS IoT Jobs' recurring windows) and is read in
an IANA time zone through ``zoneinfo``, so a window at 01:00 Europe/Berlin opens at 01:00 local time in winter and in
summer. The fleet sends a device's window with its desired state; the agent downloads at once and installs only
inside it, on the time it trusts (agent/link/clock.py), not its own clock alone.

Time zone changes:
- a start in the hour a spring change skips (02:30 on 2026-03-29 in Berlin) is read with the offset before the
  change (it opens at 03:30 summer time: the same instant as 02:30 winter time);
- a start in the hour an autumn change repeats (02:30 on 2026-10-25 in Berlin) is its first occurrence;
- a window lasts ``duration_min`` elapsed minutes whatever the change does to the wall clock meanwhile.

A window opens at its start (inside) and closes at its end (outside). Plain functions over aware datetimes; every
loop is bounded by the 9 local days a window (under 24 h, one a week at least) can open on."""

from __future__ import annotations

import datetime as dt
import re
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator

from ._strict import StrictModel

__all__ = ["DAYS", "MAX_DURATION_MIN", "MaintenanceWindow", "next_window", "window_at"]

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # datetime.weekday() order
MAX_DURATION_MIN = 1430  # AWS IoT Jobs' bound: a window shorter than a day, so it never overlaps its next day's
_TZ_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_+-]{0,30}(/[A-Za-z0-9_+-]{1,30}){0,2}$")
_START_RE = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")
UTC = dt.timezone.utc


class MaintenanceWindow(StrictModel):
    """``days`` ("mon".."sun"), ``start`` ("HH:MM", local), ``duration_min`` (1-1,430), ``tz`` (IANA name)."""

    days: tuple[str, ...] = Field(min_length=1, max_length=7)
    start: str = Field(min_length=5, max_length=5)
    duration_min: int = Field(ge=1, le=MAX_DURATION_MIN)
    tz: str = Field(default="UTC", min_length=1, max_length=64)

    @field_validator("days")
    @classmethod
    def _days(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [d for d in v if d not in DAYS]
        if bad:
            raise ValueError(f"unknown days {bad[:3]}: days are {', '.join(DAYS)}")
        if len(set(v)) != len(v):
            raise ValueError("a day is named twice")
        return tuple(sorted(v, key=DAYS.index))

    @field_validator("start")
    @classmethod
    def _start(cls, v: str) -> str:
        if not _START_RE.match(v):
            raise ValueError(f"start {v!r} must be a local time HH:MM (00:00-23:59)")
        return v

    @field_validator("tz")
    @classmethod
    def _tz(cls, v: str) -> str:
        if not _TZ_RE.match(v) or ".." in v:
            raise ValueError(f"time zone {v[:64]!r} is not an IANA name like Europe/Berlin")
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
            raise ValueError(f"unknown time zone {v!r}") from exc
        return v

    def opening_on(self, day: dt.date) -> tuple[dt.datetime, dt.datetime] | None:
        """The window that opens on local date ``day`` as (open, close) in UTC, or None on a day it does not."""
        if DAYS[day.weekday()] not in self.days:
            return None
        h, m = int(self.start[:2]), int(self.start[3:])
        local = dt.datetime(day.year, day.month, day.day, h, m, tzinfo=ZoneInfo(self.tz))  # fold 0: see the module
        opens = local.astimezone(UTC)
        return opens, opens + dt.timedelta(minutes=self.duration_min)


def _aware(t: dt.datetime) -> dt.datetime:
    if t.tzinfo is None:
        raise ValueError("a maintenance window is judged on an aware datetime (UTC), not a naive one")
    return t.astimezone(UTC)


def window_at(w: MaintenanceWindow, t: dt.datetime) -> tuple[dt.datetime, dt.datetime] | None:
    """The window (open, close) that ``t`` is inside, or None when ``t`` is outside every window."""
    t = _aware(t)
    today = t.astimezone(ZoneInfo(w.tz)).date()
    for back in (1, 0):  # under 24 h long: a window holding t opened on t's local day or the day before
        span = w.opening_on(today - dt.timedelta(days=back))
        if span is not None and span[0] <= t < span[1]:
            return span
    return None


def next_window(w: MaintenanceWindow, t: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """The window ``t`` is inside, else the first to open after ``t``: (open, close) in UTC."""
    t = _aware(t)
    inside = window_at(w, t)
    if inside is not None:
        return inside
    today = t.astimezone(ZoneInfo(w.tz)).date()
    for ahead in range(0, 9):  # one day a week at least: an opening within 8 local days
        span = w.opening_on(today + dt.timedelta(days=ahead))
        if span is not None and span[0] > t:
            return span
    raise AssertionError("unreachable: a window names one day a week at least")
