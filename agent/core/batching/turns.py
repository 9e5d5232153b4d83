"""Turns on one model's compute, shared by every version of it.

Several versions of one model share a :class:`ComputeTurns`: every batch holds one of its permits while it
runs, and so does each self-test or warm-up call of a version being installed (``ComputeTurns.call``). The
cores are not shared between a serving batch and the next version's warm-up, nor between the old
version's last batch and the new version's first: each waits its turn, first come first served, so a
swap adds at most one such call to the time between two answers instead of slowing every batch it
overlaps.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ComputeTurns"]

log = logging.getLogger("edgefleet.agent.batcher")  # the batcher's logger, as before the package

_T = TypeVar("_T")


class ComputeTurns:
    """Turns on one model's compute, first come first served: ``permits`` runs at a time (one per
    instance), shared by every version of the model. Acquired on the event loop; ``call`` runs a function
    in its turn from another thread (an install's self-test and warm-up)."""

    def __init__(self, permits: int = 1):
        if permits < 1:
            raise ValueError("compute turns need at least one permit")
        self.permits = permits
        self._free = permits
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # called (on the loop) when someone starts to wait: a batcher takes back a batch queued on a busy thread
        self.on_wait: list[Callable[[], None]] = []

    @property
    def busy(self) -> int:
        return self.permits - self._free

    @property
    def waiting(self) -> bool:
        """Someone waits for a turn (a batch of another version, an install's call)."""
        return any(not f.done() for f in self._waiters)

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        for hook in list(self.on_wait):
            hook()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a permit just as it was cancelled: pass it on
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the permit passes straight to the oldest waiter
                return
        self._free += 1

    def call(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., _T], *args: object,
             wait_s: float = 30.0) -> _T:
        """Run ``fn(*args)`` in this (non-loop) thread in its turn. If no turn comes within ``wait_s`` (a
        loop that has stopped, a batch stuck in the runtime), it runs anyway: a turn is a courtesy to
        the requests being served, not a condition of installing. A turn that arrives after this thread
        gave up is handed straight back."""
        lock = threading.Lock()
        state = {"taken": False, "gave_up": False}

        async def turn() -> None:
            try:
                await asyncio.wait_for(self.acquire(), wait_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                return
            with lock:
                if state["gave_up"]:
                    self.release()
                    return
                state["taken"] = True

        try:
            fut = asyncio.run_coroutine_threadsafe(turn(), loop)
            fut.result(wait_s + 5.0)  # the loop's own timeout comes first; this one is for a loop that stopped
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            pass
        with lock:
            state["gave_up"] = True
            held = state["taken"]
        if not held:
            log.warning("no compute turn within %.0fs; running without one", wait_s)
            return fn(*args)
        try:
            return fn(*args)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to hand on to
                loop.call_soon_threadsafe(self.release)
