"""Fleet state in SQL (SQLite by default, PostgreSQL for several replicas), through SQLAlchemy 2."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from protocol.errors import ConfigError

__all__ = ["Base", "Device", "Model", "Rollout", "RolloutTarget", "TelemetryRow", "make_engine", "utcnow"]

log = logging.getLogger("edgefleet.fleet.db")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Device(Base):
    __tablename__ = "devices"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    registered_via: Mapped[str] = mapped_column(String(16))  # "api" or "mqtt" (seen before registration)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    online: Mapped[bool] = mapped_column(default=False)
    last_seen: Mapped[dt.datetime | None] = mapped_column(default=None)
    agent_version: Mapped[str | None] = mapped_column(String(32), default=None)
    inference_url: Mapped[str | None] = mapped_column(String(256), default=None)
    running_model: Mapped[str | None] = mapped_column(String(64), default=None)
    running_version: Mapped[str | None] = mapped_column(String(32), default=None)
    last_state: Mapped[str | None] = mapped_column(String(32), default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    desired_model_id: Mapped[int | None] = mapped_column(ForeignKey("models.id"), default=None)
    desired_rollout_id: Mapped[int | None] = mapped_column(Integer, default=None)
    last_telemetry: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)  # newest by seq
    # schema 2: what the device's CPU can do (CPUID, from its status message) and the self-test its
    # last install measured on that CPU, next to the compile-time figures
    hardware: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    selftest: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("name", "version", "profile"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(32))
    profile: Mapped[str] = mapped_column(String(64))
    backend: Mapped[str] = mapped_column(String(32))
    precision: Mapped[str] = mapped_column(String(8))
    target_path: Mapped[str] = mapped_column(String(256))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(Integer)
    accuracy: Mapped[float] = mapped_column(Float)
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON)
    uploaded_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Rollout(Base):
    __tablename__ = "rollouts"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    status: Mapped[str] = mapped_column(String(16), default="in_progress")  # in_progress|succeeded|failed
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class RolloutTarget(Base):
    __tablename__ = "rollout_targets"
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id"), primary_key=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id"), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    error: Mapped[str | None] = mapped_column(Text, default=None)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class TelemetryRow(Base):
    __tablename__ = "telemetry"
    __table_args__ = (UniqueConstraint("device_id", "stream", "seq", name="uq_telemetry_record"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    device_id: Mapped[str] = mapped_column(String(64), index=True)
    stream: Mapped[str] = mapped_column(String(16))
    seq: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[float] = mapped_column(Float)
    received_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)


SCHEMA_VERSION = 2  # bump with any change to the tables above, and add the step to MIGRATIONS

# from version N to N+1: plain DDL that keeps every row (SQLite and PostgreSQL alike)
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("ALTER TABLE devices ADD COLUMN hardware JSON", "ALTER TABLE devices ADD COLUMN selftest JSON"),
}


class Meta(Base):
    __tablename__ = "edgefleet_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


def make_engine(url: str) -> tuple[Engine, sessionmaker]:
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):  # WAL: readers do not block the MQTT writer
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
    from sqlalchemy import inspect

    existing = set(inspect(engine).get_table_names())
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions.begin() as s:
        row = s.get(Meta, "schema_version", with_for_update=True)  # replicas starting together migrate once
        if row is None:
            if existing - {"edgefleet_meta"}:
                raise ConfigError(f"{url}: holds fleet tables from an edgefleet without schema versions; "
                                  "start with a fresh --data-dir / database")
            s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
        else:
            _migrate(s, row, url)
    return engine, sessions


def _migrate(s: Session, row: Meta, url: str) -> None:
    """Bring an older schema up to SCHEMA_VERSION in one transaction; refuse a newer one."""
    from sqlalchemy import text

    have = int(row.value) if row.value.isdigit() else -1
    if have > SCHEMA_VERSION or have < 1 or any(v not in MIGRATIONS for v in range(have, SCHEMA_VERSION)):
        raise ConfigError(f"{url}: database schema {row.value}, this edgefleet uses {SCHEMA_VERSION} and cannot "
                          "migrate it; upgrade edgefleet or start with a fresh --data-dir / database")
    for v in range(have, SCHEMA_VERSION):
        for stmt in MIGRATIONS[v]:
            s.execute(text(stmt))
        log.warning("%s: migrated the fleet database schema from %d to %d", url.split("@")[-1], v, v + 1)
    row.value = str(SCHEMA_VERSION)
