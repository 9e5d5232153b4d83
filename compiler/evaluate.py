"""Accuracy (top-1 on a labelled set) and an alternating benchmark of two runners."""

from __future__ import annotations

import time

import numpy as np

from compiler.data import Dataset
from compiler.targets.base import Runner

__all__ = ["benchmark_pair", "predict", "top1"]


def predict(run: Runner, data: Dataset, batch: int = 64) -> np.ndarray:
    outs = []
    for s in range(0, len(data), batch):
        feed = {k: v[s : s + batch] for k, v in data.inputs.items()}
        outs.append(run(feed)[0])
    return np.concatenate(outs, axis=0)


def top1(run: Runner, data: Dataset) -> float:
    assert data.labels is not None
    logits = predict(run, data)
    return float((logits.argmax(axis=1) == data.labels).mean())


def benchmark_pair(reference: Runner, candidate: Runner, data: Dataset, batch_size: int,
                   iterations: int, warmup: int) -> tuple[float, float]:
    """p50 latency in ms of each runner at ``batch_size``, alternating so machine drift hits both."""
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
    return float(np.median(ref_t)), float(np.median(cand_t))
