"""Calibration and evaluation sets: ``.npz`` files keyed by the model's input name, plus ``labels``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compiler.errors import InputError
from protocol.manifest import TensorSpec

__all__ = ["Dataset", "load_dataset"]

_NP = {"FP32": np.float32, "FP16": np.float16, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32,
       "INT64": np.int64, "BOOL": np.bool_}


@dataclass(frozen=True)
class Dataset:
    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None

    def __len__(self) -> int:
        return len(next(iter(self.inputs.values())))

    def head(self, n: int) -> Dataset:
        return Dataset({k: v[:n] for k, v in self.inputs.items()},
                       None if self.labels is None else self.labels[:n])


def load_dataset(path: Path, specs: tuple[TensorSpec, ...], need_labels: bool, what: str) -> Dataset:
    if not path.exists():
        raise InputError(f"{path}: {what} file not found")
    try:
        npz = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise InputError(f"{path}: not a readable .npz file ({exc})") from exc
    with npz:
        keys = set(npz.files)
        inputs: dict[str, np.ndarray] = {}
        for spec in specs:
            key = spec.name if spec.name in keys else ("input" if len(specs) == 1 and "input" in keys else None)
            if key is None:
                raise InputError(f"{path}: {what} has no array for model input {spec.name!r} (keys: {sorted(keys)})")
            arr = npz[key]
            if arr.ndim != len(spec.shape):
                raise InputError(f"{path}: array {key!r} has {arr.ndim} dimensions, model input {spec.name!r} "
                                 f"has {len(spec.shape)} {list(spec.shape)}")
            for i, (have, want) in enumerate(zip(arr.shape[1:], spec.shape[1:], strict=True), start=1):
                if want != -1 and have != want:
                    raise InputError(f"{path}: array {key!r} dimension {i} is {have}, the model wants {want}")
            inputs[spec.name] = arr.astype(_NP[spec.datatype], copy=False)
        labels = None
        if "labels" in keys:
            labels = npz["labels"]
        elif need_labels:
            raise InputError(f"{path}: {what} needs a 'labels' array for the accuracy gate")
    n = {len(v) for v in inputs.values()} | ({len(labels)} if labels is not None else set())
    if len(n) != 1 or 0 in n:
        raise InputError(f"{path}: arrays disagree on the number of samples or are empty ({sorted(n)})")
    return Dataset(inputs, labels)
