"""Two fleet replicas on one PostgreSQL and one Mosquitto: one rollout is advanced by one replica at a
time (a lease in the database), the other takes over when the lease holder dies, and reports that both
replicas receive move the wave counters once."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from sqlalchemy import select

from edgefleet.fleet.db import Rollout
from tests.conftest import postgres_db, wait_for
from tests.fleet_harness import running_fleet
from tests.test_rollout import actions, online, rollout, status, until, upload
from tests.waiting import concurrently


def test_the_lease_holder_dies_mid_rollout_and_the_other_replica_finishes_it_exactly_once(
        tmp_path, mosquitto, sims, digits_bundle):
    db = postgres_db("edgefleet_test")
    if db is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth): replicas need it")
    with ExitStack() as keep:
        doomed = ExitStack()
        a, url_a = doomed.enter_context(running_fleet(tmp_path, mosquitto.url, db_url=db, replica_id="replica-a",
                                                      shared_subscription_group="fleet", rollout_tick_s=0.05))
        upload(url_a, digits_bundle)
        sims(mqtt_url=mosquitto.url, devices=12, install_s=0.01)
        online(url_a, 12)
        rid = rollout(url_a, version="1.0.0", profile="x86-cpu", waves=["3", "100%"], soak_s=[2.0],
                      gates={"install_success_min": 0.9})
        wait_for(lambda: status(url_a, rid)["waves"][0]["installed"] == 3, 30, "wave 1 installed by replica a")
        b, url_b = keep.enter_context(running_fleet(tmp_path, mosquitto.url, db_url=db, replica_id="replica-b",
                                                    shared_subscription_group="fleet", rollout_tick_s=0.05))
        with b.sessions() as s:
            assert s.scalar(select(Rollout.lease_owner).where(Rollout.id == rid)) == "replica-a"
        # replica a dies during wave 1's soak: it does not release its lease (a crash would not)
        a.service.driver.release_leases = lambda: None  # type: ignore[method-assign]
        doomed.close()
        r = until(url_b, rid, "succeeded", timeout_s=90)  # b waits out the lease (15 s), then goes on
        with b.sessions() as s:
            assert s.scalar(select(Rollout.lease_owner).where(Rollout.id == rid)) in ("replica-b", None)
        assert r["counts"] == {"installed": 12}
        assert [(w["size"], w["state"], w["installed"], w["failed"]) for w in r["waves"]] == [
            (3, "passed", 3, 0), (9, "passed", 9, 0)], r["waves"]  # counted once, though both replicas got reports
        log = actions(url_b, rid)
        assert log.count("wave_started") == 2 and log.count("wave_passed") == 2 and log[-1] == "rollout_succeeded"


def test_replicas_share_no_disk_a_bundle_uploaded_to_one_installs_from_the_other(tmp_path, mosquitto,
                                                                                  digits_bundle):
    """Issue 20: replicas share nothing but the database and the broker. The TUF repository (signed metadata
    and bundles) lives in PostgreSQL: a bundle uploaded to replica a is installed by an agent that knows only
    replica b, and neither replica's data dir holds the bundle."""
    import shutil

    from edgefleet.fleet.keys import init_keys
    from edgefleet.fleet.tuf_store import SqlStore
    from tests.agent_harness import running_agent
    from tests.conftest import postgres_db
    from tests.fleet_harness import api

    db = postgres_db("edgefleet_replicas_no_disk")
    if db is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth): replicas need it")
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    init_keys(a_dir / "keys")
    shutil.copytree(a_dir / "keys", b_dir / "keys")  # the same fleet keys; no folder is shared
    with ExitStack() as keep:
        fa, url_a = keep.enter_context(running_fleet(a_dir, mosquitto.url, db_url=db, replica_id="replica-a",
                                                     shared_subscription_group="fleet", rollout_tick_s=0.05))
        token = api.token
        (b_dir / "fleet").mkdir(parents=True)
        shutil.copyfile(a_dir / "fleet" / "admin-token", b_dir / "fleet" / "admin-token")  # tokens are in the db
        fb, url_b = keep.enter_context(running_fleet(b_dir, mosquitto.url, db_url=db, replica_id="replica-b",
                                                     shared_subscription_group="fleet", rollout_tick_s=0.05))
        assert api.token == token
        assert isinstance(fa.repo.store, SqlStore) and isinstance(fb.repo.store, SqlStore)
        upload(url_a, digits_bundle)
        on_disk = [p for d in (a_dir, b_dir) for p in (d / "fleet").rglob("*") if p.suffix == ".tar"]
        assert on_disk == [], on_disk
        meta = api.get(f"{url_b}/tuf/metadata/timestamp.json", token=None)
        assert meta.status_code == 200 and meta.json()["signed"]["_type"] == "timestamp"
        with running_agent(tmp_path / "agent", device_id="edge-b", fleet_url=url_b,
                           trusted_root=a_dir / "keys" / "root.json") as (agent, _):
            online(url_a, 1)
            rid = rollout(url_a, version="1.0.0", devices=["edge-b"])
            until(url_b, rid, "succeeded", timeout_s=90)
            assert agent.store.current is not None and agent.store.current.installed.version == "1.0.0"
        # what the agent downloaded came from b: its TUF client's metadata names b's URL
        assert not list((b_dir / "fleet").rglob("*.tar")) and not list((a_dir / "fleet").rglob("*.tar"))


def test_two_replicas_publishing_at_once_lose_no_target(tmp_path, digits_bundle):
    """The repository's read-modify-write of targets, snapshot and timestamp is serialised across replicas
    (PostgreSQL's advisory lock): targets published at once from two processes' repositories all stay."""

    from sqlalchemy import create_engine

    from edgefleet.fleet.keys import KeyStore, init_keys
    from edgefleet.fleet.tuf_repo import Repository
    from edgefleet.fleet.tuf_store import SqlStore
    from tests.conftest import postgres_db

    db = postgres_db("edgefleet_tuf_race")
    if db is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth)")
    init_keys(tmp_path / "keys")
    repos = [Repository(SqlStore(create_engine(db)), KeyStore(tmp_path / "keys"), upload_dir=tmp_path / f"u{i}")
             for i in range(2)]
    repos[0].init()
    repos[1].init()

    def publish(i: int) -> None:
        for n in range(6):
            repos[i].add_target(f"digits/{i}.{n}.0/x86-cpu.tar", digits_bundle, {"replica": i})

    errors = concurrently(publish, 2, timeout_s=120)
    assert not errors, errors
    assert sorted(repos[1].targets()) == sorted(f"digits/{i}.{n}.0/x86-cpu.tar" for i in range(2) for n in range(6))
    _, snap, ts, _ = repos[0]._load_all()
    assert ts.signed.snapshot_meta.version == snap.signed.version == 13  # 1 at init + 12 publishes
