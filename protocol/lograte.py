"""Repeated log records are rate-limited, so that a peer who can make a process log an error cannot fill its disk.

A record's *kind* is where it comes from and what it says before its arguments: its logger, level, source line,
the message template (``record.msg``, not the formatted message: one kind whatever client it names), and for a
record with an exception the exception's type and the place it was raised. The first ``BURST`` (5) records of a
kind in an interval (``INTERVAL_S``, 10 s, from the first) pass, so a few distinct events close together all show;
the rest are dropped and counted, and once the interval has ended its count is told in one line, with the last
record dropped: ``... [1,234 like this in the last 10 s, not shown; the last]``. The count is told by the next
record logged after the interval (of any kind: the filter has no thread of its own), else at exit
(``RateLimitFilter.flush``, registered with atexit by ``install``).

asyncio's loop logs through the ``asyncio`` logger, one record per failure with the failure's details already in
the message (``socket.accept() out of system resource`` and the listening socket, when descriptors run out); its
kind is the first line of that message, so each such failure is one kind. ``install`` also stops asyncio's accept
loop spinning when descriptors run out: on EMFILE its ``_accept_connection`` logs, removes the listener's reader and
schedules a retry in 1 s, and then goes on to its next accept of up to ``backlog`` (100) in the same call -- each one
failing, logging and scheduling another retry (measured: 3,943 tracebacks, 1.8 MB, in 6 s from one listener at
64 descriptors, Python 3.11). Each call now accepts once, so an EMFILE is followed by the 1 s wait it asked for
(the loop calls it again at once while connections are pending and it has descriptors).

Standard library only (protocol/ is the floor every part imports).
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BURST", "INTERVAL_S", "RateLimitFilter", "install", "installed"]

INTERVAL_S = 10.0
BURST = 5  # records of a kind that pass in an interval (a few distinct events close together all show)
MAX_KINDS = 4096  # kinds remembered at once; beyond it the oldest is forgotten (its count told)

_Kind = tuple[object, ...]
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+|(?<=fd=)\d+")


def _kind(record: logging.LogRecord) -> _Kind:
    msg = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
    if record.name == "asyncio" or record.name.startswith("asyncio."):
        # preformatted by the loop: its first line says what failed, object addresses and descriptors aside
        msg = _ADDRESS.sub("0x", msg.split("\n", 1)[0][:200])
    exc: tuple[object, ...] = ()
    if record.exc_info and record.exc_info[1] is not None:
        e = record.exc_info[1]
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        exc = (type(e).__qualname__, getattr(e, "errno", None),
               None if tb is None else (tb.tb_frame.f_code.co_filename, tb.tb_lineno))
    return (record.name, record.levelno, record.pathname, record.lineno, msg, exc)


class RateLimitFilter(logging.Filter):
    """A logging filter: ``burst`` records of a kind per ``interval_s``, then one line with the count dropped. Put
    on handlers, on loggers or both: a record is judged once (its verdict is kept on it)."""

    def __init__(self, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 max_kinds: int = MAX_KINDS, burst: int = BURST):
        super().__init__()
        self.interval_s, self.clock, self.max_kinds, self.burst = interval_s, clock, max_kinds, burst
        self._lock = threading.Lock()
        # kind -> [when its interval began, records passed in it, dropped in it, the last dropped]
        self._seen: dict[_Kind, list] = {}
        self._sweep_at = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        verdict = getattr(record, "_ef_rate", None)
        if verdict is None:
            verdict = self._judge(record)
            record._ef_rate = verdict
        return verdict

    def _judge(self, record: logging.LogRecord) -> bool:
        kind = _kind(record)
        now = self.clock()
        due: list[tuple[logging.LogRecord, int, float]] = []
        with self._lock:
            if now >= self._sweep_at:  # at most once an interval: tell the counts of the intervals that ended
                due = self._sweep(now)
                self._sweep_at = now + self.interval_s
            s = self._seen.get(kind)
            if s is not None and now - s[0] < self.interval_s:
                if s[1] >= self.burst:
                    s[2] += 1
                    s[3] = record
                    return False
                s[1] += 1
            else:
                if s is not None and s[2]:  # its interval ended with a count not told yet: this record tells it
                    due.append((s[3], s[2], now - s[0]))
                elif s is None and len(self._seen) >= self.max_kinds:
                    due += self._evict()
                self._seen[kind] = [now, 1, 0, None]
        for args in due:
            _tell(*args)
        return True

    def _sweep(self, now: float) -> list[tuple[logging.LogRecord, int, float]]:
        """Forget the kinds whose interval ended -> their counts not told yet."""
        ended = [k for k, s in self._seen.items() if now - s[0] >= self.interval_s]
        told = []
        for k in ended:
            s = self._seen.pop(k)
            if s[2]:
                told.append((s[3], s[2], now - s[0]))
        return told

    def _evict(self) -> list[tuple[logging.LogRecord, int, float]]:
        """Room for one more kind: the oldest is forgotten -> its count, if any."""
        s = self._seen.pop(next(iter(self._seen)))
        return [(s[3], s[2], self.clock() - s[0])] if s[2] else []

    def flush(self) -> None:
        """Tell every count not told yet (at exit: the kinds that stopped coming)."""
        now = self.clock()
        with self._lock:
            due = [(s[3], s[2], now - s[0]) for s in self._seen.values() if s[2]]
            for s in self._seen.values():
                s[2], s[3] = 0, None
        for args in due:
            _tell(*args)

    def reset(self) -> None:
        """Tell every count not told yet and forget every kind: what comes next starts afresh (a test that reads the
        lines it causes, after others in the same process logged the same kinds)."""
        self.flush()
        with self._lock:
            self._seen.clear()
            self._sweep_at = 0.0


def installed() -> RateLimitFilter | None:
    """The filter ``install`` put in place in this process, if any."""
    return _installed[0] if _installed else None


def _tell(record: logging.LogRecord, n: int, since_s: float) -> None:
    """A line for ``n`` dropped records, ``record`` the last of them, through its logger's handlers."""
    first = (record.getMessage().splitlines() or [""])[0]
    summary = logging.LogRecord(record.name, record.levelno, record.pathname, record.lineno,
                                f"{first} [{n:,} like this in the last {since_s:.0f} s, not shown; the last]",
                                None, None)
    summary._ef_rate = True  # type: ignore[attr-defined]
    logging.getLogger(record.name).handle(summary)


_installed: list[RateLimitFilter] = []


def _accept_once() -> None:
    """asyncio's selector loops accept one connection per readiness event (the module's docstring says why)."""
    from asyncio import selector_events

    loop_cls = selector_events.BaseSelectorEventLoop
    orig = getattr(loop_cls, "_accept_connection", None)
    if orig is None or getattr(orig, "_ef_once", False):
        return

    def accept(self: Any, protocol_factory: Any, sock: Any, sslcontext: Any = None, server: Any = None,
               backlog: int = 100, *rest: Any) -> Any:
        return orig(self, protocol_factory, sock, sslcontext, server, 1, *rest)

    accept._ef_once = True  # type: ignore[attr-defined]
    loop_cls._accept_connection = accept  # type: ignore[attr-defined]


def install(interval_s: float = INTERVAL_S) -> RateLimitFilter:
    """Rate-limit every record that reaches the root logger's handlers and the loggers that have handlers of their
    own (uvicorn's); make asyncio's accept loop back off longer after running out of descriptors. Call after
    logging is configured (logging.basicConfig); a second call returns the first filter."""
    if _installed:
        return _installed[0]
    f = RateLimitFilter(interval_s)
    for h in logging.getLogger().handlers:
        h.addFilter(f)
    for name in ("asyncio", "uvicorn", "uvicorn.error", "uvicorn.access"):  # also where handlers are added later
        logging.getLogger(name).addFilter(f)
    _accept_once()
    atexit.register(f.flush)
    _installed.append(f)
    return f
