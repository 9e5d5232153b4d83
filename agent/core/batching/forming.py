"""Forming a batch: how many queued requests go together, and how long the oldest waits for company.

Take the oldest request of the highest level, then keep taking queued requests while the batch stays within
``max_batch_size`` samples. If the batch is not full (or not of a preferred size) it waits for more, until the
oldest request has waited ``max_queue_delay_us`` (on the monotonic clock) -- but only when there is evidence of
concurrent clients (the batch already holds two requests, or requests arrived while a batch ran): a lone client
is never made to wait for company that is not coming. With ``preferred_batch_sizes``, a batch larger than a
preferred size gives its newest requests back to the queue to run at the largest preferred size it can fill (the
runtime's fastest sizes per sample). When several instances can take a batch at once, the queue is shared
evenly between them. While the dispatch *gathers* (gathering.py: measured to serve more), a fresh batch is of the
size gathered and waits for it, from when an instance is free, at most what that size saves.
"""

from __future__ import annotations

import asyncio
import time

from .dispatch import Dispatcher
from .request_queue import HIGH, Pending, RequestQueue
from .settings import BatchSettings

__all__ = ["BatchFormer"]


class BatchFormer:
    """Forms the batches of one model from ``queue`` for ``dispatch``'s instances; ``wake`` is set when a request
    arrives."""

    def __init__(self, settings: BatchSettings, queue: RequestQueue, dispatch: Dispatcher, wake: asyncio.Event):
        self.settings = settings
        self._queue = queue
        self._dispatch = dispatch
        self._wake = wake
        self._preferred = sorted(set(settings.preferred_batch_sizes))
        self.forming: list[Pending] = []  # the batch being formed; failed if the loop is cancelled

    def _cap(self, staged: bool) -> int:
        """The samples the batch formed now may take: ``max_batch_size`` (an open batch queued behind a running one:
        at most what its buffer holds); when several instances can take a batch now, the queue split evenly between
        them, so each starts on its share at once instead of one taking everything while the others idle (a batch
        queued behind a running one: at least the dispatcher's target, which the open batches are filled to)."""
        d = self._dispatch
        cap = d.open_cap if staged and d.open else self.settings.max_batch_size
        takers = d.takers(staged)
        if takers > 1:
            share = -(-self._queue.samples // takers)
            if staged and d.open:
                share = max(share, d.target())
            cap = max(1, min(cap, share))
        return cap

    async def form(self, staged: bool = False) -> list[Pending]:
        """The next batch, its requests taken from the queue and marked dispatched (``staged``: for an instance
        that is busy, to queue behind its running batch) -> [] when nothing live is queued."""
        s, q = self.settings, self._queue
        first = q.peek()
        if first is None:
            return []
        cap = self._cap(staged)
        g = self._dispatch.gathering
        least = 1 if staged or g is None or first.priority == HIGH else self._dispatch.least()
        gather_by = 0.0
        if least > 1:  # gathering: a fresh batch of that size, its instance waiting for it at most what it saves
            cap = least
            gather_by = time.monotonic() + (g.wait_s if g is not None else 0.0)
        q.take(first)
        batch, n = [first], first.n
        self.forming = batch
        deadline = first.enqueued + s.max_queue_delay_us / 1e6
        concurrent = self._dispatch.arrived_while_running > 1
        while n < cap:
            nxt = q.peek()
            if nxt is not None:
                if n + nxt.n > cap or not nxt.stackable_with(first, self._dispatch.in_axes):
                    break
                q.take(nxt)
                batch.append(nxt)
                n += nxt.n
                continue
            if n < least:
                remaining = gather_by - time.monotonic()
                if remaining <= 0 or q.closed:
                    break
            elif self._preferred and n in self._preferred:
                break  # a preferred size: run it rather than wait
            else:
                remaining = deadline - time.monotonic()
            if n >= least and (remaining <= 0 or q.closed or not (concurrent or len(batch) > 1)
                               or (staged and self._dispatch.open)):
                break  # an open batch does not wait: later requests join it while it waits on the thread
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                break
        batch = self._to_preferred(batch, n)
        live = [p for p in batch if not p.future.done()]  # expired or cancelled while the batch formed
        for p in live:
            p.dispatched = True
            if staged:  # queued on a busy thread: it may still expire there, until its batch starts
                p.waiting_on_thread = True
            elif p.timer is not None:
                p.timer.cancel()
        self.forming = []
        return live

    def _to_preferred(self, batch: list[Pending], n: int) -> list[Pending]:
        """``batch`` of ``n`` samples cut to the largest preferred size it fills; the newest requests go back to the
        queue for the next batch."""
        fits = [p for p in self._preferred if p <= n]
        if n in self._preferred or not fits:
            return batch
        keep: list[Pending] = []
        kept = 0
        for p in batch:
            if kept + p.n > fits[-1] and keep:
                break
            keep.append(p)
            kept += p.n
        self._queue.give_back(batch[len(keep):])
        return keep
