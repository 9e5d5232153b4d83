"""The fleet subcommands of the CLI against a real fleet server; exit codes are part of the contract."""

import json

from tests.conftest import free_port
from tests.fleet_harness import api, running_fleet
from tests.test_compiler import run_cli


def test_fleet_cli_round_trip(tmp_path, mosquitto, digits_bundle, monkeypatch):
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        r = run_cli("fleet", "devices", "--fleet", url)
        assert r.returncode == 6 and "no API token" in r.stderr
        monkeypatch.setenv("EDGEFLEET_TOKEN", api.token)
        r = run_cli("fleet", "upload", str(digits_bundle), "--fleet", url, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["target"] == "digits/1.0.0/x86-cpu.tar"
        assert run_cli("fleet", "upload", str(digits_bundle), "--fleet", url).returncode == 6  # 409: exists
        assert run_cli("fleet", "register", "cam-1", "cam-2", "--fleet", url).returncode == 0
        r = run_cli("fleet", "devices", "--fleet", url)
        assert r.returncode == 0 and "cam-2" in r.stdout and "P95 MS" in r.stdout
        r = run_cli("fleet", "models", "--fleet", url, "--json")
        assert json.loads(r.stdout)[0]["accuracy"]["passed"] is True
        # nobody is running those devices: --wait gives up after --timeout with exit 7
        r = run_cli("fleet", "rollout", "digits", "1.0.0", "--devices", "cam-1,cam-2", "--fleet", url, "--wait",
                    "--timeout", "1", "--json")
        assert r.returncode == 7, r.stderr
        assert json.loads(r.stdout)["status"] == "in_progress"
        r = run_cli("fleet", "rollout", "digits", "9.9.9", "--devices", "cam-1", "--fleet", url)
        assert r.returncode == 6 and "no model digits 9.9.9" in r.stderr


def test_unreachable_fleet_is_exit_6():
    r = run_cli("fleet", "devices", "--fleet", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 6 and "cannot reach the fleet" in r.stderr


def test_missing_bundle_file_is_exit_4(tmp_path):
    r = run_cli("fleet", "upload", str(tmp_path / "nope.tar"))
    assert r.returncode == 4 and "no such bundle file" in r.stderr


def test_keys_init_json_and_refusal(tmp_path):
    r = run_cli("keys", "init", str(tmp_path / "k"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["root"].endswith("root.json")
    r = run_cli("keys", "init", str(tmp_path / "k"))
    assert r.returncode == 4 and "--force" in r.stderr
