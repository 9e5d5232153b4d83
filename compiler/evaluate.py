"""Running an engine over a data set, and an alternating benchmark of two runners."""

from __future__ import annotations

import time

import numpy as np

from compiler.data import Dataset
from compiler.targets.base import Runner

__all__ = ["benchmark_pair", "predict_all", "top1"]


def predict_all(run: Runner, data: Dataset, batch: int = 64) -> list[np.ndarray]:
    """Every output of ``run`` over ``data``, in batches, concatenated along the batch axis."""
    outs: list[list[np.ndarray]] = []
    for s in range(0, len(data), batch):
        feed = {k: v[s : s + batch] for k, v in data.inputs.items()}
        outs.append(run(feed))
    return [np.concatenate(parts, axis=0) for parts in zip(*outs, strict=True)]


def top1(run: Runner, data: Dataset) -> float:
    """Top-1 of the first output ([N, C] class scores) against the labels."""
    if data.labels is None:
        raise ValueError("top1 needs labels")
    return float((predict_all(run, data)[0].argmax(axis=1) == data.labels).mean())


def benchmark_pair(reference: Runner, candidate: Runner, data: Dataset, batch_size: int, iterations: int,
                   warmup: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((p50, p99) ms of reference, (p50, p99) ms of candidate) at ``batch_size``, alternating which
    runs first so machine drift hits both alike."""
    n = len(data)
    idx = np.arange(batch_size) % n
    feed = {k: np.ascontiguousarray(v[idx]) for k, v in data.inputs.items()}
    for _ in range(warmup):
        reference(feed)
        candidate(feed)
    ref_t: list[float] = []
    cand_t: list[float] = []
    for i in range(iterations):
        order = (reference, candidate) if i % 2 == 0 else (candidate, reference)
        for r in order:
            t0 = time.perf_counter()
            r(feed)
            dt = (time.perf_counter() - t0) * 1000
            (ref_t if r is reference else cand_t).append(dt)
    return ((float(np.median(ref_t)), float(np.percentile(ref_t, 99))),
            (float(np.median(cand_t)), float(np.percentile(cand_t, 99))))
