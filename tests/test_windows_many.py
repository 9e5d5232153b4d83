"""A wave's devices' maintenance windows are looked up for any number of devices (issue 44.4): one query with a
(scope, name) IN list of every device and group overflowed PostgreSQL's stack ('stack depth limit exceeded',
max_stack_depth 2 MB) at 20,000 devices, and the rollout was never started (bench/fleet_scale.py --sizes 20000
--brokers cluster --dbs postgresql --replicas 2). Real PostgreSQL."""

from __future__ import annotations

import pytest

from edgefleet.fleet.db import Device, WindowRow, make_engine
from edgefleet.fleet.windows import effective
from tests.conftest import postgres_db

WINDOW = {"days": ["mon"], "start": "02:00", "duration_min": 60, "tz": "UTC"}


def test_windows_of_30000_devices_in_bounded_queries():
    db = postgres_db("edgefleet_windows_many")
    if db is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth)")
    engine, sessions = make_engine(db)
    try:
        with sessions.begin() as s:
            s.add(WindowRow(scope="device", name="sim-29999", window=dict(WINDOW, start="03:00")))
            s.add(WindowRow(scope="group", name="g7", window=WINDOW))
        devices = [Device(id=f"sim-{i:05d}", group_name=f"g{i % 10}") for i in range(30_000)]
        with sessions() as s:
            found = effective(s, devices)
        assert found["sim-29999"].start == "03:00"  # its own window wins over its group's (g9 has none anyway)
        assert {d for d in found if d != "sim-29999"} == {d.id for d in devices if d.group_name == "g7"}
        assert all(w.start == "02:00" for d, w in found.items() if d != "sim-29999")
    finally:
        engine.dispose()
