"""What the ingest reads and writes for a batch of device messages (fleet.service.ingest decides what to store):
the devices heard of, statuses, the reports' ordering and their rows, self-tests, telemetry records and the devices
they touch. Each costs a fixed number of statements whatever the batch's size (executemany updates by primary key,
no recount) and takes its rows in the lock order (fleet.rollout.lock_rows): rollouts, then devices by id."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Float, Table, and_, bindparam, case, or_, select, true, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ..db import Device, Model, RolloutTarget, TelemetryRow
from ..rollout.queries import lock_rows
from .devices import DECOMMISSIONED

__all__ = ["add_heard", "build_sent", "decommissioned", "existing", "insert_telemetry", "last_records",
           "lock_report_ts", "set_details", "set_presence", "set_reports", "set_selftest", "touch"]

_DEV: Table = Device.__table__  # type: ignore[assignment]
_TEL: Table = TelemetryRow.__table__  # type: ignore[assignment]
_TGT: Table = RolloutTarget.__table__  # type: ignore[assignment]
_BY_ID = update(_DEV).where(_DEV.c.id == bindparam("b_id"))  # executemany: each row's ``b_id``


def _insert(s: Session, table: Table) -> Any:
    return sqlite_insert(table) if s.get_bind().dialect.name == "sqlite" else pg_insert(table)


# -- the devices heard of --------------------------------------------------------------------------------------
def existing(s: Session, ids: Iterable[str]) -> set[str]:
    return set(s.scalars(select(_DEV.c.id).where(_DEV.c.id.in_(ids))))


def add_heard(s: Session, ids: list[str]) -> None:
    """Devices heard on MQTT before anyone registered them (registered_via "mqtt"); one a replica added at the same
    moment is skipped."""
    s.execute(_insert(s, _DEV).on_conflict_do_nothing(index_elements=["id"]),
              [{"id": d, "labels": {}, "registered_via": "mqtt"} for d in ids])


def decommissioned(s: Session, ids: Iterable[str]) -> set[str]:
    return set(s.scalars(select(Device.id).where(Device.id.in_(ids), Device.last_state == DECOMMISSIONED)))


# -- statuses ------------------------------------------------------------------------------------------------
def set_presence(s: Session, ups: list[dict[str, Any]], downs: list[dict[str, Any]], retained: bool,
                 now: dt.datetime) -> None:
    """Devices online (``ups``) and offline (``downs``), rows of ``b_id`` in id order. ``retained``: the broker's
    copies, not signs of life: an ``online`` counts only while the device's presence bound has not passed and
    extends nothing. Live: heard from now, online for its bound (none known: until its will)."""
    lock_rows(s, devices=[u["b_id"] for u in ups + downs])  # one statement per state below: the rows in id order
    if retained:
        if ups:
            fresh = or_(_DEV.c.presence_until.is_(None), _DEV.c.presence_until >= time.time())
            s.connection().execute(_BY_ID.where(fresh).values(online=True), ups)
        if downs:
            s.connection().execute(_BY_ID.values(online=False, presence_until=None), downs)
    else:
        if ups:
            t = time.time()
            s.connection().execute(_BY_ID.values(online=True, last_seen=now, presence_until=bindparam(
                "b_t", type_=Float) + _DEV.c.presence_s), [{**u, "b_t": t} for u in ups])
        if downs:
            s.connection().execute(_BY_ID.values(online=False, last_seen=now, presence_until=None), downs)


def set_details(s: Session, groups: Iterable[list[dict[str, Any]]]) -> None:
    """What statuses said of the devices (agent version, URL, hardware, profile): each group's rows set the same
    columns (one executemany each)."""
    for group in groups:
        s.connection().execute(_BY_ID, group)


# -- reports -------------------------------------------------------------------------------------------------
def lock_report_ts(s: Session, device_ids: set[str], rollout_ids: Sequence[int]) -> dict[str, float | None]:
    """Each device's newest stored report ``ts``, its row locked (the rollouts reported on first, shared: the driver's
    moves wait), so replicas order one device's reports alike."""
    lock_rows(s, rollouts=rollout_ids, rollouts_shared=True)
    return {i: ts for i, ts in s.execute(select(_DEV.c.id, _DEV.c.last_report_ts).where(_DEV.c.id.in_(device_ids))
                                         .order_by(_DEV.c.id).with_for_update())}


def set_reports(s: Session, rows: list[dict[str, Any]]) -> None:
    s.connection().execute(_BY_ID, rows)


def set_selftest(s: Session, device_id: str, doc: dict[str, Any]) -> None:
    s.connection().execute(update(_DEV).where(_DEV.c.id == device_id).values(selftest=doc))


def build_sent(s: Session, rollout_id: int | None, device_id: str) -> Model | None:
    """The build the device's target in that rollout was sent, if any."""
    t = s.get(RolloutTarget, (rollout_id, device_id)) if rollout_id is not None else None
    return s.get(Model, t.model_id) if t is not None and t.model_id is not None else None


# -- telemetry -----------------------------------------------------------------------------------------------
def insert_telemetry(s: Session, rows: list[dict[str, Any]]) -> set[tuple[str, str, int]]:
    """Records by (device, stream, seq); those stored before (a resend, or another replica's) are skipped by the
    insert. Returns the keys of the new ones (RETURNING; multi-row INSERTs: a statement per few hundred records)."""
    stmt = _insert(s, _TEL).on_conflict_do_nothing(index_elements=["device_id", "stream", "seq"]).returning(
        _TEL.c.device_id, _TEL.c.stream, _TEL.c.seq)
    return {(r[0], r[1], r[2]) for r in s.connection().execute(stmt, rows)}


def last_records(s: Session, devices: set[str]) -> Sequence[Any]:
    """Per device: id, the stream and seq of its last record (not its whole JSON), its desired rollout and the wave of
    its target there (fleet.series), in one read."""
    last_tel = _DEV.c.last_telemetry
    return s.execute(select(_DEV.c.id, last_tel["stream"].as_string(), last_tel["seq"].as_integer(),
                            _DEV.c.desired_rollout_id, _TGT.c.wave)
                     .select_from(_DEV.outerjoin(_TGT, and_(_TGT.c.rollout_id == _DEV.c.desired_rollout_id,
                                                            _TGT.c.device_id == _DEV.c.id)))
                     .where(_DEV.c.id.in_(devices))).all()


def touch(s: Session, rows: list[dict[str, Any]], presence: bool) -> None:
    """The devices heard from (rows of ``b_id`` in id order, ``last_seen``, a newer ``last_telemetry``); with
    ``presence``, each row's bound too (``b_ps`` seconds, until ``b_pu``): a device a status said was offline stays so
    (a record still queued from before its will revives nothing), one taken offline by its bound is back."""
    by_id = _BY_ID
    if presence:
        revive = or_(_DEV.c.online.is_(True), _DEV.c.presence_until.is_not(None))
        by_id = by_id.values(presence_s=bindparam("b_ps", type_=Float),
                             presence_until=case((revive, bindparam("b_pu", type_=Float)),
                                                 else_=_DEV.c.presence_until),
                             online=case((revive, true()), else_=_DEV.c.online))
    with_tel = [r for r in rows if "last_telemetry" in r]
    without = [r for r in rows if "last_telemetry" not in r]
    for group in (with_tel, without):
        if group:
            s.connection().execute(by_id, group)
