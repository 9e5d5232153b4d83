"""How an output is scored against labels: shared by the compiler's gate and ``edgefleet verify``,
so a bundle is checked on a device exactly as it was gated at build time (numpy only)."""

from __future__ import annotations

import numpy as np

__all__ = ["label_axis", "top1_hits"]


def label_axis(output_shape: tuple[int, ...], labels_shape: tuple[int, ...]) -> int | None:
    """The class axis of an output that ``labels`` index, or None if they do not fit."""
    if len(output_shape) == len(labels_shape) + 1:
        if output_shape[:1] + output_shape[2:] == labels_shape:
            return 1
        if output_shape[:-1] == labels_shape:
            return len(output_shape) - 1
    return None


def top1_hits(output: np.ndarray, labels: np.ndarray, axis: int) -> np.ndarray:
    """Per sample (rows) and position (columns): whether the arg-max along ``axis`` is the label."""
    return np.asarray(output.argmax(axis=axis) == labels).reshape(len(labels), -1)
