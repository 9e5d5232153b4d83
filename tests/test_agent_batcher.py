"""The batching loop enforces the contract: size limits, deadlines, expiry, errors to every request."""

import asyncio
import itertools
import threading
import time

import numpy as np
import pytest

from edgefleet.agent.core.batching.batcher import Batcher
from edgefleet.agent.core.batching.request_queue import DEAD_MAX, HIGH, NORMAL
from edgefleet.agent.core.batching.settings import BatchSettings
from edgefleet.agent.core.batching.turns import ComputeTurns
from edgefleet.agent.errors import InferenceFailed, QueueFull, RequestError, Unavailable
from edgefleet.engines import Engine, EngineSpec
from edgefleet.protocol.manifest import TensorSpec
from tests.waiting import begun, until

pytestmark = pytest.mark.serial  # lone calls timed against inline_max_us, timeouts of 0.3 s: alone


class FakeBackend(Engine):
    """A real Engine implementation in NumPy: doubles its input; can be told to misbehave."""

    kind = "fake"

    def __init__(self, delay_s: float = 0.0, mode: str = "ok"):
        super().__init__(EngineSpec((TensorSpec(name="x", datatype="FP32", shape=(-1, 2)),),
                                    (TensorSpec(name="y", datatype="FP32", shape=(-1, 2)),), label="fake"))
        self.delay_s = delay_s
        self.mode = mode
        self.batches: list[int] = []
        self.seen: list[float] = []  # the first value of every batch, in the order batches ran
        self.started = threading.Event()  # set when a batch has reached infer()
        self.gate = threading.Event()
        self.gate.set()

    @property
    def inputs(self):
        return (TensorSpec(name="x", datatype="FP32", shape=(-1, 2)),)

    @property
    def outputs(self):
        return (TensorSpec(name="y", datatype="FP32", shape=(-1, 2)),)

    def load(self, engine, threads):
        pass

    def _infer_impl(self, feeds):
        self.started.set()
        self.gate.wait(5)
        time.sleep(self.delay_s)  # the runtime's work, simulated: a cost under test, not a wait for anything
        x = feeds["x"]
        self.batches.append(len(x))
        self.seen.append(float(x[0, 0]))
        if self.mode == "raise":
            raise RuntimeError("device lost")
        if self.mode == "short":
            return [x[:-1] * 2]
        return [x * 2]

    def _close_impl(self):
        pass


def run(coro):
    return asyncio.run(coro)


def x(n, start=0.0):
    return {"x": np.arange(start, start + 2 * n, dtype=np.float32).reshape(n, 2)}


def gated(settings: BatchSettings, **kw) -> tuple[FakeBackend, Batcher]:
    """A started batcher over a fake engine whose batches wait at its gate until the test opens it."""
    be = FakeBackend()
    be.gate.clear()
    b = Batcher(be, settings, **kw)
    b.start()
    return be, b


def gated_many(n: int, settings: BatchSettings) -> tuple[list[FakeBackend], Batcher]:
    """The same over ``n`` fake engines (instances), each held at its own gate."""
    bes = [FakeBackend() for _ in range(n)]
    for be in bes:
        be.gate.clear()
    b = Batcher(bes, settings)
    b.start()
    return bes, b


async def release(be: FakeBackend, b: Batcher, *pending) -> list:
    """Open the fake engine's gate, await every pending request and close the batcher: -> their answers."""
    be.gate.set()
    outs = await asyncio.gather(*pending)
    await b.close()
    return list(outs)


def test_concurrent_requests_are_batched_and_answered_in_order():
    async def main():
        be = FakeBackend()
        b = Batcher(be, BatchSettings(max_batch_size=8, max_queue_delay_us=50_000))
        b.start()
        outs = await asyncio.gather(*(b.submit(x(1, start=10 * i)) for i in range(20)))
        await b.close()
        return be, outs

    be, outs = run(main())
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)
    assert sum(be.batches) == 20 and max(be.batches) == 8
    assert len(be.batches) <= 4  # 20 requests in batches of up to 8, not 20 runs


def test_multi_sample_requests_never_exceed_max_batch():
    async def main():
        be = FakeBackend()
        b = Batcher(be, BatchSettings(max_batch_size=8, max_queue_delay_us=20_000))
        b.start()
        outs = await asyncio.gather(*(b.submit(x(3, start=i)) for i in range(6)))
        await b.close()
        return be, outs

    be, outs = run(main())
    assert all(n <= 8 for n in be.batches) and sum(be.batches) == 18
    for i, o in enumerate(outs):
        assert o[0].shape == (3, 2)
        np.testing.assert_array_equal(o[0], x(3, start=i)["x"] * 2)


def refused_at_submit(settings: BatchSettings, n: int, match: str) -> None:
    """A request of ``n`` samples to a fresh batcher with ``settings`` is refused at once (RequestError ``match``)."""
    async def main():
        b = Batcher(FakeBackend(), settings)
        b.start()
        try:
            with pytest.raises(RequestError, match=match):
                await b.submit(x(n))
        finally:
            await b.close()

    run(main())


def test_request_larger_than_max_batch_is_refused():
    refused_at_submit(BatchSettings(max_batch_size=4), 5, "exceeds this model's max batch size 4")


def test_failed_batch_fails_every_request_and_the_loop_keeps_going():
    async def main():
        be = FakeBackend(mode="raise")
        b = Batcher(be, BatchSettings(max_batch_size=8, max_queue_delay_us=20_000))
        b.start()
        res = await asyncio.gather(*(b.submit(x(1)) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, InferenceFailed) and "device lost" in str(r) for r in res)
        be.mode = "ok"
        out = await b.submit(x(1))
        await b.close()
        return out

    np.testing.assert_array_equal(run(main())[0], x(1)["x"] * 2)


def test_output_batch_mismatch_is_an_error_not_a_wrong_answer():
    async def main():
        b = Batcher(FakeBackend(mode="short"), BatchSettings(max_batch_size=8, max_queue_delay_us=10_000))
        b.start()
        res = await asyncio.gather(*(b.submit(x(1)) for _ in range(3)), return_exceptions=True)
        await b.close()
        return res

    res = run(main())
    assert all(isinstance(r, InferenceFailed) and "batch" in str(r) for r in res)


def test_requests_that_waited_too_long_expire():
    async def main():
        # the first batch blocks the inference thread
        be, b = gated(BatchSettings(max_batch_size=1, max_queue_delay_us=0, queue_timeout_s=0.05))
        first = asyncio.ensure_future(b.submit(x(1)))
        await until(be.started.is_set, 5, "the first batch running")
        second = asyncio.ensure_future(b.submit(x(1)))
        await until(second.done, 5, "the second request answered while the first holds the model")
        be.gate.set()
        r1 = await first
        with pytest.raises(Unavailable, match="waited"):
            await second
        await b.close()
        return r1

    assert run(main())[0].shape == (1, 2)


def test_queue_full_is_429_not_unbounded_memory():
    async def main():
        be, b = gated(BatchSettings(max_batch_size=2, max_queue_delay_us=0, max_queue_size=4))
        futs = [asyncio.ensure_future(b.submit(x(2)))]
        await until(be.started.is_set, 5, "the first request running (blocked), the queue empty")
        futs += [asyncio.ensure_future(b.submit(x(2))) for _ in range(2)]
        await until(lambda: b.queued_samples == 4, 5, "4 samples queued: the limit")
        with pytest.raises(QueueFull, match="queue full") as exc:
            await b.submit(x(2))
        assert exc.value.status_code == 429
        await release(be, b, *futs)

    run(main())


def test_close_drains_queued_requests():
    async def main():
        be = FakeBackend(delay_s=0.01)
        b = Batcher(be, BatchSettings(max_batch_size=2, max_queue_delay_us=0))
        b.start()
        futs = [asyncio.ensure_future(b.submit(x(1))) for _ in range(6)]
        await until(lambda: all(begun(f) for f in futs), 5, "the six requests submitted")
        await b.close()
        return await asyncio.gather(*futs)

    assert len(run(main())) == 6


def test_requests_with_different_dynamic_dims_are_not_stacked():
    class Dyn(FakeBackend):
        @property
        def inputs(self):
            return (TensorSpec(name="x", datatype="FP32", shape=(-1, -1)),)

        @property
        def outputs(self):
            return (TensorSpec(name="y", datatype="FP32", shape=(-1, -1)),)

    async def main():
        be = Dyn()
        b = Batcher(be, BatchSettings(max_batch_size=8, max_queue_delay_us=20_000))
        b.start()
        small = {"x": np.ones((1, 2), np.float32)}
        wide = {"x": np.ones((1, 5), np.float32)}
        outs = await asyncio.gather(b.submit(small), b.submit(wide), b.submit(small), b.submit(wide))
        await b.close()
        return outs

    outs = run(main())
    assert [o[0].shape for o in outs] == [(1, 2), (1, 5), (1, 2), (1, 5)]


def test_close_after_drain_timeout_answers_everyone():
    async def main():
        # inference hangs
        be, b = gated(BatchSettings(max_batch_size=1, max_queue_delay_us=0))
        futs = [asyncio.ensure_future(b.submit(x(1))) for _ in range(3)]
        await until(lambda: be.started.is_set() and b.queued_samples == 2, 5, "one request running, two queued")
        await b.close(drain_timeout_s=0.1)
        res = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 2)
        be.gate.set()
        return res

    res = run(main())
    assert all(isinstance(r, Unavailable) for r in res), res


def test_several_instances_run_batches_at_the_same_time():
    async def main():
        (a, b_), b = gated_many(2, BatchSettings(max_batch_size=1))
        assert b.instances == 2
        futs = [asyncio.ensure_future(b.submit(x(1, start=10 * i))) for i in range(2)]
        # both instances hold a batch while neither may finish: two inference threads, not one
        await until(lambda: a.started.is_set() and b_.started.is_set(), 5, "both instances running")
        a.gate.set()
        b_.gate.set()
        outs = await asyncio.gather(*futs)
        more = await asyncio.gather(*(b.submit(x(1, start=10 * i)) for i in range(8)))
        await b.close()
        return a, b_, outs, more

    a, b_, outs, more = run(main())
    for group in (outs, more):
        for i, o in enumerate(group):
            np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)
    assert len(a.batches) >= 1 and len(b_.batches) >= 1 and sum(a.batches) + sum(b_.batches) == 10


def test_high_priority_requests_run_first():
    async def main():
        be, b = gated(BatchSettings(max_batch_size=1))
        first = asyncio.ensure_future(b.submit(x(1, start=0)))
        await until(be.started.is_set, 5, "the first batch running")
        normal = [asyncio.ensure_future(b.submit(x(1, start=100 + i), priority=NORMAL)) for i in range(2)]
        await until(lambda: b.queued_samples == 2, 5, "the two normal requests queued")
        high = asyncio.ensure_future(b.submit(x(1, start=200), priority=HIGH))
        await until(lambda: b.queued_samples == 3, 5, "the high-priority request queued behind them")
        await release(be, b, first, *normal, high)
        return be.seen

    assert run(main()) == [0.0, 200.0, 100.0, 101.0]


def test_preferred_batch_sizes_split_a_queue():
    async def main():
        be, b = gated(BatchSettings(max_batch_size=8, preferred_batch_sizes=(4,)))
        first = asyncio.ensure_future(b.submit(x(1)))
        await until(be.started.is_set, 5, "the first batch running")
        rest = [asyncio.ensure_future(b.submit(x(1, start=10 * i))) for i in range(6)]
        await until(lambda: b.queued_samples == 6, 5, "the six requests queued")
        outs = await release(be, b, first, *rest)
        return be.batches, outs

    batches, outs = run(main())
    assert batches == [1, 4, 2]  # not [1, 6]: the runtime's preferred size first, the rest after
    for i, o in enumerate(outs[1:]):
        np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)


async def _held_busy(settings: BatchSettings):
    """A started batcher whose model is held busy (at its gate) by a first request -> (backend, batcher, first)."""
    be, b = gated(settings)
    first = asyncio.ensure_future(b.submit(x(1)))
    await until(be.started.is_set, 5, "the first batch running")
    return be, b, first


def test_a_request_timeout_is_answered_at_its_deadline_not_when_the_queue_moves():
    async def main():
        be, b, first = await _held_busy(BatchSettings(max_batch_size=1, queue_timeout_s=60))
        with pytest.raises(Unavailable, match=r"timeout 0.05s"):
            await b.submit(x(1), timeout_s=0.05)
        assert not be.gate.is_set() and not first.done()  # answered while the model was still busy
        assert b.queued_samples == 0
        be.gate.set()
        await first
        await b.close()
        return be.batches

    assert run(main()) == [1]  # the expired request never ran


def test_a_lone_request_does_not_wait_for_a_batch_that_is_not_coming():
    async def main():
        be = FakeBackend()
        # a queue delay of 1000 s: a batcher that waited for company would hang here (pytest-timeout)
        b = Batcher(be, BatchSettings(max_batch_size=8, max_queue_delay_us=1_000_000_000))
        b.start()
        outs = [await asyncio.wait_for(b.submit(x(1, start=i)), 60) for i in range(3)]
        await b.close()
        return be.batches, outs

    batches, outs = run(main())
    assert batches == [1, 1, 1]
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(o[0], x(1, start=i)["x"] * 2)


def test_a_request_larger_than_the_queue_is_a_400_not_a_retry():
    refused_at_submit(BatchSettings(max_batch_size=8, max_queue_size=4), 5, "exceeds this model's queue of 4 samples")


def test_as_many_results_as_requests_with_mixed_sizes_and_instances():
    async def main():
        bes = [FakeBackend(), FakeBackend(), FakeBackend()]
        b = Batcher(bes, BatchSettings(max_batch_size=8, max_queue_delay_us=5_000, preferred_batch_sizes=(2, 4)))
        b.start()
        sizes = [1 + (i * 7) % 5 for i in range(60)]
        outs = await asyncio.gather(*(b.submit(x(n, start=100 * i), priority=HIGH if i % 3 == 0 else NORMAL)
                                      for i, n in enumerate(sizes)))
        await b.close()
        return bes, sizes, outs

    bes, sizes, outs = run(main())
    assert len(outs) == len(sizes)
    for i, (n, o) in enumerate(zip(sizes, outs, strict=True)):
        np.testing.assert_array_equal(o[0], x(n, start=100 * i)["x"] * 2)
    ran = [n for be in bes for n in be.batches]
    assert sum(ran) == sum(sizes) and max(ran) <= 8


def test_a_cancelled_request_leaves_the_queue_count_right():
    async def main():
        be, b = gated(BatchSettings(max_batch_size=1, max_queue_size=2))
        first = asyncio.ensure_future(b.submit(x(1)))
        await until(be.started.is_set, 5, "the first batch running")
        gone = asyncio.ensure_future(b.submit(x(1)))
        await until(lambda: b.queued_samples == 1, 5, "the request queued")
        gone.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert b.queued_samples == 0
        kept = [asyncio.ensure_future(b.submit(x(1))) for _ in range(2)]  # the cancelled one holds no room
        await until(lambda: b.queued_samples == 2, 5, "the two requests queued")
        await release(be, b, first, *kept)
        return be.batches

    assert run(main()) == [1, 1, 1]


class Timed(FakeBackend):
    """Records when each call ran (monotonic start, end) in a list it may share with other instances."""

    def __init__(self, log: list[tuple[float, float, str]], tag: str, delay_s: float = 0.01):
        super().__init__(delay_s=delay_s)
        self.log, self.tag = log, tag

    def _infer_impl(self, feeds):
        t0 = time.monotonic()
        out = super()._infer_impl(feeds)
        self.log.append((t0, time.monotonic(), self.tag))
        return out


def _overlaps(log: list[tuple[float, float, str]]) -> list[tuple]:
    spans = sorted(log)
    return [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def test_an_install_call_takes_its_turn_between_the_serving_batches():
    """A self-test or warm-up call of the next version (from the installer's thread) never runs at the same
    time as a batch of the version being served, and does not wait for the load to stop."""
    log: list[tuple[float, float, str]] = []

    async def main():
        loop = asyncio.get_running_loop()
        turns = ComputeTurns(1)
        b = Batcher(Timed(log, "serving"), BatchSettings(max_batch_size=4), turns=turns)
        b.start()
        stop = asyncio.Event()

        async def client(k: int) -> int:
            n = 0
            while not stop.is_set() and n < 1000:  # bounded
                await b.submit(x(1, start=k))
                n += 1
            return n

        clients = [asyncio.ensure_future(client(k)) for k in range(4)]
        await until(lambda: len(log) >= 3, 5, "serving batches")
        warm = Timed(log, "install")
        done = await loop.run_in_executor(None, lambda: [turns.call(loop, warm.infer, x(1)) for _ in range(3)])
        await until(lambda: sum(t == "serving" for *_, t in log[-3:]) == 3, 5, "serving after the install calls")
        stop.set()
        served = await asyncio.gather(*clients)
        await b.close()
        return done, served, turns

    done, served, turns = run(main())
    assert len(done) == 3 and all(o[0].shape == (1, 2) for o in done)
    assert min(served) > 0
    tags = [t for *_, t in sorted(log)]
    assert tags.count("install") == 3 and tags[0] == "serving" and tags[-1] == "serving"
    assert _overlaps(log) == []
    first = tags.index("install")
    assert "serving" in tags[first:tags.index("install", first + 1)]  # one call per turn: batches in between
    assert turns.busy == 0


def test_two_versions_sharing_compute_turns_never_run_at_once_and_both_answer_everything():
    """The old version's last batches and the new version's first ones take turns: a swap does not put two
    batches on the same cores."""
    log: list[tuple[float, float, str]] = []

    async def main():
        turns = ComputeTurns(1)
        old = Batcher(Timed(log, "old"), BatchSettings(max_batch_size=2), turns=turns)
        new = Batcher(Timed(log, "new"), BatchSettings(max_batch_size=2), turns=turns)
        old.start()
        new.start()
        outs = await asyncio.gather(*(bt.submit(x(1, start=10 * i)) for i in range(12) for bt in (old, new)))
        closing = asyncio.ensure_future(old.close())
        more = await asyncio.gather(*(new.submit(x(1, start=10 * i)) for i in range(4)))
        await closing
        await new.close()
        return outs, more, turns

    outs, more, turns = run(main())
    for k, o in enumerate(outs):
        np.testing.assert_array_equal(o[0], x(1, start=10 * (k // 2))["x"] * 2)
    assert len(more) == 4
    assert {t for *_, t in log} == {"old", "new"} and _overlaps(log) == []
    assert turns.busy == 0


def test_several_permits_let_several_instances_run_and_a_cancelled_waiter_keeps_none():
    async def main():
        turns = ComputeTurns(2)
        await turns.acquire()
        await turns.acquire()  # both permits held: a third waits
        waiter = asyncio.ensure_future(turns.acquire())
        await until(lambda: turns.waiting, 5, "the third acquire waiting")
        assert not waiter.done() and turns.busy == 2
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        turns.release()
        turns.release()
        assert turns.busy == 0
        # handed the permit just as it is cancelled: the permit goes back, not astray
        await turns.acquire()
        await turns.acquire()
        late = asyncio.ensure_future(turns.acquire())
        await until(lambda: turns.waiting, 5, "the late acquire waiting")
        turns.release()  # hands the permit to ``late``
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        turns.release()
        return turns.busy

    assert run(main()) == 0
    with pytest.raises(ValueError, match="at least one permit"):
        ComputeTurns(0)


def test_an_install_call_runs_even_when_no_turn_comes():
    """A batch stuck in the runtime (or a stopped loop) delays an install by the wait, never forever."""

    async def main():
        loop = asyncio.get_running_loop()
        turns = ComputeTurns(1)
        await turns.acquire()  # held: a stuck batch
        out = await loop.run_in_executor(None, lambda: turns.call(loop, lambda: "ran", wait_s=0.2))
        busy_after_call = turns.busy
        turns.release()  # the stuck batch ends: the turn given up on is not left holding a permit
        await until(lambda: turns.busy == 0, 5, "the permit back from the turn given up on")
        return out, busy_after_call, turns

    out, busy_after_call, turns = run(main())
    assert out == "ran" and busy_after_call == 1 and turns.busy == 0


def test_requests_arriving_while_a_batch_runs_join_the_batch_queued_behind_it():
    """Without waiting for a full batch: the first request queued behind a running batch opens the next one, each
    later request joins it (copied into its rows) until the thread starts it, up to the max batch size; a request
    that does not fit waits for the batch after. Answers are each request's own rows, and every request of an open
    batch is answered once."""
    async def main():
        # the first batch holds the thread while the others arrive one by one
        be, b = gated(BatchSettings(max_batch_size=4))
        futs = [asyncio.ensure_future(b.submit(x(1, start=0)))]
        await until(be.started.is_set, 5, "the first batch running")
        held = 0
        for i, n in enumerate((1, 2, 1, 2), start=1):  # 1 + 2 + 1 fill the open batch; the last 2 do not fit
            futs.append(asyncio.ensure_future(b.submit(x(n, start=100 * i))))
            held += n
            await until(lambda held=held: b.queued_samples == held, 5, f"request {i} queued ({held} samples)")
        assert b.queued_samples == 6
        be.gate.set()
        outs = await asyncio.gather(*futs)
        again = await b.submit(x(3, start=7))  # the buffers are reused: no stale rows
        await b.close()
        return be, outs, again

    be, outs, again = run(main())
    assert be.batches == [1, 4, 2, 3]
    for i, (n, o) in enumerate(zip((1, 1, 2, 1, 2), outs, strict=True)):
        np.testing.assert_array_equal(o[0], x(n, start=100 * i)["x"] * 2)
    np.testing.assert_array_equal(again[0], x(3, start=7)["x"] * 2)


def test_closed_batches_queue_only_a_full_batch_behind():
    async def main():
        be, b = gated(BatchSettings(max_batch_size=4), open_batches=False)
        futs = [asyncio.ensure_future(b.submit(x(1)))]
        await until(be.started.is_set, 5, "the first batch running")
        futs += [asyncio.ensure_future(b.submit(x(1, start=10 * i))) for i in range(1, 4)]
        await until(lambda: b.queued_samples == 3, 5, "three requests queued")
        await release(be, b, *futs)
        return be

    assert run(main()).batches == [1, 3]


class _CpuSpy(FakeBackend):
    """A CPU engine as the batcher sees it (its kind decides whether a lone call may run inline); records the
    thread each call ran on."""

    kind = "onnxruntime"

    def __init__(self, delay_s: float = 0.0, kind: str = "onnxruntime"):
        super().__init__(delay_s)
        self.kind = kind
        self.device = "CPUExecutionProvider"  # what onnxruntime's engine says when it runs on the CPU
        self.threads: list[int] = []

    def _infer_impl(self, feeds):
        self.threads.append(threading.get_ident())
        return super()._infer_impl(feeds)


def _lone_requests(be: _CpuSpy, inline_max_us: int, n: int = 4) -> list[bool]:
    """``n`` requests one after another: for each, did it run on the event loop's own thread?"""
    async def main():
        b = Batcher(be, BatchSettings(max_batch_size=8, inline_max_us=inline_max_us))
        b.start()
        for i in range(n):
            out = await b.submit(x(1, start=i))
            np.testing.assert_array_equal(out[0], x(1, start=i)["x"] * 2)
        await b.close()
        return threading.get_ident()

    loop_thread = run(main())
    return [t == loop_thread for t in be.threads]


def test_a_lone_tiny_call_runs_on_the_event_loop_after_the_first():
    """The first lone call runs on the inference thread and is timed; every later lone call of a model whose lone
    calls take less than inline_max_us runs on the loop (two thread hand-offs would cost more than the call)."""
    assert _lone_requests(_CpuSpy(), inline_max_us=10_000) == [False, True, True, True]


@pytest.mark.parametrize("be, inline_max_us", [
    (_CpuSpy(), 0),  # switched off
    (_CpuSpy(delay_s=0.02), 100),  # 20 ms calls: far above the bound
    (_CpuSpy(kind="tensorrt"), 10_000),  # a GPU context belongs to its thread
    (_CpuSpy(kind="fake"), 10_000)])
def test_other_calls_stay_on_the_inference_thread(be, inline_max_us):
    assert _lone_requests(be, inline_max_us) == [False] * 4


def test_requests_under_concurrency_are_never_run_inline():
    """With others queued or running, the loop keeps forming batches and the thread runs them: inline only helps
    the lone request."""
    async def main():
        be = _CpuSpy()
        b = Batcher(be, BatchSettings(max_batch_size=2, inline_max_us=10_000))
        b.start()
        await b.submit(x(1))  # timed on the thread: the model's lone calls are tiny from here on
        outs = await asyncio.gather(*(b.submit(x(1, start=10 * i)) for i in range(9)))
        await b.close()
        return be, outs, threading.get_ident()

    be, outs, loop_thread = run(main())
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)
    together = [t == loop_thread for t, n in zip(be.threads, be.batches, strict=True) if n > 1]
    assert together and not any(together), (be.batches, be.threads)


def test_non_finite_outputs_fail_only_the_requests_whose_rows_hold_them():
    """The batcher checks a batch's outputs for NaN and infinity once (Outputs.finite); a batch that holds some still
    fails only the requests whose own rows do, when their answers are encoded
    (agent.transports.kserve.ordered_outputs)."""
    from edgefleet.agent.core.batching.dispatch import Outputs
    from edgefleet.agent.transports.kserve import InferRequest, encode_response

    async def main():
        be = FakeBackend()
        b = Batcher(be, BatchSettings(max_batch_size=8, max_queue_delay_us=200_000))
        b.start()
        feeds = [x(1, start=1.0), {"x": np.full((1, 2), np.inf, np.float32)}, x(1, start=5.0)]  # inf in, inf out
        mixed = await asyncio.gather(*(b.submit(f) for f in feeds))
        clean = await asyncio.gather(*(b.submit(x(1, start=10.0 * i)) for i in range(3)))
        await b.close()
        return be, mixed, clean

    be, mixed, clean = run(main())
    assert be.batches[:2] == [3, 3]  # each three formed one batch
    assert all(isinstance(o, Outputs) and not o.finite for o in mixed)
    assert all(isinstance(o, Outputs) and o.finite for o in clean)
    req = InferRequest({}, None, frozenset())
    verdicts = []
    for o in mixed:
        try:
            encode_response("m", "1", o, be.outputs, req)
            verdicts.append("ok")
        except InferenceFailed as exc:
            verdicts.append(str(exc))
    assert verdicts[0] == verdicts[2] == "ok" and "NaN or infinity" in verdicts[1]
    assert all(encode_response("m", "1", o, be.outputs, req)[0] for o in clean)


LATER_S = 0.05  # a request arriving this much after another: their deadlines differ (the order under test), not a wait


def test_default_timeouts_share_one_timer_in_order_and_keep_nothing_once_answered():
    """Requests with the default timeout are watched by one timer (RequestQueue._sweep): each still expires while the
    model is busy, oldest first, a cancelled one is not answered twice, and answered requests are not kept."""
    async def main():
        be, b, first = await _held_busy(BatchSettings(max_batch_size=1, queue_timeout_s=0.3))
        order = []
        gone = asyncio.ensure_future(b.submit(x(1, start=2)))
        old = asyncio.ensure_future(b.submit(x(1, start=4)))
        old.add_done_callback(lambda f: order.append("old"))
        await until(lambda: b.queued_samples == 2, 5, "both requests queued")
        await asyncio.sleep(LATER_S)
        gone.cancel()  # its client went away
        new = asyncio.ensure_future(b.submit(x(1, start=6)))
        new.add_done_callback(lambda f: order.append("new"))
        for f in (old, new):
            with pytest.raises(Unavailable, match=r"timeout 0.3s"):
                await f
        assert order == ["old", "new"] and gone.cancelled()
        assert not be.gate.is_set() and not first.done() and b.queued_samples == 0  # expired while it was busy
        be.gate.set()
        await first
        for _ in range(5):
            await asyncio.gather(*(b.submit(x(1, start=i)) for i in range(40)))
        await b.submit(x(1))  # a request comes: the answered ones before it leave the timeout queue
        kept = len(b._timeouts)
        await b.close()
        return be.batches, kept

    batches, kept = run(main())
    assert batches.count(1) == 202  # the first and the 201 after; none of the expired or cancelled ones ran
    assert kept <= 1  # answered requests leave the timeout queue as new ones come


def test_the_timeout_queue_does_not_keep_answered_requests_inputs():
    """While the model is busy and an older request still waits (its deadline far off), requests cancelled by their
    clients are not all kept alive, inputs and all: the timeout queue holds them weakly, and the priority queues
    compact once they hold more than DEAD_MAX of them."""
    import gc
    import weakref

    async def main():
        be, b, first = await _held_busy(BatchSettings(max_batch_size=1, queue_timeout_s=30))
        stuck = asyncio.ensure_future(b.submit(x(1)))  # queued behind the held one, unanswered: the oldest watched
        await until(lambda: b.queued_samples == 1, 5, "the stuck request queued")
        refs = []
        for i in range(300):  # answered one by one while `stuck` is still the oldest the timer watches
            feeds = x(1, start=i)
            refs.append(weakref.ref(feeds["x"]))
            b2 = asyncio.ensure_future(b.submit(feeds, priority=HIGH))
            del feeds
            await until(lambda b2=b2: begun(b2), 5, "the request submitted")
            b2.cancel()  # their clients went away: answered (cancelled), settled
            with pytest.raises(asyncio.CancelledError):
                await b2
        gc.collect()
        alive = sum(r() is not None for r in refs)
        be.gate.set()
        await first
        await stuck
        await b.close()
        return alive, len(b._timeouts)

    alive, _ = run(main())
    assert alive <= DEAD_MAX  # the queues drop cancelled requests lazily, or compact when there are many


def test_requests_queued_while_instances_are_free_are_shared_among_them():
    """Four free instances and eight requests queued at once: each instance takes a batch of its share at once (one
    instance taking all eight, the other three idle, is the defect)."""
    async def main():
        bes, b = gated_many(4, BatchSettings(max_batch_size=8))
        futs = [b.enqueue(x(1, start=10 * i)).future for i in range(8)]  # queued before the loop looks
        try:
            await until(lambda: all(be.started.is_set() for be in bes), 5, "every instance running a batch")
        finally:
            for be in bes:
                be.gate.set()
        outs = await asyncio.gather(*futs)
        await b.close()
        return bes, outs

    bes, outs = run(main())
    assert sorted(be.batches[0] for be in bes) == [2, 2, 2, 2]
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)


def test_a_free_instance_takes_the_batch_waiting_behind_a_busy_one():
    """Two instances, both running a batch held in the runtime; requests arrive and wait behind them. The second
    instance's batch ends while the first's is still held: every waiting request then runs on the second, none waits
    behind the held one while an instance is idle."""
    async def main():
        (a, c), b = gated_many(2, BatchSettings(max_batch_size=4))
        first = [asyncio.ensure_future(b.submit(x(1, start=10 * i))) for i in range(2)]
        await until(lambda: a.started.is_set() and c.started.is_set(), 5, "both instances running")
        waiting = []
        for i in range(2, 8):  # one by one, as clients send them
            waiting.append(asyncio.ensure_future(b.submit(x(1, start=10 * i))))
            await until(lambda i=i: b.queued_samples == i - 1, 5, f"request {i} queued")
        held = a if any(f.done() for f in first) else None
        c.gate.set()  # the second instance's batch ends; the first stays held
        try:
            done, _ = await asyncio.wait(waiting, timeout=4)  # the held one lets go after 5 s (FakeBackend)
        finally:
            a.gate.set()
        outs = await asyncio.gather(*first, *waiting)
        await b.close()
        return a, c, held, len(done), outs

    a, c, held, done, outs = run(main())
    assert held is None
    assert done == 6, f"{6 - done} requests waited behind a held instance while the other was free"
    assert a.batches[0] == 1 and sum(a.batches) + sum(c.batches) == 8
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)


def _waiting_batches(per_instance: int) -> tuple[list[int], list[int]]:
    """Two instances, each running a batch of ``per_instance`` held in the runtime; two requests arrive one by one
    while they run; then the first instance's batch ends, the second's stays held until the arrivals are answered
    -> (the batches each instance ran)."""
    async def main():
        (a, c), b = gated_many(2, BatchSettings(max_batch_size=4))
        n = 2 * per_instance
        running = [b.enqueue(x(1, start=10 * i)).future for i in range(n)]  # queued before the loop looks
        await until(lambda: a.started.is_set() and c.started.is_set(), 5, "both instances running")
        waiting = []
        for i in range(n, n + 2):
            waiting.append(asyncio.ensure_future(b.submit(x(1, start=10 * i))))
            # queued, and out of the queue into a batch waiting on a thread
            await until(lambda i=i: b.queued_samples == i - n + 1 and not any(b._queues), 5, f"request {i} queued")
        a.gate.set()  # the first instance's batch ends (it started first); the second's stays held
        await until(lambda: all(f.done() for f in waiting), 5, "the arrivals answered (a free instance takes what "
                    "waits behind a held one)")
        first = list(a.batches)
        c.gate.set()
        outs = await asyncio.gather(*running, *waiting)
        await b.close()
        for i, o in enumerate(outs):
            np.testing.assert_array_equal(o[0], x(1, start=10 * i)["x"] * 2)
        return first, c.batches

    return run(main())


def test_waiting_requests_fill_the_batch_behind_the_first_to_finish_when_enough_are_held():
    """Four requests held per instance (a batch of 4 running on each, 2 arriving): the two arrivals are queued
    together behind the instance that started first, half of what each instance holds (one batch running, one
    behind), and it runs them as one batch of 2; spread one per instance, each would run a batch of 1 and give up what
    the runtime gains from 1 to 2 (issue 44). With one request running on each, two arrivals are spread: one behind
    each instance, every instance fed first (the first, once free, takes the one behind the held second)."""
    first, second = _waiting_batches(4)
    assert (first, second) == ([4, 2], [4])  # spread: [4, 1, 1], [4]
    first, second = _waiting_batches(1)
    assert (first, second) == ([1, 1, 1], [1])
