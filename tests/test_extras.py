"""Extras that match the parts: a box without one gets a one-line error naming it when it asks for that feature,
and everything else keeps working.

    [image]     OpenCV, for the agent's POST /v2/models/M/infer/image only
    [broker]    amqtt, for the fleet's embedded broker only (`fleet serve` without --mqtt-url, the demo)
    [postgres]  psycopg, for a PostgreSQL database only

Each case runs the real command line (or server) in a subprocess that sees only the named extras' closure of this
venv (tests/installs.py: an import blocker, nothing of the code under test mocked).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import numpy as np
import pytest

from edgefleet.protocol.processes import stop_processes
from tests.agent_harness import preinstall
from tests.conftest import DIGITS, free_port, postgres_db, wait_for
from tests.installs import CLI, argv_as_installed, blocked_modules, closure, run_as_installed


def test_the_extras_split_the_heavy_parts_out():
    agent, fleet = closure("agent"), closure("fleet")
    assert "opencv-python-headless" not in agent and "opencv-python-headless" in closure("agent", "image")
    assert "amqtt" not in fleet and "amqtt" in closure("fleet", "broker")
    assert "psycopg" not in fleet and "psycopg" in closure("fleet", "postgres")
    assert "httpx" not in fleet  # no fleet module imports it (the demo's client does: [demo])
    assert {"cv2", "amqtt", "psycopg"} <= blocked_modules("agent", "fleet")
    # what make venv installs ([dev]) still has every part
    assert {"opencv-python-headless", "amqtt", "psycopg", "httpx", "onnxruntime", "cryptography"} <= closure("dev")


def _png(pixels: np.ndarray) -> bytes:
    import cv2

    ok, png = cv2.imencode(".png", pixels)
    assert ok
    return bytes(png.tobytes())


@contextmanager
def _running_as_installed(extras: tuple[str, ...], argv: list[str], log_path: Path, ready_url: str,
                          what: str) -> Iterator[IO[str]]:
    """``edgefleet argv`` as on a box with only ``edgefleet[extras]``, until ``ready_url`` answers 200 (60 s; the
    process exiting first fails with its log's tail); stopped on the way out. -> its log file."""
    log = log_path.open("w+")
    proc = subprocess.Popen(argv_as_installed(extras, CLI, *argv), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        def ready() -> bool:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                return httpx.get(ready_url, timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, timeout_s=60, what=what)
        yield log
    finally:
        stop_processes([proc], grace_s=30)
        log.close()


def test_image_endpoint_on_an_agent_without_the_image_extra_is_a_501_naming_it(tmp_path, image_bundle):
    data = tmp_path / "device"
    preinstall(data, image_bundle)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["agent", "--device-id", "box-1", "--fleet", "http://127.0.0.1:9", "--data-dir", str(data),
            "--trust-on-first-use", "--http-host", "127.0.0.1", "--http-port", str(port)]
    with _running_as_installed(("agent",), argv, tmp_path / "agent.log", f"{url}/v2/health/ready",
                               "the agent-only agent ready") as log:
        with np.load(DIGITS / "test.npz") as npz:
            x = npz["input"][:1].astype(np.float32)
        r = httpx.post(f"{url}/v2/models/digits/infer/image", content=_png(np.round(x[0, 0] * 255).astype(np.uint8)),
                       headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 501, r.text
        msg = r.json()["error"]
        assert "pip install 'edgefleet[image]'" in msg and "\n" not in msg, msg
        # the process keeps serving tensors
        r = httpx.post(f"{url}/v2/models/digits/infer", timeout=30, json={"inputs": [{
            "name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
        assert r.status_code == 200, r.text
        assert "cv2" not in Path(log.name).read_text()  # no traceback about it either


def _keys(tmp_path: Path) -> Path:
    r = run_as_installed(("fleet",), CLI, "keys", "init", str(tmp_path / "keys"))
    assert r.returncode == 0, r.stderr
    return tmp_path / "keys"


def test_fleet_serve_with_the_embedded_broker_but_no_broker_extra_names_it(tmp_path):
    keys = _keys(tmp_path)
    r = run_as_installed(("fleet",), CLI, "fleet", "serve", "--data-dir", str(tmp_path / "fleet"), "--keys",
                         str(keys), "--port", str(free_port()), "--embedded-mqtt-port", str(free_port()))
    assert r.returncode == 4, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'edgefleet[broker]'" in lines[0] and "--mqtt-url" in lines[0], r.stderr
    # the library says the same to whoever builds a FleetServer with no broker URL
    code = ("from pathlib import Path\nfrom edgefleet.fleet.app import FleetConfig, FleetServer\n"
            "from edgefleet.protocol.errors import ConfigError\n"
            "try:\n"
            f"    FleetServer(FleetConfig(data_dir=Path({str(tmp_path / 'lib')!r}), keys_dir=Path({str(keys)!r}),"
            " embedded_mqtt_port=0))\n"
            "except ConfigError as exc:\n    print(exc)\n")
    r = run_as_installed(("fleet",), code)
    assert r.returncode == 0 and "pip install 'edgefleet[broker]'" in r.stdout, r.stdout + r.stderr


def test_a_production_fleet_on_mosquitto_runs_without_amqtt_or_psycopg(tmp_path, mosquitto):
    keys = _keys(tmp_path)
    port = free_port()
    argv = ["fleet", "serve", "--data-dir", str(tmp_path / "fleet"), "--keys", str(keys), "--port", str(port),
            "--mqtt-url", mosquitto.url]
    with _running_as_installed(("fleet",), argv, tmp_path / "fleet.log", f"http://127.0.0.1:{port}/api/v1/health",
                               "the fleet on Mosquitto healthy"):
        pass  # healthy on Mosquitto without amqtt or psycopg importable: the test's whole point


def test_a_postgresql_url_without_the_postgres_extra_names_it(tmp_path, mosquitto):
    keys = _keys(tmp_path)
    for url in ("postgresql://fleet:s3cret@127.0.0.1:5432/fleet", "postgresql+psycopg://127.0.0.1/fleet"):
        r = run_as_installed(("fleet",), CLI, "fleet", "serve", "--data-dir", str(tmp_path / "fleet"), "--keys",
                             str(keys), "--port", str(free_port()), "--mqtt-url", mosquitto.url, "--db-url", url)
        assert r.returncode == 4, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'edgefleet[postgres]'" in lines[0], r.stderr
        assert "s3cret" not in r.stderr


def test_a_plain_postgresql_url_uses_psycopg(tmp_path):
    """``postgresql://`` (SQLAlchemy's default driver is psycopg2, which no extra installs) means psycopg here."""
    url = postgres_db("edgefleet_extras_test")
    if url is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth)")
    from edgefleet.fleet.db import make_engine

    engine, _ = make_engine(url.replace("postgresql+psycopg://", "postgresql://"))
    try:
        assert engine.dialect.driver == "psycopg"
    finally:
        engine.dispose()


def test_demo_without_its_extras_names_demo(tmp_path):
    r = run_as_installed(("agent", "compiler", "fleet"), CLI, "demo", "--work-dir", str(tmp_path), "--exit")
    assert r.returncode == 4, r.stderr
    assert "pip install 'edgefleet[demo]'" in r.stderr, r.stderr


