"""Fleet state in SQL (SQLite by default, PostgreSQL for several replicas), through SQLAlchemy 2."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path
from typing import Any

import pydantic_core
from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from ..protocol.errors import ConfigError

__all__ = ["TARGET_ROLLING_BACK", "TARGET_WAITING", "WAITING_STATES", "ApiToken", "AuditRow", "Base", "Device",
           "DriftScoreRow", "Model", "Rollout", "RolloutTarget", "RolloutWave", "TelemetryRow", "WaveDriftBinRow",
           "WaveSeriesRow", "make_engine", "utcnow"]

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
    # schema 3: the registry's selectors (a rollout targets a group, tags or a hardware profile)
    group_name: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    tags: Mapped[list[str] | None] = mapped_column(JSON, default=None)
    profile: Mapped[str | None] = mapped_column(String(64), default=None)  # hardware profile (hw-profiles/*.yaml)
    # schema 4: the ``ts`` of the newest report stored (at most a little ahead of the fleet's clock): an older one
    # is dropped, not applied
    last_report_ts: Mapped[float | None] = mapped_column(Float, default=None)
    # schema 7 (fleet.presence): how long the device counts as online without being heard from (from its telemetry
    # interval; None: no bound known, its will alone takes it offline), and until when that is (unix seconds; None
    # while it has no bound, or since a status said offline)
    presence_s: Mapped[float | None] = mapped_column(Float, default=None)
    presence_until: Mapped[float | None] = mapped_column(Float, default=None)


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
    """A rollout of one model version (one bundle per hardware profile) in waves; see fleet.rollout."""

    __tablename__ = "rollouts"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))  # one of its bundles (the first profile)
    status: Mapped[str] = mapped_column(String(16), default="in_progress")  # fleet.states.RolloutStatus
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    # schema 3
    model_name: Mapped[str | None] = mapped_column(String(64), default=None)
    model_version: Mapped[str | None] = mapped_column(String(32), default=None)
    spec: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)  # fleet.rollout.RolloutSpec
    current_wave: Mapped[int] = mapped_column(Integer, default=0)
    created_by: Mapped[str | None] = mapped_column(String(64), default=None)
    reason: Mapped[str | None] = mapped_column(Text, default=None)  # why it paused, failed or stopped
    lease_owner: Mapped[str | None] = mapped_column(String(64), default=None)  # the replica advancing it
    lease_until: Mapped[dt.datetime | None] = mapped_column(default=None)
    # schema 4: why the rollout driver could not evaluate it last time (it retries; cleared once it advances or
    # changes state)
    engine_error: Mapped[str | None] = mapped_column(Text, default=None)
    engine_error_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class RolloutWave(Base):
    """One wave: its size, soak time and counters kept up to date by each report (never recounted)."""

    __tablename__ = "rollout_waves"
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    size: Mapped[int] = mapped_column(Integer)
    soak_s: Mapped[float] = mapped_column(Float, default=0.0)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # fleet.states.WaveState
    n_installed: Mapped[int] = mapped_column(Integer, default=0)
    n_failed: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    soak_until: Mapped[dt.datetime | None] = mapped_column(default=None)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    gates: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)  # last evaluation


# Targets the reconciler reads back (fleet.reconcile): waiting for a report to the desired state sent them, or being
# rolled back. Each is the predicate of a partial index below and, word for word, a term of the reconciler's query
# (SQLite uses a partial index only for a query that repeats its predicate with the same literals).
WAITING_STATES = ("pending", "downloading", "installing")  # a target whose desired state is out and unanswered
TARGET_WAITING = text(f"state IN ({', '.join(repr(v) for v in WAITING_STATES)})")
TARGET_ROLLING_BACK = text("state = 'rolling_back'")


class RolloutTarget(Base):
    __tablename__ = "rollout_targets"
    __table_args__ = (Index("ix_rollout_targets_wave", "rollout_id", "wave"),
                      Index("ix_rollout_targets_device", "device_id"),
                      # schema 6: counts by state and a page of one state's targets without reading every target
                      Index("ix_rollout_targets_state", "rollout_id", "state", "device_id"),
                      # schema 10: a running wave's targets still waiting, oldest first, and the targets being rolled
                      # back, oldest first, each read up to a limit without reading any other target (issue 44)
                      Index("ix_rollout_targets_waiting", "rollout_id", "wave", "updated_at",
                            postgresql_where=TARGET_WAITING, sqlite_where=TARGET_WAITING),
                      Index("ix_rollout_targets_rolling_back", "updated_at",
                            postgresql_where=TARGET_ROLLING_BACK, sqlite_where=TARGET_ROLLING_BACK))
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id"), primary_key=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id"), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # fleet.states.TargetState
    error: Mapped[str | None] = mapped_column(Text, default=None)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # schema 3
    wave: Mapped[int] = mapped_column(Integer, default=0)
    model_id: Mapped[int | None] = mapped_column(Integer, default=None)  # the bundle for this device's profile
    previous_model_id: Mapped[int | None] = mapped_column(Integer, default=None)  # what it ran before (rollback)
    p99_before: Mapped[float | None] = mapped_column(Float, default=None)  # on the previous model
    p99_after: Mapped[float | None] = mapped_column(Float, default=None)  # newest, on this rollout's model
    tele_requests: Mapped[int] = mapped_column(BigInteger, default=0)  # on this rollout's model
    tele_errors: Mapped[int] = mapped_column(BigInteger, default=0)


class RolloutShadow(Base):
    """A device's latest shadow figures for a rollout's candidate (cumulative since it was loaded). A new
    table: create_all adds it to older databases, no migration step needed."""

    __tablename__ = "rollout_shadow"
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id"), primary_key=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id"), primary_key=True)
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    agreement: Mapped[float | None] = mapped_column(Float, default=None)
    max_abs_error: Mapped[float | None] = mapped_column(Float, default=None)
    p99_ms: Mapped[float | None] = mapped_column(Float, default=None)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class AuditRow(Base):
    """Every action on the fleet: who (a token's name, "fleet" for the rollout driver), what, on what."""

    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    ts: Mapped[dt.datetime] = mapped_column(default=utcnow)
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(32))
    rollout_id: Mapped[int | None] = mapped_column(Integer, default=None, index=True)
    device_id: Mapped[str | None] = mapped_column(String(64), default=None)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)


class ApiToken(Base):
    """An operator's bearer token: only its SHA-256 is stored (tokens are 256 random bits)."""

    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))  # viewer|operator|admin
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(64), default=None)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(default=None)


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


class DriftScoreRow(Base):
    """Schema 5: a device's drift score at one telemetry record (fleet.drift): the record's answer counts in its model
    version's drift bins, and the score of the device's recent answers against the reference."""

    __tablename__ = "drift_scores"
    __table_args__ = (Index("ix_drift_scores_device", "device_id", "id"),
                      Index("ix_drift_scores_version", "model", "version", "received_at"))
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    device_id: Mapped[str] = mapped_column(String(64))
    received_at: Mapped[dt.datetime] = mapped_column(default=utcnow)  # the fleet's clock: windows are read by it
    ts: Mapped[float] = mapped_column(Float)  # the device's
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(32))
    samples: Mapped[int] = mapped_column(BigInteger)  # answers of this record
    skipped: Mapped[int] = mapped_column(BigInteger, default=0)
    scored_samples: Mapped[int] = mapped_column(BigInteger)  # answers the score rests on (this record and earlier)
    psi: Mapped[float | None] = mapped_column(Float, default=None)
    feature: Mapped[str | None] = mapped_column(String(32), default=None)
    level: Mapped[str] = mapped_column(String(16))
    noise: Mapped[float] = mapped_column(Float, default=0.0)
    counts: Mapped[dict[str, Any]] = mapped_column(JSON)  # feature -> counts per bin
    features: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)  # feature -> PSI


class WaveSeriesRow(Base):
    """Schema 8 (fleet.series): a rollout wave's telemetry of one time step (a minute, ten minutes or an hour: each
    record is added to one row of each), by the model version its devices sent it from: sums over the records, so a
    wave's charts read these rows, never its devices' records. No foreign key to the rollout: the ingest adds rows
    without locking the rollout's row."""

    __tablename__ = "wave_series"
    rollout_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)  # the row's time step, s (fleet.series.STEPS)
    wave: Mapped[int] = mapped_column(Integer, primary_key=True)
    t: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # the step's start (unix s; the record's ts)
    model: Mapped[str] = mapped_column(String(64), primary_key=True)  # "" when the record names none
    version: Mapped[str] = mapped_column(String(32), primary_key=True)
    records: Mapped[int] = mapped_column(BigInteger, default=0)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    interval_s: Mapped[float] = mapped_column(Float, default=0.0)  # the records' intervals, summed
    p99_sum: Mapped[float] = mapped_column(Float, default=0.0)  # the records' p99 (ms), summed
    p99_n: Mapped[int] = mapped_column(BigInteger, default=0)  # records with a p99
    p99_max: Mapped[float | None] = mapped_column(Float, default=None)
    drift_samples: Mapped[int] = mapped_column(BigInteger, default=0)  # answers in wave_drift_bins' counts


class WaveDriftBinRow(Base):
    """Schema 8 (fleet.series): a wave's drift counts of one time step, one row per feature and bin of its model
    version's reference (bins with no answers have no row), summed over the wave's records."""

    __tablename__ = "wave_drift_bins"
    rollout_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)  # the row's time step, s (fleet.series.STEPS)
    wave: Mapped[int] = mapped_column(Integer, primary_key=True)
    t: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(32), primary_key=True)
    feature: Mapped[str] = mapped_column(String(32), primary_key=True)
    bin: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, default=0)


class WindowRow(Base):
    """A maintenance window (protocol.window.MaintenanceWindow as JSON) of a device group or of one device (schema
    9); a device's own wins over its group's."""

    __tablename__ = "maintenance_windows"
    scope: Mapped[str] = mapped_column(String(8), primary_key=True)  # "group" or "device"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)  # the group's name or the device's id
    window: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


SCHEMA_VERSION = 10  # bump with any change to the tables above, with a new Alembic revision in fleet/migrations
# edgefleet_meta.schema_version -> the Alembic revision of that schema (databases from before Alembic)
REVISIONS = {1: "0001", 2: "0002", 3: "0003", 4: "0004", 5: "0005", 6: "0006", 7: "0007", 8: "0008", 9: "0009",
             10: "0010"}


class Meta(Base):
    __tablename__ = "edgefleet_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


def _json_dumps(value: Any) -> str:
    return pydantic_core.to_json(value).decode()


def make_engine(url: str) -> tuple[Engine, sessionmaker]:
    # JSON columns (telemetry payloads above all) through pydantic-core's serializer: several times faster
    # than the json module's, and the same JSON
    kwargs: dict[str, Any] = {"json_serializer": _json_dumps, "json_deserializer": pydantic_core.from_json}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    if url.startswith(("postgresql://", "postgres://")):  # SQLAlchemy's default driver is psycopg2: ours is psycopg
        url = "postgresql+psycopg://" + url.partition("://")[2]
    try:
        engine = create_engine(url, **kwargs)
    except ImportError as exc:  # the URL's DB-API driver (the URL is not repeated: it may hold a password)
        scheme = url.partition("://")[0]
        hint = ("pip install 'edgefleet[postgres]'" if scheme in ("postgresql", "postgresql+psycopg")
                else f"install the driver {scheme} names")
        raise ConfigError(f"the database URL ({scheme}://...) needs {exc.name or 'its driver'}, which is not "
                          f"installed: {hint}") from exc
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):  # WAL: readers do not block the MQTT writer
            conn.isolation_level = None  # transactions are begun below, not by the sqlite3 module
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash of the process loses nothing
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            # IMMEDIATE: a transaction takes the write lock when it starts, so a read-then-write one
            # (a report, the rollout tick, an operator's action) waits for another instead of failing
            # with "database is locked" when it upgrades
            conn.exec_driver_sql("BEGIN IMMEDIATE")
    from sqlalchemy import inspect

    existing = set(inspect(engine).get_table_names())
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions.begin() as s:
        row = s.get(Meta, "schema_version", with_for_update=True)  # replicas starting together migrate once
        if row is None:
            if existing - {"edgefleet_meta", "alembic_version"}:
                raise ConfigError(f"{url}: holds fleet tables from an edgefleet without schema versions; "
                                  "start with a fresh --data-dir / database")
            s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
        _migrate(s, row, url)
    return engine, sessions


def _alembic(connection: Any) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).resolve().parent / "migrations"))
    cfg.attributes["connection"] = connection
    return cfg


def _migrate(s: Session, row: Meta | None, url: str) -> None:
    """Bring the schema to SCHEMA_VERSION through Alembic, in the caller's transaction; refuse a newer one.
    A fresh database (``row`` None) has every table from create_all and is stamped at the head."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError

    cfg = _alembic(s.connection())
    head = REVISIONS[SCHEMA_VERSION]
    if row is None:
        command.stamp(cfg, head)
        return
    have = int(row.value) if row.value.isdigit() else -1
    current = MigrationContext.configure(s.connection()).get_current_revision()
    newer = ConfigError(f"{url}: database schema {row.value} (revision {current}), this edgefleet uses "
                        f"{SCHEMA_VERSION} and cannot migrate it; upgrade edgefleet or start with a fresh "
                        "--data-dir / database")
    if have > SCHEMA_VERSION:
        raise newer
    if current is None:  # written before Alembic: stamp the revision its schema_version names
        if have not in REVISIONS:
            raise newer
        command.stamp(cfg, REVISIONS[have])
        current = REVISIONS[have]
    try:
        ScriptDirectory.from_config(cfg).get_revision(current)
    except CommandError as exc:
        raise newer from exc
    if current != head:
        command.upgrade(cfg, head)
        log.warning("%s: migrated the fleet database schema from revision %s to %s", url.split("@")[-1], current,
                    head)
    row.value = str(SCHEMA_VERSION)
