"""The runtime chosen on the device (agent/install/runtime_choice.py): an onnxruntime bundle's file timed on every
runtime installed here that runs it, the fastest that passes the bundle's own self-test served, the operator able to pin
one, and a pinned runtime that is missing refused with the extra to install. Real bundles (the compiler's digits
INT8 and FP32 builds), real onnxruntime and OpenVINO engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefleet import engines
from edgefleet.agent.errors import BackendError
from edgefleet.agent.install.runtime_choice import TIE, candidates, pick_runtime
from edgefleet.agent.install.store import StagedModel
from edgefleet.protocol.bundle import extract_bundle
from tests.installs import run_as_installed

needs_ov = pytest.mark.skipif(not engines.runtime_installed("openvino"),
                              reason="openvino is not installed here (the optional edgefleet[openvino])")


def _staged(bundle: Path, tmp: Path) -> StagedModel:
    return StagedModel(extract_bundle(bundle, tmp), tmp, "")


class Loads:
    """engines.load_bundle_engine on a runtime, remembering what it loaded (to check everything is closed)."""

    def __init__(self, staged: StagedModel, refuse: tuple[str, ...] = ()):
        self.staged, self.refuse, self.loaded = staged, refuse, []

    def __call__(self, runtime: str) -> engines.Engine:
        if runtime in self.refuse:  # as load_instances reports a runtime whose engine cannot load here
            raise BackendError(f"{runtime}: could not load")
        m = self.staged.manifest
        e = engines.load_bundle_engine(m, self.staged.directory / m.engine, 1, runtime=runtime)
        self.loaded.append(e)
        return e


@needs_ov
@pytest.mark.parametrize("which", ["digits_bundle", "digits_bundle_v2"])  # int8 (QDQ) and fp32
def test_auto_times_onnxruntime_and_openvino_and_serves_the_faster(request, tmp_path, which):
    staged = _staged(request.getfixturevalue(which), tmp_path)
    loads = Loads(staged)
    pick = pick_runtime(staged, "auto", loads, max_batch_size=16)
    assert pick.source == "device"
    by = {t.runtime: t.items_per_s for t in pick.timings}
    assert set(by) == {"onnxruntime", "openvino"} and all(v > 0 for v in by.values()), pick
    assert all([n for n, _ in t.timings] == [1, 8] for t in pick.timings)
    fastest = max(by, key=lambda r: by[r])
    # the bundle's own runtime is kept unless the other is more than TIE faster
    want = "onnxruntime" if by["onnxruntime"] * (1 + TIE) >= by[fastest] else fastest
    assert pick.runtime == want and pick.runtime in pick.note
    assert len(loads.loaded) == 2 and all(e.closed for e in loads.loaded)


@needs_ov
def test_a_runtime_that_does_not_load_is_not_a_candidate(tmp_path, digits_bundle):
    staged = _staged(digits_bundle, tmp_path)
    pick = pick_runtime(staged, "auto", Loads(staged, refuse=("openvino",)), max_batch_size=16)
    assert pick.runtime == "onnxruntime" and [t.runtime for t in pick.timings] == ["onnxruntime"]
    with pytest.raises(BackendError, match="onnxruntime: could not load"):  # none loads: the first failure
        pick_runtime(staged, "auto", Loads(staged, refuse=("onnxruntime", "openvino")), max_batch_size=16)


@needs_ov
def test_openvino_pinned_serves_it_untimed_with_the_same_answers(tmp_path, digits_bundle_v2, test_images):
    staged = _staged(digits_bundle_v2, tmp_path)
    loads = Loads(staged)
    pick = pick_runtime(staged, "openvino", loads, max_batch_size=16)
    assert (pick.runtime, pick.source, pick.timings, loads.loaded) == ("openvino", "operator", (), [])
    x = np.ascontiguousarray(test_images[0][:16], dtype=np.float32)
    ov, ort = Loads(staged)("openvino"), Loads(staged)("onnxruntime")
    try:  # an fp32 bundle answers the same on both (f32 set explicitly, not OpenVINO's bf16 default)
        np.testing.assert_allclose(ov.infer({"input": x})[0], ort.infer({"input": x})[0], atol=1e-4)
    finally:
        ov.close()
        ort.close()


def test_a_pin_applies_to_the_bundles_that_runtime_runs_and_leaves_the_others_to_theirs():
    every = lambda r: True  # noqa: E731
    assert candidates("onnxruntime", "int8", "openvino", installed=every) == (("openvino",), "operator")
    assert candidates("onnxruntime", "int8", "auto", installed=every) == (("onnxruntime", "openvino"), "device")
    # a bf16 bundle runs on OpenVINO only, pinned onnxruntime or not; a LiteRT bundle on LiteRT, pinned OpenVINO or not
    assert candidates("onnxruntime", "bf16", "auto", installed=every) == (("openvino",), "only")
    assert candidates("onnxruntime", "bf16", "onnxruntime", installed=every) == (("openvino",), "only")
    assert candidates("litert", "int8", "openvino", installed=every) == (("litert",), "only")


def test_a_box_without_the_extra_serves_on_onnxruntime_and_a_pin_to_openvino_names_the_extra():
    code = ("from edgefleet.agent.install.runtime_choice import candidates\n"
            "from edgefleet.agent.errors import BackendError\n"
            "print(candidates('onnxruntime', 'int8', 'auto'))\n"
            "for setting, precision in (('openvino', 'int8'), ('auto', 'bf16')):\n"
            "    try:\n"
            "        candidates('onnxruntime', precision, setting)\n"
            "    except BackendError as exc:\n"
            "        print(exc)\n")
    r = run_as_installed(("agent",), code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "(('onnxruntime',), 'only')",
        "runtime: openvino is set in the agent's config, and openvino is not installed here; install "
        "edgefleet[openvino] or set runtime: auto",
        "no runtime installed here runs this onnxruntime bf16 bundle; install edgefleet[openvino]"]


@needs_ov
def test_the_runtimes_are_timed_in_a_child_process_and_leave_nothing_in_the_agent(tmp_path, digits_bundle):
    """The agent times the runtimes in a child (agent.install.runtime_choice.pick_runtime_in_child): one it does not
    choose leaves its libraries there (in-process timing kept OpenVINO's in an agent serving onnxruntime). Run in a
    fresh interpreter, which imports neither runtime while choosing; the figures come back from the child."""
    import json
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from pathlib import Path\n"
            "from edgefleet.agent.install.runtime_choice import pick_runtime_in_child\n"
            "from edgefleet.agent.install.store import StagedModel\n"
            "from edgefleet.protocol.bundle import extract_bundle\n"
            "d = Path(sys.argv[2])\n"
            "pick = pick_runtime_in_child(StagedModel(extract_bundle(Path(sys.argv[1]), d), d, ''), 'auto', 16, 1)\n"
            "print(json.dumps({'runtime': pick.runtime, 'source': pick.source, 'note': pick.note,\n"
            "                  'timed': {t.runtime: [n for n, _ in t.timings] for t in pick.timings},\n"
            "                  'loaded': [m for m in ('openvino', 'onnxruntime') if m in sys.modules]}))\n")
    r = subprocess.run([sys.executable, "-c", code, str(digits_bundle), str(tmp_path / "b")], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["source"] == "device" and got["timed"] == {"onnxruntime": [1, 8], "openvino": [1, 8]}, got
    assert got["runtime"] in got["note"] and got["loaded"] == [], got


@needs_ov
@pytest.mark.timeout(300)
def test_a_running_agent_reports_the_runtime_it_chose_and_serves_its_answers(tmp_path, digits_bundle, test_images):
    import httpx

    from tests.agent_harness import preinstall, running_agent

    x = np.ascontiguousarray(test_images[0][:4], dtype=np.float32)
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
    for setting in ("auto", "openvino"):
        preinstall(tmp_path / setting, digits_bundle)
        with running_agent(tmp_path / setting, runtime=setting) as (agent, url):
            cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=30).json()
            rc = cfg["runtime_choice"]
            if setting == "auto":
                assert rc["source"] == "device" and set(rc["items_per_second"]) == {"onnxruntime", "openvino"}, rc
            else:
                assert rc == {"runtime": "openvino", "source": "operator", "items_per_second": {}}, rc
            r = httpx.post(f"{url}/v2/models/digits/infer", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(4, -1)
            served = Loads(StagedModel(extract_bundle(digits_bundle, tmp_path / f"x-{setting}"),
                                       tmp_path / f"x-{setting}", ""))(rc["runtime"])
            try:  # the runtime it names is the one whose answers it serves
                np.testing.assert_allclose(out, served.infer({"input": x})[0], atol=1e-5)
            finally:
                served.close()
