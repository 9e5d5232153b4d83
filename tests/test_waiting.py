"""tests/waiting.py: the one bounded poller returns what it waited for, fails naming what and the last value or
error, and lets an exception it was not told to retry on escape at once."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from tests.waiting import begun, until, wait_for, watch


def test_wait_for_returns_the_first_truthy_value() -> None:
    asks = itertools.count(1)
    assert wait_for(lambda: next(asks) >= 3 and "ready", 5, "the third ask", interval_s=0) == "ready"
    assert next(asks) == 4  # asked exactly three times


def test_wait_for_names_what_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"^the queue empty: not met in 0.05s \(last value: \[\]\)$"):
        wait_for(lambda: [], 0.05, "the queue empty")


def test_wait_for_retries_only_on_the_errors_named() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("nothing listens")

    with pytest.raises(AssertionError, match=r"the server: not met in 0.05s \(last error: ConnectionRefusedError"):
        wait_for(refused, 0.05, "the server", retry_on=(ConnectionRefusedError,))
    asks = itertools.count(1)

    def broken() -> bool:
        next(asks)
        raise KeyError("mqtt_connected")

    with pytest.raises(KeyError):
        wait_for(broken, 5, "the fleet", retry_on=(ConnectionRefusedError,))
    assert next(asks) == 2  # not retried


def test_until_runs_the_other_tasks_and_awaits_an_awaitable_predicate() -> None:
    async def main() -> None:
        done: list[int] = []

        async def other() -> None:
            for i in range(3):
                done.append(i)
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        assert await until(lambda: len(done) == 3, 5, "the other task's three steps") is True

        async def ask() -> str:
            return "yes" if task.done() else ""

        assert await until(ask, 5, "the other task done") == "yes"
        with pytest.raises(AssertionError, match=r"^never: not met in 0.02s \(last value: 0\)$"):
            await until(lambda: 0, 0.02, "never")

    asyncio.run(main())


def test_watch_returns_what_came_at_once_or_the_last_value_after_the_window() -> None:
    asks = itertools.count(1)
    assert watch(lambda: next(asks) == 2 and "an error logged", 5, interval_s=0) == "an error logged"
    t0 = time.monotonic()
    assert watch(lambda: [], 0.05) == []
    assert time.monotonic() - t0 >= 0.05  # the whole window was watched


def test_begun_tells_a_task_that_has_taken_its_first_step() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def step() -> None:
            await gate.wait()

        task = asyncio.ensure_future(step())
        assert not begun(task)
        await until(lambda: begun(task), 5, "the task begun")
        assert not task.done()
        gate.set()
        await task
        assert begun(task)

    asyncio.run(main())
