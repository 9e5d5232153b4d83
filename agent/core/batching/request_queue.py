"""The request queue: admission, two priority levels, expiry.

Requests queue on the server's event loop, in two priority levels (high first, then normal; first in,
first out within a level). A full queue answers 429 (:class:`QueueFull`) at once; a request whose timeout
passes while it is still queued gets 503 at its deadline (running requests are not interrupted).
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...errors import QueueFull, RequestError, Unavailable
from .settings import BatchSettings

__all__ = ["DEAD_MAX", "HIGH", "NORMAL", "Pending", "RequestQueue"]

HIGH, NORMAL = 0, 1  # priority levels: the index of their queue
DEAD_MAX = 64  # cancelled requests left in the queues before they are compacted (when they are half of them)


@dataclass(eq=False)
class Pending:
    feeds: dict[str, np.ndarray]
    n: int
    future: asyncio.Future
    priority: int
    enqueued: float = field(default_factory=time.monotonic)
    counted: bool = True  # its samples are still in the queue's count
    dispatched: bool = False
    waiting_on_thread: bool = False  # in a batch queued behind the running one on an inference thread
    timer: asyncio.TimerHandle | None = None  # a request with a timeout of its own; else the queue's one timer
    settled: bool = False  # RequestQueue.settle ran: its answer is out, nothing of it is needed any more

    def stackable_with(self, other: Pending, axes: dict[str, int | None]) -> bool:
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


def _gone(ref: weakref.ref[Pending]) -> bool:
    """A request in the timeout queue that needs no watching any more: answered (settled) or freed."""
    p = ref()
    return p is None or p.settled


class RequestQueue:
    """The requests waiting for a batch, and their count in samples (``samples``). ``on_gone_waiting(p)`` is told
    when a request in a batch waiting on an inference thread expires or is cancelled (that batch may not need to
    run)."""

    def __init__(self, settings: BatchSettings, in_axes: dict[str, int | None],
                 on_gone_waiting: Callable[[Pending], None]):
        self.settings = settings
        self.levels: tuple[collections.deque[Pending], collections.deque[Pending]] = (
            collections.deque(), collections.deque())
        self.samples = 0
        self.closed = False  # no more requests taken: the model is being replaced
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it serves on, once started
        self.in_axes = in_axes  # each input's batch axis (None: not batched)
        # a model with an unbatched input runs each request alone, whatever its size: no batch limit applies
        self.batchable = all(a is not None for a in in_axes.values())
        self._on_gone_waiting = on_gone_waiting
        # requests with the default timeout, in the order (and so the deadline order) they came: one timer (_sweep)
        self.timeouts: collections.deque[tuple[float, weakref.ref[Pending]]] = collections.deque()
        self._dead = 0  # cancelled requests left in the queues (a hint for _compact)
        self._sweeper: asyncio.TimerHandle | None = None

    def admit(self, feeds: dict[str, np.ndarray], priority: int, timeout_s: float | None, staged: int) -> Pending:
        """Queue one request, whose timeout starts now -> its entry; refused (raises) when it is too large, the
        queue is closed, or the queue would hold more than ``max_queue_size`` samples with the ``staged`` ones (in
        batches waiting on a busy inference thread)."""
        n = next((int(feeds[k].shape[a]) for k, a in self.in_axes.items() if a is not None), 1)
        s = self.settings
        if self.batchable and n > s.request_limit:
            raise RequestError(f"request batch of {n} exceeds this model's max batch size "
                               f"{s.request_limit}; split it into smaller requests")
        if n > s.max_queue_size:
            raise RequestError(f"request batch of {n} exceeds this model's queue of {s.max_queue_size} samples")
        if self.closed:
            raise Unavailable("the model is being replaced; retry")
        if self.samples + staged + n > s.max_queue_size:
            raise QueueFull(f"queue full ({self.samples + staged} samples waiting, limit "
                            f"{s.max_queue_size}); "
                            "retry later")
        loop = self.loop or asyncio.get_running_loop()
        p = Pending(feeds, n, loop.create_future(), HIGH if priority == HIGH else NORMAL)
        timeout = s.queue_timeout_s if timeout_s is None else min(timeout_s, s.queue_timeout_s)
        if timeout == s.queue_timeout_s:  # the usual case: one timer for them all, their deadlines in order
            dq = self.timeouts
            while dq and _gone(dq[0][1]):  # answered: nothing left to watch
                dq.popleft()
            dq.append((loop.time() + timeout, weakref.ref(p)))  # weak: an answered request's inputs are not kept
            if self._sweeper is None:
                self._sweeper = loop.call_at(dq[0][0], self._sweep)
        else:
            p.timer = loop.call_later(timeout, self._expire, p, timeout)
        self.levels[p.priority].append(p)
        self.samples += n
        return p

    def settle(self, p: Pending) -> None:
        """``p``'s future is done: a request cancelled while queued (its client went away) leaves the queue's count
        now, and its timeout timer goes."""
        if not p.dispatched and p.counted:
            p.counted = False
            self.samples -= p.n
            self._dead += 1  # still in its queue, which drops it when the batcher next looks; or compacts now
            if self._dead > DEAD_MAX and 2 * self._dead > len(self.levels[HIGH]) + len(self.levels[NORMAL]):
                self._compact()
        elif p.waiting_on_thread and p.future.cancelled():  # its client went away while its batch waited on a thread
            self._on_gone_waiting(p)
        if p.timer is not None:
            p.timer.cancel()
        p.settled = True  # the timeout queue lets it go (and holds it only weakly meanwhile)

    def _compact(self) -> None:
        """Drop the answered requests (cancelled by their clients) from the queues now: while the model is busy the
        batcher does not look at its queues, and a client that sends and cancels would otherwise fill them with
        requests the queue's count no longer holds (memory bounded to about twice what waits)."""
        for q in self.levels:
            live = [p for p in q if not p.future.done() or p.counted]
            q.clear()
            q.extend(live)
        self._dead = 0

    def _sweep(self) -> None:
        """The one timer of requests with the default timeout: expire those whose deadline has passed (oldest first:
        they were queued in deadline order), then wait for the next one."""
        self._sweeper = None
        loop = self.loop or asyncio.get_running_loop()
        now, dq, timeout = loop.time(), self.timeouts, self.settings.queue_timeout_s
        while dq and (dq[0][0] <= now or _gone(dq[0][1])):
            p = dq.popleft()[1]()
            if p is not None and not p.settled:
                self._expire(p, timeout)
        if dq:
            self._sweeper = loop.call_at(dq[0][0], self._sweep)

    def _expire(self, p: Pending, timeout: float) -> None:
        if p.future.done() or (p.dispatched and not p.waiting_on_thread):
            return
        if p.counted:
            p.counted = False
            self.samples -= p.n
        staged = p.waiting_on_thread
        p.future.set_exception(Unavailable(f"request waited {time.monotonic() - p.enqueued:.3f}s in the queue "
                                           f"(timeout {timeout:g}s); retry later"))
        if staged:
            self._on_gone_waiting(p)

    def peek(self) -> Pending | None:
        """The next live request (answered ones -- expired, cancelled -- are dropped on the way)."""
        for q in self.levels:
            while q:
                p = q[0]
                if not p.future.done():
                    return p
                q.popleft()
                if p.counted:
                    p.counted = False
                    self.samples -= p.n
        return None

    def take(self, p: Pending) -> None:
        """``p``, the request at the head of its level (``peek``), leaves the queue for a batch."""
        self.levels[p.priority].popleft()
        p.counted = False
        self.samples -= p.n

    def give_back(self, items: list[Pending]) -> None:
        """``items`` (taken for a batch that does not run now) go back to the front of their levels, in order."""
        for p in reversed(items):
            self.levels[p.priority].appendleft(p)
            p.counted = True
            p.dispatched = p.waiting_on_thread = False
            self.samples += p.n

    def clear(self) -> list[Pending]:
        """Empty the queue (every request is answered by the caller: nothing is left to watch) -> what it held."""
        held = [*self.levels[HIGH], *self.levels[NORMAL]]
        for q in self.levels:
            q.clear()
        self.samples = 0
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.timeouts.clear()
        return held
