"""Waiting in tests: the one bounded poller, sync and async.

A test waits for the other side on an event the code path sets (threading.Event, asyncio.Event, a future, a
gated fake) or, where nothing can be awaited, on this poller: it asks ``pred`` until it returns something
truthy, for at most ``timeout_s``, and fails with an AssertionError naming ``what`` and the last value seen.
``retry_on`` lists the exceptions that mean "not yet" (e.g. a connection refused while a server starts); the
last one is named in the error, any other escapes at once.

A sleep in a test is left only where the time itself is under test (idle past a timeout, a request arriving
late, a generator's pacing); such a sleep is a named constant with a comment saying why it is not a wait.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.05  # between two asks of a synchronous predicate
POLL_ASYNC_S = 0.005  # between two asks on the event loop (each ask also lets every ready task run)


def _failure(what: str, timeout_s: float, last: object, error: BaseException | None) -> AssertionError:
    seen = f"last error: {error!r}" if error is not None else f"last value: {last!r}"
    return AssertionError(f"{what}: not met in {timeout_s}s ({seen})")


def wait_for(pred: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", interval_s: float = POLL_S,
             retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Ask ``pred`` until it returns something truthy (at most ``timeout_s``); return that value."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            value = pred()
        except retry_on as exc:
            error = exc
        else:
            if value:
                return value
            last, error = value, None
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, last, error)
        time.sleep(interval_s)


def watch(pred: Callable[[], T], window_s: float, interval_s: float = POLL_S) -> T:
    """For an absence (nothing more may come, no error is logged): ask ``pred`` for ``window_s`` -> its first truthy
    value (what should not have come), or its last falsy one once the window has passed. The window is the time an
    unwanted event is given to show: a bound the test states, not a wait for the other side."""
    deadline = time.monotonic() + window_s
    while True:
        value = pred()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


async def until(pred: Callable[[], T | Awaitable[T]], timeout_s: float = 10.0, what: str = "condition",
                interval_s: float = POLL_ASYNC_S, retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """The event loop's ``wait_for``: ``pred`` may be a plain function or return an awaitable; between two asks
    the loop runs every other ready task (the first time without waiting: a step of another task is often all
    that was missing)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    error: BaseException | None = None
    pause = 0.0
    while True:
        try:
            value = pred()
            if isinstance(value, Awaitable):
                value = await value
        except retry_on as exc:
            error = exc
        else:
            if value:
                return value  # type: ignore[return-value]
            last, error = value, None
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, last, error)
        await asyncio.sleep(pause)
        pause = interval_s


def begun(task: asyncio.Future) -> bool:
    """Whether ``task`` (a Task around a coroutine) has taken its first step, e.g. a submitted request that has
    reached its queue: its coroutine is past its start, or it is done. For ``until``."""
    if task.done():
        return True
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    return coro is not None and inspect.getcoroutinestate(coro) != inspect.CORO_CREATED


def concurrently(fn: Callable[[int], object], n: int, timeout_s: float = 60.0) -> list[BaseException]:
    """Run ``fn(0) .. fn(n - 1)`` in n threads at once and wait for them (``timeout_s`` in all); every exception a
    thread raised, and an AssertionError for each thread still running at the end, in thread order."""
    errors: list[list[BaseException]] = [[] for _ in range(n)]

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:
            errors[i].append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors[i].append(AssertionError(f"thread {i} still running after {timeout_s:g}s"))
    return [e for per in errors for e in per]


def at_once(fns: Sequence[Callable[[], object]], join_s: float = 120.0) -> tuple[list[threading.Thread],
                                                                               list[BaseException]]:
    """Run each of ``fns`` in its thread, the threads let go together (a barrier, at most 10 s), and join each (at most
    ``join_s``): the threads (one still alive is a writer still waiting) and every exception they raised (each the
    test's finding), for the test to assert on."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(fns))

    def guarded(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                start.wait(10)
                fn()
            except BaseException as exc:  # every failure is the test's finding
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(f)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return threads, errors


def recv_until(sock: socket.socket, done: Callable[[bytes], bool], what: str, got: bytes = b"",
               size: int = 65536) -> bytes:
    """Read ``sock`` (each read bounded by its own timeout) until ``done`` holds of all read so far (``got`` first):
    all of it; an AssertionError naming ``what`` if the other side closes the connection before."""
    while not done(got):
        chunk = sock.recv(size)
        assert chunk, what
        got += chunk
    return got


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to ``proc``, SIGKILL if it has not ended within ``grace_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
