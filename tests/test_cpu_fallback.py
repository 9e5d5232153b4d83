"""A Jetson profile names a CPU fallback (arm64-cpu): built instead when this host has no TensorRT, and rolled out to
Jetsons when a model version has no TensorRT bundle.

The compile tests run the real command line on this host (no GPU, no ``tensorrt`` module) and build a real LiteRT
bundle, so they need the isolated "tflite" toolchain; like tests/test_litert.py, the session fixture installs it
when it is missing. The fleet test runs a real fleet (HTTP on loopback, a real database and MQTT broker).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edgefleet.compiler import toolchain
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.bundle import extract_bundle
from edgefleet.protocol.errors import SchemaError
from edgefleet.protocol.profile import load_profile, profile_dir
from tests.conftest import DIGITS, wait_for
from tests.emulation import python_argv
from tests.fleet_harness import api, running_fleet

pytestmark = pytest.mark.timeout(1800)  # the first compile may install the tflite toolchain (about a minute)

LINE = ("jetson-orin-nano: TensorRT is not installed on this build host; built its CPU fallback arm64-cpu instead "
        "(jetson-orin-nano devices get it until a TensorRT bundle is uploaded)")


# -- the profile field ------------------------------------------------------------------------------------------
def test_shipped_jetson_profiles_name_arm64_cpu():
    for name in ("jetson-orin-nano", "jetson-agx-orin"):
        assert load_profile(name).cpu_fallback == "arm64-cpu"
    for name in ("arm64-cpu", "x86-cpu", "x86-cpu-vnni"):
        assert load_profile(name).cpu_fallback is None


def _jetson(tmp_path: Path, fallback: str, name: str = "my-jetson") -> Path:
    text = (profile_dir() / "jetson-orin-nano.yaml").read_text().replace("name: jetson-orin-nano", f"name: {name}")
    text = text.replace("cpu_fallback: arm64-cpu", f"cpu_fallback: {fallback}")
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def test_a_fallback_must_be_a_known_profile(tmp_path):
    with pytest.raises(SchemaError) as e:
        load_profile(str(_jetson(tmp_path, "arm64-cpus")))
    msg = str(e.value)
    assert "cpu_fallback" in msg and "no profile 'arm64-cpus'" in msg and "did you mean 'arm64-cpu'?" in msg


@pytest.mark.parametrize("bad", ["../arm64-cpu", "Arm64-CPU", "arm64 cpu", ""])
def test_a_fallback_is_a_profile_name_not_a_path(tmp_path, bad):
    with pytest.raises(SchemaError, match="cpu_fallback"):
        load_profile(str(_jetson(tmp_path, f"'{bad}'")))


def test_a_gpu_profile_is_no_fallback(tmp_path):
    with pytest.raises(SchemaError) as e:
        load_profile(str(_jetson(tmp_path, "jetson-agx-orin")))
    assert "jetson-agx-orin is a gpu profile" in str(e.value) and "must be a CPU profile" in str(e.value)


def test_a_fallback_of_another_arch_is_refused(tmp_path):
    with pytest.raises(SchemaError) as e:
        load_profile(str(_jetson(tmp_path, "x86-cpu")))
    assert "x86-cpu is for x86_64 while my-jetson devices are aarch64" in str(e.value)


def test_a_profile_is_not_its_own_fallback(tmp_path):
    with pytest.raises(SchemaError, match="names this profile itself"):
        load_profile(str(_jetson(tmp_path, "my-jetson")))


def test_a_fallback_beside_a_custom_profile_is_found_there(tmp_path):
    cpu = (profile_dir() / "arm64-cpu.yaml").read_text().replace("name: arm64-cpu", "name: my-arm")
    (tmp_path / "my-arm.yaml").write_text(cpu)
    assert load_profile(str(_jetson(tmp_path, "my-arm"))).cpu_fallback == "my-arm"


# -- the compiler on a host without TensorRT ----------------------------------------------------------------------
@pytest.fixture(scope="session")
def tflite_toolchain() -> toolchain.ToolchainStatus:
    st = toolchain.ensure("tflite", lambda msg: print(f"[toolchain] {msg}", file=sys.stderr, flush=True))
    assert st.installed
    return st


def compile_cli(out: Path, profile: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*python_argv(), "-m", "edgefleet.cli", "compile", str(DIGITS / "model.onnx"), "--profile",
                           profile, "--calibration", str(DIGITS / "calibration.npz"), "--eval",
                           str(DIGITS / "test.npz"), "--out", str(out), "--name", "digits", "--version", "1.0.0",
                           "--precision", "int8", "--no-benchmark", "--quiet", *extra],
                          capture_output=True, text=True, timeout=1500)


def test_this_host_has_no_tensorrt():
    assert importlib.util.find_spec("tensorrt") is None, "these tests are about a build host without TensorRT"


def test_a_jetson_compile_without_tensorrt_builds_its_arm64_cpu_fallback(tflite_toolchain, tmp_path):
    r = compile_cli(tmp_path, "jetson-orin-nano")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "fallback" in line] == [LINE]
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["digits-1.0.0-arm64-cpu.tar"]
    m = extract_bundle(tmp_path / "digits-1.0.0-arm64-cpu.tar", tmp_path / "x")
    assert (m.profile, m.backend, m.precision) == ("arm64-cpu", "litert", "int8")
    assert "profile arm64-cpu" in r.stdout  # the summary is the bundle's, not a TensorRT one

    r = compile_cli(tmp_path, "jetson-orin-nano", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["profile"] == "jetson-orin-nano"  # the profile asked for; the bundle is arm64-cpu
    assert doc["cpu_fallback"] == {"requested": "jetson-orin-nano", "built": "arm64-cpu",
                                   "reason": "TensorRT is not installed on this build host"}
    assert doc["manifest"]["profile"] == "arm64-cpu" and doc["bundle"].endswith("digits-1.0.0-arm64-cpu.tar")
    assert LINE in r.stderr.splitlines()


def test_the_fallback_asked_for_too_is_built_once(tflite_toolchain, tmp_path):
    r = compile_cli(tmp_path, "jetson-orin-nano,arm64-cpu", "--json", "--no-cache")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jetson, arm = doc["builds"]
    assert jetson["profile"] == "jetson-orin-nano" and jetson["cpu_fallback"]["built"] == "arm64-cpu"
    assert arm["profile"] == "arm64-cpu" and "cpu_fallback" not in arm
    assert jetson["bundle"] == arm["bundle"] and arm["seconds"] == 0.0  # the second is the first's result
    assert r.stderr.count("built its CPU fallback") == 1
    table = compile_cli(tmp_path, "jetson-orin-nano,arm64-cpu")  # the table says it in the Jetson's row
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("jetson-orin-nano "))
    assert " litert " in row and "built its CPU fallback arm64-cpu (TensorRT is not installed" in row


def test_no_cpu_fallback_keeps_the_toolchain_failure(tmp_path):
    r = compile_cli(tmp_path, "jetson-orin-nano", "--no-cpu-fallback")
    assert r.returncode == 5 and "TensorRT is not installed" in r.stderr, r.stderr
    assert "fallback" not in r.stderr and not list(tmp_path.glob("*.tar"))


def test_a_failed_fallback_says_both_and_exits_as_the_toolchain_error(tmp_path):
    env_dir = tmp_path / "no-toolchains"
    r = subprocess.run([*python_argv(), "-m", "edgefleet.cli", "compile", str(DIGITS / "model.onnx"), "--profile",
                        "jetson-agx-orin", "--calibration", str(DIGITS / "calibration.npz"), "--eval",
                        str(DIGITS / "test.npz"), "--out", str(tmp_path), "--precision", "int8", "--quiet",
                        "--no-cache"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "EDGEFLEET_TOOLCHAIN_DIR": str(env_dir)})
    assert r.returncode == 5, r.stderr
    assert ("TensorRT is not installed on this build host; building its CPU fallback arm64-cpu instead failed"
            in r.stderr) and "edgefleet toolchain install tflite" in r.stderr


# -- the fleet -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def arm64_bundle(tflite_toolchain, tmp_path_factory) -> Path:
    from edgefleet.compiler.compile import CompileOptions, compile_model

    return compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="arm64-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=tmp_path_factory.mktemp("arm64"), name="digits", version="1.0.0",
        benchmark=False, precision="int8")).bundle


@pytest.fixture
def fleet(tmp_path, mosquitto, fleet_db):
    with running_fleet(tmp_path, mosquitto.url, rollout_tick_s=0.05, db_url=fleet_db) as (fs, url):
        yield url, mosquitto


def test_a_jetson_without_a_tensorrt_bundle_gets_the_arm64_cpu_one(fleet, arm64_bundle, digits_bundle):
    url, broker = fleet
    r = api.post(f"{url}/api/v1/bundles", content=arm64_bundle.read_bytes())
    assert r.status_code == 201, r.text
    for dev, group, prof in [("nano-1", "yard", "jetson-orin-nano"), ("pi-1", "yard", "arm64-cpu"),
                             ("pc-1", "office", "x86-cpu"), ("odd-1", "odd", "cray-1")]:
        r = api.post(f"{url}/api/v1/devices", json={"device_id": dev, "group": group, "profile": prof})
        assert r.status_code == 201, r.text

    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "group": "yard"})
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    targets = {t["device_id"]: t for t in r.json()["targets"]}
    assert sorted(targets) == ["nano-1", "pi-1"]
    assert {d: t["bundle_profile"] for d, t in targets.items()} == {"nano-1": "arm64-cpu", "pi-1": "arm64-cpu"}
    assert r.json()["profiles"] == ["arm64-cpu"]
    page = api.get(f"{url}/api/v1/rollouts/{rid}?targets_limit=10").json()  # the paged answer says it too
    assert [(t["device_id"], t["bundle_profile"]) for t in page["targets"]] == [("nano-1", "arm64-cpu"),
                                                                               ("pi-1", "arm64-cpu")]
    page = api.get(f"{url}/rollouts/{rid}")  # the console's rollout page, for an operator
    assert page.status_code == 200 and "arm64-cpu bundle (CPU fallback of jetson-orin-nano)" in page.text
    assert page.text.count("CPU fallback of") == 1  # the arm64-cpu device runs its own profile's build
    created = next(a for a in api.get(f"{url}/api/v1/rollouts/{rid}/audit").json() if a["action"] == "rollout_created")
    assert created["detail"]["cpu_fallback"] == {"jetson-orin-nano": {"bundle": "arm64-cpu", "count": 1,
                                                                       "devices": ["nano-1"]}}
    # the Jetson is told to install the arm64-cpu build: its desired state (retained on MQTT) names that bundle
    got: list[mqtt.MQTTMessage] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-nano-1")
    c.on_message = lambda cl, u, m: got.append(m)
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    try:
        c.subscribe(proto.topic("nano-1", "desired"), qos=1)
        wait_for(lambda: got)
    finally:
        c.loop_stop()
        c.disconnect()
    desired = proto.decode(proto.DesiredState, got[0].payload, "test")
    assert (desired.rollout_id, desired.target) == (rid, "digits/1.0.0/arm64-cpu.tar")
    dev = api.get(f"{url}/api/v1/devices/nano-1").json()
    assert dev["desired"] == {"model": "digits", "version": "1.0.0", "rollout_id": rid}

    # an x86-cpu device has no fallback: the clear 422 as before
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "group": "office"})
    assert r.status_code == 422
    assert "no bundle of digits 1.0.0 for profile x86-cpu (devices pc-1); it is built for arm64-cpu" in (
        r.json()["error"])
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["odd-1"]})
    assert r.status_code == 422 and "for profile cray-1 (devices odd-1);" in r.json()["error"]

    # a bundle of the device's own profile wins over its fallback: with an x86 build uploaded, the Jetson still
    # falls back, and a profile selector for the Jetsons is served by the fallback too
    r = api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
    assert r.status_code == 201, r.text
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "profile": "jetson-orin-nano"})
    assert r.status_code == 201, r.text
    assert [(t["device_id"], t["bundle_profile"]) for t in r.json()["targets"]] == [("nano-1", "arm64-cpu")]
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "devices": ["pc-1", "pi-1"]})
    assert r.status_code == 201, r.text
    assert [(t["device_id"], t["bundle_profile"]) for t in r.json()["targets"]] == [("pc-1", "x86-cpu"),
                                                                                   ("pi-1", "arm64-cpu")]


def test_a_missing_fallback_bundle_is_named_in_the_refusal(fleet, digits_bundle):
    url, _ = fleet
    r = api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes())
    assert r.status_code == 201, r.text
    r = api.post(f"{url}/api/v1/devices", json={"device_id": "nano-1", "group": "yard", "profile": "jetson-orin-nano"})
    assert r.status_code == 201, r.text
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "group": "yard"})
    assert r.status_code == 422
    assert ("no bundle of digits 1.0.0 for profile jetson-orin-nano (devices nano-1), nor for its CPU fallback "
            "arm64-cpu; it is built for x86-cpu") in r.json()["error"]
    r = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0", "profile": "jetson-orin-nano"})
    assert r.status_code == 422
    assert "profile 'jetson-orin-nano' has no bundle of digits 1.0.0, nor has its CPU fallback 'arm64-cpu'" in (
        r.json()["error"])
