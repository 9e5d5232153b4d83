"""Calibration and evaluation sets.

- ``.npz``: arrays keyed by the model's input names (or ``input`` for a one-input model), plus
  optional ``labels``;
- ``.npy``: one array for a one-input model, no labels;
- a folder of images (JPEG, PNG, BMP, WebP), decoded with OpenCV through the bundle's recorded
  preprocessing (:mod:`protocol.preprocess`). Images in class subfolders (``cat/1.jpg``) get labels:
  the subfolder's index in the model's label list, or in the sorted subfolder names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..protocol.manifest import TensorSpec
from ..protocol.preprocess import IMAGE_SUFFIXES, Preprocessing, decode_image
from .errors import InputError

__all__ = ["Dataset", "load_dataset", "load_for_model", "sample_axes"]

_NP = {"FP32": np.float32, "FP16": np.float16, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32,
       "INT64": np.int64, "BOOL": np.bool_}


@dataclass(frozen=True)
class Dataset:
    """Arrays in the model's own layout: samples run along each input's batch axis (axis 0 unless the
    model says otherwise); an input with no batch axis holds one tensor shared by every sample."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None
    axes: dict[str, int | None] = field(default_factory=dict)  # input -> batch axis; missing means 0
    per_sample: bool = False  # the model takes one sample per call: run it on samples one at a time

    def _axis(self, name: str) -> int | None:
        return self.axes.get(name, 0)

    def __len__(self) -> int:
        for k, v in self.inputs.items():
            axis = self._axis(k)
            if axis is not None:
                return int(v.shape[axis])
        return 1

    def take(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Samples ``start:stop`` as a feed for the model."""
        out = {}
        for k, v in self.inputs.items():
            axis = self._axis(k)
            out[k] = v if axis is None else np.take(v, np.arange(start, min(stop, v.shape[axis])), axis=axis)
        return out

    def pick(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The samples at ``idx`` (repeats allowed) as a contiguous feed."""
        return {k: v if (a := self._axis(k)) is None else np.ascontiguousarray(np.take(v, idx, axis=a))
                for k, v in self.inputs.items()}

    def head(self, n: int) -> Dataset:
        return Dataset(self.take(0, n), None if self.labels is None else self.labels[:n], self.axes, self.per_sample)


def sample_axes(specs: tuple[TensorSpec, ...], per_sample: bool,
                data_axes: dict[str, int | None] | None = None) -> dict[str, int | None]:
    """Where a data set holds the samples, per input, as the compiler and ``edgefleet verify`` both read it: the batch
    axis of a batched model's input (None for one shared by the batch, a scalar); for a model that takes one sample
    per call (no input has a batch axis), ``data_axes`` when the compiler measured them, else the first axis of size
    1 in the input's shape ([1, 3, 32, 32]: 0; state pinned to [2, 1, 128]: 1), None for an input with none (a
    scalar, a fixed parameter)."""
    if not per_sample:
        return {s.name: s.batch_axis for s in specs}
    known = data_axes or {}
    return {s.name: known[s.name] if s.name in known else next((i for i, d in enumerate(s.shape) if d in (1, -1)), None)
            for s in specs}


def load_for_model(path: Path, specs: tuple[TensorSpec, ...], per_sample: bool, need_labels: bool, what: str,
                   preprocessing: Preprocessing | None = None, class_names: tuple[str, ...] | None = None,
                   data_axes: dict[str, int | None] | None = None) -> Dataset:
    """The one loader of a model's calibration or evaluation data (the compiler's and ``edgefleet verify``'s): the
    samples on :func:`sample_axes`, run one per call when ``per_sample``."""
    return load_dataset(path, specs, need_labels, what, preprocessing, class_names,
                        axes=sample_axes(specs, per_sample, data_axes), per_sample=per_sample)


def load_dataset(path: Path, specs: tuple[TensorSpec, ...], need_labels: bool, what: str,
                 preprocessing: Preprocessing | None = None, class_names: tuple[str, ...] | None = None,
                 axes: dict[str, int | None] | None = None, per_sample: bool = False) -> Dataset:
    """``axes``: where the data stacks the samples per input (default: each spec's batch axis); with
    ``per_sample`` the model takes one sample per call and the samples are stacked on those axes."""
    axes = axes if axes is not None else {s.name: s.batch_axis for s in specs}
    data = _load(path, specs, need_labels, what, preprocessing, class_names, axes)
    return Dataset(data.inputs, data.labels, data.axes, per_sample)


def _load(path: Path, specs: tuple[TensorSpec, ...], need_labels: bool, what: str,
          preprocessing: Preprocessing | None, class_names: tuple[str, ...] | None,
          axes: dict[str, int | None]) -> Dataset:
    if not path.exists():
        raise InputError(f"{path}: {what} file not found")
    if path.is_dir():
        data = _load_images(path, specs, what, preprocessing, class_names, axes)
        if need_labels and data.labels is None:
            raise InputError(f"{path}: {what} needs labels: put the images in one subfolder per class")
        return data
    if path.suffix == ".npy":
        if len(specs) != 1:
            raise InputError(f"{path}: a .npy {what} can feed a one-input model only; this one has "
                             f"{len(specs)} inputs: use an .npz keyed by input name")
        if need_labels:
            raise InputError(f"{path}: a .npy {what} has no labels; use an .npz with a 'labels' array")
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"{path}: not a readable .npy file ({exc})") from exc
        spec = specs[0]
        return Dataset({spec.name: _check(path, "array", arr, spec, axes[spec.name])}, None, dict(axes))
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
            inputs[spec.name] = _check(path, f"array {key!r}", npz[key], spec, axes[spec.name])
        labels = None
        if "labels" in keys:
            labels = npz["labels"]
        elif need_labels:
            raise InputError(f"{path}: {what} needs a 'labels' array for the accuracy gate")
    axes = _fit_axes(inputs, specs, dict(axes))
    n = {int(v.shape[a]) for k, v in inputs.items() if (a := axes[k]) is not None} | (
        {len(labels)} if labels is not None else set())
    if len(n) != 1 or 0 in n:
        raise InputError(f"{path}: arrays disagree on the number of samples along their batch axes, or are empty "
                         f"({sorted(n)}; shapes {({k: list(v.shape) for k, v in inputs.items()})}"
                         f"{'' if labels is None else f', labels {list(labels.shape)}'})")
    return Dataset(inputs, labels, axes)


def _fit_axes(inputs: dict[str, np.ndarray], specs: tuple[TensorSpec, ...],
              axes: dict[str, int | None]) -> dict[str, int | None]:
    """A tensor declared with several dynamic dimensions (state exported as [?, N, 128]) holds its samples
    on the one dynamic axis whose size is the sample count of the others."""
    sizes = [int(v.shape[a]) for k, v in inputs.items() if (a := axes[k]) == 0 and v.ndim]
    if not sizes:
        return axes
    n = max(set(sizes), key=sizes.count)
    for spec in specs:
        a, arr = axes[spec.name], inputs[spec.name]
        if a is None or arr.shape[a] == n:
            continue
        fits = [i for i, d in enumerate(spec.shape) if d == -1 and i != a and arr.shape[i] == n]
        if len(fits) == 1:
            axes[spec.name] = fits[0]
    return axes


def _check(path: Path, what: str, arr: np.ndarray, spec: TensorSpec, axis: int | None) -> np.ndarray:
    if arr.ndim != len(spec.shape):
        raise InputError(f"{path}: {what} has {arr.ndim} dimensions (shape {list(arr.shape)}), model input "
                         f"{spec.name!r} has {len(spec.shape)} {list(spec.shape)}")
    if axis is not None and axis >= arr.ndim:
        raise InputError(f"{path}: {what} has {arr.ndim} dimensions and no axis {axis} to hold the samples of model "
                         f"input {spec.name!r} {list(spec.shape)}")
    for i, (have, want) in enumerate(zip(arr.shape, spec.shape, strict=True)):
        if i != axis and want != -1 and have != want:
            raise InputError(f"{path}: {what} dimension {i} is {have}, the model wants {want}")
    return arr.astype(_NP[spec.datatype], copy=False)


def _load_images(folder: Path, specs: tuple[TensorSpec, ...], what: str, prep: Preprocessing | None,
                 class_names: tuple[str, ...] | None, axes: dict[str, int | None]) -> Dataset:
    if prep is None:
        raise InputError(f"{folder}: a folder of images needs preprocessing: the model input's shape does not say "
                         "how to turn an image into it; pass --preprocess preprocess.yaml")
    if len(specs) != 1 or specs[0].name != prep.input or axes[specs[0].name] != 0:
        raise InputError(f"{folder}: images can feed a model with one input ({prep.input!r}); this one has "
                         f"{[s.name for s in specs]}: use an .npz keyed by input name")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(f"{folder}: no images in the {what} folder (looked for {', '.join(IMAGE_SUFFIXES)})")
    subdirs = sorted({p.parent.relative_to(folder).parts[0] for p in files if p.parent != folder})
    labelled = bool(subdirs) and all(p.parent != folder for p in files)
    names = list(class_names) if class_names else subdirs
    samples, labels = [], []
    for f in files:
        try:
            samples.append(prep.apply(decode_image(f.read_bytes(), str(f))))
        except (ValueError, OSError) as exc:
            raise InputError(f"{exc}; remove it from the {what} folder or replace it") from exc
        if labelled:
            cls = f.relative_to(folder).parts[0]
            if cls not in names:
                raise InputError(f"{f}: class folder {cls!r} is not one of the model's labels {names[:10]}...")
            labels.append(names.index(cls))
    arr = _check(folder, f"images preprocessed to {list(prep.sample_shape())}", np.stack(samples), specs[0], 0)
    return Dataset({specs[0].name: arr}, np.asarray(labels, np.int64) if labelled else None, dict(axes))
