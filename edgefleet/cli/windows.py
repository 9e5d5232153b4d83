"""``edgefleet windows list|set|delete``: the maintenance windows of device groups and devices, over the fleet's API
(``/api/v1/windows``, fleet/routes/windows.py) through ``fleet.client`` like the rollout commands, each exiting
through the CLI's one ``command`` path: 0 ok, 2 a window that is not one (the field named, checked here by the same
model the fleet and the agent read, protocol/window.py), 6 the fleet is unreachable or refused (a 404: the group or
device has no window to delete).
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import TYPE_CHECKING, Any

from edgefleet.cli.command import Formatter, UsageError, api_command
from edgefleet.protocol.exits import ExitCode
from edgefleet.protocol.window import DAYS, MAX_DURATION_MIN, UTC, MaintenanceWindow, next_window

if TYPE_CHECKING:
    from edgefleet.fleet.client import FleetClient
    from edgefleet.fleet.schemas import Window

__all__ = ["add_parsers", "parse_days"]

SCOPES = ("group", "device")

FORM = f"""A maintenance window recurs every week: on DAYS, from START (local time in TZ), for DURATION_MIN minutes.
A rollout's devices download its bundle at any time and install it only inside their window (a rollout
created with --urgent installs at once). A device's own window wins over its group's. Each device judges
the time on the fleet's signed time, not on its own clock alone.

  --days          {','.join(DAYS)}, comma-separated; a range such as mon-fri
                  (fri-mon wraps round the week's end); daily: every day
  --start         HH:MM, 00:00-23:59: the local time in --tz at which the window opens
  --duration-min  1-{MAX_DURATION_MIN:,} minutes (under a day), elapsed time: a window may run past midnight,
                  and one across a clock change lasts its minutes, not its wall-clock hours
  --tz            an IANA time zone (Europe/Berlin, America/New_York, UTC; default UTC), read through
                  zoneinfo: 01:00 Europe/Berlin opens at 01:00 there in winter and in summer. A start in
                  the hour a spring change skips opens at the instant it names before the change; one in
                  the hour an autumn change repeats opens at its first occurrence

  edgefleet windows set group stores --days mon-fri --start 01:00 --duration-min 120 --tz Europe/Berlin
  edgefleet windows set device edge-7 --days sat,sun --start 22:00 --duration-min 360
  edgefleet windows list
  edgefleet windows delete group stores"""


def parse_days(value: str) -> list[str]:
    """``mon,wed``, ``mon-fri`` (``fri-mon`` wraps round the week's end) or ``daily``, as the API's list of days."""
    out: list[str] = []
    for part in (p.strip().lower() for p in value.split(",")):
        if part == "daily":
            out += DAYS
        elif "-" in part:
            first, _, last = part.partition("-")
            if first not in DAYS or last not in DAYS:
                raise argparse.ArgumentTypeError(f"{part!r}: a range is two days of {', '.join(DAYS)}")
            i, j = DAYS.index(first), DAYS.index(last)
            out += [DAYS[(i + k) % 7] for k in range((j - i) % 7 + 1)]
        elif part:
            out.append(part)  # an unknown day is named by the window's own check
    if not out:
        raise argparse.ArgumentTypeError("no days given")
    return list(dict.fromkeys(out))  # mon-fri,fri: each day once


def _scope(a: argparse.Namespace) -> str:
    if a.scope not in SCOPES:
        raise UsageError(f"{a.scope!r} is not a scope: a window is a group's or a device's ({' or '.join(SCOPES)})")
    return str(a.scope)


def _window(a: argparse.Namespace) -> MaintenanceWindow:
    from pydantic import ValidationError

    try:
        return MaintenanceWindow(days=tuple(a.days), start=a.start, duration_min=a.duration_min, tz=a.tz)
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'window'}: {e['msg']}" for e in exc.errors())
        raise UsageError(f"not a maintenance window: {why}") from None


def _line(scope: str, name: str, w: MaintenanceWindow, now: dt.datetime) -> str:
    """One window as an operator reads it, with when it next opens (on this machine's clock) in its own zone."""
    from zoneinfo import ZoneInfo

    opens, closes = next_window(w, now)
    tz = ZoneInfo(w.tz)
    when = (f"open now, until {closes.astimezone(tz):%Y-%m-%d %H:%M %Z}" if opens <= now
            else f"next opens {opens.astimezone(tz):%Y-%m-%d %H:%M %Z}")
    return f"{scope:<6} {name:<24} {','.join(w.days)} {w.start} for {w.duration_min} min ({w.tz}); {when}"


def cmd_list(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
    rows: list[Window] = c.windows()
    now = dt.datetime.now(UTC)
    human = "\n".join(_line(r.scope, r.name, r.window, now) for r in rows)
    return rows, human or "no maintenance windows: every device installs as soon as its update arrives", ExitCode.OK


def cmd_set(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
    scope, w = _scope(a), _window(a)
    got = c.set_window(scope, a.name, w.model_dump(mode="json"))
    return got, "set: " + _line(got.scope, got.name, got.window, dt.datetime.now(UTC)), ExitCode.OK


def cmd_delete(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
    scope = _scope(a)
    c.delete_window(scope, a.name)
    doc = {"scope": scope, "name": a.name, "removed": True}
    fallback = " (its group's window, if it has one, applies now)" if scope == "device" else ""
    return doc, f"removed the maintenance window of {scope} {a.name}{fallback}", ExitCode.OK


def add_parsers(sub: Any) -> None:
    help_ = "maintenance windows: when a group's or a device's updates may install"
    wp = sub.add_parser("windows", help=help_, description=f"{help_}.\n\n{FORM}", formatter_class=Formatter)
    ws = wp.add_subparsers(dest="windows_cmd", required=True)

    def common(name: str, help_: str, fn: Any, form: bool = False) -> argparse.ArgumentParser:
        return api_command(ws.add_parser(name, formatter_class=Formatter, help=help_,
                                         description=f"{help_}.\n\n{FORM}" if form else help_), fn)

    common("list", "list every group's and device's window, with when it next opens", cmd_list)
    s = common("set", "give a group or a device its maintenance window (replacing the one it had)", cmd_set, True)
    s.add_argument("scope", metavar="{group,device}", help="whose window: a device group's, or one device's")
    s.add_argument("name", help="the group's name or the device's id")
    s.add_argument("--days", type=parse_days, required=True, help="e.g. mon-fri, sat,sun or daily")
    s.add_argument("--start", required=True, help="HH:MM, local time in --tz")
    s.add_argument("--duration-min", type=int, required=True, help=f"1-{MAX_DURATION_MIN:,} minutes")
    s.add_argument("--tz", default="UTC", help="IANA time zone")
    d = common("delete", "remove a group's or a device's maintenance window", cmd_delete)
    d.add_argument("scope", metavar="{group,device}", help="whose window: a device group's, or one device's")
    d.add_argument("name", help="the group's name or the device's id")
