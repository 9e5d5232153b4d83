"""``edgefleet windows list|set|delete`` (issue 43.4) against a real fleet on loopback, run as an operator runs it (a
process of its own): what it sets is what the fleet stores and sends with desired states, a window that is not one
is exit 2 naming the field before anything is asked of the fleet, a window to delete that is not there and a wrong
token are the fleet's refusals (exit 6), each one line on stderr."""

from __future__ import annotations

import argparse
import json

import pytest

from edgefleet.cli.windows import parse_days
from tests.fleet_harness import api, running_fleet
from tests.test_compiler import run_cli

BERLIN = ["--days", "mon-fri", "--start", "01:00", "--duration-min", "120", "--tz", "Europe/Berlin"]


def _one_line_error(r, code: int, *says: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for s in says:
        assert s in r.stderr, r.stderr


def test_windows_are_set_listed_and_deleted_through_the_fleets_api(tmp_path, mosquitto):
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        fleet = ["--fleet", url, "--token", api.token]

        r = run_cli("windows", "list", *fleet)
        assert r.returncode == 0 and "no maintenance windows" in r.stdout, r.stderr

        r = run_cli("windows", "set", "group", "stores", *BERLIN, *fleet, "--json")
        assert r.returncode == 0, r.stderr
        want = {"days": ["mon", "tue", "wed", "thu", "fri"], "start": "01:00", "duration_min": 120,
                "tz": "Europe/Berlin"}
        assert json.loads(r.stdout) == {"scope": "group", "name": "stores", "window": want}
        r = run_cli("windows", "set", "device", "edge-7", "--days", "sat,sun", "--start", "22:00", "--duration-min",
                    "360", *fleet)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("set: device edge-7") and "sat,sun 22:00 for 360 min (UTC);" in r.stdout, r.stdout
        assert "next opens" in r.stdout or "open now" in r.stdout, r.stdout

        # what the fleet holds, asked by its API, and what a rollout sends: the device's own window over its group's
        stored = {(w["scope"], w["name"]): w["window"] for w in api.get(f"{url}/api/v1/windows").json()}
        assert stored[("group", "stores")] == want and stored[("device", "edge-7")]["days"] == ["sat", "sun"]
        from edgefleet.fleet import windows
        from edgefleet.fleet.db import Device

        fs.service.devices.register_device("edge-7", group="stores")
        fs.service.devices.register_device("edge-8", group="stores")
        with fs.service.sessions() as s:
            got = windows.effective(s, s.query(Device).all())
        assert got["edge-7"].start == "22:00" and got["edge-8"].tz == "Europe/Berlin"

        r = run_cli("windows", "list", *fleet, "--json")
        assert r.returncode == 0 and len(json.loads(r.stdout)) == 2, r.stderr
        r = run_cli("windows", "list", *fleet)
        lines = r.stdout.splitlines()
        assert len(lines) == 2 and lines[0].startswith("device edge-7") and lines[1].startswith("group  stores")
        assert "mon,tue,wed,thu,fri 01:00 for 120 min (Europe/Berlin);" in lines[1]
        assert " CET" in lines[1] or " CEST" in lines[1], lines  # when it next opens, in its own zone

        r = run_cli("windows", "delete", "device", "edge-7", *fleet, "--json")
        assert r.returncode == 0 and json.loads(r.stdout) == {"scope": "device", "name": "edge-7", "removed": True}
        assert [w["name"] for w in api.get(f"{url}/api/v1/windows").json()] == ["stores"]
        # before: a window that was not there was 'removed' too (204), so a typo went unnoticed
        _one_line_error(run_cli("windows", "delete", "device", "edge-7", *fleet), 6, "404",
                        "device 'edge-7' has no maintenance window")
        _one_line_error(run_cli("windows", "list", "--fleet", url, "--token", "wrong"), 6, "401")
        actions = [a["action"] for a in api.get(f"{url}/api/v1/audit").json()]
        assert actions.count("window_set") == 2 and actions.count("window_removed") == 1, actions


@pytest.mark.parametrize(("args", "says"), [
    (["--duration-min", "1431"], "duration_min"),
    (["--duration-min", "0"], "duration_min"),
    (["--tz", "Mars/Olympus"], "unknown time zone"),
    (["--start", "24:00"], "HH:MM"),
    (["--days", "monday"], "unknown days"),
])
def test_a_window_that_is_not_one_is_exit_2_naming_the_field_before_the_fleet_is_asked(args, says):
    from tests.conftest import free_port

    fleet = ["--fleet", f"http://127.0.0.1:{free_port()}"]  # nobody there: a refusal there would be exit 6
    argv = [*BERLIN]
    for flag, value in zip(args[::2], args[1::2], strict=True):
        argv[argv.index(flag) + 1] = value
    _one_line_error(run_cli("windows", "set", "group", "stores", *argv, *fleet), 2, "not a maintenance window", says)


def test_a_scope_that_is_neither_is_exit_2():
    _one_line_error(run_cli("windows", "set", "store", "x", *BERLIN, "--fleet", "http://127.0.0.1:9"), 2,
                    "'store' is not a scope")


def test_days_are_lists_ranges_or_daily():
    assert parse_days("mon-fri") == ["mon", "tue", "wed", "thu", "fri"]
    assert parse_days("fri-mon") == ["fri", "sat", "sun", "mon"]  # round the week's end
    assert parse_days("daily") == ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
    assert parse_days("sat, sun,sat") == ["sat", "sun"]
    with pytest.raises(argparse.ArgumentTypeError, match="a range is two days"):
        parse_days("mon-xyz")
