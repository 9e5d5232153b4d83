"""Maintenance windows name IANA time zones, read through ``zoneinfo`` (protocol/window.py, imported by the agent, the
fleet and the CLI). ``zoneinfo`` looks in the system's tz database (TZPATH: /usr/share/zoneinfo...) and then in the
``tzdata`` package; a slim container image or a box without the system's tzdata has no such folder, and there every
window in a zone other than UTC was refused ("unknown time zone") and the fleet could not say when one opens. So
``tzdata`` is a dependency of every part (pyproject.toml's base dependencies, pinned in both constraints files).

The box without a tz database is a Python process whose TZPATH is an empty folder (PYTHONTZPATH); ``make test-py310``
runs this file on Python 3.10 too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import datetime as dt, json, zoneinfo
from edgefleet.protocol.window import MaintenanceWindow, next_window
w = MaintenanceWindow(days=("sun",), start="01:00", duration_min=180, tz="Europe/Berlin")
at = dt.datetime(2026, 10, 24, 12, tzinfo=dt.timezone.utc)
opens, closes = next_window(w, at)
print(json.dumps({"tzpath": list(zoneinfo.TZPATH), "opens": opens.isoformat(), "closes": closes.isoformat()}))
"""


def test_time_zones_resolve_on_a_box_without_a_tz_database(tmp_path):
    empty = tmp_path / "no-zoneinfo"
    empty.mkdir()
    env = {**os.environ, "PYTHONTZPATH": str(empty)}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]  # before: ValidationError ... unknown time zone 'Europe/Berlin'
    got = json.loads(r.stdout)
    assert got["tzpath"] == [str(empty)]  # no system tz database was looked in
    # 01:00 summer time the morning the clocks go back, for 180 elapsed minutes: the change read from tzdata
    assert (got["opens"], got["closes"]) == ("2026-10-24T23:00:00+00:00", "2026-10-25T02:00:00+00:00")


def test_tzdata_is_a_dependency_of_every_part_and_pinned_for_both_pythons():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10 (make test-py310 runs this file): pytest's own tomli
        import tomli as tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"tzdata\b", d) for d in deps), deps
    for name in ("constraints.txt", "constraints-py310.txt"):
        pins = [line for line in (ROOT / name).read_text().splitlines() if line.startswith("tzdata==")]
        assert len(pins) == 1, (name, pins)
