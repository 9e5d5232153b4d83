"""The whole loop with real processes: compile, upload, rollout, agents install and serve real images.

Run against a Mosquitto the test starts on a free port, and again against the fleet's embedded broker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from edgefleet.demo import AgentProc, LocalFleet, infer_images
from tests.agent_harness import served_version
from tests.conftest import Mosquitto, wait_for

CRASH_AT = Path(__file__).resolve().parent / "crash_at.py"  # runs the agent dying at one install step


def _loop(lf: LocalFleet, bundle, images, labels, devices=("edge-a", "edge-b")) -> None:
    lf.start()
    assert lf.client.upload(bundle).version == "1.0.0"
    for d in devices:
        lf.client.register(d)
        lf.start_agent(d)
    lf.wait_online(list(devices))
    r = lf.wait_rollout(lf.client.rollout("digits", "1.0.0", list(devices)).id)
    assert r.status == "succeeded", r
    for d in devices:
        pred, _ = infer_images(lf.agents[d].url, "digits", images[:120])
        assert (pred == labels[:120]).mean() >= 0.95
        meta = httpx.get(f"{lf.agents[d].url}/v2/models/digits").json()
        assert meta["versions"] == ["1.0.0"] and meta["precision"] == "int8"
    devs = {x.device_id: x for x in lf.client.devices()}
    assert all(devs[d].running_version == "1.0.0" and devs[d].online for d in devices)


@pytest.mark.timeout(300)
def test_whole_loop_with_mosquitto(tmp_path, mosquitto, digits_bundle, test_images):
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url)
    try:
        _loop(lf, digits_bundle, *test_images)
    finally:
        lf.stop()


@pytest.mark.timeout(300)
def test_whole_loop_with_the_embedded_broker(tmp_path, digits_bundle, test_images):
    lf = LocalFleet(tmp_path)
    try:
        _loop(lf, digits_bundle, *test_images)
    finally:
        lf.stop()


def _agent_online(lf: LocalFleet, device: str, bundles: list[Path], extra: list[str] | None = None) -> AgentProc:
    """The fleet started with ``bundles`` uploaded, ``device`` registered and its agent (``extra`` arguments) online."""
    lf.start()
    for bundle in bundles:
        lf.client.upload(bundle)
    lf.client.register(device)
    agent = lf.start_agent(device, extra)
    lf.wait_online([device])
    return agent


def _wait(pred, timeout_s=60.0, what="condition"):
    return wait_for(pred, timeout_s, what, interval_s=0.2)


@pytest.mark.timeout(400)
def test_upgrade_downgrade_broker_outage_and_restart(tmp_path, mosquitto: Mosquitto, digits_bundle,
                                                     digits_bundle_v2, test_images):
    images, labels = test_images
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url, telemetry_interval_s=0.5)
    try:
        agent = _agent_online(lf, "edge-x", [digits_bundle, digits_bundle_v2])
        assert lf.wait_rollout(lf.client.rollout("digits", "1.0.0", ["edge-x"]).id).status == "succeeded"

        # hot swap to 1.1.0 while a client keeps sending: no request fails
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            traffic = pool.submit(infer_images, agent.url, "digits", images[:300], 4)
            r = lf.wait_rollout(lf.client.rollout("digits", "1.1.0", ["edge-x"]).id)
            pred, _ = traffic.result()
        assert r.status == "succeeded"
        assert (pred == labels[:300]).mean() >= 0.95
        assert httpx.get(f"{agent.url}/v2/models/digits").json()["versions"] == ["1.1.0"]

        # a downgrade is refused, reported, and the device keeps serving 1.1.0
        r = lf.wait_rollout(lf.client.rollout("digits", "1.0.0", ["edge-x"]).id)
        assert r.status == "failed" and r.targets and "downgrade refused" in str(r.targets[0].error)
        assert httpx.get(f"{agent.url}/v2/models/digits").json()["versions"] == ["1.1.0"]

        # the broker goes away: the agent keeps serving and spools telemetry; nothing is lost
        mosquitto.stop()
        pred, _ = infer_images(agent.url, "digits", images[:50])
        assert (pred == labels[:50]).mean() >= 0.95
        spool = tmp_path / "agents" / "edge-x" / "spool"
        _wait(lambda: len(list(spool.glob("[0-9]*.json"))) >= 3, 30, "telemetry spooled while offline")
        mosquitto.start()  # same port
        _wait(lambda: not list(spool.glob("[0-9]*.json")), 60, "spool drained after reconnect")
        rows = lf.client.telemetry("edge-x", limit=1000)
        seqs = sorted(r.seq for r in rows)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "telemetry has gaps"
        assert seqs[0] == 0
        served = httpx.get(f"{agent.url}/metrics/summary").json()["requests"]
        assert sum(r.requests for r in rows) == served, (served, [(r.seq, r.requests) for r in rows])

        # the agent restarts with no fleet reachable: it serves its committed model at once
        lf.stop_agent("edge-x")
        lf.fleet_proc.terminate()
        lf.fleet_proc.wait(10)
        lf.fleet_proc = None
        again = lf.start_agent("edge-x")
        _wait(lambda: _ready(again.url), 60, "restarted agent ready")
        assert httpx.get(f"{again.url}/v2/models/digits").json()["versions"] == ["1.1.0"]
        pred, _ = infer_images(again.url, "digits", images[:40])
        assert (pred == labels[:40]).mean() >= 0.95
    finally:
        lf.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_rollout_to_a_device_of_another_architecture_fails_cleanly(tmp_path, mosquitto, digits_bundle):
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url)
    try:
        _agent_online(lf, "jetson-1", [digits_bundle], ["--config", str(_jetson_config(tmp_path))])
        r = lf.wait_rollout(lf.client.rollout("digits", "1.0.0", ["jetson-1"]).id)
        assert r.status == "failed" and r.targets and "built for profile 'x86-cpu'" in str(r.targets[0].error)
        assert not _ready(lf.agents["jetson-1"].url)
    finally:
        lf.stop()


def _jetson_config(tmp_path):
    p = tmp_path / "jetson.yaml"
    p.write_text("profiles: [jetson-orin-nano]\n")
    return p



@pytest.mark.timeout(300)
def test_tampered_bundle_on_the_fleet_is_refused_and_the_old_model_keeps_serving(tmp_path, mosquitto, digits_bundle,
                                                                                 digits_bundle_v2, test_images):
    images, labels = test_images
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url)
    try:
        agent = _agent_online(lf, "edge-t", [digits_bundle])
        assert lf.wait_rollout(lf.client.rollout("digits", "1.0.0", ["edge-t"]).id).status == "succeeded"
        lf.client.upload(digits_bundle_v2)
        stored = next((tmp_path / "fleet" / "tuf" / "targets" / "digits" / "1.1.0").glob("*.tar"))
        data = bytearray(stored.read_bytes())
        data[len(data) // 2] ^= 0x01  # someone with write access to the fleet's disk flips one bit
        stored.write_bytes(bytes(data))
        r = lf.wait_rollout(lf.client.rollout("digits", "1.1.0", ["edge-t"]).id)
        assert r.status == "failed"
        assert r.targets and "TUF verification failed" in str(r.targets[0].error)
        assert httpx.get(f"{agent.url}/v2/models/digits").json()["versions"] == ["1.0.0"]
        pred, _ = infer_images(agent.url, "digits", images[:40])
        assert (pred == labels[:40]).mean() >= 0.95
    finally:
        lf.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("point", "after_restart"), [("extracted", "1.0.0"), ("moved", "1.0.0"),
                                                       ("before_commit", "1.0.0"), ("after_commit", "1.1.0")])
def test_agent_process_killed_mid_install_restarts_on_a_whole_model(tmp_path, mosquitto, digits_bundle,
                                                                    digits_bundle_v2, test_images, point,
                                                                    after_restart):
    """A real crash (os._exit, no clean-up) at each step of an install: on restart the agent serves either
    the old model or the new one, whole, and then finishes the rollout from the retained desired state."""
    images, labels = test_images
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url)
    try:
        _agent_online(lf, "edge-c", [digits_bundle, digits_bundle_v2])
        assert lf.wait_rollout(lf.client.rollout("digits", "1.0.0", ["edge-c"]).id).status == "succeeded"
        lf.stop_agent("edge-c")
        doomed = lf.start_agent("edge-c", launcher=[sys.executable, str(CRASH_AT), point])
        lf.wait_online(["edge-c"])
        rid = lf.client.rollout("digits", "1.1.0", ["edge-c"]).id
        assert doomed.proc.wait(60) == 137
        lf.agents.pop("edge-c")
        # what the disk holds after the crash: one whole model, the old or the new one by where it died
        from edgefleet.agent.install.store import ModelStore

        store = ModelStore(tmp_path / "agents" / "edge-c" / "store")
        entry = store.recover()
        assert entry is not None and entry.installed.version == after_restart
        store.load_manifest(entry, verify=True)  # every file present and matching its sha256
        again = lf.start_agent("edge-c")
        _wait(lambda: served_version(again.url), 60, "restarted agent serving")
        pred, _ = infer_images(again.url, "digits", images[:40])
        assert (pred == labels[:40]).mean() >= 0.95
        # and the retained desired state brings it to 1.1.0
        assert lf.wait_rollout(rid).status == "succeeded"
        assert served_version(again.url) == "1.1.0"
    finally:
        lf.stop()


@pytest.mark.timeout(300)
def test_a_shadow_wave_on_a_real_agent_mirrors_live_requests_then_installs(tmp_path, mosquitto, digits_bundle,
                                                                           digits_bundle_v2, test_images):
    """The agent loads 1.1.0 in shadow next to 1.0.0, keeps answering with 1.0.0, mirrors the live requests
    to 1.1.0 off the request path, and reports their agreement; the fleet installs 1.1.0 once it agrees."""
    images, labels = test_images
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("shadow_sample_rate: 1.0\n")
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url, telemetry_interval_s=0.3)
    try:
        agent = _agent_online(lf, "edge-s", [digits_bundle, digits_bundle_v2], ["--config", str(cfg)])
        assert lf.wait_rollout(lf.client.rollout("digits", "1.0.0", ["edge-s"]).id).status == "succeeded"
        r = lf.client.create_rollout("digits", "1.1.0", devices=["edge-s"],
                                     shadow={"agreement_min": 0.95, "min_samples": 100})
        _wait(lambda: lf.client.device("edge-s").last_state == "shadowing", 60,
              "the agent shadowing 1.1.0")
        # answered by 1.0.0, mirrored to 1.1.0 as far as the candidate keeps up (the agent skips a mirror when two
        # are already waiting, and counts it): more rounds of live traffic until the gate has its 100 samples
        for round_ in range(8):
            pred, _ = infer_images(agent.url, "digits", images[:150])
            assert (pred == labels[:150]).mean() >= 0.95
            if round_ == 0:  # the candidate answers nobody while it shadows
                assert httpx.get(f"{agent.url}/v2/models/digits").json()["versions"] == ["1.0.0"]
            try:
                _wait(lambda: lf.client.get_rollout(r.id, targets=False).status != "in_progress", 5, "the wave")
                break
            except AssertionError:
                continue
        done = lf.wait_rollout(r.id)
        assert done.status == "succeeded", done
        gate = (done.waves[0].gates or [])[0]
        assert gate.name == "shadow_agreement" and gate.passed and (gate.value or 0) >= 0.95, gate
        _wait(lambda: httpx.get(f"{agent.url}/v2/models/digits").json()["versions"] == ["1.1.0"], 30,
              "1.1.0 serving after the shadow passed")
        print(f"\nshadow: {gate.detail}")
    finally:
        lf.stop()


@pytest.mark.timeout(300)
def test_a_device_reports_the_precision_it_timed_and_the_fleet_shows_it(tmp_path, mosquitto, two_precision_bundle,
                                                                        test_images):
    """A bundle with two precisions, rolled out through a real broker: the device times both at install, serves
    the faster, and its report carries the figures and the choice; the fleet stores them with the device's
    self-test, its API returns them and the console's device page shows them."""
    images, labels = test_images
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url)
    try:
        lf.start()
        m = lf.client.upload(two_precision_bundle)
        assert m.precision == "int8"
        lf.client.register("edge-p")
        lf.start_agent("edge-p")
        lf.wait_online(["edge-p"])
        r = lf.wait_rollout(lf.client.rollout("digits", "1.0.0", ["edge-p"]).id)
        assert r.status == "succeeded", r

        def serving():
            st = lf.client.device("edge-p").selftest
            return st.serving if st is not None else None

        sv = _wait(serving, what="the device's serving choice").model_dump(mode="json")
        assert sv["precision_source"] == "device", sv
        timed = {t["precision"]: t["items_per_s"] for t in sv["precisions"]}
        assert set(timed) == {"int8", "fp32"} and all(v > 0 for v in timed.values()), sv
        served = httpx.get(f"{lf.agents['edge-p'].url}/v2/models/digits/config").json()["precision_choice"]
        assert served["precision"] == sv["precision"] and served["items_per_second"] == timed
        assert sv["batch_source"] == "measured" and sv["batch_timings"] and sv["max_batch_size"] >= 1, sv
        # telemetry carries how the model it serves now runs (a restart chooses again without an install report)
        # (the first record may predate the install: wait for one sent while the model served)
        t = _wait(lambda: (t if (t := lf.client.device("edge-p").telemetry) is not None and t.model is not None
                           else None), what="telemetry from the installed model")
        assert t.serving is not None and t.serving.model_dump(mode="json") == sv
        pred, _ = infer_images(lf.agents["edge-p"].url, "digits", images[:60])
        assert (pred == labels[:60]).mean() >= 0.95
        html = httpx.get(f"{lf.url}/devices/edge-p", headers={"Authorization": f"Bearer {lf.client.token}"}).text
        assert f"<b>{sv['precision']}</b>" in html and "timed here: " in html, html
        assert f"int8 {timed['int8']:g}/s" in html and f"fp32 {timed['fp32']:g}/s" in html
        # and the runtime serving it, chosen on the device (runtime: auto; issue 35)
        assert sv["runtime"] is not None and f'<b class="runtime">{sv["runtime"]["runtime"]}</b>' in html, sv
    finally:
        lf.stop()
