"""The simulator speaks TLS to an ``mqtts://`` broker, checking the broker's certificate as the agent does.

Before, it opened a plain TCP connection whatever the scheme: against a TLS-only Mosquitto every device failed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import Mosquitto, free_port
from tests.test_agent_proxy import _tls
from tests.test_compiler import run_cli


@pytest.fixture
def tls_broker(tmp_path: Path):
    _, ca, other_ca = _tls(tmp_path)
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    # as root Mosquitto drops to its own user before it reads the key (in pytest's private tmp): stay root here
    user = "user root\n" if os.geteuid() == 0 else ""
    conf.write_text(f"{user}listener {port} 127.0.0.1\ncafile {ca}\ncertfile {tmp_path / 'server.pem'}\n"
                    f"keyfile {tmp_path / 'server.key'}\nallow_anonymous true\npersistence false\n")
    m = Mosquitto(port, conf)
    m.start()
    yield f"mqtts://127.0.0.1:{port}", ca, other_ca
    m.stop()


def test_simulated_devices_connect_to_an_mqtts_broker(tls_broker, sims):
    url, ca, _ = tls_broker
    sim = sims(mqtt_url=url, devices=5, mqtt_ca_file=str(ca))
    assert sim.stats.connected == 5


def test_a_broker_whose_certificate_is_not_trusted_is_refused(tls_broker):
    from edgefleet.fleet.simulator import SimConfig, Simulator

    url, _, other_ca = tls_broker
    sim = Simulator(SimConfig(mqtt_url=url, devices=2, mqtt_ca_file=str(other_ca)))
    with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        sim.start(timeout_s=60)


def test_the_cli_takes_the_brokers_ca(tls_broker, tmp_path):
    url, ca, _ = tls_broker
    r = run_cli("simulate", "--devices", "2", "--mqtt-url", url, "--mqtt-ca-file", str(ca), "--duration-s", "0.2")
    assert r.returncode == 0 and "2 simulated devices connected" in r.stderr, r.stderr
    r = run_cli("simulate", "--devices", "2", "--mqtt-url", url, "--mqtt-ca-file", str(tmp_path / "nope.pem"))
    assert r.returncode == 4 and "--mqtt-ca-file" in r.stderr and "Traceback" not in r.stderr, r.stderr
