"""Image preprocessing a bundle records, so the compiler's calibration and the agent's image endpoint
turn a JPEG/PNG into exactly the same tensor.

    decode (OpenCV, BGR) -> color order -> resize to height x width -> float32 * scale
    -> (x - mean) / std per channel -> layout (nchw or nhwc) -> one sample, no batch axis

``preprocess.yaml`` (``edgefleet compile --preprocess``) holds the same keys; unknown keys are errors.
OpenCV is imported only when an image is decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import Field, model_validator

from ._strict import StrictModel, parse_document
from .errors import SchemaError

__all__ = ["IMAGE_SUFFIXES", "Preprocessing", "decode_image", "default_preprocessing", "load_preprocessing"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


class Preprocessing(StrictModel):
    input: str  # the model input the image feeds
    height: int = Field(gt=0, le=16384)
    width: int = Field(gt=0, le=16384)
    color: Literal["rgb", "bgr", "gray"] = "rgb"
    layout: Literal["nchw", "nhwc"] = "nchw"
    scale: float = Field(default=1 / 255, gt=0)
    mean: tuple[float, ...] = (0.0,)  # one value, or one per channel
    std: tuple[float, ...] = (1.0,)

    @model_validator(mode="after")
    def _channels(self) -> Preprocessing:
        c = self.channels
        for key in ("mean", "std"):
            v = getattr(self, key)
            if len(v) not in (1, c):
                raise ValueError(f"{key} has {len(v)} values; give 1 or {c} (one per channel)")
        if any(s == 0 for s in self.std):
            raise ValueError("std must not be 0")
        return self

    @property
    def channels(self) -> int:
        return 1 if self.color == "gray" else 3

    def sample_shape(self) -> tuple[int, int, int]:
        c, h, w = self.channels, self.height, self.width
        return (c, h, w) if self.layout == "nchw" else (h, w, c)

    def apply(self, bgr: np.ndarray) -> np.ndarray:
        """An image as OpenCV decodes it (H x W x 3 BGR, or H x W gray) -> one model input sample."""
        import cv2

        if self.color == "gray":
            img = bgr if bgr.ndim == 2 else cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY)
        else:
            img = cv2.cvtColor(bgr, cv2.COLOR_GRAY2BGR) if bgr.ndim == 2 else bgr
            if self.color == "rgb":
                img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if img.shape[:2] != (self.height, self.width):
            img = cv2.resize(img, (self.width, self.height), interpolation=cv2.INTER_LINEAR)
        x = img.astype(np.float32).reshape(self.height, self.width, self.channels) * np.float32(self.scale)
        y: np.ndarray = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(y.transpose(2, 0, 1) if self.layout == "nchw" else y, dtype=np.float32)


def decode_image(data: bytes, source: str) -> np.ndarray:
    """JPEG/PNG/... bytes -> an OpenCV image; ValueError naming ``source`` if it is not an image."""
    import cv2

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED) if data else None
    if img is None:
        raise ValueError(f"{source}: not a readable image (JPEG, PNG, BMP or WebP)")
    if img.ndim == 3 and img.shape[2] == 4:
        img = cv2.cvtColor(img, cv2.COLOR_BGRA2BGR)
    if img.dtype != np.uint8:  # 16-bit PNG
        img = (img / 257).astype(np.uint8)
    return img


def default_preprocessing(input_name: str, shape: tuple[int, ...]) -> Preprocessing | None:
    """Plain RGB in [0, 1] at the model's own size, when its input is a fixed-size image; else None."""
    if len(shape) != 4:
        return None
    if shape[1] in (1, 3) and shape[2] > 0 and shape[3] > 0:
        return Preprocessing(input=input_name, height=shape[2], width=shape[3],
                             color="gray" if shape[1] == 1 else "rgb", layout="nchw")
    if shape[3] in (1, 3) and shape[1] > 0 and shape[2] > 0:
        return Preprocessing(input=input_name, height=shape[1], width=shape[2],
                             color="gray" if shape[3] == 1 else "rgb", layout="nhwc")
    return None


def load_preprocessing(path: Path) -> Preprocessing:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SchemaError(str(path), ["file not found"]) from exc
    except yaml.YAMLError as exc:
        raise SchemaError(str(path), [f"not valid YAML: {exc}"]) from exc
    return parse_document(Preprocessing, data, str(path))
