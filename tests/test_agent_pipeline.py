"""The batch queued behind a running one (agent/core/batching/dispatch.py): formed while the runtime is busy and
started by the inference thread the moment the running batch ends; taken back for a high-priority request or an
install's turn; its requests still expire, still count against the queue's limit, and all get their own answers."""

import asyncio
import threading

import numpy as np

from edgefleet.agent.core.batching.batcher import Batcher
from edgefleet.agent.core.batching.request_queue import HIGH
from edgefleet.agent.core.batching.settings import BatchSettings
from edgefleet.agent.core.batching.turns import ComputeTurns
from tests.test_agent_batcher import FakeBackend, gated, release, x
from tests.waiting import until


def run(coro):
    return asyncio.run(coro)


async def _queued_behind(settings: BatchSettings, first_start: float, starts: list[float],
                         turns: ComputeTurns | None = None):
    """A batcher whose first request (``first_start``) runs, held inside its gated fake engine, with requests
    ``starts`` submitted after it and a batch of them queued on the busy thread. -> (engine, batcher, first, rest)"""
    be, b = gated(settings, turns=turns)
    first = asyncio.ensure_future(b.submit(x(1, start=first_start)))
    await until(be.started.is_set, 5, "the first batch running")
    rest = [asyncio.ensure_future(b.submit(x(1, start=v))) for v in starts]
    await until(lambda: b._instances[0].slot is not None, 5, "a batch queued on the busy thread")
    return be, b, first, rest


def test_a_full_batch_waits_on_the_busy_thread_and_every_request_gets_its_own_answer():
    async def main():
        be, b, first, rest = await _queued_behind(BatchSettings(max_batch_size=4, max_queue_size=16), -10,
                                                  [10 * i for i in range(8)])
        assert b.queued_samples == 8  # still counted as waiting
        staged = b._instances[0].slot
        assert staged is not None and staged.n == 4
        outs = await release(be, b, first, *rest)
        return be, outs

    be, outs = run(main())
    np.testing.assert_array_equal(outs[0][0], x(1, start=-10)["x"] * 2)
    for i, o in enumerate(outs[1:]):
        np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)
    assert be.batches == [1, 4, 4]


def test_an_install_turn_takes_back_the_queued_batch():
    """A swap adds at most one batch to the wait of an install's call: the batch queued behind the running one
    goes back to the queue when the call asks for its turn."""
    async def main():
        turns = ComputeTurns(1)
        be, b, first, rest = await _queued_behind(BatchSettings(max_batch_size=2), 0, [100 + 10 * i for i in range(2)],
                                                  turns)
        loop = asyncio.get_running_loop()
        install = loop.run_in_executor(None, lambda: turns.call(loop, be.seen.append, -1.0))  # marks its turn
        await until(lambda: b._instances[0].slot is None, 5, "the queued batch taken back")
        be.gate.set()
        await install
        await asyncio.gather(first, *rest)
        await b.close()
        return be.seen

    assert run(main()) == [0.0, -1.0, 100.0]  # the running batch, the install's call, then the queued batch


def test_a_high_priority_request_goes_before_the_queued_batch():
    async def main():
        be, b, first, normal = await _queued_behind(BatchSettings(max_batch_size=2), 0, [100 + i for i in range(2)])
        high = asyncio.ensure_future(b.submit(x(1, start=200), priority=HIGH))
        await until(lambda: b.queued_samples == 3, 5, "the high-priority request queued")
        await release(be, b, first, *normal, high)
        return be.seen

    seen = run(main())
    assert seen[0] == 0.0 and seen[1] == 200.0  # the high-priority request heads the next batch


def test_the_thread_starts_the_queued_batch_without_the_event_loop():
    """With the event loop blocked (busy on other work), the queued batch still starts the moment the running one
    ends."""
    async def main():
        be, b, first, rest = await _queued_behind(BatchSettings(max_batch_size=2), 0, [10 * i for i in range(2)])
        be.started.clear()
        be.gate.set()
        ran = be.started.wait(10)  # blocks the event loop: only the inference thread can move
        await asyncio.gather(first, *rest)
        await b.close()
        return ran

    assert run(main())


def test_threads_are_not_left_behind():
    before = threading.active_count()

    async def main():
        b = Batcher(FakeBackend(), BatchSettings(max_batch_size=2))
        b.start()
        await asyncio.gather(*(b.submit(x(1)) for _ in range(9)))
        await b.close()

    run(main())
    assert threading.active_count() <= before + 1
