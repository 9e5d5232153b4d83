"""Upgrading the previous releases' databases (schemas 1 and 2, their exact DDL below) keeps every row,
and a rollout that was in progress under release 2 finishes under this one. SQLite and PostgreSQL."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, select, text

from edgefleet.fleet.db import REVISIONS, SCHEMA_VERSION, Device, Meta, Rollout, RolloutWave, TelemetryRow, make_engine
from edgefleet.fleet.rollout import RolloutDriver
from edgefleet.protocol import mqtt as proto
from tests.conftest import postgres_db

# CREATE statements of release 2 (fleet/db.py at schema 2), as SQLAlchemy emitted them
_V2 = {
    "sqlite": """
CREATE TABLE edgefleet_meta ( "key" VARCHAR(64) NOT NULL,  value VARCHAR(256) NOT NULL,  PRIMARY KEY ("key") );
CREATE TABLE models ( id INTEGER NOT NULL,  name VARCHAR(64) NOT NULL,  version VARCHAR(32) NOT NULL,  profile VARCHAR(64) NOT NULL,  backend VARCHAR(32) NOT NULL,  precision VARCHAR(8) NOT NULL,  target_path VARCHAR(256) NOT NULL,  sha256 VARCHAR(64) NOT NULL,  size_bytes INTEGER NOT NULL,  accuracy FLOAT NOT NULL,  manifest JSON NOT NULL,  uploaded_at DATETIME NOT NULL,  PRIMARY KEY (id),  UNIQUE (name, version, profile) );
CREATE TABLE telemetry ( id INTEGER NOT NULL,  device_id VARCHAR(64) NOT NULL,  stream VARCHAR(16) NOT NULL,  seq BIGINT NOT NULL,  ts FLOAT NOT NULL,  received_at DATETIME NOT NULL,  payload JSON NOT NULL,  PRIMARY KEY (id),  CONSTRAINT uq_telemetry_record UNIQUE (device_id, stream, seq) );
CREATE INDEX ix_telemetry_device_id ON telemetry (device_id);
CREATE TABLE devices ( id VARCHAR(64) NOT NULL,  labels JSON NOT NULL,  registered_via VARCHAR(16) NOT NULL,  created_at DATETIME NOT NULL,  online BOOLEAN NOT NULL,  last_seen DATETIME,  agent_version VARCHAR(32),  inference_url VARCHAR(256),  running_model VARCHAR(64),  running_version VARCHAR(32),  last_state VARCHAR(32),  last_error TEXT,  desired_model_id INTEGER,  desired_rollout_id INTEGER,  last_telemetry JSON,  hardware JSON,  selftest JSON,  PRIMARY KEY (id),  FOREIGN KEY(desired_model_id) REFERENCES models (id) );
CREATE TABLE rollouts ( id INTEGER NOT NULL,  model_id INTEGER NOT NULL,  status VARCHAR(16) NOT NULL,  created_at DATETIME NOT NULL,  finished_at DATETIME,  PRIMARY KEY (id),  FOREIGN KEY(model_id) REFERENCES models (id) );
CREATE TABLE rollout_targets ( rollout_id INTEGER NOT NULL,  device_id VARCHAR(64) NOT NULL,  state VARCHAR(16) NOT NULL,  error TEXT,  updated_at DATETIME NOT NULL,  PRIMARY KEY (rollout_id, device_id),  FOREIGN KEY(rollout_id) REFERENCES rollouts (id),  FOREIGN KEY(device_id) REFERENCES devices (id) );
""",  # noqa: E501
    "postgresql": """
CREATE TABLE edgefleet_meta ( key VARCHAR(64) NOT NULL,  value VARCHAR(256) NOT NULL,  PRIMARY KEY (key) );
CREATE TABLE models ( id SERIAL NOT NULL,  name VARCHAR(64) NOT NULL,  version VARCHAR(32) NOT NULL,  profile VARCHAR(64) NOT NULL,  backend VARCHAR(32) NOT NULL,  precision VARCHAR(8) NOT NULL,  target_path VARCHAR(256) NOT NULL,  sha256 VARCHAR(64) NOT NULL,  size_bytes INTEGER NOT NULL,  accuracy FLOAT NOT NULL,  manifest JSON NOT NULL,  uploaded_at TIMESTAMP WITHOUT TIME ZONE NOT NULL,  PRIMARY KEY (id),  UNIQUE (name, version, profile) );
CREATE TABLE telemetry ( id BIGSERIAL NOT NULL,  device_id VARCHAR(64) NOT NULL,  stream VARCHAR(16) NOT NULL,  seq BIGINT NOT NULL,  ts FLOAT NOT NULL,  received_at TIMESTAMP WITHOUT TIME ZONE NOT NULL,  payload JSON NOT NULL,  PRIMARY KEY (id),  CONSTRAINT uq_telemetry_record UNIQUE (device_id, stream, seq) );
CREATE INDEX ix_telemetry_device_id ON telemetry (device_id);
CREATE TABLE devices ( id VARCHAR(64) NOT NULL,  labels JSON NOT NULL,  registered_via VARCHAR(16) NOT NULL,  created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL,  online BOOLEAN NOT NULL,  last_seen TIMESTAMP WITHOUT TIME ZONE,  agent_version VARCHAR(32),  inference_url VARCHAR(256),  running_model VARCHAR(64),  running_version VARCHAR(32),  last_state VARCHAR(32),  last_error TEXT,  desired_model_id INTEGER,  desired_rollout_id INTEGER,  last_telemetry JSON,  hardware JSON,  selftest JSON,  PRIMARY KEY (id),  FOREIGN KEY(desired_model_id) REFERENCES models (id) );
CREATE TABLE rollouts ( id SERIAL NOT NULL,  model_id INTEGER NOT NULL,  status VARCHAR(16) NOT NULL,  created_at TIMESTAMP WITHOUT TIME ZONE NOT NULL,  finished_at TIMESTAMP WITHOUT TIME ZONE,  PRIMARY KEY (id),  FOREIGN KEY(model_id) REFERENCES models (id) );
CREATE TABLE rollout_targets ( rollout_id INTEGER NOT NULL,  device_id VARCHAR(64) NOT NULL,  state VARCHAR(16) NOT NULL,  error TEXT,  updated_at TIMESTAMP WITHOUT TIME ZONE NOT NULL,  PRIMARY KEY (rollout_id, device_id),  FOREIGN KEY(rollout_id) REFERENCES rollouts (id),  FOREIGN KEY(device_id) REFERENCES devices (id) );
""",  # noqa: E501
}

_ROWS = [
    "INSERT INTO models (id, name, version, profile, backend, precision, target_path, sha256, size_bytes, accuracy, "
    "manifest, uploaded_at) VALUES (1, 'digits', '1.0.0', 'x86-cpu', 'onnxruntime', 'int8', "
    "'digits/1.0.0/x86-cpu.tar', '" + "a" * 64 + "', 1000, 0.98, '{\"accuracy\": {}}', '2026-01-01 00:00:00')",
    "INSERT INTO devices (id, labels, registered_via, created_at, online, running_model, running_version, "
    "desired_model_id, desired_rollout_id) VALUES ('edge-a', '{\"site\": \"a\"}', 'api', '2026-01-01 00:00:00', "
    "{true}, 'digits', '1.0.0', 1, 1)",
    "INSERT INTO devices (id, labels, registered_via, created_at, online, desired_model_id, desired_rollout_id) "
    "VALUES ('edge-b', '{}', 'mqtt', '2026-01-01 00:00:00', {false}, 1, 1)",
    "INSERT INTO rollouts (id, model_id, status, created_at) VALUES (1, 1, 'in_progress', '2026-01-01 00:00:00')",
    "INSERT INTO rollout_targets (rollout_id, device_id, state, updated_at) VALUES "
    "(1, 'edge-a', 'installed', '2026-01-01 00:00:00'), (1, 'edge-b', 'pending', '2026-01-01 00:00:00')",
    "INSERT INTO telemetry (device_id, stream, seq, ts, received_at, payload) VALUES "
    "('edge-a', '0123456789abcdef', 0, 1.0, '2026-01-01 00:00:00', '{\"seq\": 0}')",
]


def _old_database(url: str, dialect: str, version: int) -> None:
    engine = create_engine(url)
    with engine.begin() as c:
        for stmt in _V2[dialect].strip().split(";\n"):
            if version == 1 and stmt.startswith("CREATE TABLE devices"):
                stmt = stmt.replace(",  hardware JSON,  selftest JSON", "")
            c.execute(text(stmt.rstrip(";")))
        c.execute(text(f"INSERT INTO edgefleet_meta (key, value) VALUES ('schema_version', '{version}')"))
        t, f = ("true", "false") if dialect == "postgresql" else ("1", "0")
        for stmt in _ROWS:
            c.execute(text(stmt.replace("{true}", t).replace("{false}", f)))
        if dialect == "postgresql":  # SERIALs continue after the ids inserted by hand, as release 2 left them
            c.execute(text("SELECT setval('models_id_seq', 1)"))
            c.execute(text("SELECT setval('rollouts_id_seq', 1)"))
    engine.dispose()


class _Sink:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def publish(self, topic: str, payload: bytes, retain: bool) -> None:
        self.sent.append(topic)


def _check_upgrade(url: str) -> None:
    engine, sessions = make_engine(url)
    with sessions() as s:
        assert s.scalar(select(Meta.value).where(Meta.key == "schema_version")) == str(SCHEMA_VERSION)
        assert s.scalar(text("SELECT version_num FROM alembic_version")) == REVISIONS[SCHEMA_VERSION]  # Alembic's head
        a, b = s.get(Device, "edge-a"), s.get(Device, "edge-b")
        assert a is not None and a.labels == {"site": "a"} and a.running_version == "1.0.0" and a.group_name is None
        assert b is not None and b.registered_via == "mqtt"
        r = s.get(Rollout, 1)
        assert r is not None and r.status == "in_progress" and (r.model_name, r.model_version) == ("digits", "1.0.0")
        w = s.get(RolloutWave, (1, 0))
        assert w is not None and (w.size, w.n_installed, w.n_failed, w.state) == (2, 1, 0, "installing")
        assert s.scalar(select(TelemetryRow.payload)) == {"seq": 0}
    # the release-2 rollout goes on: the pending device reports, the driver finishes it
    driver = RolloutDriver(sessions, _Sink())
    rep = proto.ReportedState(device_id="edge-b", ts=time.time(), state="installed", rollout_id=1, model="digits",
                              version="1.0.0", running_model="digits", running_version="1.0.0")
    with sessions.begin() as s:
        driver.on_report(s, rep)
    driver.tick()
    assert driver.status(1).status == "succeeded"
    engine.dispose()
    make_engine(url)[0].dispose()  # opening the upgraded database again changes nothing


@pytest.mark.parametrize("version", [1, 2])
def test_upgrade_from_an_older_release_keeps_every_row_sqlite(tmp_path, version):
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    _old_database(url, "sqlite", version)
    _check_upgrade(url)


@pytest.mark.parametrize("version", [1, 2])
def test_upgrade_from_an_older_release_keeps_every_row_postgresql(version):
    url = postgres_db(f"edgefleet_migrate_v{version}")
    if url is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth)")
    _old_database(url, "postgresql", version)
    _check_upgrade(url)
