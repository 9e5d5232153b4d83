"""Model lifecycle on a running agent (real HTTP on loopback): several models on disk, a hot swap under
concurrent load with no failed request, and a version that fails its self-test never replacing the one that
serves."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import tarfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.agent.errors import SelfTestFailed
from edgefleet.agent.install.store import ModelStore
from tests.agent_harness import Load, preinstall, running_agent, under_load
from tests.conftest import wait_for


def rebuild(bundle: Path, out: Path, version: str, name: str | None = None, break_selftest: bool = False) -> Path:
    """The same engine under another version (and name); ``break_selftest`` records wrong expected outputs
    (the hashes in the manifest are updated, so the bundle is intact: only its self-test fails)."""
    with tarfile.open(bundle) as src:
        members = {m.name: (m, src.extractfile(m).read()) for m in src.getmembers()}  # type: ignore[union-attr]
    doc = json.loads(members["manifest.json"][1])
    doc["version"] = version
    if name:
        doc["name"] = name
    if break_selftest:
        st = doc["selftest"]
        with np.load(io.BytesIO(members[st][1])) as npz:
            arrays = {k: npz[k] for k in npz.files}
        for k in arrays:
            if k.startswith("expected:"):
                arrays[k] = -arrays[k] + 3.0
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        data = buf.getvalue()
        members[st] = (members[st][0], data)
        doc["files"][st] = {"sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    members["manifest.json"] = (members["manifest.json"][0], json.dumps(doc).encode())
    with tarfile.open(out, "w") as dst:
        for m, data in members.values():
            m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    return out


def infer_body(images: np.ndarray) -> dict:
    return {"inputs": [{"name": "input", "shape": list(images.shape), "datatype": "FP32",
                        "data": images.reshape(-1).tolist()}]}


def index(url: str) -> list[dict]:
    return httpx.post(f"{url}/v2/repository/index", json={}, timeout=10).json()


def test_several_models_on_disk_each_with_its_active_version(tmp_path, digits_bundle, test_images):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    preinstall(data, rebuild(digits_bundle, tmp_path / "b.tar", "1.0.0", name="digits-b"))
    preinstall(data, rebuild(digits_bundle, tmp_path / "d11.tar", "1.1.0"))  # digits again: 1.0.0 kept for rollback
    store = ModelStore(data / "store")
    store.recover()
    slots = {n: (a.installed.version, p.installed.version if p else None) for n, (a, p) in store.active().items()}
    assert slots == {"digits": ("1.1.0", "1.0.0"), "digits-b": ("1.0.0", None)}
    images, labels = test_images
    with running_agent(data) as (_agent, url):
        for model, version in (("digits", "1.1.0"), ("digits-b", "1.0.0")):
            r = httpx.post(f"{url}/v2/models/{model}/infer", json=infer_body(images[:8]), timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["model_version"] == version
        states = {(e["name"], e["version"]): e["state"] for e in index(url)}
    assert states == {("digits", "1.1.0"): "READY", ("digits", "1.0.0"): "UNAVAILABLE",
                      ("digits-b", "1.0.0"): "READY"}


def test_hot_swap_under_concurrent_load_fails_no_request(tmp_path, digits_bundle, test_images):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    preinstall(data, rebuild(digits_bundle, tmp_path / "v11.tar", "1.1.0"))
    images, labels = test_images
    with running_agent(data, instances=2) as (agent, url):
        assert len(agent.host.models["digits"].backends) == 2

        def client(load: Load, seed: int) -> None:
            rng = np.random.default_rng(seed)
            with httpx.Client(timeout=30) as c:
                for _ in range(100_000):  # bounded; stopped by the event long before
                    if load.stopped.is_set():
                        return
                    i = int(rng.integers(0, len(images) - 4))
                    r = c.post(f"{url}/v2/models/digits/infer", json=infer_body(images[i:i + 4]))
                    ok = r.status_code == 200
                    version = r.json().get("model_version") if ok else None
                    right = ok and bool((np.array(r.json()["outputs"][0]["data"]).reshape(4, 10).argmax(1)
                                         == labels[i:i + 4]).mean() >= 0.5)
                    load.add((r.status_code, version, right))  # (status, version, all predictions right)

        with under_load(client, 6, join_s=60) as load:
            wait_for(lambda: load.count() >= 50, 60, "load before the swap")
            assert agent._loop is not None
            # the other version's self-test and warm-up take turns with the serving batches (the model's ComputeTurns)
            shared = agent.host.models["digits"].batcher.turns
            assert shared is agent.host.turns("digits", 2)
            turns: list[str] = []
            real_call = shared.call
            shared.call = lambda loop, fn, *a, **kw: (turns.append(fn.__name__), real_call(loop, fn, *a, **kw))[1]  # type: ignore[method-assign]
            swapped = asyncio.run_coroutine_threadsafe(agent.rollback("digits"), agent._loop).result(120)
            # three self-test runs, a batch-1 warm-up on each instance, then the batch sizes measured (timed calls)
            assert turns[:5] == ["infer"] * (3 + 2) and len(turns) > 5 and set(turns[5:]) == {"_timed"}
            assert agent.host.models["digits"].batcher.turns is shared
            assert swapped.version == "1.0.0"
            before = load.count()
            wait_for(lambda: load.count() >= before + 50, 60, "load after the swap")
    results = load.results
    statuses = {s for s, _, _ in results}
    versions = [v for _, v, _ in results]
    assert statuses == {200}, [r for r in results if r[0] != 200][:5]
    assert all(right for _, _, right in results)
    assert versions[0] == "1.1.0" and versions[-1] == "1.0.0"  # both served, the swap in between
    assert set(versions) == {"1.0.0", "1.1.0"}
    store = ModelStore(data / "store")
    store.recover()
    assert (store.current.installed.version, store.previous.installed.version) == ("1.0.0", "1.1.0")  # type: ignore[union-attr]


def test_version_that_fails_its_self_test_never_replaces_the_serving_one(tmp_path, digits_bundle, test_images):
    data = tmp_path / "agent"
    preinstall(data, rebuild(digits_bundle, tmp_path / "bad.tar", "0.9.0", break_selftest=True))
    preinstall(data, digits_bundle)  # 1.0.0 serves; 0.9.0 (broken) is the previous version
    images, labels = test_images
    with running_agent(data) as (agent, url):
        assert agent._loop is not None
        with pytest.raises(SelfTestFailed, match="differs by"):
            asyncio.run_coroutine_threadsafe(agent.rollback("digits"), agent._loop).result(120)
        r = httpx.post(f"{url}/v2/models/digits/infer", json=infer_body(images[:16]), timeout=30)
        assert r.status_code == 200 and r.json()["model_version"] == "1.0.0"
        entries = {(e["name"], e["version"]): e for e in index(url)}
        assert entries[("digits", "1.0.0")]["state"] == "READY"
        bad = entries[("digits", "0.9.0")]
        assert bad["state"] == "UNAVAILABLE" and "self-test" in bad["reason"] and "differs by" in bad["reason"]
    store = ModelStore(data / "store")
    store.recover()
    assert store.current is not None and store.current.installed.version == "1.0.0"
