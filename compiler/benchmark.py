"""An alternating benchmark of two runners (running one over a data set: :mod:`edgefleet.judge.predict`)."""

from __future__ import annotations

import time

import numpy as np

from ..judge.data import Dataset
from ..judge.predict import Runner, predict_all

__all__ = ["benchmark_pair", "top1"]


def top1(run: Runner, data: Dataset) -> float:
    """Top-1 of the first output ([N, C] class scores) against the labels."""
    if data.labels is None:
        raise ValueError("top1 needs labels")
    first = predict_all(run, data)[0]
    if isinstance(first, list):
        raise ValueError("top1 needs one shape of class scores for every sample")
    return float((first.argmax(axis=1) == data.labels).mean())


def benchmark_pair(reference: Runner, candidate: Runner, data: Dataset, batch_size: int, iterations: int,
                   warmup: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((p50, p99) ms of reference, (p50, p99) ms of candidate) at ``batch_size``, alternating which
    runs first so machine drift hits both alike."""
    feed = data.pick(np.arange(1 if data.per_sample else batch_size) % len(data))
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
