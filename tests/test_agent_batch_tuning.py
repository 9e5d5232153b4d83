"""A device chooses its own batch sizes at install: measured in its turns on the model's compute, on the bundle's own
sample, picked from the figures (the smallest size near the best images/s), overridden by an operator's
max_batch_size, and shown in /v2/models/{name}/config. Costs are a fake engine's, never timing thresholds."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest

from edgefleet.agent.config import AgentConfig
from edgefleet.agent.core.batching.batcher import Batcher
from edgefleet.agent.core.batching.settings import BatchSettings
from edgefleet.agent.core.batching.tuning import batch_ladder, choose_batch_size
from edgefleet.agent.core.host import ModelHost
from edgefleet.agent.core.metrics import Metrics
from edgefleet.agent.install.job import Installer
from edgefleet.agent.install.selftest import measure_batch_sizes
from edgefleet.agent.install.store import ModelStore, StagedModel
from edgefleet.engines import Engine, EngineSpec
from edgefleet.protocol.bundle import sha256_file
from tests.agent_harness import preinstall, running_agent
from tests.test_agent_batcher import FakeBackend, x


class Costed(Engine):
    """The bundle's own inputs and outputs, and a known cost per batch size (seconds slept per call)."""

    kind = "fake"

    def __init__(self, staged: StagedModel, cost_s: dict[int, float]):
        m = staged.manifest
        super().__init__(EngineSpec(m.inputs, m.outputs, label="costed"))
        self.cost_s = cost_s
        self.calls: list[int] = []

    @property
    def inputs(self):
        return self.spec.inputs

    @property
    def outputs(self):
        return self.spec.outputs

    def load(self, engine, threads):
        pass

    def _infer_impl(self, feeds):
        n = len(next(iter(feeds.values())))
        self.calls.append(n)
        time.sleep(self.cost_s[n])
        return [np.zeros((n, *(d for d in o.shape[1:])), dtype=np.float32) for o in self.outputs]

    def _close_impl(self):
        pass


@pytest.fixture
def staged(tmp_path, digits_bundle) -> StagedModel:
    store = ModelStore(tmp_path / "store")
    store.recover()
    return store.stage(digits_bundle, sha256_file(digits_bundle))


# batch 4 costs as much as batch 1 (4x the images/s); 8 and 16 are slower per image than 4
COSTS = {1: 0.004, 2: 0.004, 4: 0.004, 8: 0.016, 16: 0.032}


def installer(tmp_path, **config) -> Installer:
    cfg = AgentConfig(device_id="dev-1", fleet_url="http://127.0.0.1:9", data_dir=tmp_path, **config)
    host = ModelHost(BatchSettings(max_batch_size=cfg.max_batch_size), Metrics())
    return Installer(cfg, None, host, lambda *a, **k: None, lambda: None, threading.Event(),  # type: ignore[arg-type]
                     lambda: False)


def test_the_ladder_and_the_choice():
    assert batch_ladder(16) == (1, 2, 4, 8, 16)
    assert batch_ladder(12) == (1, 2, 4, 8, 12)
    assert batch_ladder(1) == (1,)
    assert choose_batch_size(((1, 100.0), (2, 180.0), (4, 260.0), (8, 250.0), (16, 190.0))) == 4
    # a larger size barely faster than a smaller one: the smaller, for each request's latency
    assert choose_batch_size(((1, 100.0), (4, 240.0), (8, 258.0), (16, 262.0))) == 8
    assert choose_batch_size(((1, 100.0), (2, 90.0))) == 1


def test_tuning_runs_every_call_in_its_turn_and_picks_by_the_measured_figures(tmp_path, staged):
    engine = Costed(staged, COSTS)
    turns: list[int] = []

    def turn(fn, *args):
        turns.append(len(engine.calls))
        return fn(*args)

    settings, tuning = installer(tmp_path).tune_batches(engine, staged, turn)
    assert len(turns) == len(engine.calls) > 5  # every call went through a turn, one call per turn
    assert turns == list(range(len(engine.calls)))
    assert sorted(set(engine.calls)) == [1, 2, 4, 8, 16]
    assert tuning.mode == "measured" and tuning.chosen == 4
    assert [n for n, _ in tuning.images_per_s] == [1, 2, 4, 8, 16]
    assert settings.max_batch_size == 4 and settings.preferred_batch_sizes == (4,)
    assert settings.request_limit == 16  # requests any device takes are still taken
    # one call's time by batch size up to the chosen one, from the same figures (measured on one instance)
    assert settings.call_ms == tuple((n, pytest.approx(1e3 * n / v)) for n, v in tuning.images_per_s if n <= 4)


def test_the_measurement_stops_at_its_budget(staged):
    engine = Costed(staged, COSTS)
    figures = measure_batch_sizes(engine, staged, (1, 2, 4, 8, 16), budget_s=0.0)
    assert [n for n, _ in figures] == [1] and engine.calls == [1, 1]  # one untimed call, one timed


def test_an_operators_max_batch_size_wins_and_off_means_off(tmp_path, staged):
    engine = Costed(staged, COSTS)
    settings, tuning = installer(tmp_path, max_batch_size=8).tune_batches(engine, staged, lambda fn, *a: fn(*a))
    assert tuning.mode == "operator" and settings.max_batch_size == 8 and engine.calls == []
    settings, tuning = installer(tmp_path, batch_tuning="off").tune_batches(engine, staged, lambda fn, *a: fn(*a))
    assert tuning.mode == "off" and settings.max_batch_size == 16 and engine.calls == []


def test_a_request_larger_than_the_batches_formed_runs_alone():
    async def main():
        be = FakeBackend()
        b = Batcher(be, BatchSettings(max_batch_size=2, max_request_batch_size=8))
        b.start()
        outs = await asyncio.gather(b.submit(x(6)), b.submit(x(1)), b.submit(x(1)))
        await b.close()
        return be.batches, outs

    batches, outs = asyncio.run(main())
    assert [len(o[0]) for o in outs] == [6, 1, 1]
    assert 6 in batches and max(n for n in batches if n != 6) <= 2


def test_the_choice_and_its_figures_show_in_the_model_config(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    with running_agent(data) as (_agent, url):
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
    t = cfg["batch_tuning"]
    figures = [(int(n), v) for n, v in t["images_per_second"].items()]
    # the ladder 1..16, or its start: the trial stops when its time budget is spent (agent/install/selftest.py
    # measure_batch_sizes: on a loaded box before 16) and leaves the sizes not reached out, as the config then says
    sizes = [n for n, _ in figures]
    assert t["mode"] == "measured" and len(sizes) >= 2 and sizes == [1, 2, 4, 8, 16][:len(sizes)], sizes
    assert t["max_formed_batch_size"] == choose_batch_size(figures)
    assert cfg["max_batch_size"] == 16  # Triton's field: the largest request accepted
    chosen = t["max_formed_batch_size"]
    assert cfg["dynamic_batching"]["preferred_batch_size"] == ([chosen] if chosen > 1 else [])
    # gathering (batches that wait for a larger size) is weighed from the same figures where batches form at all
    assert t["gathering"] == (None if chosen == 1 else {"mode": "spreading", "size": 1, "measured_gap_ms": None,
                                                        "saves_ms": None, "tries": 0})
    with running_agent(data, max_batch_size=8) as (_agent, url):
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
    assert cfg["batch_tuning"]["mode"] == "operator" and cfg["batch_tuning"]["images_per_second"] == {}
    assert cfg["max_batch_size"] == 8 and cfg["batch_tuning"]["max_formed_batch_size"] == 8
    assert cfg["batch_tuning"]["gathering"] is None  # no figures: never weighed
