"""The fleet subcommands of the CLI against a real fleet server; exit codes are part of the contract."""

import json
import subprocess
import sys

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


def test_rollout_cli_over_the_rest_api(tmp_path, mosquitto, digits_bundle, monkeypatch):
    """create (with --wait), status, pause, resume, abort, rollback and audit, JSON and human, with their exit codes."""
    from edgefleet.fleet.simulator import SimConfig, Simulator

    with running_fleet(tmp_path, mosquitto.url, rollout_tick_s=0.05) as (fs, url):
        r = run_cli("rollout", "list", "--fleet", url)
        assert r.returncode == 6 and "no API token" in r.stderr
        monkeypatch.setenv("EDGEFLEET_TOKEN", api.token)
        assert run_cli("fleet", "upload", str(digits_bundle), "--fleet", url).returncode == 0
        sim = Simulator(SimConfig(mqtt_url=mosquitto.url, devices=4, install_s=0.01, prefix="cli"))
        sim.start()
        try:
            r = run_cli("rollout", "create", "digits", "1.0.0", "--profile", "x86-cpu", "--waves", "1,100%",
                        "--soak-s", "0.1", "--min-install-success", "0.9", "--wait", "--wait-s", "60", "--json",
                        "--fleet", url)
            assert r.returncode == 0, r.stderr
            doc = json.loads(r.stdout)
            assert doc["status"] == "succeeded" and [w["size"] for w in doc["waves"]] == [1, 3]
            rid = doc["id"]
            r = run_cli("rollout", "status", str(rid), "--fleet", url)
            assert r.returncode == 0 and "wave 2:" in r.stdout and "4 installed" in r.stdout
            r = run_cli("rollout", "pause", str(rid), "--fleet", url)
            assert r.returncode == 6 and "succeeded; it cannot become paused" in r.stderr
            r = run_cli("rollout", "rollback", str(rid), "--fleet", url, "--json")
            assert r.returncode == 0 and json.loads(r.stdout)["status"] == "rolled_back"
            assert "4 had none" in json.loads(r.stdout)["reason"]  # nothing ran before 1.0.0
            r = run_cli("rollout", "audit", str(rid), "--fleet", url, "--json")
            acts = [x["action"] for x in json.loads(r.stdout)]
            assert acts[0] == "rollout_rolled_back" and acts[-1] == "rollout_created"
            r = run_cli("rollout", "create", "digits", "1.0.0", "--group", "nowhere", "--fleet", url)
            assert r.returncode == 6 and "unknown group 'nowhere'" in r.stderr
            r = run_cli("rollout", "create", "digits", "1.0.0", "--profile", "x86-cpu", "--waves", "1,100%",
                        "--soak-s", "30", "--fleet", url, "--json")
            rid = json.loads(r.stdout)["id"]
            assert json.loads(run_cli("rollout", "pause", str(rid), "--fleet", url, "--json").stdout)["status"] \
                == "paused"
            assert json.loads(run_cli("rollout", "resume", str(rid), "--fleet", url, "--json").stdout)["status"] \
                == "in_progress"
            r = run_cli("rollout", "abort", str(rid), "--fleet", url)
            assert r.returncode == 0 and "aborted" in r.stdout
            r = run_cli("rollout", "list", "--fleet", url, "--json")
            assert [x["status"] for x in json.loads(r.stdout)] == ["aborted", "rolled_back"]
        finally:
            sim.stop()


def test_simulate_cli_runs_devices_for_a_while(mosquitto):
    r = run_cli("simulate", "--devices", "5", "--mqtt-url", mosquitto.url, "--duration-s", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    assert "5 simulated devices connected" in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["connected"] == 0  # then all left cleanly
    r = run_cli("simulate", "--devices", "1", "--mqtt-url", "http://x")
    assert r.returncode == 4 and "mqtt://HOST:PORT" in r.stderr


# what only the fleet's (or the compiler's) extras install: an agent-only install has none of them
NOT_ON_AN_AGENT = ("httpx", "fastapi", "sqlalchemy", "alembic", "amqtt", "psycopg", "onnx")
_AGENT_ONLY = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {NOT_ON_AN_AGENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
from edgefleet.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def run_agent_only(*args: str) -> subprocess.CompletedProcess:
    """The CLI as an install with only edgefleet[agent] runs it."""
    return subprocess.run([sys.executable, "-c", _AGENT_ONLY, *args], capture_output=True, text=True, timeout=300)


def test_rollout_front_end_runs_on_an_agent_only_install(tmp_path, mosquitto, digits_bundle, monkeypatch):
    """Both spellings are one command with one client (stdlib HTTP): the same answers and exit codes, with
    none of the fleet's dependencies importable."""
    probe = _AGENT_ONLY.replace("from edgefleet.cli import main", "import httpx")
    assert "No module named 'httpx'" in subprocess.run([sys.executable, "-c", probe], capture_output=True,
                                                        text=True).stderr
    r = run_agent_only("rollout", "list", "--fleet", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 6 and "cannot reach the fleet" in r.stderr, r.stderr
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        r = run_agent_only("rollout", "list", "--fleet", url)
        assert r.returncode == 6 and "no API token" in r.stderr, r.stderr
        monkeypatch.setenv("EDGEFLEET_TOKEN", api.token)
        assert run_cli("fleet", "upload", str(digits_bundle), "--fleet", url).returncode == 0
        r = run_agent_only("fleet", "register", "cam-1", "cam-2", "--fleet", url, "--json")
        assert r.returncode == 0, r.stderr
        assert [d["device_id"] for d in json.loads(r.stdout)] == ["cam-1", "cam-2"]
        # nobody runs those devices: --wait gives up, exit 7, under either name
        for argv in (["rollout", "create"], ["fleet", "rollout"]):
            r = run_agent_only(*argv, "digits", "1.0.0", "--devices", "cam-1,cam-2", "--fleet", url, "--wait",
                               "--wait-s", "0.5", "--json")
            assert r.returncode == 7, (argv, r.stderr)
            doc = json.loads(r.stdout)
            assert doc["status"] == "in_progress" and sum(doc["counts"].values()) == 2, doc
            r = run_agent_only(*argv, "digits", "9.9.9", "--devices", "cam-1", "--fleet", url)
            assert r.returncode == 6 and "no model digits 9.9.9" in r.stderr, (argv, r.stderr)
            r = run_agent_only(*argv, "digits", "1.0.0", "--soak-s", "soon", "--fleet", url)
            assert r.returncode == 2 and "comma-separated list of seconds" in r.stderr, (argv, r.stderr)
        r = run_agent_only("rollout", "list", "--fleet", url)
        assert r.returncode == 0 and [line.split()[0] for line in r.stdout.splitlines()] == ["#2", "#1"], r.stdout
        r = run_agent_only("rollout", "status", "2", "--targets", "--fleet", url)
        assert r.returncode == 0 and "cam-2" in r.stdout and "wave 1:" in r.stdout, r.stdout
        r = run_agent_only("rollout", "abort", "2", "--fleet", url, "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["status"] == "aborted"
        r = run_agent_only("fleet", "devices", "--fleet", url)
        assert r.returncode == 0 and "cam-2" in r.stdout, r.stderr


def test_help_names_one_rollout_front_end():
    """'edgefleet fleet rollout' is 'edgefleet rollout create' under its older name: the same options."""
    a = run_cli("rollout", "create", "--help").stdout
    b = run_cli("fleet", "rollout", "--help").stdout
    options = [line.split()[0] for line in a.splitlines() if line.strip().startswith("--")]
    assert len(options) > 15 and options == [line.split()[0] for line in b.splitlines()
                                             if line.strip().startswith("--")]
