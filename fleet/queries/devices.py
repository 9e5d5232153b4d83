"""The device registry's reads and writes: a device by id, pages of devices filtered in SQL, the models they are
sent, groups and counts, the telemetry stored; registrations, selector changes, decommissions. Each takes the
caller's session (the service holds the transaction); the rows are the ORM's (fleet.db.Device, Model) or the small
frozen records below."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Table, case, func, select
from sqlalchemy.orm import Session

from ..db import Device, Model, TelemetryRow

__all__ = ["DECOMMISSIONED", "Counts", "GroupRow", "decommission", "desired_models", "device", "enrolled",
           "filters", "group_rows", "in_order", "insert_new", "page", "register", "set_selectors", "telemetry",
           "telemetry_count"]

DECOMMISSIONED = "decommissioned"  # a device's last_state once decommissioned, until it enrolls again
_ONLINE = case((Device.online.is_(True), 1), else_=0)  # summed: how many are online


@dataclass(frozen=True)
class GroupRow:
    name: str
    devices: int
    online: int


@dataclass(frozen=True)
class Counts:
    """The whole fleet's devices, counted in the database; ``failing``: their last report failed or rolled back."""

    devices: int
    online: int
    failing: int
    telemetry_rows: int


# -- writes --------------------------------------------------------------------------------------------------
def device(s: Session, device_id: str) -> Device | None:
    return s.get(Device, device_id)


def register(s: Session, device_id: str, labels: dict[str, str] | None) -> Device:
    """The device, added if new; registered through the API either way, its labels replaced when given."""
    dev = s.get(Device, device_id)
    if dev is None:
        dev = Device(id=device_id, labels=labels or {}, registered_via="api")
        s.add(dev)
    else:
        dev.registered_via = "api"
        if labels is not None:
            dev.labels = labels
    return dev


def set_selectors(dev: Device, group: str | None, tags: list[str] | None, profile: str | None) -> None:
    """What a rollout selects a device by; None leaves one as it is, "" clears a group or a profile."""
    if group is not None:
        dev.group_name = group or None
    if tags is not None:
        dev.tags = sorted(set(tags))
    if profile is not None:
        dev.profile = profile or None


def insert_new(s: Session, items: list[dict[str, Any]]) -> int:
    """A batch registration (``items`` as DeviceService.register_devices takes them): the devices already known are
    updated, the others inserted in one statement; returns how many were new."""
    ids = {it["device_id"] for it in items}
    existing = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(ids)))} if ids else {}
    new = []
    for it in items:
        d = existing.get(it["device_id"])
        if d is None:
            new.append({"id": it["device_id"], "labels": it.get("labels") or {}, "registered_via": "api",
                        "group_name": it.get("group") or None, "tags": sorted(set(it.get("tags") or ())),
                        "profile": it.get("profile") or None})
            continue
        d.registered_via = "api"
        if it.get("labels") is not None:
            d.labels = it["labels"]
        set_selectors(d, it.get("group"), it.get("tags"), it.get("profile"))
    if new:
        dev: Table = Device.__table__  # type: ignore[assignment]
        s.execute(dev.insert(), new)
    return len(new)


def decommission(s: Session, device_id: str) -> Device | None:
    """Marked decommissioned and offline (sticky: its messages are dropped until it enrolls again); None: no such
    device."""
    dev = s.get(Device, device_id)
    if dev is not None:
        dev.online = False
        dev.last_state = DECOMMISSIONED
    return dev


def enrolled(s: Session, device_id: str) -> None:
    """A device that enrolls again is no longer decommissioned."""
    dev = s.get(Device, device_id)
    if dev is not None and dev.last_state == DECOMMISSIONED:
        dev.last_state = None


# -- reads ---------------------------------------------------------------------------------------------------
def desired_models(s: Session, devices: Iterable[Device]) -> dict[int, Model]:
    """The models the devices are sent, by id, in one query (the session's identity map holds its objects weakly:
    ``s.get`` per device went to the database for each of them, 50 queries a console page)."""
    ids = {d.desired_model_id for d in devices if d.desired_model_id}
    return {m.id: m for m in s.scalars(select(Model).where(Model.id.in_(ids)))} if ids else {}


def in_order(s: Session, device_ids: list[str] | None = None) -> list[Device]:
    """Every device by id, or those of ``device_ids``."""
    q = select(Device).order_by(Device.id)
    return list(s.scalars(q if device_ids is None else q.where(Device.id.in_(device_ids))))


def filters(group: str | None = None, state: str | None = None, q: str | None = None) -> list[ColumnElement[bool]]:
    """``group`` exactly, ``state`` a last report's state or ``online``/``offline`` (the connection), ``q`` a
    substring of the id."""
    where: list[ColumnElement[bool]] = []
    if group:
        where.append(Device.group_name == group)
    if state in ("online", "offline"):
        where.append(Device.online.is_(state == "online"))
    elif state:
        where.append(Device.last_state == state)
    if q:
        pattern = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        where.append(Device.id.like(f"%{pattern}%", escape="\\"))
    return where


def page(s: Session, where: list[ColumnElement[bool]], limit: int | None, offset: int,
         total: int | None) -> tuple[list[Device], int]:
    """One page of the devices that pass ``where``, by id, and how many pass in all (``total``, when the caller has
    just counted them). ``limit`` None: every match."""
    if total is None and where and limit is not None:
        # a filtered page: its ids and how many match from one pass over the matching devices (a count and
        # then the page scanned them twice, and the page's walk by id could read most of the table to find
        # a rare match); the page's rows are then read by id
        # (OFFSET 0 keeps the matching ids a subquery of their own: unfenced, PostgreSQL walked the whole
        # primary key in id order to filter it, several times slower than the group index and a sort)
        matching = select(Device.id).where(*where).offset(0).subquery()
        rows = s.execute(select(matching.c.id, func.count().over()).order_by(matching.c.id)
                         .offset(max(0, offset)).limit(max(0, limit))).all()
        if rows:
            found = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_([r[0] for r in rows])))}
            return [found[r[0]] for r in rows if r[0] in found], int(rows[0][1])
    if total is None:
        total = int(s.scalar(select(func.count()).select_from(Device).where(*where)) or 0)
    query = select(Device).where(*where).order_by(Device.id).offset(max(0, offset))
    if limit is not None:
        query = query.limit(max(0, limit))
    return list(s.scalars(query)), total


def group_rows(s: Session) -> list[GroupRow]:
    rows = s.execute(select(Device.group_name, func.count(), func.sum(_ONLINE))
                     .where(Device.group_name.is_not(None)).group_by(Device.group_name).order_by(Device.group_name))
    return [GroupRow(g, int(n), int(o or 0)) for g, n, o in rows]


def counts(s: Session, failing: bool = False, telemetry_rows: bool = False) -> Counts:
    """Devices and those online, and, where asked, those failing and the telemetry records stored (0 otherwise:
    each is one more pass)."""
    cols: list[Any] = [func.count(), func.sum(_ONLINE)]
    if failing:
        cols.append(func.sum(case((Device.last_state.in_(("failed", "rolled_back")), 1), else_=0)))
    total, online, *bad = s.execute(select(*cols).select_from(Device)).one()
    rows = int(s.scalar(select(func.count()).select_from(TelemetryRow)) or 0) if telemetry_rows else 0
    return Counts(int(total or 0), int(online or 0), int(bad[0] or 0) if bad else 0, rows)


def telemetry(s: Session, device_id: str, limit: int) -> list[dict[str, Any]]:
    """The device's newest telemetry records as stored, newest first (``limit`` 1 to 1000)."""
    rows = s.scalars(select(TelemetryRow).where(TelemetryRow.device_id == device_id)
                     .order_by(TelemetryRow.id.desc()).limit(max(1, min(limit, 1000))))
    return [r.payload for r in rows]


def telemetry_count(s: Session, device_id: str | None = None) -> int:
    q = select(func.count(TelemetryRow.id))
    if device_id:
        q = q.where(TelemetryRow.device_id == device_id)
    return int(s.scalar(q) or 0)
