"""``edgefleet bench BUNDLE``: the compiler's benchmark, run again on the box the bundle is for.

The compiler measured the engine on the build host (latency p50/p99 per batch size, in the
manifest). This runs the same engine through the agent's own backend, on the bundle's self-test
inputs repeated to each batch size, a fixed number of times, and prints both side by side. Only the
agent's dependencies are needed.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgefleet.engines import load_bundle_engine
from edgefleet.protocol.bundle import extract_bundle
from edgefleet.protocol.cpu import cpu_features
from edgefleet.protocol.manifest import Manifest

__all__ = ["BenchPoint", "bench_bundle"]


@dataclass(frozen=True)
class BenchPoint:
    batch_size: int
    ms_p50: float
    ms_p99: float
    items_per_s: float
    build_ms_p50: float | None  # what the compiler recorded on the build host, if it benchmarked this size

    def to_json(self) -> dict[str, float | int | None]:
        return {"batch_size": self.batch_size, "ms_p50": self.ms_p50, "ms_p99": self.ms_p99,
                "items_per_s": self.items_per_s, "build_ms_p50": self.build_ms_p50,
                "vs_build": None if not self.build_ms_p50 else round(self.build_ms_p50 / self.ms_p50, 3)}


def _recorded_p50(manifest: Manifest) -> dict[int, float]:
    """The build host's p50 per batch size for the precision that was shipped (with --precision auto
    the compiler benchmarks both and may ship the reference)."""
    b = manifest.benchmark
    if b is None:
        return {}
    shipped_is_candidate = (b.candidate_precision or manifest.precision) == manifest.precision
    return {p.batch_size: p.candidate_ms_p50 if shipped_is_candidate else p.reference_ms_p50 for p in b.points}


def _repeat(arr: np.ndarray, axis: int | None, n: int) -> np.ndarray:
    """``arr``'s samples repeated to a batch of ``n`` along its batch axis (as-is without one)."""
    if axis is None or arr.ndim <= axis or arr.shape[axis] == 0:
        return np.ascontiguousarray(arr)
    return np.ascontiguousarray(np.take(arr, np.arange(n) % arr.shape[axis], axis=axis))


def bench_bundle(bundle: Path, batch_sizes: tuple[int, ...] | None = None, iterations: int = 30, warmup: int = 5,
                 threads: int = 2) -> tuple[Manifest, list[BenchPoint], tuple[str, ...]]:
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-") as tmp:
        manifest = extract_bundle(bundle, Path(tmp))
        recorded = _recorded_p50(manifest)
        batchable = manifest.batchable
        sizes = (batch_sizes or tuple(recorded) or (1,)) if batchable else (1,)
        backend = load_bundle_engine(manifest, Path(tmp) / manifest.engine, threads)
        try:
            with np.load(Path(tmp) / manifest.selftest, allow_pickle=False) as npz:
                sample = {s.name: npz[f"input:{s.name}"] for s in manifest.inputs}
            points = []
            for bs in sizes:
                feed = {s.name: _repeat(sample[s.name], s.batch_axis, bs) for s in manifest.inputs}
                for _ in range(warmup):
                    backend.infer(feed)
                times = []
                for _ in range(iterations):
                    t0 = time.perf_counter()
                    backend.infer(feed)
                    times.append((time.perf_counter() - t0) * 1000)
                p50 = float(np.median(times))
                points.append(BenchPoint(bs, round(p50, 4), round(float(np.percentile(times, 99)), 4),
                                         round(bs * 1000 / p50, 1) if p50 > 0 else 0.0, recorded.get(bs)))
        finally:
            backend.close()
    return manifest, points, tuple(sorted(cpu_features()))
