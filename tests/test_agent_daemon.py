"""The agent as a daemon: strict config, the systemd unit, a clean SIGTERM (real process), device telemetry."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edgefleet.agent.config import load_config
from edgefleet.agent.link.telemetry import DeviceSampler, parse_tegrastats, read_nvml, read_thermal_zones
from edgefleet.cli import main as cli_main
from edgefleet.protocol.errors import ConfigError
from tests.agent_harness import preinstall
from tests.conftest import REPO, free_port, wait_for
from tests.systemd_units import unit_fields, verify_unit
from tests.waiting import recv_until


def write_config(path: Path, data_dir: Path, extra: str = "") -> Path:
    path.write_text(f"device_id: cam-7\nfleet_url: http://127.0.0.1:9\ndata_dir: {data_dir}\n"
                    f"trust_on_first_use: true\n{extra}")
    return path


# -- config -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "message"), [
    ("max_batch: 8", "unknown key 'max_batch' (did you mean 'max_batch_size'?)"),
    ("http-prot: 8080", "unknown key 'http_prot' (did you mean 'http_port'?)"),
    ("shutdown_grace: 5", "unknown key 'shutdown_grace' (did you mean 'shutdown_grace_s'?)"),
    ("colour: blue", "unknown key 'colour' (valid keys: batch_tuning, clock_tolerance_s, data_dir, device_id,"),
    ("onnxruntime_providers: [CUDAExecutionProvidr]",
     "unknown execution provider 'CUDAExecutionProvidr' (did you mean 'CUDAExecutionProvider'?)"),
    ("onnxruntime_providers: []", "name at least one provider"),
    ("shutdown_grace_s: -1", "shutdown_grace_s"),
])
def test_config_errors_name_the_key_and_the_nearest_valid_one(tmp_path, line, message):
    cfg = write_config(tmp_path / "agent.yaml", tmp_path, line + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg, {})
    assert str(err.value).startswith(f"{cfg}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_config_daemon_settings(tmp_path):
    cfg = load_config(write_config(tmp_path / "agent.yaml", tmp_path, "shutdown_grace_s: 7.5\nsysfs_root: /x\n"
                                   "onnxruntime_providers: [CUDAExecutionProvider, CPUExecutionProvider]\n"), {})
    assert cfg.shutdown_grace_s == 7.5 and cfg.sysfs_root == Path("/x")
    assert cfg.onnxruntime_providers == ("CUDAExecutionProvider", "CPUExecutionProvider")


# -- the anchor of trust: a root given, one already held, or trust on first use said out loud ---------------
def _agent_args(data_dir: Path, *extra: str) -> list[str]:
    return ["agent", "--device-id", "cam-7", "--fleet", "http://127.0.0.1:9", "--data-dir", str(data_dir), *extra]


def test_an_agent_without_a_trusted_root_refuses_to_start(tmp_path, capsys):
    from edgefleet.agent.config import AgentConfig
    from edgefleet.agent.daemon import Agent

    with pytest.raises(ConfigError) as err:
        Agent(AgentConfig(device_id="cam-7", fleet_url="http://127.0.0.1:9", data_dir=tmp_path / "a"))
    msg = str(err.value)
    assert "--trusted-root" in msg and "edgefleet keys init" in msg and "--trust-on-first-use" in msg, msg
    assert cli_main(_agent_args(tmp_path / "b")) == 4  # EXIT_INPUT, before anything listens or connects
    out = capsys.readouterr().err
    assert "--trusted-root PATH" in out and "--trust-on-first-use" in out and "trust_on_first_use" in out, out


def test_trust_on_first_use_or_a_held_root_lets_the_agent_start(tmp_path):
    from edgefleet.agent.config import AgentConfig
    from edgefleet.agent.daemon import Agent

    base = {"device_id": "cam-7", "fleet_url": "http://127.0.0.1:9"}
    Agent(AgentConfig(**base, data_dir=tmp_path / "a", trust_on_first_use=True))
    held = tmp_path / "b" / "tuf" / "metadata" / "root.json"  # a device that already trusts a root
    held.parent.mkdir(parents=True)
    held.write_text("{}")
    Agent(AgentConfig(**base, data_dir=tmp_path / "b"))
    root = tmp_path / "root.json"
    root.write_text("{}")
    Agent(AgentConfig(**base, data_dir=tmp_path / "c", trusted_root=root))
    cfg = load_config(write_config(tmp_path / "agent.yaml", tmp_path / "d"), {})
    assert cfg.trust_on_first_use is True


def test_the_agent_help_names_both_ways_to_trust(capsys):
    with pytest.raises(SystemExit):
        cli_main(["agent", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--trusted-root" in out and "--trust-on-first-use" in out and "keys init" in out


# -- the systemd unit -------------------------------------------------------------------------------------
def test_install_service_dry_run_prints_the_unit_and_writes_nothing(tmp_path, capsys):
    cfg = write_config(tmp_path / "agent.yaml", Path("/var/lib/edgefleet-agent"), "shutdown_grace_s: 20\n")
    units = tmp_path / "units"
    units.mkdir()
    assert cli_main(["agent", "install-service", "--config", str(cfg), "--unit-dir", str(units), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not list(units.iterdir())
    f = unit_fields(text)
    assert f["Type"] == "notify" and f["KillSignal"] == "SIGTERM" and f["Restart"] == "on-failure"
    assert f["ExecStart"].endswith(f" agent --config {cfg}") and Path(f["ExecStart"].split()[0]).is_absolute()
    assert f["TimeoutStopSec"] == "35"  # the grace period plus time to close the models
    assert f["StateDirectory"] == "edgefleet-agent" and f["User"] == "edgefleet"
    assert "[Install]" in text and f["WantedBy"] == "multi-user.target"
    assert "@" not in "".join(f.values())  # every placeholder filled


def test_install_service_writes_the_unit_to_the_given_directory(tmp_path, capsys):
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "agent.yaml", data)
    units = tmp_path / "units"
    units.mkdir()
    assert cli_main(["agent", "install-service", "--config", str(cfg), "--unit-dir", str(units),
                     "--user", "camera"]) == 0
    out = capsys.readouterr().out
    unit = units / "edgefleet-agent.service"
    assert f"wrote {unit}" in out and "systemctl daemon-reload && systemctl enable --now edgefleet-agent" in out
    f = unit_fields(unit.read_text())
    assert f["ReadWritePaths"] == str(data) and f["User"] == "camera"
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    verify_unit(unit)


def test_install_service_refuses_a_bad_config_in_one_line(tmp_path, capsys):
    cfg = write_config(tmp_path / "agent.yaml", tmp_path, "max_batch: 4\n")
    units = tmp_path / "units"
    units.mkdir()
    assert cli_main(["agent", "install-service", "--config", str(cfg), "--unit-dir", str(units)]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'max_batch_size'?" in err
    assert not list(units.iterdir())
    assert cli_main(["agent", "install-service", "--config", str(write_config(tmp_path / "ok.yaml", tmp_path)),
                     "--unit-dir", str(tmp_path / "missing")]) == 4
    assert "no such directory" in capsys.readouterr().err


# -- SIGTERM, for real ------------------------------------------------------------------------------------
def _read_head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_sigterm_finishes_the_request_in_flight_then_exits_cleanly(tmp_path, digits_bundle, test_images):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    port = free_port()
    cfg = write_config(tmp_path / "agent.yaml", data, f"http_port: {port}\nshutdown_grace_s: 60\n")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    proc = subprocess.Popen([sys.executable, "-m", "edgefleet", "agent", "--config", str(cfg), "-v"], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    conn = None
    try:
        ready = notify.recv(4096).decode()
        assert ready.startswith("READY=1\n") and "serving digits 1.0.0" in ready
        images, labels = test_images
        body = json.dumps({"inputs": [{"name": "input", "shape": [4, 1, 8, 8], "datatype": "FP32",
                                       "data": images[:4].reshape(-1).tolist()}]}).encode()
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        conn.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        # uvicorn says 100 Continue when the handler starts reading the body: the request is in flight
        assert _read_head(conn).startswith(b"HTTP/1.1 100 Continue")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _refused(port), 30, "the agent to stop accepting connections")
        conn.sendall(body)
        head = recv_until(conn, lambda got: b"\r\n\r\n" in got, "the connection closed before the response")
        status, rest = head.split(b"\r\n", 1)
        assert status == b"HTTP/1.1 200 OK", head
        headers, payload = rest.split(b"\r\n\r\n", 1)
        length = int(next(h.split(b":")[1] for h in headers.split(b"\r\n") if h.lower().startswith(b"content-length")))
        payload = recv_until(conn, lambda got: len(got) >= length, "the connection closed before the body", payload)
        out = json.loads(payload)["outputs"][0]
        assert np.array_equal(np.array(out["data"]).reshape(4, 10).argmax(1), labels[:4])
        assert proc.wait(60) == 0
        assert notify.recv(4096) == b"STOPPING=1"
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "in-flight requests are done" in stderr and "Traceback" not in stderr
    finally:
        if conn is not None:
            conn.close()
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


# -- device telemetry -------------------------------------------------------------------------------------
def fake_sysfs(root: Path, zones: dict[str, str]) -> Path:
    for i, (kind, temp) in enumerate(zones.items()):
        z = root / "class" / "thermal" / f"thermal_zone{i}"
        z.mkdir(parents=True)
        (z / "type").write_text(kind.split("#")[0] + "\n")
        (z / "temp").write_text(temp + "\n")
    return root


def test_thermal_zones_from_a_fake_sysfs(tmp_path):
    root = fake_sysfs(tmp_path, {"cpu-thermal": "47500", "gpu-thermal": "45000", "acpitz": "27800",
                                 "acpitz#2": "29800", "tj-thermal": "not-a-number", "soc0-thermal": "-274000"})
    assert read_thermal_zones(root) == {"cpu-thermal": 47.5, "gpu-thermal": 45.0, "acpitz": 27.8, "acpitz.1": 29.8}
    assert read_thermal_zones(tmp_path / "nothing") == {}


TEGRASTATS_ORIN = (
    "11-23-2025 15:04:01 RAM 2851/7620MB (lfb 5x4MB) SWAP 0/3810MB (cached 0MB) CPU [12%@729,4%@729,off,0%@729,"
    "7%@1510,3%@1510] EMC_FREQ 0% GR3D_FREQ 37% cpu@47.5C soc2@45.093C soc0@45.718C gpu@46.25C tj@47.5C "
    "soc1@45.25C VDD_IN 5042mW/5042mW VDD_CPU_GPU_CV 602mW/602mW VDD_SOC 1441mW/1441mW")
TEGRASTATS_NANO = (
    "RAM 1617/3964MB (lfb 151x4MB) SWAP 0/1982MB (cached 0MB) IRAM 0/252kB(lfb 252kB) CPU [7%@1479,3%@1479,"
    "5%@1479,2%@1479] EMC_FREQ 2%@1600 GR3D_FREQ 0%@76 APE 25 PLL@33C CPU@35.5C PMIC@100C GPU@34C AO@41.5C "
    "thermal@34.75C POM_5V_IN 2303/2303 POM_5V_GPU 0/0 POM_5V_CPU 366/366")


def test_tegrastats_orin_line():
    t = parse_tegrastats(TEGRASTATS_ORIN)
    assert (t.ram_used_mb, t.ram_total_mb, t.gpu_percent) == (2851, 7620, 37.0)
    assert t.cpu_percent == (12.0, 4.0, None, 0.0, 7.0, 3.0)
    assert t.temperatures_c["cpu"] == 47.5 and t.temperatures_c["gpu"] == 46.25 and t.temperatures_c["tj"] == 47.5
    assert t.power_mw == {"VDD_IN": 5042, "VDD_CPU_GPU_CV": 602, "VDD_SOC": 1441}


def test_tegrastats_jetpack4_line():
    t = parse_tegrastats(TEGRASTATS_NANO)
    assert (t.ram_used_mb, t.ram_total_mb, t.gpu_percent) == (1617, 3964, 0.0)
    assert t.cpu_percent == (7.0, 3.0, 5.0, 2.0)
    assert t.temperatures_c == {"pll": 33.0, "cpu": 35.5, "pmic": 100.0, "gpu": 34.0, "ao": 41.5, "thermal": 34.75}
    assert t.power_mw == {"POM_5V_IN": 2303, "POM_5V_GPU": 0, "POM_5V_CPU": 366}
    assert parse_tegrastats("garbage") == parse_tegrastats("")


def test_nvml_figures():
    class NVMLError(Exception):
        pass

    def temperature(handle, sensor):
        if handle == 1:
            raise NVMLError("not supported")
        return 61

    nvml = SimpleNamespace(
        NVMLError=NVMLError, NVML_TEMPERATURE_GPU=0, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"NVIDIA A2" if h == 0 else "NVIDIA T4",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=40 + h),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=512 * 2**20, total=16 * 2**30),
        nvmlDeviceGetTemperature=temperature, nvmlDeviceGetPowerUsage=lambda h: 35500)
    a2, t4 = read_nvml(nvml)
    assert (a2.name, a2.utilization_percent, a2.memory_used_mb, a2.memory_total_mb) == ("NVIDIA A2", 40.0, 512.0,
                                                                                         16384.0)
    assert (a2.temperature_c, a2.power_w) == (61.0, 35.5)
    assert t4.name == "NVIDIA T4" and t4.temperature_c is None


def test_sampler_reads_sysfs_and_a_running_tegrastats(tmp_path):
    root = fake_sysfs(tmp_path / "sys", {"cpu-thermal": "51000"})
    tegrastats = tmp_path / "tegrastats"  # prints a line per interval like the real one, until terminated
    tegrastats.write_text(f"#!/bin/sh\n[ \"$1\" = --interval ] || exit 2\nwhile true; do echo '{TEGRASTATS_ORIN}';"
                          " sleep 0.05; done\n")
    tegrastats.chmod(0o755)
    sampler = DeviceSampler(tmp_path, root, tegrastats, interval_s=0.05)
    try:
        stats = wait_for(lambda: (s := sampler.sample()).tegrastats and s, 20, "a tegrastats line")
        assert stats.temperatures_c == {"cpu-thermal": 51.0}
        assert stats.tegrastats.gpu_percent == 37.0 and stats.tegrastats.power_mw["VDD_IN"] == 5042
        assert 0 < stats.memory_used_mb <= stats.memory_total_mb and stats.disk_free_mb
        assert json.dumps(stats.to_json())
        proc = sampler._tegra._proc  # type: ignore[union-attr]
    finally:
        sampler.close()
    assert proc.poll() is not None  # tegrastats stopped with the sampler
    quiet = DeviceSampler(tmp_path, tmp_path / "nosys", tmp_path / "no-tegrastats")
    assert quiet.sample().tegrastats is None and quiet.sample().temperatures_c == {}
    quiet.close()


def test_agent_samples_the_device_while_it_runs(tmp_path, digits_bundle):
    from tests.agent_harness import running_agent

    preinstall(tmp_path / "agent", digits_bundle)
    root = fake_sysfs(tmp_path / "sys", {"soc-thermal": "42250"})
    with running_agent(tmp_path / "agent", sysfs_root=root, telemetry_interval_s=0.1) as (agent, _url):
        stats = wait_for(lambda: agent.device_stats, 20, "a device sample")
    assert stats.temperatures_c == {"soc-thermal": 42.25}  # taken by the agent's telemetry thread
