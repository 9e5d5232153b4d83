"""A device chooses its layout (instances x intra-op threads over its inference CPUs) at install: each candidate
timed as bench/serve.py times the runtime's limit (all its instances at once, on the serving CPUs, in a child
process), the layout serving the most chosen, the choice kept unless an operator set instances or intra_op_threads,
shown in /v2/models/{name}/config and in the serving choice of the install report; answers bit-identical to the
untuned agent's. The rule is tested on given figures, never on timing thresholds."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.agent.core.batching.tuning import (
    LAYOUT_TIE,
    LayoutFigures,
    choose_layout,
    in_the_running,
    layout_candidates,
)
from edgefleet.agent.errors import BackendError
from edgefleet.agent.install import bench as agent_bench
from edgefleet.agent.install.store import ModelStore, StagedModel
from edgefleet.protocol.bundle import sha256_file
from tests.agent_harness import preinstall, running_agent
from tests.test_agent_batch_tuning import Costed

DIGITS_EVAL = Path(__file__).resolve().parent.parent / "models" / "digits" / "test.npz"


@pytest.fixture
def staged(tmp_path, digits_bundle) -> StagedModel:
    store = ModelStore(tmp_path / "store")
    store.recover()
    return store.stage(digits_bundle, sha256_file(digits_bundle))


def fig(name: str, best: float, lone_ms: float) -> LayoutFigures:
    i, t = (int(v) for v in name.split("x"))
    return LayoutFigures(i, t, ((1, best / 2), (4, best)), lone_ms)


def test_the_candidates_use_every_inference_cpu():
    assert layout_candidates(1) == ((1, 1),)
    assert layout_candidates(2) == ((1, 2), (2, 1))
    assert layout_candidates(4) == ((1, 4), (2, 2), (4, 1))


def test_the_layout_that_serves_most_is_chosen_even_when_a_lone_request_is_slower():
    # the INT8 figures on 4 pinned CPUs: 4x1 serves 10% more than 2x2 and 1x4 at twice their lone call;
    # the old rule (5% + 10% of the lone call's extra time) kept 2x2, 10% under the runtime's best
    assert choose_layout([fig("1x4", 580, 2.0), fig("2x2", 900, 2.0), fig("4x1", 998, 4.0)]).name == "4x1"
    # 8 one-thread sessions at 845 against one of 8 threads at 618, lone call 4x longer: 8x1
    assert choose_layout([fig("1x8", 618, 3.0), fig("8x1", 845, 12.0)]).name == "8x1"
    assert choose_layout([fig("1x1", 50, 5)]).name == "1x1"


def test_layouts_within_the_tie_are_equals_and_the_faster_lone_call_wins():
    assert LAYOUT_TIE <= 0.05  # the bound: the choice within 5% of the best layout
    assert choose_layout([fig("1x2", 99, 10), fig("2x1", 100, 20)]).name == "1x2"  # 1% under: equals
    assert choose_layout([fig("1x2", 95, 10), fig("2x1", 100, 20)]).name == "2x1"  # 5% under: not
    assert choose_layout([fig("1x2", 100, 10), fig("2x1", 100, 10)]).name == "1x2"  # all equal: the first


def test_the_choice_is_always_within_the_tie_of_the_best_and_pruning_never_drops_it():
    rng = random.Random(32)
    for _ in range(2000):
        figs = [fig(f"{i}x{12 // i}", rng.uniform(50, 150), rng.uniform(1, 20)) for i in (1, 2, 3, 4, 6, 12)]
        top = max(f.best for f in figs)
        chosen = choose_layout(figs)
        assert chosen.best >= (1 - LAYOUT_TIE) * top
        # measured one by one, closing what falls out of the running: the final choice was never closed
        kept: set[str] = set()
        for k in range(len(figs)):
            kept.add(figs[k].name)
            so_far = max(f.best for f in figs[:k + 1])
            kept = {n for n in kept if in_the_running(next(f for f in figs if f.name == n), so_far)}
        assert chosen.name in kept


class Paired(Costed):
    """One instance of a layout under trial. The first instance, in its first timed call, waits until the second
    has made four calls: a trial that drives them at once lets the second go on meanwhile; one that runs them in
    lock-step (every round waits for the slowest) cannot, and the wait runs out. Each call records the CPUs its
    thread may run on and how many calls of the layout were in progress together."""

    def __init__(self, staged, index: int, shared: dict):
        super().__init__(staged, {n: 0.0005 for n in (1, 2, 4, 8, 16)})
        self.index, self.shared = index, shared

    def _infer_impl(self, feeds):
        sh = self.shared
        with sh["lock"]:
            sh["calls"][self.index] += 1
            sh["now"] += 1
            sh["overlap"] = max(sh["overlap"], sh["now"])
            mine = sh["calls"][self.index]
        sh["cpus"].add(frozenset(os.sched_getaffinity(0)))
        try:
            if self.index == 1 and mine == 4:
                sh["second_went_on"].set()
            if self.index == 0 and mine == 2 and not sh["second_went_on"].wait(5):
                sh["starved"] = True
            return super()._infer_impl(feeds)
        finally:
            with sh["lock"]:
                sh["now"] -= 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="two CPUs to pin to")
def test_the_trial_drives_every_instance_at_once_on_the_serving_cpus(tmp_path, staged, monkeypatch):
    monkeypatch.setattr(agent_bench, "LAYOUT_BUDGET_S", 0.0)  # the shortest slices: the figures are not the point
    layouts: dict[str, dict] = {}

    def load(count, threads):
        sh = layouts[f"{count}x{threads}"] = {"lock": threading.Lock(), "calls": [0] * count, "now": 0, "overlap": 0,
                                              "cpus": set(), "second_went_on": threading.Event(), "starved": False}
        sh["engines"] = [Paired(staged, i, sh) for i in range(count)]
        return sh["engines"]

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})  # the calling thread on one CPU: the trial's threads go where serving ones do
    try:
        figures = agent_bench.layout_trial(staged.manifest, staged.directory, ((1, 2), (2, 1)), (1, 2, 4),
                                           agent_bench.slice_seconds(2, 3), cpus=(0, 1), load=load)
    finally:
        os.sched_setaffinity(0, before)
    two = layouts["2x1"]
    assert not two["starved"], "one instance waited for the other: the trial ran them in lock-step"
    assert two["overlap"] == 2 and two["calls"][1] >= 4
    assert two["cpus"] == {frozenset({0, 1})} and layouts["1x2"]["cpus"] == {frozenset({0, 1})}
    assert [f.name for f in figures] == ["1x2", "2x1"] and all(f.images_per_s for f in figures)
    assert all(b.closed for sh in layouts.values() for b in sh["engines"])  # the trial leaves no session open


def infer(url: str, images: np.ndarray) -> list[bytes]:
    out = []
    for img in images:
        body = {"inputs": [{"name": "input", "shape": [1, *img.shape], "datatype": "FP32",
                            "data": img.reshape(-1).tolist()}],
                "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}
        r = httpx.post(f"{url}/v2/models/digits/infer", content=json.dumps(body), timeout=30)
        assert r.status_code == 200, r.text
        out.append(r.content[int(r.headers["inference-header-content-length"]):])
    return out


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="two CPUs to pin to")
def test_the_device_measures_its_layouts_and_an_operators_layout_wins(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    with np.load(DIGITS_EVAL) as npz:
        images = npz["input"][:24].astype(np.float32)
    with running_agent(data, inference_cpus=(0,)) as (agent, url):  # one inference CPU: 1x1, the only candidate
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        serving = agent.host.models["digits"].serving
    lay = cfg["batch_tuning"]["layout"]
    assert lay["source"] == "measured" and (lay["instances"], lay["threads"]) == (1, 1) and list(lay["measured"]) == \
        ["1x1"]
    assert (serving.instances, serving.threads, serving.layout_source) == (1, 1, "measured")

    with running_agent(data, inference_cpus=(0, 1)) as (agent, url):
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        serving = agent.host.models["digits"].serving
        auto = infer(url, images)
    t, lay = cfg["batch_tuning"], cfg["batch_tuning"]["layout"]
    assert lay["source"] == "measured" and list(lay["measured"]) == ["1x2", "2x1"]
    figures = [LayoutFigures(*(int(v) for v in n.split("x")), ((1, f["images_per_second"]),), f["lone_call_ms"])
               for n, f in lay["measured"].items()]
    assert f"{lay['instances']}x{lay['threads']}" == choose_layout(figures).name  # the rule, on its own figures
    assert cfg["instance_group"][0]["count"] == lay["instances"]
    assert (serving.instances, serving.threads, serving.layout_source) == (lay["instances"], lay["threads"],
                                                                           "measured")
    assert t["mode"] == "measured" and serving.max_batch_size == t["max_formed_batch_size"]

    with running_agent(data, instances=2, intra_op_threads=1) as (agent, url):  # the operator's layout, kept
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        serving = agent.host.models["digits"].serving
    lay = cfg["batch_tuning"]["layout"]
    assert (lay["instances"], lay["threads"], lay["source"], lay["measured"]) == (2, 1, "operator", {})
    assert cfg["instance_group"][0]["count"] == 2
    assert (serving.instances, serving.threads, serving.layout_source) == (2, 1, "operator")

    with running_agent(data, batch_tuning="off") as (agent, url):  # the untuned agent: 1x2, batches up to 16
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        untuned = infer(url, images)
    assert cfg["batch_tuning"]["layout"]["source"] == "default" and cfg["instance_group"][0]["count"] == 1
    assert auto == untuned  # bit for bit


def test_the_trial_runs_in_a_child_and_an_engine_that_does_not_load_is_a_backend_error(tmp_path, staged):
    figures = agent_bench.layout_trial_in_child(staged.manifest, staged.directory, ((1, 1),), (1, 2), 0.05)
    assert [f.name for f in figures] == ["1x1"] and [n for n, _ in figures[0].images_per_s][:1] == [1]
    (tmp_path / "empty").mkdir()  # the bundle's sample, no engine
    shutil.copy(staged.directory / staged.manifest.selftest, tmp_path / "empty")
    with pytest.raises(BackendError, match=staged.manifest.engine):
        agent_bench.layout_trial_in_child(staged.manifest, tmp_path / "empty", ((1, 1),), (1,), 0.05)


def test_the_trial_runs_on_the_runtime_that_will_serve(staged):
    """The agent serves an onnxruntime bundle on the runtime it chose (agent.install.runtime_choice: OpenVINO where it
    is faster): the layout and batch size are timed on that runtime, not on the bundle's own (before, the child always
    loaded onnxruntime, and an OpenVINO-served model got onnxruntime's layout and batch size)."""
    from edgefleet import engines

    # a runtime that does not run this bundle: the child loaded it (and said so), it did not fall back
    with pytest.raises(BackendError, match="litert runtime cannot run a onnxruntime bundle"):
        agent_bench.layout_trial_in_child(staged.manifest, staged.directory, ((1, 1),), (1,), 0.05, runtime="litert")
    if engines.runtime_installed("openvino"):
        figures = agent_bench.layout_trial_in_child(staged.manifest, staged.directory, ((1, 1),), (1, 2), 0.05,
                                                    runtime="openvino")
        assert [f.name for f in figures] == ["1x1"] and all(v > 0 for _, v in figures[0].images_per_s)


def test_a_layout_trial_whose_child_cannot_start_runs_in_this_process(monkeypatch, tmp_path):
    """Where this interpreter cannot start itself (qemu-user without binfmt: sys.executable is a foreign binary,
    'Exec format error'; a box without exec rights), the trial runs in the agent's own process instead of failing
    the install (the emulated aarch64 agent never became ready before)."""
    import sys
    from types import SimpleNamespace

    from edgefleet.agent.install import bench

    seen = []
    monkeypatch.setattr(sys, "executable", str(tmp_path / "not-a-program"))
    monkeypatch.setattr(bench, "layout_trial", lambda *a, **k: seen.append(a) or ["figures"])
    manifest = SimpleNamespace(model_dump=lambda mode: {})
    assert bench.layout_trial_in_child(manifest, tmp_path, [(1, 1)], (1,), 0.1) == ["figures"]  # type: ignore[arg-type]
    assert len(seen) == 1
