"""An engine's outputs over a data set: what the judge compares (the compiler's gate and ``edgefleet verify``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .data import Dataset
from .tasks import Outputs

__all__ = ["Outputs", "Runner", "predict_all"]

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
