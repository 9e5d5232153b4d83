"""Running an engine over a data set, and an alternating benchmark of two runners."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from edgefleet.compiler.data import Dataset
from edgefleet.compiler.tasks import Outputs

__all__ = ["Outputs", "Runner", "benchmark_pair", "predict_all", "top1"]

# feeds a batch {input name: array} and returns the outputs in the model's output order: an engine's infer()
Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def predict_all(run: Runner, data: Dataset, batch: int = 64,
                output_axes: list[int | None] | None = None) -> list[Outputs]:
    """Every output of ``run`` over ``data``, in batches, with the samples on axis 0 (an output with no
    batch axis gets one entry per call). A model that takes one sample per call (``data.per_sample``) runs
    sample by sample; each output is then one entry per sample (its leading 1 dropped when every sample
    has one), stacked when all samples have the same shape, else a list of per-sample arrays."""
    if data.per_sample:
        batch = 1
    outs: list[list[np.ndarray]] = []
    for s in range(0, len(data), batch):
        outs.append(run(data.take(s, s + batch)))
    axes = output_axes or [0] * len(outs[0])
    merged: list[Outputs] = []
    for axis, parts in zip(axes, zip(*outs, strict=True), strict=True):
        if data.per_sample:
            items = [p[0] for p in parts] if all(p.ndim and p.shape[0] == 1 for p in parts) else list(parts)
        elif axis is None:
            items = list(parts)
        else:
            rows = [np.moveaxis(p, axis, 0) for p in parts]
            if len({r.shape[1:] for r in rows}) == 1:
                merged.append(np.concatenate(rows))
                continue
            items = [row for r in rows for row in r]
        merged.append(np.stack(items) if len({i.shape for i in items}) == 1 else items)
    return merged


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
