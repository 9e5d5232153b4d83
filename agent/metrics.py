"""Counters for telemetry: requests, errors, latencies and batch sizes per reporting interval."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["Metrics", "MetricsSnapshot"]

MAX_SAMPLES = 100_000  # latencies kept per interval; beyond this, every other one is dropped


@dataclass(frozen=True)
class MetricsSnapshot:
    requests: int
    errors: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float | None
    batches: int
    batch_size_mean: float | None
    batch_size_max: int | None


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()
        self.total_requests = 0
        self.total_errors = 0

    def _reset(self) -> None:
        self._requests = 0
        self._errors = 0
        self._lat: list[float] = []
        self._batches: list[int] = []

    def request_done(self, latency_s: float, ok: bool) -> None:
        with self._lock:
            self._requests += 1
            self.total_requests += 1
            if not ok:
                self._errors += 1
                self.total_errors += 1
            if len(self._lat) >= MAX_SAMPLES:
                self._lat = self._lat[::2]
            self._lat.append(latency_s * 1000.0)

    def batch_done(self, size: int) -> None:
        with self._lock:
            if len(self._batches) < MAX_SAMPLES:
                self._batches.append(size)

    def snapshot_and_reset(self) -> MetricsSnapshot:
        with self._lock:
            lat, batches, req, err = self._lat, self._batches, self._requests, self._errors
            self._reset()
        p = np.percentile(lat, [50, 95, 99]).tolist() if lat else [None, None, None]
        return MetricsSnapshot(
            requests=req, errors=err,
            latency_p50_ms=None if p[0] is None else round(p[0], 3),
            latency_p95_ms=None if p[1] is None else round(p[1], 3),
            latency_p99_ms=None if p[2] is None else round(p[2], 3),
            latency_max_ms=round(max(lat), 3) if lat else None,
            batches=len(batches),
            batch_size_mean=round(float(np.mean(batches)), 3) if batches else None,
            batch_size_max=max(batches) if batches else None,
        )
