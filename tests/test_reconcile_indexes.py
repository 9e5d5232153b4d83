"""The reconciler's read of targets still waiting for a report (issue 44: one query over every target, 17 ms a call at
50,000 devices on PostgreSQL and growing with the fleet): each kind of target it reads back is an ordered range of a
partial index that a fresh and an upgraded database both have, it answers what that one query answered, and its plan
reads those indexes, never the whole table. SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import event, inspect, text

from edgefleet.fleet.db import Device, Model, Rollout, RolloutTarget, RolloutWave, make_engine
from edgefleet.fleet.reconcile import Reconciler
from tests.conftest import postgres_db
from tests.test_fleet_migrations import _old_database

NEW_INDEXES = {"ix_rollout_targets_waiting", "ix_rollout_targets_rolling_back"}


def _ignore(devices: list[str]) -> None:  # the reconciler's call to the broker: not reached by stale_devices
    pass


def _url(tmp_path, dialect: str, name: str) -> str:
    if dialect == "sqlite":
        return f"sqlite:///{tmp_path / name}.db"
    url = postgres_db(f"edgefleet_{name}")
    if url is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth)")
    return url


def _indexes(url: str) -> dict[str, list[tuple[str, tuple[str, ...], bool, str]]]:
    """Every table's indexes as the database describes them: name, columns, unique, predicate (partial ones)."""
    engine, _ = make_engine(url)
    insp = inspect(engine)
    out = {}
    for table in insp.get_table_names():
        out[table] = sorted((ix["name"], tuple(ix["column_names"]), bool(ix["unique"]),
                             " ".join(str(v) for k, v in ix.get("dialect_options", {}).items() if k.endswith("_where")))
                            for ix in insp.get_indexes(table))
    engine.dispose()
    return out


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_an_upgraded_database_has_every_index_a_fresh_one_has(tmp_path, dialect):
    """fleet.db's models (create_all, a fresh database) and the migrations (an older one) agree on every index, the
    reconciler's partial ones included."""
    fresh, old = _url(tmp_path, dialect, "idx_fresh"), _url(tmp_path, dialect, "idx_old")
    _old_database(old, dialect, 2)
    upgraded = _indexes(old)
    assert upgraded == _indexes(fresh)
    targets = {name: where for name, _, _, where in upgraded["rollout_targets"]}
    assert NEW_INDEXES <= set(targets), sorted(targets)
    assert all(w in targets["ix_rollout_targets_waiting"] for w in ("pending", "downloading", "installing"))
    assert "rolling_back" in targets["ix_rollout_targets_rolling_back"]


def _add_rollout(s, rid: int, status: str, waves: list[str]) -> None:
    s.add(Rollout(id=rid, model_id=1, model_name="m", model_version="1", spec={}, current_wave=0, created_by="t",
                  status=status))
    s.flush()
    for idx, state in enumerate(waves):
        s.add(RolloutWave(rollout_id=rid, idx=idx, size=1, soak_s=0, state=state))


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_the_stale_targets_are_those_of_running_waves_and_rollbacks_oldest_first(tmp_path, dialect):
    """What one query over every target answered: waiting targets (pending, downloading, installing) of a running wave
    (installing or shadowing) of a rollout in progress, and targets being rolled back in any rollout, that waited
    after_s or longer, oldest first, each device once, at most 4 x batch targets."""
    engine, sessions = make_engine(_url(tmp_path, dialect, "stale_targets"))
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    with sessions.begin() as s:
        s.add_all([Device(id=f"d{i}", labels={}, registered_via="api") for i in range(1, 13)])
        s.add(Model(id=1, name="m", version="1", profile="x86-cpu", backend="onnxruntime", precision="int8",
                    target_path="t", sha256="0" * 64, size_bytes=1, accuracy=1.0, manifest={}))
        s.flush()
        _add_rollout(s, 1, "in_progress", ["installing", "pending"])
        _add_rollout(s, 2, "paused", ["installing"])
        _add_rollout(s, 3, "rolled_back", ["succeeded"])
        _add_rollout(s, 4, "in_progress", ["succeeded", "shadowing"])
        s.flush()
        for rid, device, state, wave, age_s in [
            (1, "d1", "pending", 0, 50), (1, "d2", "downloading", 0, 40), (1, "d3", "installing", 0, 30),
            (1, "d4", "installed", 0, 60),  # answered
            (1, "d5", "pending", 0, 1),  # not waited after_s yet
            (1, "d6", "shadowing", 0, 70),  # not waiting for an install
            (1, "d7", "pending", 1, 100),  # a wave yet to come
            (2, "d8", "pending", 0, 90),  # a paused rollout
            (3, "d9", "rolling_back", 0, 45), (3, "d10", "rolled_back", 0, 80),
            (4, "d11", "installing", 1, 35), (4, "d12", "pending", 0, 85),  # wave 0 is over
            (4, "d1", "pending", 1, 20),  # d1 again, in another rollout: once, at its oldest
        ]:
            s.add(RolloutTarget(rollout_id=rid, device_id=device, state=state, wave=wave, model_id=1,
                                updated_at=now - dt.timedelta(seconds=age_s)))
    assert Reconciler(sessions, _ignore, after_s=10.0, batch=10).stale_devices() == ["d1", "d9", "d2", "d11", "d3"]
    assert Reconciler(sessions, _ignore, after_s=10.0, batch=1).stale_devices() == ["d1", "d9", "d2", "d11"]
    engine.dispose()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_the_stale_targets_are_read_through_the_partial_indexes(tmp_path, dialect):
    """20,000 targets of a rollout in progress, half installed, half waiting: the plan of the reconciler's read
    scans ix_rollout_targets_waiting and ix_rollout_targets_rolling_back, and no other way into rollout_targets."""
    engine, sessions = make_engine(_url(tmp_path, dialect, "stale_plan"))
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    n = 20_000
    with sessions.begin() as s:
        s.add(Model(id=1, name="m", version="1", profile="x86-cpu", backend="onnxruntime", precision="int8",
                    target_path="t", sha256="0" * 64, size_bytes=1, accuracy=1.0, manifest={}))
        s.flush()
        _add_rollout(s, 1, "in_progress", ["installing"])
        _add_rollout(s, 2, "rolled_back", ["succeeded"])
        s.flush()
        series = f"WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {n - 1}) "
        online = "true" if dialect == "postgresql" else "1"
        s.execute(text(series + "INSERT INTO devices (id, labels, registered_via, created_at, online) "
                       f"SELECT 'sim-' || i, '{{}}', 'api', :now, {online} FROM n"), {"now": now})
        s.execute(text(series + "INSERT INTO rollout_targets (rollout_id, device_id, state, updated_at, wave, "
                       "tele_requests, tele_errors) SELECT 1, 'sim-' || i, CASE WHEN i % 2 = 0 THEN 'installed' "
                       "WHEN i % 4 = 1 THEN 'pending' ELSE 'installing' END, CASE WHEN i % 3 = 0 THEN :now ELSE :old "
                       "END, 0, 0, 0 FROM n"), {"now": now, "old": now - dt.timedelta(minutes=5)})
        s.execute(text(series + "INSERT INTO rollout_targets (rollout_id, device_id, state, updated_at, wave, "
                       "tele_requests, tele_errors) SELECT 2, 'sim-' || i, 'rolling_back', :old, 0, 0, 0 FROM n "
                       "WHERE i < 20 AND i % 2 = 0"), {"old": now - dt.timedelta(minutes=5)})
    with engine.connect() as c:  # the planner's statistics, as autovacuum would leave them
        c.exec_driver_sql("ANALYZE")
        c.commit()
    statements: list[tuple[str, object]] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _capture(conn, cursor, statement, parameters, context, executemany):
        if "rollout_targets" in statement:
            statements.append((statement, parameters))

    assert len(Reconciler(sessions, _ignore, after_s=10.0, batch=400).stale_devices()) == 1600
    event.remove(engine, "before_cursor_execute", _capture)
    assert len(statements) == 1, statements
    statement, params = statements[0]
    with engine.connect() as c:
        explain = "EXPLAIN " if dialect == "postgresql" else "EXPLAIN QUERY PLAN "
        plan = "\n".join(" ".join(str(v) for v in row) for row in c.exec_driver_sql(explain + statement, params))
    for name in NEW_INDEXES:
        assert name in plan, plan
    reads = [line for line in plan.splitlines() if "rollout_targets" in line]
    assert all(any(name in line for name in NEW_INDEXES) for line in reads), plan
    engine.dispose()
