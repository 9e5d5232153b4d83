"""What the agent counts, for three readers.

- **Prometheus** (``GET /metrics``, text exposition format): requests and errors by model, version and
  status code (rejected requests included), request latency, queue time and compute time histograms,
  batch sizes, queue depth, model load and swap events. One registry per :class:`Metrics`, never
  prometheus_client's global one, so several agents can live in one process (the tests).
- **Open Inference Protocol statistics** (``GET /v2/models/{m}/stats``): cumulative counts and
  nanoseconds per model version, in Triton's layout (:meth:`ModelMetrics.stats`).
- **Telemetry** to the fleet: counters and latency percentiles per reporting interval
  (:meth:`Metrics.snapshot_and_reset`).

The lifecycle code reports loads, swaps, failed loads and rollbacks with :meth:`Metrics.model_event`.
The batcher reports through a :class:`ModelMetrics` bound to one model version, so the request path
does no label look-ups.

A pipeline (agent/core/pipeline.py) is one model to every reader: its requests, errors and end-to-end latency are the
model's (so the telemetry's p99, the rollout gate's figure, is the pipeline's). Each of its stages has a
:class:`ModelMetrics` of its own (:meth:`Metrics.for_stage`), labelled ``<model>/<stage>`` in Prometheus
(``ocr/det``, ``ocr/rec``): one "request" is one pipeline request's use of the stage (its time in the stage's
queue and runtime), its batches are the stage's. A stage's figures stay out of the agent's request totals (each
pipeline request counts once, as the model's); the entry stage's batches (the detector's: images per batch) are
the model's batches in telemetry. Each stage keeps its interval's figures for the telemetry's ``stages``
(:meth:`ModelMetrics.take_interval`), and ``/v2/models/{m}/stats`` lists them under ``stages``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "UNKNOWN_MODEL", "Metrics", "MetricsSnapshot", "ModelMetrics"]

MAX_SAMPLES = 100_000  # latencies kept per interval; beyond this, every other one is dropped
CONTENT_TYPE = CONTENT_TYPE_LATEST
UNKNOWN_MODEL = "_unknown"  # the model label of a request for a model this agent does not serve (bounded labels)

# seconds: from 100 us (a tiny model over loopback) to 10 s (a queue timeout)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# successful requests are counted in bulk: their latencies wait in a list (at most this many) and are folded into
# every counter and histogram when it fills or anything reads them (exposition, stats, telemetry). Measured: the
# per-request counters and histogram look-ups were a fifth of the on-box socket's event-loop time for a small model
FOLD_EVERY = 256


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


class _Duration:
    """A count and a total in nanoseconds (Triton's ``{"count": n, "ns": t}``)."""

    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def doc(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class ModelMetrics:
    """Counters of one model version, with its Prometheus children bound once. ``stage``: a pipeline stage's
    (labelled ``model/stage``; ``entry``: the first stage, whose batches are the model's in telemetry)."""

    def __init__(self, parent: Metrics, model: str, version: str, stage: str | None = None, entry: bool = False):
        self.parent = parent
        self.model = model if stage is None else f"{model}/{stage}"
        self.version = version
        self.stage = stage
        self._entry = stage is None or entry  # its batches count as the model's
        # a stage's figures of the telemetry interval (take_interval): latencies (ms), errors, batch sizes
        self._iv_lat: list[float] = []
        self._iv_errors = 0
        self._iv_batches: list[int] = []
        self.stages: dict[str, ModelMetrics] = {}  # a pipeline's stages, by name (for stats())
        self._lock = threading.Lock()
        self._requests = parent.requests.labels(self.model, version)
        self._latency = parent.latency.labels(self.model, version)
        self._queue = parent.queue_time.labels(self.model, version)
        self._compute = parent.compute_time.labels(self.model, version)
        self._batch = parent.batch_size.labels(self.model, version)
        self._errors: dict[int, Counter] = {}
        self.success, self.fail, self.queue, self.compute = _Duration(), _Duration(), _Duration(), _Duration()
        self.inference_count = 0  # samples
        self.execution_count = 0  # batches run
        self.last_inference_ms = 0
        self.batch_stats: dict[int, _Duration] = {}
        self._ok: list[float] = []  # latencies of successful requests not folded in yet (fold)

    def request(self, latency_s: float, status: int) -> None:
        """One request for this model finished (any outcome: ``status`` is the HTTP code). A success is counted in
        bulk (``fold``); anything that reads the counters folds first."""
        if status < 400:
            with self._lock:
                self._ok.append(latency_s)
                full = len(self._ok) >= FOLD_EVERY
            if full:
                self.fold()
            return
        self._requests.inc()
        self._latency.observe(latency_s)
        ok = status < 400
        if not ok:
            c = self._errors.get(status)
            if c is None:
                c = self._errors[status] = self.parent.errors.labels(self.model, self.version, str(status))
            c.inc()
        with self._lock:
            (self.success if ok else self.fail).add(latency_s)
            if self.stage is not None:
                self._iv_errors += 1
                self._interval_latencies([latency_s])
        if self.stage is None:
            self.parent.request_done(latency_s, ok)

    def fold(self) -> None:
        """Count the successful requests not counted yet, in every counter and histogram at once."""
        with self._lock:
            ok, self._ok = self._ok, []
        if not ok:
            return
        self._requests.inc(len(ok))
        _observe_many(self._latency, ok)
        with self._lock:
            self.success.add(sum(ok), len(ok))
            if self.stage is not None:
                self._interval_latencies(ok)
        if self.stage is None:
            self.parent.requests_done(ok)

    def _interval_latencies(self, latencies_s: list[float]) -> None:
        """(a stage's, under the lock) latencies into the telemetry interval, bounded as the agent's are."""
        if len(self._iv_lat) + len(latencies_s) > MAX_SAMPLES:
            self._iv_lat = self._iv_lat[::2]
        self._iv_lat.extend(v * 1000.0 for v in latencies_s)

    def take_interval(self) -> dict[str, Any]:
        """A stage's figures since the last call (the telemetry's ``stages`` entry: protocol.mqtt.StageFigures'
        fields), then starts a new interval: its calls (pipeline requests that used it), errors, latency
        percentiles (ms, queue and runtime) and batches."""
        self.fold()
        with self._lock:
            lat, errors, batches = self._iv_lat, self._iv_errors, self._iv_batches
            self._iv_lat, self._iv_errors, self._iv_batches = [], 0, []
        p = np.percentile(lat, [50, 95, 99]).tolist() if lat else [None, None, None]
        return {"calls": len(lat), "errors": errors,
                "latency": {"p50_ms": None if p[0] is None else round(p[0], 3),
                            "p95_ms": None if p[1] is None else round(p[1], 3),
                            "p99_ms": None if p[2] is None else round(p[2], 3),
                            "max_ms": round(max(lat), 3) if lat else None},
                "batches": len(batches), "batch_size_mean": round(float(np.mean(batches)), 3) if batches else None,
                "batch_size_max": max(batches) if batches else None}

    def batch(self, size: int, queue_s: list[float], compute_s: float) -> None:
        """A batch of ``size`` samples ran: ``queue_s`` is each request's time in the queue."""
        self._batch.observe(size)
        self._compute.observe(compute_s)
        _observe_many(self._queue, queue_s)
        with self._lock:
            self.inference_count += size
            self.execution_count += 1
            self.last_inference_ms = int(time.time() * 1000)
            self.queue.add(sum(queue_s), len(queue_s))
            self.compute.add(compute_s, len(queue_s))
            bs = self.batch_stats.get(size)
            if bs is None:
                bs = self.batch_stats[size] = _Duration()
            bs.add(compute_s)
            if self.stage is not None and len(self._iv_batches) < MAX_SAMPLES:
                self._iv_batches.append(size)
        if self._entry:
            self.parent.batch_done(size)

    def stats(self) -> dict[str, object]:
        """Triton's per-model statistics (``/v2/models/{m}/stats``): counts and nanoseconds since load."""
        zero = {"count": 0, "ns": 0}
        self.fold()
        stages = [m.stats() for _, m in sorted(self.stages.items())]
        with self._lock:
            queue, compute = self.queue.doc(), self.compute.doc()
            inferences, executions = self.inference_count, self.execution_count
            if stages:  # a pipeline: its queue and compute are its stages', summed per request (as Triton's
                # ensembles sum their composing models'), its inferences and executions its entry stage's
                # (perf_analyzer finds the version a run used by the growth of its queue count)
                n = self.success.count + self.fail.count
                parts = list(self.stages.values())
                queue = {"count": n, "ns": sum(st.queue.ns for st in parts)}
                compute = {"count": n, "ns": sum(st.compute.ns for st in parts)}
                entry = next((m for m in self.stages.values() if m._entry), None)
                if entry is not None:
                    inferences, executions = entry.inference_count, entry.execution_count
            return {
                "name": self.model, "version": self.version, "last_inference": self.last_inference_ms,
                "inference_count": inferences, "execution_count": executions,
                # compute_input and compute_output: counted with compute_infer (as Triton does; perf_analyzer
                # requires the three counts equal), their time inside compute_infer's (no separate copy is timed)
                "inference_stats": {"success": self.success.doc(), "fail": self.fail.doc(), "queue": queue,
                                    "compute_input": {"count": compute["count"], "ns": 0},
                                    "compute_infer": compute,
                                    "compute_output": {"count": compute["count"], "ns": 0},
                                    "cache_hit": zero, "cache_miss": zero},
                "batch_stats": [{"batch_size": size, "compute_input": {"count": d.count, "ns": 0},
                                 "compute_infer": d.doc(), "compute_output": {"count": d.count, "ns": 0}}
                                for size, d in sorted(self.batch_stats.items())],
                **({"stages": stages} if stages else {}),  # a pipeline's: each stage's, named model/stage
            }

    def watch_queue(self, depth: Callable[[], float]) -> None:
        """Report ``depth()`` (samples waiting) as this version's queue depth at every scrape."""
        self.parent.queue_depth.labels(self.model, self.version).set_function(depth)

    def retire(self) -> None:
        """The version no longer serves: stop reporting its queue depth (its counters stay)."""
        try:
            self.parent.queue_depth.remove(self.model, self.version)
        except KeyError:
            pass


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()
        self._total_requests = 0
        self._total_errors = 0
        r = self.registry = CollectorRegistry(auto_describe=True)
        mv = ["model", "version"]
        self.requests = Counter("edgefleet_inference_requests", "Inference requests, by model and version "
                                "(every outcome)", mv, registry=r)
        self.errors = Counter("edgefleet_inference_errors", "Inference requests that failed or were rejected, by "
                              "HTTP status code", [*mv, "code"], registry=r)
        self.latency = Histogram("edgefleet_request_duration_seconds", "Inference request latency in the agent "
                                 "(body read to response)", mv, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("edgefleet_queue_duration_seconds", "Time a request waited in the batching "
                                    "queue", mv, buckets=LATENCY_BUCKETS, registry=r)
        self.compute_time = Histogram("edgefleet_compute_duration_seconds", "Time the runtime took for one batch",
                                      mv, buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("edgefleet_batch_size", "Samples per batch run", mv, buckets=BATCH_BUCKETS,
                                    registry=r)
        self.queue_depth = Gauge("edgefleet_queue_depth", "Samples waiting in the batching queue", mv, registry=r)
        self.model_events = Counter("edgefleet_model_events", "Model lifecycle events (load, swap, unload, "
                                    "load_failed, selftest_failed, rollback; trials_timed: a version's install "
                                    "trials ran, trials_recalled: it served from their kept record)",
                                    [*mv, "kind"], registry=r)
        self.serving = Gauge("edgefleet_model_serving", "1 for each model version being served", mv, registry=r)
        self._models: dict[tuple[str, str], ModelMetrics] = {}

    # -- per model -----------------------------------------------------------------------------
    def for_model(self, model: str, version: str) -> ModelMetrics:
        key = (model, version)
        with self._lock:
            m = self._models.get(key)
            if m is None:
                m = self._models[key] = ModelMetrics(self, model, version)
            return m

    def for_stage(self, model: str, stage: str, version: str, entry: bool = False) -> ModelMetrics:
        """Stage ``stage`` of pipeline ``model`` (labelled ``model/stage``); listed in the model's stats."""
        key = (f"{model}/{stage}", version)
        with self._lock:
            m = self._models.get(key)
            if m is None:
                m = self._models[key] = ModelMetrics(self, model, version, stage, entry)
        self.for_model(model, version).stages[stage] = m
        return m

    def model_event(self, model: str, version: str, kind: str) -> None:
        """Count a lifecycle event; ``load`` and ``swap`` mark the version as serving, ``unload`` clears it."""
        self.model_events.labels(model, version, kind).inc()
        if kind in ("load", "swap"):
            self.serving.labels(model, version).set(1)
        elif kind == "unload":
            self.serving.labels(model, version).set(0)

    def rejected(self, latency_s: float, status: int, model: str | None = None) -> None:
        """A request refused before it reached a model version: an unknown model (``model`` None: counted under
        ``_unknown``), or a served ``model`` asked for a version it does not serve (version ``_unknown``)."""
        labels = (UNKNOWN_MODEL, "") if model is None else (model, UNKNOWN_MODEL)
        self.requests.labels(*labels).inc()
        self.errors.labels(*labels, str(status)).inc()
        self.request_done(latency_s, False)

    def exposition(self) -> bytes:
        self.fold()
        return generate_latest(self.registry)

    def fold(self) -> None:
        """Every model's successful requests not counted yet (ModelMetrics.fold): before anything reads them."""
        with self._lock:
            models = list(self._models.values())
        for m in models:
            m.fold()

    @property
    def total_requests(self) -> int:
        self.fold()
        return self._total_requests

    @property
    def total_errors(self) -> int:
        return self._total_errors

    # -- telemetry -----------------------------------------------------------------------------
    def _reset(self) -> None:
        self._requests = 0
        self._errors = 0
        self._lat: list[float] = []
        self._batches: list[int] = []

    def request_done(self, latency_s: float, ok: bool) -> None:
        with self._lock:
            self._requests += 1
            self._total_requests += 1
            if not ok:
                self._errors += 1
                self._total_errors += 1
            if len(self._lat) >= MAX_SAMPLES:
                self._lat = self._lat[::2]
            self._lat.append(latency_s * 1000.0)

    def requests_done(self, latencies_s: list[float]) -> None:
        """``request_done`` of each of these successful requests."""
        with self._lock:
            self._requests += len(latencies_s)
            self._total_requests += len(latencies_s)
            if len(self._lat) + len(latencies_s) > MAX_SAMPLES:
                self._lat = self._lat[::2]
            self._lat.extend(v * 1000.0 for v in latencies_s)

    def batch_done(self, size: int) -> None:
        with self._lock:
            if len(self._batches) < MAX_SAMPLES:
                self._batches.append(size)

    def snapshot_and_reset(self) -> MetricsSnapshot:
        self.fold()
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


def _observe_many(h: Any, values: list[float]) -> None:
    """``h.observe(v)`` of each value, in one pass: the bucket counts by numpy, then one increment per bucket hit and
    one of the sum (prometheus_client's Histogram child: ``_upper_bounds``, ``_buckets``, ``_sum``, as observe itself
    uses them; tests/test_agent_parts.py checks the result equals one observe per value). Another client version
    without them: one observe per value."""
    bounds, buckets, total = (getattr(h, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if len(values) < 4 or bounds is None or buckets is None or total is None:
        for v in values:
            h.observe(v)
        return
    total.inc(math.fsum(values))
    for i, c in enumerate(np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))):
        if c:
            buckets[i].inc(int(c))
