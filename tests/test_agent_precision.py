"""Precision chosen on the device: a bundle that carries several precisions (compiled where its devices' CPU
could not be timed) is timed by the agent on its own cores at install and each start, and served in the faster;
the operator can pin one; a precision that fails its self-test on this CPU is not a candidate. From the outside:
a real agent on loopback, real onnxruntime engines, the answers compared with each engine run directly."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from edgefleet.protocol.bundle import extract_bundle, sha256_file, write_bundle
from edgefleet.protocol.manifest import parse_manifest
from tests.agent_harness import preinstall, running_agent

pytestmark = pytest.mark.timeout(300)


def _config(url: str) -> dict:
    r = httpx.get(f"{url}/v2/models/digits/config", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _answers(url: str, x: np.ndarray) -> np.ndarray:
    r = httpx.post(f"{url}/v2/models/digits/infer", timeout=60, json={"inputs": [{
        "name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def _direct(bundle: Path, tmp: Path, precision: str, x: np.ndarray) -> np.ndarray:
    """The bundle's engine of ``precision`` run by onnxruntime itself, outside the agent."""
    m = extract_bundle(bundle, tmp).as_variant(precision)
    sess = ort.InferenceSession(str(tmp / m.engine), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


@pytest.fixture(scope="module")
def sample(test_images) -> np.ndarray:
    images, _ = test_images
    return np.ascontiguousarray(images[:8], dtype=np.float32)


def test_the_device_times_both_precisions_and_serves_the_faster(tmp_path, two_precision_bundle, sample):
    preinstall(tmp_path / "d", two_precision_bundle)
    with running_agent(tmp_path / "d") as (_, url):
        cfg = _config(url)
        pc = cfg["precision_choice"]
        assert pc["source"] == "device" and sorted(pc["available"]) == ["fp32", "int8"], pc
        figures = pc["items_per_second"]
        assert set(figures) == {"int8", "fp32"} and all(v > 0 for v in figures.values()), pc
        served = pc["precision"]
        assert cfg["parameters"]["precision"]["string_value"] == served
        # the faster by the device's own figures; the bundle's own (int8) kept when within 3% of the other
        if served == "fp32":
            assert figures["fp32"] > figures["int8"] * 1.03, pc
        else:
            assert figures["int8"] * 1.03 >= figures["fp32"], pc
        got = _answers(url, sample)
    want = _direct(two_precision_bundle, tmp_path / "x", served, sample)
    other = _direct(two_precision_bundle, tmp_path / "y", "fp32" if served == "int8" else "int8", sample)
    assert np.allclose(got, want, atol=1e-5), "the agent's answers are not the chosen engine's"
    assert not np.allclose(got, other, atol=1e-5), "int8 and fp32 answer alike: the test cannot tell them apart"


@pytest.mark.parametrize("setting, served, source", [("fp32", "fp32", "operator"), ("int8", "int8", "operator"),
                                                     ("bundle", "int8", "bundle")])
def test_an_operator_setting_wins_and_nothing_is_timed(tmp_path, two_precision_bundle, sample, setting, served,
                                                       source):
    preinstall(tmp_path / "d", two_precision_bundle)
    with running_agent(tmp_path / "d", precision=setting) as (_, url):
        pc = _config(url)["precision_choice"]
        assert (pc["precision"], pc["source"], pc["items_per_second"]) == (served, source, {}), pc
        got = _answers(url, sample)
    assert np.allclose(got, _direct(two_precision_bundle, tmp_path / "x", served, sample), atol=1e-5)


def test_a_precision_the_bundle_lacks_is_timed_among_those_it_has(tmp_path, digits_bundle, sample):
    """A one-engine bundle: precision fp32 in the config cannot be honoured; the bundle's own serves, untimed."""
    preinstall(tmp_path / "d", digits_bundle)
    with running_agent(tmp_path / "d", precision="fp32") as (_, url):
        pc = _config(url)["precision_choice"]
        assert (pc["precision"], pc["source"], pc["available"]) == ("int8", "bundle", ["int8"]), pc


def test_a_variant_that_fails_its_self_test_here_is_not_a_candidate(tmp_path, two_precision_bundle, sample):
    """A bundle whose fp32 self-test expects other answers (a compiler bug, say): the device serves int8, the
    precision that computes as gated here, instead of failing the model or serving an engine it could not check."""
    m = extract_bundle(two_precision_bundle, tmp_path / "b")
    with np.load(tmp_path / "b" / "selftest-fp32.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["expected:logits"] = arrays["expected:logits"][:, ::-1].copy()  # every class ranked backwards
    np.savez_compressed(tmp_path / "b" / "selftest-fp32.npz", **arrays)
    data = m.model_dump(mode="json")
    f = tmp_path / "b" / "selftest-fp32.npz"
    data["files"]["selftest-fp32.npz"] = {"sha256": sha256_file(f), "size_bytes": f.stat().st_size}
    bad = write_bundle(parse_manifest(data), tmp_path / "b", tmp_path / "bad.tar")
    preinstall(tmp_path / "d", bad)
    with running_agent(tmp_path / "d") as (_, url):
        pc = _config(url)["precision_choice"]
        assert pc["precision"] == "int8" and set(pc["items_per_second"]) == {"int8"}, pc
        got = _answers(url, sample)
    assert np.allclose(got, _direct(bad, tmp_path / "x", "int8", sample), atol=1e-5)


def test_the_choice_is_made_again_at_each_start(tmp_path, two_precision_bundle):
    """The figures are this box's today: a restart times again (and an operator's pin after a restart holds)."""
    preinstall(tmp_path / "d", two_precision_bundle)
    with running_agent(tmp_path / "d") as (_, url):
        first = _config(url)["precision_choice"]
    with running_agent(tmp_path / "d", precision="fp32") as (_, url):
        second = _config(url)["precision_choice"]
    assert first["source"] == "device" and second == {**second, "precision": "fp32", "source": "operator"}
    shutil.rmtree(tmp_path / "d")
