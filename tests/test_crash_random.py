"""Crash safety at random: a real agent process is SIGKILLed at random moments while it downloads,
installs and swaps in a new model, then restarted.

After every restart the box must serve a complete, verified model at once (old or new), converge to
the desired version, and leave no temporary file behind. One fleet (in this process), one Mosquitto
and one agent data folder live through all iterations; each iteration rolls out a new version.

    EDGEFLEET_CRASH_SEED=<int>        replay a run (the seed is printed)
    EDGEFLEET_CRASH_ITERATIONS=<n>    default 50
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.agent.install.store import ModelStore
from edgefleet.demo import AgentProc, free_port, spawn
from tests.agent_harness import served_version
from tests.conftest import Mosquitto, wait_for
from tests.fleet_harness import running_fleet
from tests.test_tuf_bundles import rebundle

DEVICE = "crash-1"
PAD = 6 * 1024 * 1024  # bigger bundles: download and hashing take long enough to be hit


_STARTED: list[AgentProc] = []


@pytest.fixture(autouse=True)
def _kill_agents_left_running():
    yield
    while _STARTED:
        _kill(_STARTED.pop())


def _start_agent(work: Path, fleet_url: str) -> AgentProc:
    port = free_port()
    log = work / "logs" / "agent.log"
    # one runtime: each install's runtime trial (a child process timing onnxruntime and OpenVINO) is not what this
    # test kills at random, and 50 installs of it cost minutes on a loaded box
    config = work / "agent-config.yaml"
    config.write_text("runtime: onnxruntime\n", encoding="utf-8")
    args = ["agent", "--config", str(config), "--device-id", DEVICE, "--fleet", fleet_url, "--data-dir",
            str(work / "agent"), "--trusted-root", str(work / "keys" / "root.json"), "--http-port", str(port),
            "--telemetry-interval-s", "0.5", "--threads", "1", "-v"]
    a = AgentProc(DEVICE, f"http://127.0.0.1:{port}", spawn(args, log), log)
    _STARTED.append(a)
    return a


def _kill(a: AgentProc) -> None:
    if a.proc.poll() is None:
        a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)


def _phase(data: Path, want_dir_prefix: str) -> str:
    """Where the install was when the process died, judged from what it left on disk."""
    state = data / "store" / "state.json"
    cur = json.loads(state.read_text())["current"] if state.exists() else None
    committed = cur is not None and cur["directory"].startswith(want_dir_prefix)
    downloaded = any((data / "tuf" / "downloads").glob("*"))
    if committed:
        return "swap" if downloaded else "after_install"
    if any((data / "store" / "models").glob(f"{want_dir_prefix}*")) or any((data / "store" / "staging").iterdir()):
        return "install"
    return "download" if downloaded else "before_download"


def _serving_or_exit(a: AgentProc) -> str | None:
    if a.proc.poll() is not None:
        raise AssertionError(f"agent exited with {a.proc.returncode}; see {a.log}")
    return served_version(a.url)


def _infer_ok(url: str, images: np.ndarray, labels: np.ndarray) -> bool:
    hits = 0
    for img, label in zip(images, labels, strict=True):
        body = {"inputs": [{"name": "input", "shape": [1, *img.shape], "datatype": "FP32",
                            "data": img.reshape(-1).tolist()}]}
        r = httpx.post(f"{url}/v2/models/digits/infer", json=body, timeout=10)
        if r.status_code != 200:
            return False
        hits += int(np.argmax(r.json()["outputs"][0]["data"]) == label)
    return hits >= len(labels) - 1


def _verified_current(data: Path) -> str | None:
    """The committed model's version if every one of its files matches the signed manifest."""
    state = json.loads((data / "store" / "state.json").read_text())
    entry = ModelStore._entry(state["current"])
    if entry is None:
        return None
    return ModelStore(data / "store").load_manifest(entry, verify=True).version


def _leftovers(data: Path, keep_dirs: set[str]) -> list[str]:
    """Temporary files or folders an interrupted install must not leave behind."""
    bad = []
    for p in data.rglob("*"):
        rel = p.relative_to(data).as_posix()
        if p.name.endswith(".tmp") or p.name.startswith("tmp") or p.name.startswith("stage-"):
            bad.append(rel)
    bad += [p.relative_to(data).as_posix() for p in (data / "tuf" / "downloads").iterdir()]
    bad += [p.relative_to(data).as_posix() for p in (data / "store" / "staging").iterdir()]
    bad += [f"store/models/{p.name}" for p in (data / "store" / "models").iterdir() if p.name not in keep_dirs]
    if bad:  # the running agent writes its spool meanwhile: a temp file of a live write is gone a moment later
        time.sleep(1.0)
        bad = [rel for rel in bad if (data / rel).exists()]
    return bad


def record_figures(name: str, figures: dict) -> None:
    """Append this test's figures for bench/reliability.py (when it asked for them)."""
    out = os.environ.get("EDGEFLEET_RELIABILITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


@pytest.mark.timeout(1200)
def test_sigkill_at_random_during_download_install_and_swap(tmp_path, mosquitto: Mosquitto, digits_bundle,
                                                            digits_bundle_v2, test_images):
    seed = int(os.environ.get("EDGEFLEET_CRASH_SEED", random.SystemRandom().randrange(2**31)))
    iterations = int(os.environ.get("EDGEFLEET_CRASH_ITERATIONS", "50"))
    print(f"\ncrash test seed: {seed} (EDGEFLEET_CRASH_SEED={seed} replays it), {iterations} iterations")
    rng = random.Random(seed)
    images, labels = test_images[0][:8], test_images[1][:8]
    data = tmp_path / "agent"
    bundles = tmp_path / "bundles"
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        svc = fs.service
        svc.devices.register_device(DEVICE)

        def publish(i: int) -> str:
            version = f"2.0.{i}"
            src = digits_bundle if i % 2 else digits_bundle_v2  # int8 and fp32 engines take turns
            svc.models.upload_bundle(rebundle(src, bundles / f"{i}.tar", pad_bytes=PAD, version=version))
            return version

        def converge(version: str, rollout_id: int, agent: AgentProc) -> None:
            def done() -> bool:
                if agent.proc.poll() is not None:
                    raise AssertionError(f"agent exited with {agent.proc.returncode}; see {agent.log}")
                return (served_version(agent.url) == version
                        and svc.rollouts.get_rollout(rollout_id).status != "in_progress")
            wait_for(done, 120, f"converging to {version}", interval_s=0.1)
            assert svc.rollouts.get_rollout(rollout_id).status == "succeeded", svc.rollouts.get_rollout(rollout_id)

        # the first install, undisturbed: it also measures how long an install takes on this machine
        version = publish(0)
        agent = _start_agent(tmp_path, url)
        wait_for(lambda: served_version(agent.url) is not None or svc.devices.get_device(DEVICE).online, 60,
                 "agent up")
        t0 = time.monotonic()
        rid = svc.rollouts.create_rollout("digits", version, [DEVICE]).id
        converge(version, rid, agent)
        install_s = time.monotonic() - t0
        _kill(agent)
        t0 = time.monotonic()
        agent = _start_agent(tmp_path, url)
        wait_for(lambda: _serving_or_exit(agent), 60, "agent serving after restart", interval_s=0.05)
        startup_s = time.monotonic() - t0
        print(f"undisturbed install {install_s:.2f}s, restart to serving {startup_s:.2f}s")

        phases: Counter[str] = Counter()
        broken: list[str] = []
        kills = 0
        for i in range(1, iterations + 1):
            old = version
            version = publish(i)
            rid = svc.rollouts.create_rollout("digits", version, [DEVICE]).id
            # kill 1: while the running agent installs; sometimes kill 2: while the restarted one resumes
            time.sleep(rng.uniform(0, install_s * 0.9))
            _kill(agent)
            kills += 1
            phases[_phase(data, f"digits-{version}-")] += 1
            if rng.random() < 0.3:
                agent = _start_agent(tmp_path, url)
                time.sleep(rng.uniform(startup_s * 0.5, startup_s + install_s * 1.3))
                _kill(agent)
                kills += 1
                phases[_phase(data, f"digits-{version}-")] += 1
            agent = _start_agent(tmp_path, url)
            # at once, before the fleet is even asked: a complete model that is the old or the new one
            first = wait_for(lambda a=agent: _serving_or_exit(a), 60, f"iteration {i}: serving after restart",
                             interval_s=0.05)
            if first not in (old, version) or not _infer_ok(agent.url, images, labels):
                broken.append(f"iteration {i}: served {first!r} after restart, wanted {old} or {version}")
            converge(version, rid, agent)
            assert _verified_current(data) == version
            state = json.loads((data / "store" / "state.json").read_text())
            keep = {e["directory"] for e in (state["current"], state["previous"]) if e}
            left = _leftovers(data, keep)
            assert not left, f"iteration {i} (seed {seed}): temporary files left behind: {left}"
        _kill(agent)

    print(f"SIGKILLs: {kills} over {iterations} iterations; phase at the kill: {dict(phases)}; "
          f"boxes without a working model: {len(broken)}")
    record_figures("crash", {"iterations": iterations, "kills": kills, "phases": dict(phases),
                             "without_model": len(broken), "seed": seed})
    assert not broken, broken
    # the kills did land inside installs, not only before or after them
    assert phases["download"] + phases["install"] + phases["swap"] > 0, phases
