"""Two fleet replicas on one PostgreSQL and one Mosquitto: one rollout is advanced by one replica at a
time (a lease in the database), the other takes over when the lease holder dies, and reports that both
replicas receive move the wave counters once."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from sqlalchemy import select

from fleet.db import Rollout
from tests.conftest import wait_for
from tests.fleet_harness import running_fleet
from tests.test_fleet import _postgres_url
from tests.test_rollout import actions, online, rollout, status, until, upload


def test_the_lease_holder_dies_mid_rollout_and_the_other_replica_finishes_it_exactly_once(
        tmp_path, mosquitto, sims, digits_bundle):
    db = _postgres_url()
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
        a.service.rollouts.release_leases = lambda: None  # type: ignore[method-assign]
        doomed.close()
        r = until(url_b, rid, "succeeded", timeout_s=90)  # b waits out the lease (15 s), then goes on
        with b.sessions() as s:
            assert s.scalar(select(Rollout.lease_owner).where(Rollout.id == rid)) in ("replica-b", None)
        assert r["counts"] == {"installed": 12}
        assert [(w["size"], w["state"], w["installed"], w["failed"]) for w in r["waves"]] == [
            (3, "passed", 3, 0), (9, "passed", 9, 0)], r["waves"]  # counted once, though both replicas got reports
        log = actions(url_b, rid)
        assert log.count("wave_started") == 2 and log.count("wave_passed") == 2 and log[-1] == "rollout_succeeded"
