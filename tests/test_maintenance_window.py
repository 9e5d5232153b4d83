"""Maintenance windows as plain functions (protocol/window.py, issue 43.4): inside a window or not, and the next
opening, across a window's edges, midnight, a week's end and both of Europe/Berlin's 2026 clock changes."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from edgefleet.protocol.window import MaintenanceWindow, next_window, window_at

UTC = dt.timezone.utc


def at(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s).replace(tzinfo=UTC)


def W(days: str, start: str, minutes: int, tz: str = "Europe/Berlin") -> MaintenanceWindow:
    return MaintenanceWindow(days=tuple(days.split(",")), start=start, duration_min=minutes, tz=tz)


NIGHTLY = W("mon,tue,wed,thu,fri,sat,sun", "01:00", 120)


def test_a_window_opens_at_its_start_and_closes_at_its_end():
    # 2026-01-14 (winter, UTC+1): 01:00-03:00 local is 00:00-02:00 UTC
    assert window_at(NIGHTLY, at("2026-01-13T23:59:59")) is None
    assert window_at(NIGHTLY, at("2026-01-14T00:00:00")) == (at("2026-01-14T00:00"), at("2026-01-14T02:00"))
    assert window_at(NIGHTLY, at("2026-01-14T01:59:59")) is not None
    assert window_at(NIGHTLY, at("2026-01-14T02:00:00")) is None
    assert next_window(NIGHTLY, at("2026-01-14T02:00")) == (at("2026-01-15T00:00"), at("2026-01-15T02:00"))
    # in summer (UTC+2) the same local hours are an hour earlier in UTC
    assert window_at(NIGHTLY, at("2026-07-01T23:00")) == (at("2026-07-01T23:00"), at("2026-07-02T01:00"))
    assert window_at(NIGHTLY, at("2026-07-02T01:00")) is None


def test_the_spring_change_berlin_2026_03_29():
    # 01:00 CET opens at 00:00 UTC; at 02:00 CET the clock jumps to 03:00 CEST; 120 elapsed minutes end at 02:00 UTC
    assert window_at(NIGHTLY, at("2026-03-29T00:00")) == (at("2026-03-29T00:00"), at("2026-03-29T02:00"))
    assert window_at(NIGHTLY, at("2026-03-29T01:59:59")) is not None
    assert window_at(NIGHTLY, at("2026-03-29T02:00")) is None
    # the next night is summer time: 01:00 CEST is 23:00 UTC
    assert next_window(NIGHTLY, at("2026-03-29T02:00")) == (at("2026-03-29T23:00"), at("2026-03-30T01:00"))
    assert window_at(NIGHTLY, at("2026-03-29T22:59:59")) is None
    # a start in the skipped hour (02:30 local does not exist that day) opens at the instant 02:30 CET would be
    skipped = W("sun", "02:30", 30)
    assert next_window(skipped, at("2026-03-28T12:00")) == (at("2026-03-29T01:30"), at("2026-03-29T02:00"))
    assert window_at(skipped, at("2026-03-29T01:29:59")) is None


def test_the_autumn_change_berlin_2026_10_25():
    # 02:30 happens twice (CEST, then CET): the window opens at the first, 00:30 UTC, for 60 elapsed minutes
    twice = W("sat,sun,mon", "02:30", 60)
    assert next_window(twice, at("2026-10-24T12:00")) == (at("2026-10-25T00:30"), at("2026-10-25T01:30"))
    assert window_at(twice, at("2026-10-25T01:29:59")) is not None
    assert window_at(twice, at("2026-10-25T01:30")) is None  # 02:30 CET, the second time: the window is over
    assert next_window(twice, at("2026-10-25T01:30")) == (at("2026-10-26T01:30"), at("2026-10-26T02:30"))
    # across the change: 01:00 CEST for 180 minutes ends at 02:00 UTC (03:00 CET), not 04:00 on the wall
    long = W("sun", "01:00", 180)
    assert window_at(long, at("2026-10-24T23:00")) == (at("2026-10-24T23:00"), at("2026-10-25T02:00"))
    assert window_at(long, at("2026-10-25T02:00")) is None


def test_a_window_past_midnight_and_the_weeks_end():
    # Saturday 22:00 UTC for 6 h: inside on Sunday 03:59, and the next one a week later
    sat = W("sat", "22:00", 360, tz="UTC")
    assert window_at(sat, at("2026-01-18T03:59")) == (at("2026-01-17T22:00"), at("2026-01-18T04:00"))
    assert window_at(sat, at("2026-01-18T04:00")) is None
    assert next_window(sat, at("2026-01-18T04:00")) == (at("2026-01-24T22:00"), at("2026-01-25T04:00"))
    assert window_at(sat, at("2026-01-16T23:00")) is None  # Friday night is not Saturday night


def test_a_naive_time_is_refused():
    with pytest.raises(ValueError, match="aware"):
        window_at(NIGHTLY, dt.datetime(2026, 1, 1))


@pytest.mark.parametrize("bad, field", [
    ({"days": ("mon",), "start": "01:00", "duration_min": 0}, "duration_min"),
    ({"days": ("mon",), "start": "01:00", "duration_min": 1431}, "duration_min"),
    ({"days": (), "start": "01:00", "duration_min": 60}, "days"),
    ({"days": ("mon", "mon"), "start": "01:00", "duration_min": 60}, "named twice"),
    ({"days": ("monday",), "start": "01:00", "duration_min": 60}, "unknown days"),
    ({"days": ("mon",), "start": "24:00", "duration_min": 60}, "HH:MM"),
    ({"days": ("mon",), "start": "01:00", "duration_min": 60, "tz": "Mars/Olympus"}, "unknown time zone"),
    ({"days": ("mon",), "start": "01:00", "duration_min": 60, "tz": "../../etc/passwd"}, "IANA"),
    ({"days": ("mon",), "start": "01:00", "duration_min": 60, "every": "day"}, "every"),
])
def test_a_bad_window_is_refused_naming_what_is_wrong(bad, field):
    with pytest.raises(ValidationError, match=field):
        MaintenanceWindow(**bad)
