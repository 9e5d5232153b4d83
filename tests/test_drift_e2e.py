"""Output drift end to end: a real broker, a real fleet and real agents serving digits.

A camera change on one box (its images inverted) shows as drift on that device within the telemetry record of the
interval that answered them, while the other box stays stable; a wave whose model answers differently (digits 1.2.0,
its outputs permuted, built here) is halted by the drift gate, while an unchanged model passes the same gate on the
same traffic.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.demo import LocalFleet, infer_images
from tests.conftest import DIGITS, Mosquitto, wait_for


def _drift_rows(lf: LocalFleet, device: str) -> list[dict]:
    r = httpx.get(f"{lf.url}/api/v1/devices/{device}/drift?limit=100",
                  headers={"Authorization": f"Bearer {(lf.work_dir / 'fleet' / 'admin-token').read_text().strip()}"},
                  timeout=30)
    r.raise_for_status()
    return r.json()  # newest first


def _start(lf: LocalFleet, bundle: Path, devices: list[str]) -> None:
    lf.start()
    lf.client.upload(bundle)
    for d in devices:
        lf.client.register(d)
        lf.start_agent(d)
    lf.wait_online(devices)
    assert lf.wait_rollout(lf.client.rollout("digits", "1.0.0", devices).id).status == "succeeded"


@pytest.mark.timeout(300)
def test_a_camera_change_shows_as_drift_on_that_device(tmp_path, mosquitto: Mosquitto, digits_bundle, test_images):
    images, _ = test_images
    lf = LocalFleet(tmp_path, mqtt_url=mosquitto.url, telemetry_interval_s=0.5)
    try:
        _start(lf, digits_bundle, ["cam-a", "cam-b"])
        for d in ("cam-a", "cam-b"):
            infer_images(lf.agents[d].url, "digits", images)
        for d in ("cam-a", "cam-b"):
            wait_for(lambda d=d: sum(r["samples"] for r in _drift_rows(lf, d)) >= len(images), 60,
                     f"{d}'s answers in drift rows", interval_s=0.2)
            assert _drift_rows(lf, d)[0]["level"] == "stable", _drift_rows(lf, d)[0]
        before = {r["received_at"] for r in _drift_rows(lf, "cam-a")}
        infer_images(lf.agents["cam-a"].url, "digits", 1.0 - images)  # the camera now sees a negative
        infer_images(lf.agents["cam-b"].url, "digits", images)
        wait_for(lambda: sum(r["samples"] for r in _drift_rows(lf, "cam-a") if r["received_at"] not in before)
                 >= len(images), 60, "cam-a's inverted answers in drift rows", interval_s=0.2)
        new = [r for r in reversed(_drift_rows(lf, "cam-a")) if r["received_at"] not in before]
        # the record of the interval that answered them says drift (the first with most of them, at most two records)
        biggest = max(new[:2], key=lambda r: r["samples"])
        assert biggest["level"] == "drift" and biggest["psi"] > 0.25, new
        wait_for(lambda: sum(r["samples"] for r in _drift_rows(lf, "cam-b")) >= 2 * len(images), 60,
                 "cam-b's second batch in drift rows", interval_s=0.2)
        assert _drift_rows(lf, "cam-b")[0]["level"] == "stable"
        page = httpx.get(f"{lf.url}/devices/cam-a", cookies={
            "edgefleet_token": (lf.work_dir / "fleet" / "admin-token").read_text().strip()}, timeout=30)
        assert page.status_code == 200 and "<svg" in page.text and "drift (PSI)" in page.text
    finally:
        lf.stop()


def _permuted_digits(out: Path) -> Path:
    """digits with its ten scores permuted: the same model, answering other classes."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(DIGITS / "model.onnx"))
    last = m.graph.node[-1]
    raw = last.output[0] + "_raw"
    final = last.output[0]
    last.output[0] = raw
    perm = np.array([3, 7, 0, 9, 1, 8, 2, 5, 4, 6], np.int64)
    m.graph.initializer.append(numpy_helper.from_array(perm, "drift_test_perm"))
    m.graph.node.append(helper.make_node("Gather", [raw, "drift_test_perm"], [final], axis=1))
    path = out / "model.onnx"
    onnx.save(m, str(path))
    return path


@pytest.mark.timeout(400)
def test_the_drift_gate_halts_a_wave_whose_model_answers_differently(tmp_path, mosquitto: Mosquitto, digits_bundle,
                                                                      digits_bundle_v2, test_images):
    from edgefleet.compiler.compile import CompileOptions, compile_model

    images, labels = test_images
    seen = np.concatenate([images[labels < 3]] * 3)  # this box's camera sees the digits 0, 1 and 2
    work = tmp_path / "permuted"
    work.mkdir()
    permuted = compile_model(CompileOptions(
        model=_permuted_digits(work), profile="x86-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=work, name="digits", version="1.2.0", benchmark=False,
        precision="fp32")).bundle
    lf = LocalFleet(tmp_path / "fleet", mqtt_url=mosquitto.url, telemetry_interval_s=0.5)
    try:
        _start(lf, digits_bundle, ["gate-a"])
        agent = lf.agents["gate-a"]
        infer_images(agent.url, "digits", seen)
        wait_for(lambda: sum(r["samples"] for r in _drift_rows(lf, "gate-a")) >= len(seen), 60,
                 "1.0.0's answers in drift rows", interval_s=0.2)
        gates = {"install_success_min": 1.0, "max_drift_psi": 0.25}

        def roll(bundle: Path, version: str):
            lf.client.upload(bundle)
            rid = lf.client.create_rollout("digits", version, devices=["gate-a"], gates=gates, soak_s=[0.5],
                                           require_telemetry=True).id
            wait_for(lambda: httpx.get(f"{agent.url}/v2/models/digits").json()["versions"] == [version], 120,
                     f"{version} serving", interval_s=0.2)
            infer_images(agent.url, "digits", seen)  # the same camera, the new model
            return lf.wait_rollout(rid, 120)

        same = roll(digits_bundle_v2, "1.1.0")  # the same model (fp32): its answers agree with 1.0.0's
        assert same.status == "succeeded", same
        gate = next(g for g in same.waves[0].gates or [] if g.name == "drift_psi")
        assert gate.value is not None and gate.value <= 0.25 and gate.passed

        moved = roll(permuted, "1.2.0")
        assert moved.status == "failed", moved
        assert "drift_psi" in (moved.reason or "") and "class" in (moved.reason or ""), moved.reason
        gate = next(g for g in moved.waves[0].gates or [] if g.name == "drift_psi")
        assert gate.value is not None and gate.value > 0.25 and not gate.passed
        drift = httpx.get(f"{lf.url}/api/v1/rollouts/{moved.id}/drift", headers={
            "Authorization": f"Bearer {(lf.work_dir / 'fleet' / 'admin-token').read_text().strip()}"}, timeout=30)
        assert drift.status_code == 200 and drift.json()["waves"][0]["vs_previous"]["level"] == "drift"
    finally:
        lf.stop()
