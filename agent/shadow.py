"""A candidate model in shadow: it sees a sample of the live requests, never answers them.

After the active model answered a request, ``offer`` hands the same inputs and the active model's
outputs to the shadow with probability ``sample_rate``; one background thread runs the candidate and
compares. Nothing here is on the request path beyond a random draw and a queue put: when the shadow
falls behind (more than ``max_pending`` requests waiting), new ones are skipped and counted, so a slow
candidate cannot slow the device down. The figures (``ShadowFigures``) travel in telemetry; the fleet
promotes the candidate only if they agree well enough.

Agreement: for each output of class scores (``[N, C]`` with the batch on axis 0), the share of samples
whose argmax is the same; the worst absolute difference over every output; the candidate's p99.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from edgefleet.engines import Engine
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.manifest import Manifest

__all__ = ["ShadowMirror"]

log = logging.getLogger("edgefleet.agent.shadow")


class ShadowMirror:
    def __init__(self, manifest: Manifest, backend: Engine, sample_rate: float, staged: Any = None,
                 max_pending: int = 2, seed: int | None = None):
        self.manifest = manifest
        self.backend = backend
        self.staged = staged  # the candidate's files, until the shadow is dropped
        self.sample_rate = sample_rate
        self.max_pending = max_pending
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._pending = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow")
        self.samples = 0  # mirrored samples (batch rows) compared
        self.compared = 0  # samples with class scores, for top-1 agreement
        self.agreed = 0
        self.max_abs_error: float | None = None
        self.skipped = 0  # sampled, but the shadow was behind
        self.errors = 0
        self._latencies: deque[float] = deque(maxlen=2000)
        self._top1 = [i for i, t in enumerate(manifest.outputs) if len(t.shape) == 2 and t.batch_axis == 0]

    def offer(self, model: str, feeds: dict[str, np.ndarray], outputs: list[np.ndarray]) -> None:
        """Called after the active model of ``model`` answered; cheap unless this request is sampled."""
        if model != self.manifest.name or self._rng.random() >= self.sample_rate:
            return
        with self._lock:
            if self._pending >= self.max_pending:
                self.skipped += 1
                return
            self._pending += 1
        self._executor.submit(self._run, feeds, outputs)

    def _run(self, feeds: dict[str, np.ndarray], outputs: list[np.ndarray]) -> None:
        try:
            t0 = time.perf_counter()
            got = self.backend.infer(feeds)
            self._latencies.append((time.perf_counter() - t0) * 1000.0)
            n = next((int(v.shape[0]) for v in feeds.values() if v.ndim > 0), 1)
            worst = 0.0
            agreed = compared = 0
            for i, (a, b) in enumerate(zip(outputs, got, strict=False)):
                a, b = np.asarray(a), np.asarray(b)
                if a.shape != b.shape:
                    worst = float("inf")
                    continue
                if a.size:
                    worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
                if i in self._top1 and a.ndim == 2:
                    agreed += int(np.sum(np.argmax(a, axis=1) == np.argmax(b, axis=1)))
                    compared += a.shape[0]
            with self._lock:
                self.samples += n
                self.agreed += agreed
                self.compared += compared
                if np.isfinite(worst):
                    self.max_abs_error = worst if self.max_abs_error is None else max(self.max_abs_error, worst)
                else:  # shapes differ: that is a disagreement on every sample with class scores
                    self.compared += n if self._top1 else 0
        except Exception as exc:  # a failing candidate is a finding, not a crash
            with self._lock:
                self.errors += 1
            log.warning("shadow %s %s failed on a mirrored request: %r", self.manifest.name, self.manifest.version,
                        exc)
        finally:
            with self._lock:
                self._pending -= 1

    def figures(self) -> proto.ShadowFigures:
        with self._lock:
            lat = sorted(self._latencies)
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
            return proto.ShadowFigures(
                model=self.manifest.name, version=self.manifest.version, samples=self.samples,
                top1_agreement=self.agreed / self.compared if self.compared else None,
                max_abs_error=self.max_abs_error, p99_ms=None if p99 is None else round(p99, 3))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.backend.close()
