"""Maintenance windows of device groups and devices (issue 43.4): stored as protocol.window.MaintenanceWindow JSON
(fleet.db.WindowRow), a device's own winning over its group's. A rollout's desired state carries the device's window
unless the rollout is urgent (fleet.rollout.moves); the agent downloads at once and installs inside it. ``waiting``
says, on the fleet's clock, which devices are outside their window now and when it next opens (the console)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, Literal

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from ..protocol import mqtt as proto
from ..protocol.window import MaintenanceWindow, next_window
from .audit import audit
from .db import Device, WindowRow, utcnow
from .errors import BadRequest, NotFound

__all__ = ["Scope", "effective", "list_windows", "next_opening", "set_window"]

Scope = Literal["group", "device"]


def set_window(s: Session, scope: Scope, name: str, window: MaintenanceWindow | None, actor: str) -> None:
    """Give a group or a device its window (None: remove it; NotFound when it has none), audited."""
    if scope == "device" and proto.device_id_problem(name) is not None:
        raise BadRequest(proto.device_id_problem(name) or "", 422)
    if not 1 <= len(name) <= 64:
        raise BadRequest(f"a {scope} name is 1-64 characters", 422)
    row = s.get(WindowRow, (scope, name))
    if window is None:
        if row is None:
            raise NotFound(f"{scope} {name!r} has no maintenance window")
        s.delete(row)
    elif row is None:
        s.add(WindowRow(scope=scope, name=name, window=window.model_dump(mode="json"), updated_at=utcnow()))
    else:
        row.window, row.updated_at = window.model_dump(mode="json"), utcnow()
    audit(s, actor, "window_set" if window is not None else "window_removed", device_id=name if scope == "device"
          else None, scope=scope, name=name, window=window.model_dump(mode="json") if window else None)


def list_windows(s: Session) -> list[dict[str, Any]]:
    return [{"scope": r.scope, "name": r.name, "window": r.window}
            for r in s.scalars(select(WindowRow).order_by(WindowRow.scope, WindowRow.name))]


# (scope, name) pairs in one IN list: PostgreSQL parses one such list recursively, and 20,000 pairs overflowed its stack
# ('stack depth limit exceeded', max_stack_depth 2 MB), so a wave of that many devices was never started
KEYS_PER_QUERY = 1000


def effective(s: Session, devices: Iterable[Device]) -> dict[str, MaintenanceWindow]:
    """The window of each device that has one (its own, else its group's), in a query per KEYS_PER_QUERY devices
    and groups."""
    devs = list(devices)
    keys = {("device", d.id) for d in devs} | {("group", d.group_name) for d in devs if d.group_name}
    if not keys:
        return {}
    ordered = sorted(keys)
    rows = {(r.scope, r.name): MaintenanceWindow.model_validate(r.window)
            for i in range(0, len(ordered), KEYS_PER_QUERY)
            for r in s.scalars(select(WindowRow).where(
                tuple_(WindowRow.scope, WindowRow.name).in_(ordered[i:i + KEYS_PER_QUERY])))}
    found: dict[str, MaintenanceWindow] = {}
    for d in devs:
        w = rows.get(("device", d.id)) or (rows.get(("group", d.group_name)) if d.group_name else None)
        if w is not None:
            found[d.id] = w
    return found


def next_opening(w: MaintenanceWindow | None, now: dt.datetime) -> tuple[bool, dt.datetime | None]:
    """(inside a window now, when the next one opens: None when inside or with no window), on the fleet's clock."""
    if w is None:
        return True, None
    opens, _ = next_window(w, now)
    return (True, None) if opens <= now else (False, opens)
