"""Gathering (agent/core/batching/gathering.py): a batch waits for a larger size though an instance is free only where
the install's figures say the larger size serves more and the measured idle gap says the wait costs less than that.

The choice is a pure rule over counts and a clock (tested with a fake clock); one test drives the real batcher with
two closed-loop clients on one instance whose batch of 2 costs barely more than a batch of 1 (a GPU's shape), and
checks what it does against the same clients without figures."""

import asyncio
import time

import numpy as np
import pytest

from edgefleet.agent.core.batching import gathering as G
from edgefleet.agent.core.batching.batcher import Batcher
from edgefleet.agent.core.batching.gathering import Gathering
from edgefleet.agent.core.batching.settings import BatchSettings
from tests.test_agent_batcher import FakeBackend


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# one instance's call at batch 1: 10 ms, at 2: 12 ms (two singles 20 ms: gathering saves 8 ms a pair), at 4: 30 ms
GPU = ((1, 10.0), (2, 12.0), (4, 30.0))
CPU = ((1, 10.0), (2, 20.5), (4, 41.0))  # no faster per sample at any size: never worth gathering


def warmed(g: Gathering, held: int, n: int | None = None) -> None:
    for _ in range(n if n is not None else G.STEADY * g.instances):
        g.note_held(held)


def test_figures_interpolate_and_say_what_a_larger_batch_saves():
    g = Gathering(GPU, instances=2, cap=4)
    assert g.call_s(1) == pytest.approx(0.010) and g.call_s(3) == pytest.approx(0.021)  # between 2 and 4
    assert g.call_s(8) is None  # beyond the largest measured: not known
    assert g.saves_s(1, 2) == pytest.approx(0.008)
    assert g.saves_s(2, 4) == pytest.approx(-0.006)  # two batches of 2 are faster than one of 4
    assert Gathering(CPU, 2, 4).saves_s(1, 2) < 0


def test_it_gathers_only_with_enough_held_and_a_size_that_saves():
    g = Gathering(GPU, instances=2, cap=4, clock=Clock())
    warmed(g, held=3)  # 1.5 per instance: nothing to pair
    assert g.least() == 1 and not g.gathering
    warmed(g, held=4, n=G.STEADY * 2 - 1)
    assert g.least() == 1  # not yet steady
    g.note_held(4)
    assert g.least() == 2 and g.gathering and g.tries == 1
    assert g.wait_s == pytest.approx(0.008)  # a batch waits at most what the pair saves
    c = Gathering(CPU, instances=2, cap=4, clock=Clock())
    warmed(c, held=4)
    assert c.least() == 1 and c.tries == 0  # no faster per sample: never tried
    one = Gathering(GPU, instances=2, cap=1, clock=Clock())
    warmed(one, held=8)
    assert one.least() == 1  # batches of 1 only


def test_the_measured_gap_decides_and_a_lost_try_backs_off():
    clock = Clock()
    g = Gathering(GPU, instances=2, cap=2, clock=clock)
    warmed(g, held=4)
    assert g.least() == 2
    for _ in range(G.SETTLE * 2):  # the change of pace is dropped, however long
        g.note_gap(1.0)
    for _ in range(G.WINDOW * 2):
        g.note_gap(0.002)  # 2 ms idle a batch < 8 ms saved: gathering stays
    assert g.least() == 2 and g.gap_s == pytest.approx(0.002)
    for _ in range(G.WINDOW * 2):
        g.note_gap(0.009)  # 9 ms > 8 ms: spreading serves more
    assert g.least() == 1 and g.gap_s == pytest.approx(0.009)
    assert g.report() == {"mode": "spreading", "size": 1, "measured_gap_ms": 9.0, "saves_ms": None, "tries": 1}
    g.note_gap(0.0)  # gaps while spreading are not counted
    clock.t += G.RETRY_S - 0.1
    assert g.least() == 1  # backing off
    clock.t += 0.2
    assert g.least() == 2 and g.tries == 2
    for _ in range(G.SETTLE * 2 + G.WINDOW * 2):
        g.note_gap(0.009)
    assert g.least() == 1
    clock.t += 2 * G.RETRY_S - 0.1
    assert g.least() == 1  # the second loss doubled the back-off
    clock.t += 0.2
    assert g.least() == 2


def test_fewer_clients_spread_again_at_once():
    g = Gathering(GPU, instances=2, cap=2, clock=Clock())
    warmed(g, held=4)
    assert g.least() == 2
    warmed(g, held=1, n=4 * 2)  # the high-water of the last 4 x instances dispatches falls
    assert g.least() == 1 and g.tries == 1
    warmed(g, held=4)
    assert g.least() == 2  # no back-off: nothing was lost


def test_settings_check_their_call_times():
    assert BatchSettings(call_ms=((1, 2.0), (2, 3.0))).call_ms == ((1, 2.0), (2, 3.0))
    for bad in (((0, 1.0),), ((1, 0.0),), ((2, 1.0), (1, 1.0)), ((1, 1.0), (1, 2.0)), ((1, 4e6),)):
        with pytest.raises(ValueError, match="call_ms"):
            BatchSettings(call_ms=bad)


class Gpuish(FakeBackend):
    """Doubles its input; a call takes 40 ms at batch 1 and 42 ms at 2 (asleep: a runtime's time off the GIL)."""

    def _infer_impl(self, feeds):
        x = feeds["x"]
        time.sleep(0.040 + 0.002 * (len(x) - 1))
        self.batches.append(len(x))
        return [x * 2]


def closed_loop(settings: BatchSettings, clients: int = 2, each: int = 40) -> tuple[list[int], object]:
    """``clients`` clients, each sending ``each`` one-row requests one after the other (5 ms apart), every answer
    checked."""
    async def main():
        be = Gpuish()
        b = Batcher(be, settings)
        b.start()

        async def client(c: int) -> None:
            await asyncio.sleep(0.015 * c)  # not in step: the second arrives while the first one's batch runs
            for i in range(each):
                v = np.array([[c, i]], np.float32)
                out = await b.submit({"x": v})
                assert np.array_equal(out[0], v * 2)  # its own answer, not its partner's
                await asyncio.sleep(0.005)  # the client's round trip: the batch queued behind has started by then

        await asyncio.gather(*(client(c) for c in range(clients)))
        report = b.gathering_report()
        await b.close()
        return be.batches, report

    return asyncio.run(main())


def test_two_clients_on_one_gpu_like_instance_run_as_pairs():
    spread, none = closed_loop(BatchSettings(max_batch_size=4, preferred_batch_sizes=(4,)))
    assert none is None  # no figures: never considered
    assert spread.count(1) >= len(spread) - 3  # one running, one queued behind it: batches of 1
    batches, report = closed_loop(BatchSettings(max_batch_size=4, preferred_batch_sizes=(4,),
                                                call_ms=((1, 40.0), (2, 42.0), (4, 46.0))))
    assert isinstance(report, dict) and report["mode"] == "gathering" and report["size"] == 2
    # after the spread's first batches and the switch, pairs (the measured gap is the loop's hand-offs, far below
    # the 38 ms a pair saves)
    assert batches.count(2) >= len(batches) - G.STEADY - G.SETTLE - 4, batches
    assert sum(batches) == 80 and max(batches) == 2
