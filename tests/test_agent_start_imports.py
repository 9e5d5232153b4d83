"""The agent's serving start imports only what serving needs (issue 41: a restart serves in a second). The fleet link
(TUF, securesystemslib, urllib3, paho), the install's trials and steps, the judge and the YAML reader are imported
after the agent listens, or when something asks for them: counted as modules, never timed.

The agent is started as a device starts it (``python -m edgefleet.cli agent``) over an installed digits bundle whose
trial record is kept (the restart's path), with ``-X importtime``: every module the interpreter imported is named on
stderr when its import completes, in order, and the agent's "KServe v2 on ..." line marks where it listens. What
came before that line is the serving start."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from edgefleet.protocol.processes import stop_processes
from tests.agent_harness import preinstall

REPO = Path(__file__).resolve().parent.parent
# not imported before the agent listens (each was, before issue 41's cut; a prefix covers its submodules)
NOT_ON_THE_SERVING_START = (
    "tuf", "securesystemslib", "urllib3", "paho.mqtt.client",  # the fleet link's TUF client and MQTT
    "edgefleet.agent.link.updater", "edgefleet.agent.link.mqtt", "edgefleet.agent.link.enroll",
    "edgefleet.agent.link.fetch", "edgefleet.agent.link.telemetry",
    "edgefleet.agent.install.steps", "edgefleet.agent.install.bench", "edgefleet.agent.install.runtime_choice",
    "edgefleet.judge",  # a pipeline's chain: a single model does not need it
    "edgefleet.agent.core.pipeline",
    "edgefleet.fleet", "edgefleet.compiler",
)
# a self time below 0: another thread imported meanwhile
IMPORTED = re.compile(r"^import time:\s+-?\d+ \|\s+\d+ \|( *)(\S+)\s*$")
LISTENING = "KServe v2 on http://"


def _infer_body() -> bytes:
    x = np.zeros((1, 1, 8, 8), np.float32)
    return json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()


def _start(data: Path, log: Path, importtime: bool) -> tuple[list[str], list[str]]:
    """``edgefleet agent`` over ``data`` (with -X importtime if asked) to its first answer, then stopped -> (modules
    imported before it listened, after)."""
    args = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "edgefleet.cli", "agent",
            "--device-id", "dev-1", "--fleet", "http://127.0.0.1:9", "--data-dir", str(data), "--http-port", "0",
            "--trust-on-first-use", "-v"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            m = re.search(r"KServe v2 on (http://[0-9.:]+)", log.read_text(errors="replace"))
            url = m.group(1) if m else None
            time.sleep(0.05)
        assert url is not None, log.read_text(errors="replace")[-3000:]
        r = httpx.post(f"{url}/v2/models/digits/infer", content=_infer_body(),
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text  # it serves: the start checked is a working one
    finally:
        stop_processes([proc], grace_s=10)
    before: list[str] = []
    after: list[str] = []
    seen = before
    for line in log.read_text(errors="replace").splitlines():
        if LISTENING in line:
            seen = after
        m = IMPORTED.match(line)
        if m:
            seen.append(m.group(2))
    return before, after


def _heavy(modules: list[str]) -> list[str]:
    return sorted({m for m in modules for h in NOT_ON_THE_SERVING_START if m == h or m.startswith(h + ".")})


def test_the_serving_start_imports_no_fleet_link_install_or_judge(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    _start(data, tmp_path / "first.log", importtime=False)  # the install's trials run and are kept
    assert list((data / "store" / "trials").glob("*.json")), "the first start kept no trial record"
    before, _ = _start(data, tmp_path / "restart.log", importtime=True)
    assert "onnxruntime" in before and "edgefleet.agent.install.trials" in before, before  # it loaded the model
    assert "served from its trial record" in (tmp_path / "restart.log").read_text(errors="replace")  # a restart's
    assert _heavy(before) == []
