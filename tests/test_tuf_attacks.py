"""The rest of TUF's threat model, attack by attack, at a real agent against the fleet's real
repository over HTTP. An attacker sits between the two (a proxy on loopback that the fleet names as
its public URL) and can rewrite or slow down anything the agent downloads. Each attack must be
refused, the old model must keep serving, and the device's report must say why.

One Mosquitto, one fleet, one agent (serving digits 1.0.0) for the whole module; each attack
publishes its own version.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.bundle import sha256_file
from tests.agent_harness import running_agent
from tests.conftest import free_port, running_mosquitto, wait_for
from tests.fleet_harness import running_fleet
from tests.test_crash_random import record_figures
from tests.test_tuf_bundles import rebundle, write_raw_bundle

DEVICE = "edge-tuf"
Rule = Callable[[str, bytes], "Reply | None"]


@dataclass
class Reply:
    body: bytes
    dribble_s: float = 0.0  # send one byte per this many seconds (slow retrieval)


@dataclass
class Attacker:
    """An HTTP proxy to the fleet that applies ``rule`` (path, upstream body) -> Reply | None."""

    port: int
    upstream: str = ""
    rule: Rule | None = None
    hits: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self) -> http.server.ThreadingHTTPServer:
        attacker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                r = httpx.get(attacker.upstream + self.path, timeout=30)
                reply = attacker.rule(self.path, r.content) if attacker.rule and r.status_code == 200 else None
                if reply is not None:
                    attacker.hits.append(self.path)
                body = r.content if reply is None else reply.body
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/octet-stream"))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if reply is not None and reply.dribble_s:
                        deadline = time.monotonic() + 120  # bounded even if the client never gives up
                        for i in range(len(body)):
                            if time.monotonic() > deadline:
                                return
                            self.wfile.write(body[i:i + 1])
                            self.wfile.flush()
                            time.sleep(reply.dribble_s)
                    else:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the agent hung up: what a refused slow retrieval looks like from here

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv


@dataclass
class World:
    fs: object
    agent_url: str
    attacker: Attacker
    tmp: Path
    digits: Path
    images: np.ndarray
    labels: np.ndarray
    reports: list[proto.ReportedState] = field(default_factory=list)  # what the device said, as sent


@pytest.fixture(scope="module")
def world(tmp_path_factory, digits_bundle, test_images) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("tuf-attacks")
    with running_mosquitto(tmp) as broker:
        attacker = Attacker(free_port())
        srv = attacker.serve()
        try:
            with running_fleet(tmp, broker.url, public_url=attacker.url) as (fs, url):
                attacker.upstream = url
                fs.service.devices.register_device(DEVICE)
                fs.service.models.upload_bundle(digits_bundle)
                with running_agent(tmp / "agent", device_id=DEVICE, fleet_url=attacker.url,
                                   trusted_root=tmp / "keys" / "root.json", install_retries=0,
                                   download_grace_s=2.0, download_min_bytes_per_s=4096) as (agent, agent_url):
                    wait_for(lambda: fs.service.devices.get_device(DEVICE).online, 30, "agent online")
                    rid = fs.service.rollouts.create_rollout("digits", "1.0.0", [DEVICE]).id
                    wait_for(lambda: fs.service.rollouts.get_rollout(rid).status == "succeeded", 60,
                             "1.0.0 installed")
                    w = World(fs, agent_url, attacker, tmp, digits_bundle, *test_images)
                    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="report-watcher")
                    sub.on_message = lambda c, u, m: w.reports.append(
                        proto.decode(proto.ReportedState, bytes(m.payload), source=m.topic))
                    sub.connect("127.0.0.1", broker.port)
                    sub.subscribe(proto.topic(DEVICE, "reported"), qos=1)
                    sub.loop_start()
                    try:
                        yield w
                    finally:
                        sub.loop_stop()
                        sub.disconnect()
        finally:
            srv.shutdown()
            srv.server_close()


def _refused(w: World, version: str, why: str) -> str:
    """Wait for the device to report the install of ``version`` failed; check the old model serves."""
    def failed() -> str | None:
        for r in list(w.reports):
            if r.version == version and r.state == "failed" and why in (r.error or ""):
                return r.error
        return None

    try:
        err = wait_for(failed, 60, f"the device reports {version} refused ({why})", interval_s=0.1)
    finally:
        w.attacker.rule = None
    assert not [r for r in w.reports if r.version == version and r.state == "installed"]
    wait_for(lambda: w.fs.service.devices.get_device(DEVICE).last_error == err, 30,  # type: ignore[attr-defined]
             "the fleet recorded why")
    meta = httpx.get(f"{w.agent_url}/v2/models/digits").json()
    assert meta["versions"] == ["1.0.0"], f"the attack changed the served model: {meta['versions']}"
    img = w.images[:16]
    body = {"inputs": [{"name": "input", "shape": list(img.shape), "datatype": "FP32",
                        "data": img.reshape(-1).tolist()}]}
    out = httpx.post(f"{w.agent_url}/v2/models/digits/infer", json=body, timeout=30).json()["outputs"][0]
    pred = np.array(out["data"]).reshape(out["shape"]).argmax(1)
    assert (pred == w.labels[:16]).mean() >= 0.9, "the old model no longer answers correctly"
    record_figures("attack", {"attack": why, "refused": True})
    return err


def _publish_desired(w: World, target: str, bundle: Path, version: str) -> None:
    """What the fleet publishes for a rollout, for targets the fleet's upload path would never make."""
    msg = proto.DesiredState(device_id=DEVICE, ts=time.time(), rollout_id=None, model="digits", version=version,
                             target=target, sha256=sha256_file(bundle), size_bytes=bundle.stat().st_size)
    w.fs.bridge.publish(proto.topic(DEVICE, "desired"), proto.encode(msg), retain=True)  # type: ignore[attr-defined]


def _roll_out(w: World, bundle: Path, version: str) -> None:
    w.fs.service.models.upload_bundle(bundle)  # type: ignore[attr-defined]
    w.fs.service.rollouts.create_rollout("digits", version, [DEVICE])  # type: ignore[attr-defined]


def _metadata_version(w: World, role: str) -> int:
    tgt, snap, ts = w.fs.repo._load()  # type: ignore[attr-defined]
    return {"targets": tgt, "snapshot": snap}[role].signed.version


@pytest.mark.parametrize("role", ["targets", "snapshot"])
def test_attack_mix_and_match_metadata(world: World, role: str):
    """The attacker answers the request for the newest targets (or snapshot) metadata with a validly
    signed older one: every file verifies alone, but they were never published together."""
    version = {"targets": "1.1.0", "snapshot": "1.2.0"}[role]
    bundle = rebundle(world.digits, world.tmp / f"mm-{role}.tar", version=version)
    world.fs.service.models.upload_bundle(bundle)  # type: ignore[attr-defined]
    newest = _metadata_version(world, role)
    older = httpx.get(f"{world.attacker.upstream}/tuf/metadata/{newest - 1}.{role}.json").content

    def swap(path: str, body: bytes) -> Reply | None:
        return Reply(older) if path.endswith(f"/metadata/{newest}.{role}.json") else None

    world.attacker.rule = swap
    world.fs.service.rollouts.create_rollout("digits", version, [DEVICE])  # type: ignore[attr-defined]
    err = _refused(world, version, "BadVersionNumber")
    assert world.attacker.hits, "the attack never ran"
    assert "TUF verification failed" in err


def test_attack_slow_retrieval(world: World):
    """The attacker serves the genuine bundle one byte at a time: the download is abandoned."""
    bundle = rebundle(world.digits, world.tmp / "slow.tar", version="1.3.0")
    world.attacker.rule = lambda path, body: Reply(body, dribble_s=0.05) if "/tuf/targets/" in path else None
    _roll_out(world, bundle, "1.3.0")
    err = _refused(world, "1.3.0", "SlowRetrievalError")
    assert "below the 4096 B/s minimum" in err


def test_attack_manifest_claims_another_profile_than_its_target_path(world: World):
    """Signed as digits/1.4.0/x86-cpu.tar, but the bundle inside says it was built for arm64-cpu."""
    bundle = rebundle(world.digits, world.tmp / "arm.tar", version="1.4.0", profile="arm64-cpu")
    target = "digits/1.4.0/x86-cpu.tar"
    world.fs.repo.add_target(target, bundle, {"name": "digits", "version": "1.4.0",  # type: ignore[attr-defined]
                                              "profile": "x86-cpu", "cpu_features": []})
    _publish_desired(world, target, bundle, "1.4.0")
    err = _refused(world, "1.4.0", "bundle manifest says digits 1.4.0 arm64-cpu")
    assert "expected digits 1.4.0 x86-cpu" in err


def test_attack_unknown_manifest_version(world: World):
    """A bundle written for a manifest contract this agent does not know is not guessed at."""
    bundle = write_raw_bundle(world.digits, world.tmp / "future.tar",
                              lambda d: {**d, "version": "1.5.0", "manifest_version": 99})
    target = "digits/1.5.0/x86-cpu.tar"
    world.fs.repo.add_target(target, bundle, {"name": "digits", "version": "1.5.0",  # type: ignore[attr-defined]
                                              "profile": "x86-cpu", "cpu_features": []})
    _publish_desired(world, target, bundle, "1.5.0")
    _refused(world, "1.5.0", "manifest_version 99 is newer than this edgefleet understands")


def test_the_attacker_proxy_passes_honest_traffic(world: World):
    """Without a rule the proxy is transparent: a genuine new version installs through it (so the
    refusals above come from the attacks, not from the proxy)."""
    bundle = rebundle(world.digits, world.tmp / "honest.tar", version="1.0.1")
    _roll_out(world, bundle, "1.0.1")
    wait_for(lambda: httpx.get(f"{world.agent_url}/v2/models/digits").json()["versions"] == ["1.0.1"], 60,
             "1.0.1 installed through the proxy")
