"""A served model's batching settings, checked when they are made."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["BatchSettings"]


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int = 16  # samples
    max_queue_delay_us: int = 0  # longest the oldest request waits for a fuller batch (only under concurrency)
    preferred_batch_sizes: tuple[int, ...] = ()  # sizes the runtime runs best at, e.g. (4, 8)
    queue_timeout_s: float = 5.0  # a request's default timeout in the queue; a request may ask for less
    max_queue_size: int = 1024  # samples waiting, both levels together; beyond it: 429
    # the largest request accepted, in samples (None: max_batch_size). A request larger than max_batch_size (the
    # largest batch formed) runs alone: a device that tuned its batches smaller still takes what any device takes
    max_request_batch_size: int | None = None
    # a lone request (nothing else queued or running) of a CPU model whose lone calls take less than this runs on
    # the event loop itself: handing it to the inference thread and its answer back costs more (about 0.2 ms of
    # thread wake-ups, measured). 0: always on the inference thread
    inline_max_us: int = 100
    # one call's time on one instance at each batch size while every instance runs, in ms, ascending sizes: from
    # the install's figures (agent.install.job); lets the dispatch weigh gathering larger batches (gathering.py).
    # (): not measured, never gathered
    call_ms: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_request_batch_size is not None and self.max_request_batch_size < self.max_batch_size:
            raise ValueError("max_request_batch_size must be at least max_batch_size")
        if self.max_queue_delay_us < 0 or self.queue_timeout_s <= 0 or self.max_queue_size < 1:
            raise ValueError("max_queue_delay_us must be >= 0, queue_timeout_s > 0, max_queue_size >= 1")
        if any(b < 1 or not 0 < ms < 3.6e6 for b, ms in self.call_ms) or any(
                a[0] >= b[0] for a, b in itertools.pairwise(self.call_ms)):
            raise ValueError(f"call_ms {self.call_ms}: (batch size >= 1, 0 < ms < 1 hour) pairs, ascending sizes")
        bad = [p for p in self.preferred_batch_sizes if not 1 <= p <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes {bad} are outside 1..max_batch_size ({self.max_batch_size})")


    @property
    def request_limit(self) -> int:
        """The largest request accepted, in samples."""
        return self.max_request_batch_size or self.max_batch_size

