"""The MQTT ingest worker: messages the bridge validated are stored in batches, off paho's thread.

Whatever queued up while the last batch was written becomes the next batch (up to ``max_batch``), so a
quiet fleet stores each message at once and a busy one pays one transaction per batch, not per
message. A batch that fails is retried message by message, so one poisoned message costs only
itself (logged, counted); telemetry is acked only after its batch committed, so the agent resends
anything a failure lost. If something escapes even that, the thread starts its loop again (counted in
``restarts``; the fleet's health then says degraded). The queue is bounded: when the database falls
that far behind, ``put`` makes paho's thread wait (the broker holds the rest), and past ``put_timeout_s``
the message is dropped and counted (unacked telemetry is sent again by the agent). A handler that drops some
messages on purpose (a report older than the one stored) returns them as :class:`NotStored`: they are not acked.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .audit import Rejections

__all__ = ["IngestWorker", "NotStored"]

log = logging.getLogger("edgefleet.fleet.ingest")


@dataclass(frozen=True)
class NotStored:
    """What a batch handler returns when it dropped some of its messages on purpose: those are not acked as
    stored (any other return value: all of them were stored)."""

    msgs: tuple[Any, ...]


def _stored(msgs: list[Any], result: object) -> list[Any]:
    if not isinstance(result, NotStored) or not result.msgs:
        return msgs
    dropped = {id(m) for m in result.msgs}
    return [m for m in msgs if id(m) not in dropped]


class IngestWorker:
    def __init__(self, handlers: dict[str, Callable[[list[Any]], object]], rejections: Rejections,
                 on_stored: Callable[[str, list[Any]], None], max_batch: int = 1000, max_backlog: int = 100_000,
                 put_timeout_s: float = 5.0):
        self.handlers = handlers  # kind -> batch handler, run in this order within a batch
        self.rejections = rejections
        self.on_stored = on_stored
        self.max_batch = max_batch
        self.put_timeout_s = put_timeout_s
        self.restarts = 0  # times the loop died and was started again
        self.last_failure: tuple[float, str] | None = None  # (time.time(), what killed the loop)
        self.dropped = 0  # messages refused because the backlog stayed full
        self.batches = 0  # batches formed, and the messages in them: their mean size is what a message costs
        self.batched = 0
        self._q: queue.Queue[tuple[str, Any] | None] = queue.Queue(max_backlog)
        self._thread: threading.Thread | None = None

    def put(self, kind: str, msg: Any) -> None:
        try:
            self._q.put((kind, msg), timeout=self.put_timeout_s)
        except queue.Full:
            self.dropped += 1
            self.rejections.add("ingest_backlog_full", getattr(msg, "device_id", "?"),
                                f"dropped a {kind} message: {self._q.maxsize} messages wait for the database")

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def backlog(self) -> int:
        return self._q.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="fleet-ingest", daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        while True:
            try:
                self._run()
                return
            except BaseException as exc:  # whatever ended the loop, the fleet must keep storing
                failure = f"{type(exc).__name__}: {exc}"[:500]
                log.critical("the ingest loop died (%s); restarting it", failure, exc_info=exc)
                self.restarts += 1
                self.last_failure = (time.time(), failure)
                time.sleep(min(0.1 * 2 ** min(self.restarts, 7), 10.0))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Store what is queued, then stop."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            stop = item is None
            batch = [] if item is None else [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            if batch:
                self.batches += 1
                self.batched += len(batch)
                self._process(batch)
            if stop:
                return

    def _process(self, batch: list[tuple[str, Any]]) -> None:
        for kind, handler in self.handlers.items():
            msgs = [m for k, m in batch if k == kind]
            if not msgs:
                continue
            try:
                msgs = _stored(msgs, handler(msgs))
            except Exception:
                log.exception("storing a batch of %d %s messages failed; storing them one by one", len(msgs), kind)
                ok = []
                for m in msgs:
                    try:
                        ok.extend(_stored([m], handler([m])))
                    except Exception as exc:
                        self.rejections.add(f"ingest_failed_{kind}", getattr(m, "device_id", "?"),
                                            f"could not store a {kind} message of {getattr(m, 'device_id', '?')}: "
                                            f"{exc}")
                msgs = ok
            if msgs:
                try:
                    self.on_stored(kind, msgs)
                except Exception:
                    log.exception("after-store hook failed")
