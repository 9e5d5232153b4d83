"""The fleet's systemd unit (issue 45): written by `edgefleet fleet install-service`, with a descriptor limit."""

from __future__ import annotations

import stat

import pytest

from edgefleet.cli import main as cli_main
from tests.systemd_units import unit_fields, verify_unit


def test_fleet_install_service_writes_a_unit_with_a_descriptor_limit(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    units = tmp_path / "units"
    units.mkdir()
    serve = ["--keys", "keys", "--data-dir", "/var/lib/edgefleet-fleet", "--mosquitto-acl-file",
             str(tmp_path / "mosq" / "acl")]
    assert cli_main(["fleet", "install-service", "--unit-dir", str(units), "--", *serve]) == 0
    unit = units / "edgefleet-fleet.service"
    assert f"wrote {unit}" in capsys.readouterr().out and stat.S_IMODE(unit.stat().st_mode) == 0o644
    f = unit_fields(unit.read_text())
    assert f["LimitNOFILE"] == "65536" and f["User"] == "edgefleet" and f["KillSignal"] == "SIGTERM"
    assert f["ExecStart"].endswith(" fleet serve " + " ".join(serve)) and f["WorkingDirectory"] == str(tmp_path)
    assert f["ReadWritePaths"] == f"/var/lib/edgefleet-fleet {tmp_path / 'mosq'}"
    assert "@" not in "".join(f.values())  # every placeholder filled
    verify_unit(unit)


def test_fleet_install_service_checks_the_serve_options_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["fleet", "install-service", "--unit-dir", str(tmp_path), "--", "--kes", "x"])
    assert "--keys" in capsys.readouterr().err and not list(tmp_path.iterdir())
    # a value a unit line would misread: one line, exit 4 (a configuration error)
    assert cli_main(["fleet", "install-service", "--unit-dir", str(tmp_path), "--", "--keys", "my keys"]) == 4
    assert "would misread" in capsys.readouterr().err and not list(tmp_path.iterdir())
