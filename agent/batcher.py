"""Dynamic batching: the loop, not user code, enforces the contract.

Requests queue on the server's event loop. One loop task forms a batch: it takes the oldest
request, then keeps taking queued requests until the batch holds ``max_batch_size`` samples or
the oldest request has waited ``max_queue_delay_us``. It waits for more only when there is
evidence of concurrent clients (the batch already holds two requests, or requests arrived while
the previous batch ran): a lone client is never made to wait for company that is not coming
(a fixed wait cost ~3 ms per request at one client here, see bench/README.md). The batch runs on
a single inference thread while the next one forms. Requests that waited longer than ``queue_timeout_s`` are
answered 503 without running; a batch whose outputs do not match its inputs, or that raises,
fails every request in it with the same error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from agent.backends.base import Backend
from agent.errors import InferenceFailed, RequestError, Unavailable
from agent.metrics import Metrics

__all__ = ["BatchSettings", "Batcher"]

log = logging.getLogger("edgefleet.agent.batcher")


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int = 16
    max_queue_delay_us: int = 0
    queue_timeout_s: float = 5.0
    max_queue_size: int = 1024  # samples


@dataclass
class _Pending:
    feeds: dict[str, np.ndarray]
    n: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)

    def stackable_with(self, other: _Pending, axes: dict[str, int | None]) -> bool:
        """Every input has a batch axis, and the same other dimensions (dynamic dims may differ between
        requests). A model with an unbatched input (a shared parameter) runs one request at a time."""
        for k, v in self.feeds.items():
            a = axes.get(k, 0)
            if a is None:
                return False
            o = other.feeds[k].shape
            if v.shape[:a] + v.shape[a + 1:] != o[:a] + o[a + 1:]:
                return False
        return True


class Batcher:
    def __init__(self, backend: Backend, settings: BatchSettings, metrics: Metrics | None = None):
        self.backend = backend
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._queued_samples = 0
        self._wake = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infer")
        self._task: asyncio.Task | None = None
        self._running = False
        self._arrived_while_running = 0
        self._forming: list[_Pending] = []  # the batch being formed or run; failed if the loop is cancelled
        self._in_axes = {t.name: t.batch_axis for t in backend.inputs}
        self._out_axes = [t.batch_axis for t in backend.outputs]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def submit(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Queue one request (already validated) and wait for its outputs."""
        n = next((int(feeds[k].shape[a]) for k, a in self._in_axes.items() if a is not None), 1)
        if n > self.settings.max_batch_size:
            raise RequestError(f"request batch of {n} exceeds this model's max batch size "
                               f"{self.settings.max_batch_size}; split it into smaller requests")
        if self._closing:
            raise Unavailable("the model is being replaced; retry")
        if self._queued_samples + n > self.settings.max_queue_size:
            raise Unavailable(f"queue full ({self._queued_samples} samples waiting); retry later")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(feeds, n, fut))
        self._queued_samples += n
        if self._running:
            self._arrived_while_running += 1
        self._wake.set()
        return await fut

    def _pop(self) -> _Pending:
        item = self._queue.popleft()
        self._queued_samples -= item.n
        return item

    async def _loop(self) -> None:
        s = self.settings
        delay = s.max_queue_delay_us / 1e6
        while True:
            while not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
            first = self._pop()
            batch, n = [first], first.n
            self._forming = batch
            deadline = first.enqueued + delay
            concurrent = self._arrived_while_running > 1
            while n < s.max_batch_size:
                if self._queue:
                    nxt = self._queue[0]
                    if n + nxt.n > s.max_batch_size or not nxt.stackable_with(first, self._in_axes):
                        break
                    item = self._pop()
                    batch.append(item)
                    n += item.n
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing or not (concurrent or len(batch) > 1):
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except TimeoutError:
                    break
            self._running = True
            self._arrived_while_running = 0
            try:
                await self._run(batch)
            finally:
                self._running = False
                self._forming = []

    async def _run(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        live = []
        for p in batch:
            if p.future.done():  # the client went away
                continue
            if now - p.enqueued > self.settings.queue_timeout_s:
                p.future.set_exception(Unavailable(
                    f"request waited {now - p.enqueued:.1f}s in the queue (limit {self.settings.queue_timeout_s}s)"))
                continue
            live.append(p)
        if not live:
            return
        n = sum(p.n for p in live)
        names = [spec.name for spec in self.backend.inputs]
        try:
            feeds = {k: (live[0].feeds[k] if len(live) == 1 else
                         np.concatenate([p.feeds[k] for p in live], axis=self._in_axes[k] or 0))
                     for k in names}
            outs = await asyncio.get_running_loop().run_in_executor(self._executor, self.backend.infer, feeds)
            if len(outs) != len(self.backend.outputs):
                raise InferenceFailed(f"backend returned {len(outs)} outputs, the model declares "
                                      f"{len(self.backend.outputs)}")
            for o, spec in zip(outs, self.backend.outputs, strict=True):
                a = spec.batch_axis
                if a is not None and (o.ndim <= a or o.shape[a] != n):
                    raise InferenceFailed(f"output {spec.name!r} has shape {list(o.shape)}: not {n} samples on its "
                                          f"batch axis {a}")
        except Exception as exc:
            err = exc if isinstance(exc, InferenceFailed) else InferenceFailed(f"inference failed: {exc}")
            log.error("batch of %d failed: %s", n, err)
            for p in live:
                if not p.future.done():
                    p.future.set_exception(err)
            return
        self.metrics.batch_done(n)
        if len(live) == 1:
            if not live[0].future.done():
                live[0].future.set_result(outs)
            return
        start = 0
        for p in live:
            if not p.future.done():
                p.future.set_result([o if a is None else np.take(o, np.arange(start, start + p.n), axis=a)
                                     for o, a in zip(outs, self._out_axes, strict=True)])
            start += p.n

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, finish the queued ones, release the inference thread."""
        self._closing = True
        self._wake.set()
        stuck: list[_Pending] = []
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), drain_timeout_s)
            except TimeoutError:
                stuck = list(self._forming)  # the loop's own clean-up forgets them when cancelled
                self._task.cancel()
                log.error("batcher did not drain in %.0fs; failing what is left", drain_timeout_s)
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(self._task, 1.0)
            except Exception:
                log.exception("the batching loop had crashed")
        gone = Unavailable("the model was replaced before this request ran; retry")
        for p in [*stuck, *self._forming, *self._queue]:
            if not p.future.done():
                p.future.set_exception(gone)
        self._queue.clear()
        self._queued_samples = 0
        # an inference still running after a drain timeout must not block the event loop
        self._executor.shutdown(wait=False)
