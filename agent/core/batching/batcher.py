"""Dynamic batching: the loop, not user code, enforces the contract.

:class:`Batcher` is one model version's batching, put together from its parts, one module each:
``request_queue`` (admission, two priority levels, expiry), ``forming`` (which requests go together, and how long
the oldest waits), ``dispatch`` (engine instances, their threads, the batch queued behind a running one), ``turns``
(turns on the cores, shared by a model's versions), ``settings`` and ``tuning`` (the batch sizes and layout chosen
from figures measured at install). One loop task (:meth:`Batcher._loop`) forms batches and hands each to a free
instance.

The contract: every request gets exactly one answer. A request whose timeout passes while it is still
queued gets 503 at its deadline (running requests are not interrupted); a full queue answers 429
(:class:`QueueFull`) at once; a batch whose outputs do not match its inputs, or that raises, fails every
request in it with the same error; a request still waiting when the batcher closes gets 503.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import weakref
from collections.abc import Collection, Sequence

import numpy as np

from ....engines import Engine
from ...errors import Unavailable
from ..metrics import Metrics, ModelMetrics
from .dispatch import Dispatcher, Instance
from .forming import BatchFormer
from .request_queue import HIGH, NORMAL, Pending, RequestQueue
from .settings import BatchSettings
from .turns import ComputeTurns

__all__ = ["Batcher"]

log = logging.getLogger("edgefleet.agent.batcher")


class Batcher:
    """One model version's batching: requests in (``submit``, ``enqueue``), exactly one answer out for each."""

    _dispatch: Dispatcher  # made after the queue, whose callback reaches it

    def __init__(self, backends: Engine | Sequence[Engine], settings: BatchSettings,
                 metrics: ModelMetrics | Metrics | None = None, turns: ComputeTurns | None = None,
                 cpus: Collection[int] | None = None, open_batches: bool = True):
        """``turns``: shared with the model's other versions (default: one of its own, a permit per instance).
        ``cpus``: the CPUs the inference threads run on (None: wherever the scheduler puts them).
        ``open_batches``: a batch queued behind a running one takes requests until its thread starts it (False: it
        is queued there only when full, and closed)."""
        backends = [backends] if isinstance(backends, Engine) else list(backends)
        if not backends:
            raise ValueError("a batcher needs at least one backend instance")
        self.backend = backends[0]  # the model's description (inputs, outputs); every instance has the same
        self.settings = settings
        if metrics is None or isinstance(metrics, Metrics):
            metrics = (metrics or Metrics()).for_model(self.backend.spec.model, self.backend.spec.version)
        self.metrics: ModelMetrics = metrics
        self.turns = turns if turns is not None else ComputeTurns(len(backends))
        self._wake = asyncio.Event()  # set whenever the loop may have something to do
        self._queue = RequestQueue(settings, {t.name: t.batch_axis for t in self.backend.inputs},
                                   on_gone_waiting=lambda p: self._dispatch.drop_if_all_done(p))
        self._dispatch = Dispatcher(backends, settings, metrics, self.turns, self._queue, self._wake, cpus,
                                    open_batches)
        self._former = BatchFormer(settings, self._queue, self._dispatch, self._wake)
        self._task: asyncio.Task | None = None

    @property
    def instances(self) -> int:
        return len(self._dispatch.instances)

    @property
    def queued_samples(self) -> int:
        """Samples waiting: in the queues and in batches waiting behind a running one on a thread."""
        return self._queue.samples + self._dispatch.staged_samples

    # the parts' containers, read-only, by the names the batcher's tests look at them
    @property
    def _queues(self) -> tuple[collections.deque[Pending], collections.deque[Pending]]:
        return self._queue.levels

    @property
    def _timeouts(self) -> collections.deque[tuple[float, weakref.ref[Pending]]]:
        return self._queue.timeouts

    @property
    def _running(self) -> dict[asyncio.Task, list[Pending]]:
        return self._dispatch.running

    @property
    def _instances(self) -> list[Instance]:
        return self._dispatch.instances

    def gathering_report(self) -> dict[str, object] | None:
        """Whether batches wait for a larger size though an instance is free, and what decided it (None: never
        considered: no call times measured at install)."""
        g = self._dispatch.gathering
        return None if g is None else g.report()

    def start(self) -> None:
        # the loop it serves on, kept: asyncio.get_running_loop() costs a getpid() system call on Python 3.11
        loop = self._queue.loop = self._dispatch.loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="batcher")
        self.turns.on_wait.append(self._dispatch.unstage_all)
        self.metrics.watch_queue(lambda: self.queued_samples)

    async def submit(self, feeds: dict[str, np.ndarray], priority: int = NORMAL,
                     timeout_s: float | None = None) -> list[np.ndarray]:
        """Queue one request (already validated) and wait for its outputs. ``timeout_s`` (at most the
        configured ``queue_timeout_s``) bounds its time in the queue."""
        p = self.enqueue(feeds, priority, timeout_s)
        try:
            return await p.future
        finally:
            self.settle(p)

    def enqueue(self, feeds: dict[str, np.ndarray], priority: int = NORMAL,
                timeout_s: float | None = None) -> Pending:
        """``submit`` without a coroutine: queue one request -> its entry, whose ``future`` gets the outputs (or the
        error). The caller calls ``settle(entry)`` once that future is done, cancelled included (a transport that
        answers from a done-callback: no task per request). Raises as ``submit`` does when the request is refused."""
        d = self._dispatch
        p = self._queue.admit(feeds, priority, timeout_s, staged=d.staged_samples)
        if p.priority == HIGH and d.staged_samples:  # it goes before a batch not yet started
            d.unstage_all()
        d.note_arrival()
        self._wake.set()
        return p

    def settle(self, p: Pending) -> None:
        """``p``'s future is done: a request cancelled while queued (its client went away) leaves the queue's count
        now, and its timeout timer goes."""
        self._queue.settle(p)

    async def _loop(self) -> None:
        d, q = self._dispatch, self._queue
        while True:
            staged: Instance | None = None
            while not (d.idle and q.peek() is not None):
                if d.idle and d.steal():
                    continue  # a free instance takes the batch waiting behind a busy one
                d.top_up()  # open batches below their target first; then a new one behind a busy instance
                staged = d.stageable()
                if staged is not None:
                    break
                if q.closed and q.peek() is None and not d.running:
                    return
                self._wake.clear()
                await self._wake.wait()
            if staged is not None:
                batch = await self._former.form(staged=True)  # a full batch is queued: formed without waiting
                if not batch:
                    continue
                if staged.inflight == 0:  # it finished meanwhile: a fresh turn, as below
                    await d.dispatch_fresh(batch)
                else:
                    d.dispatch(staged, batch)  # the instance's permit covers the batch queued behind
                continue
            await self.turns.acquire()  # requests queued meanwhile join the batch formed next
            try:
                batch = await self._former.form()
            except BaseException:
                self.turns.release()
                raise
            if not batch:
                self.turns.release()
                continue
            d.dispatch(d.idle.pop(), batch)

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, finish the queued ones, release the inference threads."""
        self._queue.closed = True
        self._wake.set()
        with contextlib.suppress(ValueError):
            self.turns.on_wait.remove(self._dispatch.unstage_all)
        stuck: list[Pending] = []
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), drain_timeout_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                stuck = list(self._former.forming)  # the loop's own clean-up forgets them when cancelled
                self._task.cancel()
                log.error("batcher did not drain in %.0fs; failing what is left", drain_timeout_s)
                with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._task, 1.0)
            except Exception:
                log.exception("the batching loop had crashed")
        gone = Unavailable("the model was replaced before this request ran; retry")
        running = [p for batch in self._dispatch.running.values() for p in batch]  # only after a drain timeout
        for p in [*stuck, *self._former.forming, *running, *self._queue.clear()]:  # everyone is answered
            if not p.future.done():
                p.future.set_exception(gone)
        self._dispatch.shut_down()  # their threads are let go; running tasks must not wait for them
        self.metrics.retire()
