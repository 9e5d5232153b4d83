"""One lock order on PostgreSQL (issue 33.4): report ingest and an operator's rollback of the same rollout, at the
same time, from two replicas' worth of threads. Every writer takes its row locks in one order (the rollout, then
devices by id, then targets by rollout and device, then waves; fleet.rollout's docstring), so none deadlocks and
none fails because another moved a row under it; the wave counters end equal to a recount."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from edgefleet.fleet.db import RolloutTarget, RolloutWave, make_engine
from edgefleet.fleet.keys import init_keys
from edgefleet.fleet.service import FleetService
from edgefleet.fleet.tuf_repo import KeyStore, Repository
from edgefleet.fleet.tuf_store import SqlStore
from edgefleet.protocol import mqtt as proto
from tests.conftest import postgres_db
from tests.fleet_harness import RecordingPublisher
from tests.waiting import at_once

DEVICES = 300



@pytest.fixture
def pg_service(tmp_path: Path, digits_bundle, digits_bundle_v2):
    db = postgres_db("edgefleet_lock_order")
    if db is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth): the lock order is "
                    "PostgreSQL's (SQLite takes one lock for the whole database)")
    engine, sessions = make_engine(db)
    init_keys(tmp_path / "keys")
    repo = Repository(SqlStore(engine), KeyStore(tmp_path / "keys"), upload_dir=tmp_path / "up")
    repo.init()
    svc = FleetService(sessions, repo, RecordingPublisher())
    svc.models.upload_bundle(digits_bundle)
    svc.models.upload_bundle(digits_bundle_v2)
    yield svc
    engine.dispose()


def _report(device: str, rid: int, state: str, ts: float) -> proto.ReportedState:
    return proto.ReportedState(device_id=device, ts=ts, state=state, rollout_id=rid,  # type: ignore[arg-type]
                               model="digits", version="1.1.0", running_model="digits",
                               running_version="1.1.0" if state == "installed" else "1.0.0")


def test_ingest_and_rollback_at_once_neither_deadlocks_nor_conflicts(pg_service):
    svc = pg_service
    ids = [f"dev-{i:04d}" for i in range(DEVICES)]
    svc.devices.register_devices([{"device_id": d, "profile": "x86-cpu"} for d in ids])
    # every device runs 1.0.0 before: a rollback has somewhere to send each one
    svc.ingest.handle_statuses([proto.StatusMessage(device_id=d, ts=1.0, state="online") for d in ids])
    svc.ingest.handle_reports([proto.ReportedState(device_id=d, ts=1.0, state="installed", rollout_id=None,
                                                   model="digits", version="1.0.0", running_model="digits",
                                                   running_version="1.0.0")
                               for d in ids])
    rid = svc.rollouts.create_rollout("digits", "1.1.0", devices=ids).id
    now = time.time()
    # two replicas receive every report (reports are not shared), each in its own batches and order; a third thread
    # stores statuses and a fourth the operator's rollback, all at once
    batches = []
    for seed in (1, 2):
        order = ids[:]
        random.Random(seed).shuffle(order)
        batches.append([order[i:i + 37] for i in range(0, len(order), 37)])

    def replica(k: int):
        def go() -> None:
            for i, b in enumerate(batches[k]):
                svc.ingest.handle_reports([_report(d, rid, "downloading", now + i * 0.001) for d in b])
                svc.ingest.handle_reports([_report(d, rid, "installed", now + 1 + i * 0.001) for d in reversed(b)])
        return go

    def statuses() -> None:
        order = ids[:]
        random.Random(3).shuffle(order)
        for i in range(0, len(order), 50):
            svc.ingest.handle_statuses([proto.StatusMessage(device_id=d, ts=now, state="online")
                                        for d in order[i:i + 50]])

    def rollback() -> None:
        time.sleep(0.05)  # in the middle of the ingest
        svc.rollouts.rollout_action(rid, "rollback", "operator")

    threads, errors = at_once((replica(0), replica(1), statuses, rollback), join_s=120)
    assert not any(t.is_alive() for t in threads), "a writer is still waiting: a deadlock nobody detected"
    assert not errors, [f"{type(e).__name__}: {e}"[:300] for e in errors]
    with svc.sessions() as s:
        w = s.get(RolloutWave, (rid, 0))
        by_state = dict(s.execute(select(RolloutTarget.state, func.count()).where(RolloutTarget.rollout_id == rid)
                                  .group_by(RolloutTarget.state)).all())
    assert w is not None and w.n_installed == by_state.get("installed", 0), (w.n_installed, by_state)
    assert w.n_failed == by_state.get("failed", 0), (w.n_failed, by_state)
    assert sum(by_state.values()) == DEVICES
    assert svc.rollouts.get_rollout(rid, with_targets=False).status == "rolled_back"
