"""A pipeline: two models run as one, with the steps between them that are not models (manifest version 7).

The one shape built today is **detect, then read**: a detector finds boxes in the input image, each box is cropped
from that image and resized for a reader, and the reader's answers are decoded -- a text detector then a CTC
recognizer (OCR), or a person detector then a classifier. Other chains (a VAD then a keyword model, three stages)
are refused by name, not half-run.

``pipeline.yaml`` (``edgefleet compile-pipeline``) holds :class:`PipelineFile`: the pipeline's name and version, its
two stages (each a model file, its own precision and task) and the steps. The bundle's manifest carries
:class:`PipelineManifest`: the same steps (:class:`PipelineSpec`) and each stage's own manifest, gated like a single
model; the bundle's top-level manifest describes the pipeline as a whole (its input, its end outputs, the gate of
its end answers against the FP32 pipeline). Every number has a range, and each request's work is bounded: boxes
per image (``boxes.max_boxes``), crops per request (``max_crops``), bytes per decoded string
(``read.max_text_bytes``).

End outputs (``N`` images, ``K`` = ``boxes.max_boxes``; rows past ``count`` are zero):

- ``boxes`` FP32 [N, K, 4]: x0, y0, x1, y1 in the detector input's pixels, in reading order;
- ``box_scores`` FP32 [N, K]; ``count`` INT32 [N]: boxes found;
- ``read.op: ctc``: ``text`` UINT8 [N, K, max_text_bytes], each string UTF-8, zero-padded (``bytes(row).rstrip(b"\\0")
  .decode()``), and ``text_scores`` FP32 [N, K] (the mean of the best class's probability over the kept steps);
- ``read.op: topk``: ``classes`` INT32 [N, K, k] and ``class_scores`` FP32 [N, K, k].
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator

from ._strict import StrictModel, parse_document
from .errors import SchemaError

__all__ = [
    "BOX_FORMATS",
    "MAX_STAGES_BYTES",
    "BoxesStep",
    "CropStep",
    "Normalization",
    "PipelineFile",
    "PipelineSpec",
    "ReadStep",
    "StageSource",
    "end_output_names",
    "load_pipeline_file",
]

BOX_FORMATS = ("map", "yolov8", "yolov5", "yolox")
MAX_STAGES_BYTES = 64 * 1024  # a pipeline.yaml is a few hundred bytes; a larger one is refused unread
_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"


class BoxesStep(StrictModel):
    """How the detector's output becomes boxes.

    ``map``: a probability map [1, H, W] (a DB text detector): pixels above ``threshold`` form 4-connected regions;
    a region whose mean probability is below ``box_threshold`` or whose box is under ``min_size`` pixels is dropped;
    each box is grown on every side by area * ``unclip`` / perimeter (DB's rule, as PP-OCR applies it).
    ``yolov8``/``yolov5``/``yolox``: decoded as the detection task decodes them, boxes scoring ``threshold`` or
    more after per-class NMS at ``nms_iou``.
    """

    format: Literal["map", "yolov8", "yolov5", "yolox"]
    output: str | None = Field(default=None, min_length=1, max_length=256)  # the detector output; None: its first
    threshold: float = Field(default=0.3, gt=0.0, lt=1.0)
    box_threshold: float = Field(default=0.5, ge=0.0, lt=1.0)
    nms_iou: float = Field(default=0.45, gt=0.0, le=1.0)
    min_size: int = Field(default=3, ge=1, le=4096)
    unclip: float = Field(default=1.5, ge=0.0, le=4.0)  # 0: boxes as found
    max_boxes: int = Field(default=32, ge=1, le=256)


class Normalization(StrictModel):
    """``x = (pixel * scale - mean) / std`` per channel (the agent's image preprocessing uses the same)."""

    scale: float = Field(default=1 / 255, gt=0.0, le=1.0)
    mean: tuple[float, ...] = Field(default=(0.0,), min_length=1, max_length=3)
    std: tuple[float, ...] = Field(default=(1.0,), min_length=1, max_length=3)

    @field_validator("mean", "std")
    @classmethod
    def _finite(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(abs(x) > 1e6 for x in v):
            raise ValueError("values are within +-1e6")
        return v

    @model_validator(mode="after")
    def _std(self) -> Normalization:
        if any(abs(s) < 1e-9 for s in self.std):
            raise ValueError("std must not be 0")
        return self


class CropStep(StrictModel):
    """How each box is cut from the pipeline's input and fed to the reader: the box's pixels (``source``: how the
    input was normalized, undone here) resized to ``height`` with the aspect kept (``keep_aspect``; narrower crops
    are padded on the right with ``pad_value``, wider ones squeezed to ``width``) or stretched to ``height`` x
    ``width``, then normalized as the reader expects (``target``). NCHW only."""

    height: int = Field(ge=4, le=1024)
    width: int = Field(ge=4, le=4096)
    keep_aspect: bool = True
    pad_value: float = Field(default=0.0, ge=0.0, le=255.0)  # in pixel units (0..255), before ``target``
    channels: Literal[1, 3] = 3
    source: Normalization = Normalization()
    target: Normalization = Normalization()


class ReadStep(StrictModel):
    """How the reader's answer per crop is decoded: ``ctc`` (greedy: best class per step, repeats merged, ``blank``
    dropped; class i is ``charset[i - 1]`` when ``blank`` is 0, else ``charset[i]``; the output is [K, T, C] or
    [T, K, C] with ``time_major``) or ``topk`` (the ``k`` best classes of a [K, C] output)."""

    op: Literal["ctc", "topk"]
    output: str | None = Field(default=None, min_length=1, max_length=256)
    blank: int = Field(default=0, ge=0, le=1_000_000)
    time_major: bool = False
    charset: tuple[str, ...] | None = Field(default=None, max_length=100_000)
    # pipeline.yaml only: where the compiler reads the charset -- "model:KEY" (the reader's ONNX metadata, one entry
    # per line, as PP-OCR ships it) or "file:PATH" (one per line, relative to the YAML); the manifest holds the list
    charset_from: str | None = Field(default=None, min_length=6, max_length=4096)
    k: int = Field(default=1, ge=1, le=100)
    max_text_bytes: int = Field(default=128, ge=4, le=4096)

    @field_validator("charset")
    @classmethod
    def _chars(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and any(len(c) > 16 for c in v):
            raise ValueError("each charset entry is at most 16 characters")
        return v

    @model_validator(mode="after")
    def _needs(self) -> ReadStep:
        if self.op == "ctc" and not self.charset and not self.charset_from:
            raise ValueError("read.op ctc needs its charset (the characters the classes stand for) or charset_from "
                             "('model:KEY' or 'file:PATH')")
        if self.charset_from is not None and not self.charset_from.startswith(("model:", "file:")):
            raise ValueError(f"charset_from {self.charset_from!r} is 'model:KEY' or 'file:PATH'")
        return self


class PipelineSpec(StrictModel):
    """The steps between and after the stages; recorded in the manifest as the compiler gated them."""

    kind: Literal["detect_then_read"] = "detect_then_read"
    detector: str = Field(pattern=_NAME)  # stage names
    reader: str = Field(pattern=_NAME)
    boxes: BoxesStep
    crop: CropStep
    read: ReadStep
    max_crops: int = Field(default=256, ge=1, le=65_536)  # crops per request, over all its images

    @model_validator(mode="after")
    def _two(self) -> PipelineSpec:
        if self.detector == self.reader:
            raise ValueError("the detector and the reader are two different stages")
        return self


def end_output_names(spec: PipelineSpec) -> tuple[str, ...]:
    """The pipeline's outputs, in the manifest's order."""
    tail = ("text", "text_scores") if spec.read.op == "ctc" else ("classes", "class_scores")
    return ("boxes", "box_scores", "count", *tail)


class StageSource(StrictModel):
    """One stage in ``pipeline.yaml``: its model file (relative to the YAML's folder) and how to build it."""

    name: str = Field(pattern=_NAME)
    model: str = Field(min_length=1, max_length=4096)
    precision: Literal["auto", "fp32", "fp16", "int8", "bf16"] = "auto"
    task: str | None = Field(default=None, max_length=64)
    task_args: str | None = Field(default=None, max_length=1024)


class PipelineFile(StrictModel):
    """``pipeline.yaml``."""

    name: str = Field(pattern=_NAME)
    version: str = Field(pattern=r"^(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})$")
    stages: tuple[StageSource, ...] = Field(min_length=1, max_length=8)
    pipeline: PipelineSpec

    @model_validator(mode="after")
    def _stages(self) -> PipelineFile:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        if len(names) != 2:
            raise ValueError(f"a detect_then_read pipeline has exactly two stages (a detector and a reader); this "
                             f"file has {len(names)}: {names}. Longer chains are not built yet")
        for role in ("detector", "reader"):
            if getattr(self.pipeline, role) not in names:
                raise ValueError(f"pipeline.{role} {getattr(self.pipeline, role)!r} is not one of the stages {names}")
        return self

    def stage(self, name: str) -> StageSource:
        return next(s for s in self.stages if s.name == name)

    def model_path(self, stage: StageSource, base: Path) -> Path:
        p = Path(stage.model)
        return p if p.is_absolute() else base / p


def load_pipeline_file(path: Path) -> PipelineFile:
    """``pipeline.yaml`` parsed and validated; SchemaError naming the file and key otherwise."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise SchemaError(str(path), ["file not found"]) from exc
    if len(raw) > MAX_STAGES_BYTES:
        raise SchemaError(str(path), [f"{len(raw)} bytes; a pipeline file is at most {MAX_STAGES_BYTES}"])
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise SchemaError(str(path), [f"not valid YAML: {exc}"]) from exc
    return parse_document(PipelineFile, data, str(path))
