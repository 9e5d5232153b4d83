"""Gathering: when a batch waits for a larger size although an instance is free, measured, not assumed.

With the samples a model holds at about two per instance (32 closed-loop clients, 16 instances), the dispatch's
*spread* keeps every instance busy with batches of 1, one running and one queued behind it
(:meth:`~edgefleet.agent.core.batching.dispatch.Dispatcher.target`). A runtime that serves more per sample at a
larger size (a GPU, or MobileNetV2 INT8 on a 16-core Xeon: 3.7% more at batch 2 than at 1) would serve more if
every instance ran batches of 2 instead, but then nothing waits behind them: each instance waits, after each
batch, for its clients' round trip (the answers out, the next requests in, the hand-offs between the event loop
and the inference thread). *Gathering* is that choice: a batch starts with at least ``size`` samples, waiting at
most what the larger batch saves.

Per ``size`` samples an instance spends ``size / t x call(t)`` spreading at batch ``t`` and ``call(size) + gap``
gathering, ``gap`` being its idle time between batches. The calls' times come from the install's figures
(``BatchSettings.call_ms``); the gap is this device's and its clients' own, so it is measured: gathering is
tried, the inference threads time each idle gap before a batch (:meth:`Gathering.note_gap`), and after every
``WINDOW x instances`` gaps the mean decides (the first ``SETTLE x instances`` after a switch are dropped: the
instances changing pace, not the steady gap). Gathering stays while it saves time; else the dispatch spreads again and
tries gathering after a back-off (``RETRY_S``, doubled after each failed try up to ``RETRY_MAX_S``), since clients
and load change. Without figures, or when the larger size saves less than ``MIN_GAIN`` of the time even with no
gap, it is never tried. A batch waits for its size at most what gathering saves (``wait_s``): beyond that, running
what is there is the faster choice.

Which size: the samples the model has held at most over its last ``4 x instances`` dispatches, per instance (a
closed loop's clients, counted while their requests are inside), at most the batch size the install chose, and
only when that is more than the spread's target.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

__all__ = ["MIN_GAIN", "RETRY_MAX_S", "RETRY_S", "SETTLE", "STEADY", "WINDOW", "Gathering"]

log = logging.getLogger("edgefleet.agent.batcher")

MIN_GAIN = 0.01  # gathering is tried only when, with no gap at all, it would save at least this share of the time
RETRY_S = 10.0  # after gathering lost, the spread serves at least this long before it is tried again
RETRY_MAX_S = 320.0  # ... doubled after each try that lost, up to this
SETTLE = 6  # gaps per instance dropped after gathering starts: the instances changing pace, not the steady gap
WINDOW = 4  # gaps per instance whose mean decides, again and again while gathering
STEADY = 8  # gathering is tried after this many batches per instance in a row with 2+ samples held each at most


class Gathering:
    """One model's choice between spreading and gathering (see the module). ``call_ms``: (batch size, ms of one
    call on one instance while every instance runs), ascending sizes; ``instances``; ``cap``: the largest batch
    formed. Runs on the event loop but for :meth:`note_gap`, which the inference threads call."""

    def __init__(self, call_ms: Sequence[tuple[int, float]], instances: int, cap: int,
                 clock: Callable[[], float] = time.monotonic):
        self._call_s = {int(b): float(ms) / 1e3 for b, ms in call_ms if b >= 1 and ms > 0}
        self.instances = instances
        self.cap = cap
        self._clock = clock
        self.size = 1  # gathering: a batch starts with at least this many samples; 1: spreading
        self.spread_target = 1  # the spread's target when gathering was chosen: what it is compared against
        self.gap_s: float | None = None  # the mean idle gap before a batch measured in the last window gathering
        self.tries = 0  # gathering tried (each window that lost ends one)
        self._held = collections.deque[int](maxlen=4 * max(1, instances))
        self._gaps = collections.deque[float](maxlen=WINDOW * max(1, instances))  # appended by the inference threads
        self._retry_at = 0.0
        self._retry_s = RETRY_S
        self._high = 0  # the most samples held over the last ``4 x instances`` dispatches
        self._steady = 0  # dispatches in a row with two samples or more per instance held at most (``_high``)
        self._settle = 0  # gaps still to drop after a switch: the instances' change of pace, not the steady gap

    @property
    def gathering(self) -> bool:
        return self.size > 1

    def call_s(self, batch: int) -> float | None:
        """One call's time at ``batch`` from the figures: a measured size's, else linear between the nearest ones
        (None beyond the largest measured)."""
        if batch in self._call_s:
            return self._call_s[batch]
        below = [b for b in self._call_s if b < batch]
        above = [b for b in self._call_s if b > batch]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        w = (batch - lo) / (hi - lo)
        return (1 - w) * self._call_s[lo] + w * self._call_s[hi]

    def saves_s(self, target: int, size: int) -> float:
        """Instance time saved per ``size`` samples by one batch of ``size`` over batches of ``target`` (no gap on
        either side); <= 0 when the larger batch is no faster per sample, or a time is not known."""
        small, large = self.call_s(target), self.call_s(size)
        if small is None or large is None:
            return 0.0
        return size / target * small - large

    @property
    def wait_s(self) -> float:
        """The longest a batch waits for ``size`` samples: what gathering saves (waiting longer loses more
        than the larger batch gains)."""
        return max(0.0, self.saves_s(self.spread_target, self.size)) if self.gathering else 0.0

    def note_held(self, held: int) -> None:
        """The samples the model holds (queued, waiting on threads, running), read as a batch was dispatched."""
        self._held.append(held)
        self._high = max(self._held)
        self._steady = self._steady + 1 if self._high >= 2 * self.instances else 0

    def note_gap(self, gap_s: float) -> None:
        """On an inference thread: its instance was idle ``gap_s`` between its last batch's end and this batch's
        start (about 0 for a batch that waited behind it). Counted only while gathering."""
        if self.size > 1:
            if self._settle > 0:
                self._settle -= 1
            else:
                self._gaps.append(gap_s)

    def least(self) -> int:
        """The least samples a batch starts with now (1: spreading); switches between spreading and gathering as the
        samples held and the measured gaps say."""
        m = self.instances
        size = min(self.cap, self._high // m)
        target = max(1, min(self.cap, (8 * self._high + 2 * m) // (16 * m)))  # the spread's, at that many held
        small = self.call_s(target)
        worth = (size >= 2 and size > target and small is not None
                 and self.saves_s(target, size) > MIN_GAIN * size / target * small)
        if not worth:
            if self.size > 1:  # fewer clients (or a larger spread target): spread, no penalty
                log.info("batching: spreading again: %d samples held at most over the last %d batches (%d "
                         "instances)", self._high, len(self._held), m)
                self.size, self._gaps = 1, collections.deque(maxlen=self._gaps.maxlen)
            return 1
        now = self._clock()
        if self.size == 1:
            if now < self._retry_at or self._steady < STEADY * self.instances:
                return 1
            self.size, self.spread_target = size, target
            self.tries += 1
            self._gaps.clear()
            self._settle = SETTLE * self.instances
            log.info("batching: gathering batches of %d (spreading at %d: the figures say it saves %.2f ms per %d "
                     "samples if the instances' idle gap is shorter); measuring the gap", size, target,
                     1e3 * self.saves_s(target, size), size)
            return size
        self.size, self.spread_target = size, target
        if len(self._gaps) >= WINDOW * self.instances:
            gaps = list(self._gaps)
            self._gaps.clear()
            self.gap_s = sum(gaps) / len(gaps)
            saves = self.saves_s(target, size)
            if self.gap_s >= saves:
                self.size = 1
                self._retry_at = now + self._retry_s
                gaps.sort()
                log.info("batching: spreading again: the instances' idle gap gathering (%.2f ms, mean of %d; median "
                         "%.2f, max %.2f) is more than gathering saves (%.2f ms); trying again in %.0f s",
                         1e3 * self.gap_s, len(gaps), 1e3 * gaps[len(gaps) // 2], 1e3 * gaps[-1], 1e3 * saves,
                         self._retry_s)
                self._retry_s = min(RETRY_MAX_S, 2 * self._retry_s)
                return 1
            self._retry_s = RETRY_S
        return self.size

    def report(self) -> dict[str, object]:
        """What the model config shows (``batch_tuning.gathering``)."""
        return {"mode": "gathering" if self.gathering else "spreading", "size": self.size,
                "measured_gap_ms": None if self.gap_s is None else round(1e3 * self.gap_s, 3),
                "saves_ms": round(1e3 * self.saves_s(self.spread_target, self.size), 3) if self.gathering else None,
                "tries": self.tries}
