"""Probes of precision chosen on the device (manifest v4 variants, the agent's ``precision`` setting, the serving
report) from the outside: a crafted v4 manifest, a careless agent config, a variant engine that breaks on the
device, and a hostile device's serving figures sent to a real fleet through its broker."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from edgefleet.agent.errors import BackendError, SelfTestFailed
from edgefleet.agent.install.precision import pick_precision
from edgefleet.agent.install.store import StagedModel
from edgefleet.engines import Engine, EngineError, load_bundle_engine
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.bundle import extract_bundle, sha256_file
from edgefleet.protocol.errors import ContractError
from edgefleet.protocol.manifest import parse_manifest
from tests.conftest import wait_for
from tests.fleet_harness import api, running_fleet
from tests.test_trust_boundaries import _device, _enroll

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def v4(two_precision_bundle, tmp_path_factory) -> tuple[dict[str, Any], Path]:
    d = tmp_path_factory.mktemp("v4")
    m = extract_bundle(two_precision_bundle, d)
    return m.model_dump(mode="json"), d


# -- the manifest: each file has one role ----------------------------------------------------------------------
@pytest.mark.parametrize("key, names", [
    ("engine", "selftest"),  # the variant's engine is the primary's self-test sample
    ("selftest", "engine"),  # the variant's self-test sample is the primary's engine
    ("selftest", "selftest"),  # both self-test one sample: the variant's expected answers are the primary's
])
def test_a_variant_cannot_reuse_a_file_of_the_bundles_own_engine(v4, key, names):
    data = copy.deepcopy(v4[0])
    data["variants"][0][key] = data[names]
    with pytest.raises(ContractError, match="file"):
        parse_manifest(data)


def test_a_variant_naming_the_manifest_or_not_passing_or_five_of_them_is_refused(v4):
    base = v4[0]
    cases = []
    d = copy.deepcopy(base)
    d["variants"][0]["engine"] = "manifest.json"
    d["files"]["manifest.json"] = d["files"].pop("model-fp32.onnx")
    cases.append(d)
    d = copy.deepcopy(base)
    d["variants"][0]["precision"] = d["precision"]  # the primary's precision again
    cases.append(d)
    d = copy.deepcopy(base)
    d["variants"] = [d["variants"][0]] * 5
    cases.append(d)
    d = copy.deepcopy(base)
    d["variants"] = []  # mode device with nothing to choose among
    cases.append(d)
    for case in cases:
        with pytest.raises(ContractError):
            parse_manifest(case)


# -- the agent's precision setting ----------------------------------------------------------------------------
def test_a_typo_in_the_precision_setting_is_a_config_error(tmp_path):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"device_id: dev-1\nfleet_url: http://127.0.0.1:9\ndata_dir: {tmp_path / 'd'}\n"
                   "trust_on_first_use: true\nprecision: int9\n")
    r = subprocess.run([sys.executable, "-m", "edgefleet", "agent", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 4, (r.returncode, r.stderr[-2000:])  # EXIT_INPUT: bad configuration
    assert "key 'precision'" in r.stderr and "'int8'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _load(directory: Path):
    """One engine of a manifest, as the agent's Installer.load_instances makes it (an EngineError: BackendError)."""
    def load(m):
        try:
            return load_bundle_engine(m, directory / m.engine, 1, None)
        except EngineError as exc:
            raise BackendError(str(exc)) from exc
    return load


def test_a_variant_engine_that_does_not_load_here_is_skipped(v4, tmp_path):
    """The fp32 engine is garbage whose sha256 the manifest lists: the device serves int8, it does not fail."""
    data, src = v4
    d = tmp_path / "b"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "model-fp32.onnx").write_bytes(b"\x08\x07not an onnx graph" * 100)
    data = copy.deepcopy(data)
    data["files"]["model-fp32.onnx"] = {"sha256": sha256_file(d / "model-fp32.onnx"),
                                        "size_bytes": (d / "model-fp32.onnx").stat().st_size}
    staged = StagedModel(parse_manifest(data), d, "0" * 64)
    pick = pick_precision(staged, "auto", _load(d), 8)
    assert pick.staged.manifest.precision == "int8" and [t.precision for t in pick.timings] == ["int8"]


class _BreaksAtBatch8:
    """An engine that passes its self-test (the sample's own batch size) but fails when timed at batch 8, as a
    runtime with a broken kernel for one shape would."""

    def __init__(self, engine, fail: bool):
        self._e, self._fail = engine, fail

    def __getattr__(self, name):
        return getattr(self._e, name)

    def infer(self, feeds):
        if self._fail and next(iter(feeds.values())).shape[0] == 8:
            raise RuntimeError("kernel failed for this shape")
        return self._e.infer(feeds)


def test_a_variant_that_fails_while_timed_is_not_a_candidate(v4):
    """A precision that passes its self-test but fails when timed is dropped; the other one serves."""
    data, d = v4
    staged = StagedModel(parse_manifest(data), d, "0" * 64)
    with np.load(d / staged.manifest.as_variant("fp32").selftest) as npz:
        assert npz["input:input"].shape[0] != 8  # the self-test itself does not run batch 8
    load = _load(d)
    pick = pick_precision(staged, "auto", lambda m: cast(Engine, _BreaksAtBatch8(load(m), m.precision == "fp32")), 8)
    assert pick.staged.manifest.precision == "int8" and pick.source == "device"
    assert [t.precision for t in pick.timings] == ["int8"]
    with pytest.raises(SelfTestFailed):  # every precision fails: the failure is the install's
        pick_precision(staged, "auto", lambda m: cast(Engine, _BreaksAtBatch8(load(m), True)), 8)


# -- the fleet: a hostile device's serving figures -----------------------------------------------------------
def _serving(**over: Any) -> dict[str, Any]:
    return {"precision": "int8", "precision_source": "device", "max_batch_size": 8, "batch_source": "measured",
            "instances": 1, "threads": 2, "layout_source": "measured",
            "precisions": [{"precision": "int8", "items_per_s": 400.0,
                            "timings": [{"batch_size": 1, "items_per_s": 300.0}]}], **over}


def _report(device_id: str, serving: Any) -> bytes:
    doc = json.loads(proto.encode(proto.ReportedState(
        device_id=device_id, ts=time.time(), state="installed", rollout_id=None, model="digits", version="1.0.0",
        running_model="digits", running_version="1.0.0",
        selftest=proto.SelfTestResult(samples=8, top1=1.0, top1_agreement=1.0, drift=0.1))))
    doc["serving"] = serving
    return json.dumps(doc).encode()


def _telemetry(device_id: str, seq: int, serving: Any) -> bytes:
    doc = json.loads(proto.encode(proto.Telemetry(
        device_id=device_id, ts=time.time(), stream="0123456789abcdef", seq=seq, interval_s=1.0, model="digits",
        version="1.0.0", requests=1, errors=0, latency=proto.LatencySummary(p50_ms=1, p95_ms=1, p99_ms=1, max_ms=1),
        batches=1, batch_size_mean=1.0, batch_size_max=1, cpu_percent=1.0, rss_mb=1.0)))
    doc["serving"] = serving
    return json.dumps(doc).encode()


def test_malformed_serving_figures_are_refused_counted_and_ingest_goes_on(tmp_path):
    timing = {"batch_size": 1, "items_per_s": 1.0}
    deep: Any = 1
    for _ in range(60):
        deep = [deep]
    bad = [
        _serving(precisions=[{"precision": "int8", "items_per_s": -1.0}]),
        # long lists, each message still under the brokers' 256 KiB limit (fleet.acl.MAX_PAYLOAD_BYTES: bigger ones
        # never reach the fleet, tests/test_broker_identity.py), so the fleet's own bound on list lengths judges them
        _serving(batch_timings=[timing] * 5_000),
        _serving(precisions=[{"precision": "int8", "items_per_s": 1.0, "timings": [timing] * 5_000}]),
        _serving(precisions=[{"precision": "int8", "items_per_s": deep}]),
        _serving(precision="<script>alert(1)</script>"),
        _serving(precision_source="<img src=x onerror=alert(1)>"),
    ]
    raw_inf = _telemetry("evil", 99, _serving()).replace(b'"items_per_s": 400.0', b'"items_per_s": Infinity')
    assert b"Infinity" in raw_inf
    with running_fleet(tmp_path, None) as (fs, url):
        assert fs.broker is not None
        evil = _device(fs.broker.port, _enroll(url, "evil"))
        good = _device(fs.broker.port, _enroll(url, "good"))
        sent = 0
        for i, sv in enumerate(bad):
            evil.publish(proto.topic("evil", "reported"), _report("evil", sv))
            evil.publish(proto.topic("evil", "telemetry"), _telemetry("evil", i, sv))
            sent += 2
        evil.publish(proto.topic("evil", "telemetry"), raw_inf)
        sent += 1
        wait_for(lambda: fs.bridge.rejected >= sent, timeout_s=30, what="every malformed serving refused")
        counts = fs.service.rejections.snapshot()
        assert counts.get("malformed_reported") == len(bad) and counts.get("malformed_telemetry") == len(bad) + 1, \
            counts
        good.publish(proto.topic("good", "reported"), _report("good", _serving()))
        good.publish(proto.topic("good", "telemetry"), _telemetry("good", 0, _serving(precision="fp32")))
        wait_for(lambda: fs.service.devices.telemetry_count("good") == 1, timeout_s=15,
                 what="the good device's telemetry")
        wait_for(lambda: api.get(f"{url}/api/v1/devices/good").json().get("last_state") == "installed",
                 timeout_s=15, what="the good device's report")
        dev = api.get(f"{url}/api/v1/devices/good").json()
        assert dev["selftest"]["serving"]["precision"] == "int8", dev["selftest"]
        assert fs.service.devices.telemetry_count("evil") == 0
        assert api.get(f"{url}/api/v1/devices/evil").json().get("selftest") is None
        page = api.get(f"{url}/devices/good").text
        assert "<b>fp32</b>" in page and "timed here" in page, page[-3000:]  # telemetry's word is the newest
        assert "<script>alert" not in api.get(f"{url}/devices/evil").text
        health = api.get(f"{url}/api/v1/health").json()
        assert health["mqtt_restarts"] == 0 and health["ingest_restarts"] == 0, health
        evil.close()
        good.close()


def test_a_precision_the_two_precision_bundle_lacks_is_timed_and_said(v4):
    """precision: fp16 for a bundle of int8 + fp32: both are timed, and the note says why."""
    data, d = v4
    pick = pick_precision(StagedModel(parse_manifest(data), d, "0" * 64), "fp16", _load(d), 8)
    assert pick.source == "device" and {t.precision for t in pick.timings} == {"int8", "fp32"}
    assert pick.note.startswith("precision fp16 is not in this bundle (int8, fp32); "), pick.note


def test_crafted_v4_bundles_are_refused_by_the_fleet(two_precision_bundle, tmp_path):
    """Uploaded over HTTP: a variant whose engine is the primary's self-test sample, and one whose engine is not
    in the archive, are refused with 422 naming the problem; the unspoilt bundle is accepted (the control)."""
    from tests.test_bundle_upload_checks import _base

    def upload(c, name: str):
        return api.post(f"{url}/api/v1/bundles", content=c.write(tmp_path / name).read_bytes(),
                        headers={"Content-Type": "application/x-tar"})

    aliased = _base(two_precision_bundle, "9.1.0")
    aliased.manifest["variants"][0]["engine"] = aliased.manifest["selftest"]
    aliased.members = [m for m in aliased.members if m.name != "model-fp32.onnx"]
    del aliased.manifest["files"]["model-fp32.onnx"]
    missing = _base(two_precision_bundle, "9.2.0")
    missing.members = [m for m in missing.members if m.name != "model-fp32.onnx"]
    with running_fleet(tmp_path / "f", None) as (fs, url):
        r = upload(aliased, "aliased.tar")
        assert r.status_code == 422 and "file of its own" in r.json()["error"], r.text
        r = upload(missing, "missing.tar")
        assert r.status_code == 422 and "missing" in r.json()["error"] and "model-fp32.onnx" in r.json()["error"], \
            r.text
        assert not any(t.startswith("digits/9.") for t in fs.repo.targets())
        r = upload(_base(two_precision_bundle, "9.3.0"), "ok.tar")
        assert r.status_code == 201, r.text
