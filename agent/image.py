"""The image endpoint's decoding: JPEG or PNG bytes -> one model input sample, through the bundle's recorded
preprocessing (:mod:`protocol.preprocess`, the same code the compiler runs on calibration images).

Before OpenCV sees the bytes, the image's size is read from its header and checked against a pixel
limit, so a small upload cannot make the agent allocate gigabytes (a decompression bomb). OpenCV is
imported only when an image is decoded.
"""

from __future__ import annotations

import struct

import numpy as np

from agent.errors import RequestError
from protocol.manifest import Manifest
from protocol.preprocess import Preprocessing, decode_image

__all__ = ["MAX_IMAGE_PIXELS", "image_size", "preprocess_image"]

MAX_IMAGE_PIXELS = 40_000_000  # about 120 MB decoded (3 bytes a pixel)
_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def image_size(data: bytes) -> tuple[str, int, int]:
    """-> (format, width, height) from a JPEG or PNG header; RequestError if it is neither or is cut short."""
    if data.startswith(_PNG):
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise RequestError("corrupt PNG: no IHDR header")
        w, h = struct.unpack(">II", data[16:24])
        return "png", w, h
    if data.startswith(b"\xff\xd8"):
        i = 2
        while i + 4 <= len(data):  # walk the JPEG markers up to the frame header (each step moves forward)
            if data[i] != 0xFF:
                raise RequestError(f"corrupt JPEG: expected a marker at byte {i}")
            marker = data[i + 1]
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
                i += 2
                continue
            (length,) = struct.unpack(">H", data[i + 2:i + 4])
            if length < 2:
                raise RequestError(f"corrupt JPEG: segment length {length} at byte {i}")
            if marker in _JPEG_SOF:
                if i + 9 > len(data):
                    break
                h, w = struct.unpack(">HH", data[i + 5:i + 9])
                return "jpeg", w, h
            i += 2 + length
        raise RequestError("corrupt JPEG: no frame header (truncated?)")
    raise RequestError("the body is not a JPEG or PNG image (post the file's bytes; other formats are not taken)")


def preprocess_image(data: bytes, manifest: Manifest) -> dict[str, np.ndarray]:
    """An uploaded image -> the model's feeds (a batch of one), or RequestError naming what is wrong."""
    prep: Preprocessing | None = manifest.preprocessing
    if prep is None:
        raise RequestError(f"model {manifest.name!r} {manifest.version} records no image preprocessing; send "
                           "tensors to /infer instead")
    if len(manifest.inputs) != 1:
        raise RequestError(f"model {manifest.name!r} takes {len(manifest.inputs)} inputs; the image endpoint feeds "
                           "models with one")
    fmt, w, h = image_size(data)
    if w < 1 or h < 1 or w * h > MAX_IMAGE_PIXELS:
        raise RequestError(f"the {fmt.upper()} image is {w}x{h} pixels; the limit is {MAX_IMAGE_PIXELS:,} pixels")
    try:
        img = decode_image(data, f"the uploaded {fmt.upper()} image")
    except ValueError as exc:
        raise RequestError(f"{exc} (corrupt or truncated?)") from exc
    sample = prep.apply(img)
    spec = manifest.inputs[0]
    if spec.batch_axis is None:
        return {spec.name: sample}
    return {spec.name: np.expand_dims(sample, spec.batch_axis)}
