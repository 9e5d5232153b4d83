"""The image endpoint's decoding: JPEG or PNG bytes -> one model input sample, through the bundle's recorded
preprocessing (:mod:`protocol.preprocess`, the same code the compiler runs on calibration images).

Memory is bounded before any decoder runs. The image's header (PNG IHDR: width, height, bit depth, colour
type; JPEG SOFn: width, height, components, precision) gives its decoded size, width x height x channels
x bytes per sample, and the bytes a decode takes at its peak (:attr:`ImageHeader.decode_cost_bytes`);
an image whose decode would take more than ``max_image_decoded_bytes`` is refused with 413, so a small
upload cannot make the agent allocate gigabytes (a decompression bomb). Other formats are 415, an
unreadable header 400. The server lets at most ``max_concurrent_image_decodes`` decode at once, so images
never hold more than ``max_concurrent_image_decodes x max_image_decoded_bytes`` at a time.

OpenCV decodes to 8-bit BGR whatever the source (a 16-bit PNG is never held at 16 bits per sample, nor as
float64) and ignores EXIF orientation, as the compiler's ``decode_image`` does. OpenCV is imported only
when an image is decoded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from edgefleet.agent.errors import NotInstalled, PayloadTooLarge, RequestError
from edgefleet.protocol.manifest import Manifest
from edgefleet.protocol.preprocess import Preprocessing

__all__ = ["DEFAULT_MAX_DECODED_BYTES", "ImageHeader", "ImageLimits", "UnsupportedImage", "check_budget",
           "check_image", "decode_feeds", "image_header", "preprocess_image"]

DEFAULT_MAX_DECODED_BYTES = 96 * 1024 * 1024
_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}
# PNG colour type -> (channels once decoded, allowed bit depths); a palette expands to 3 channels of 8 bits
_PNG_TYPES = {0: (1, (1, 2, 4, 8, 16)), 2: (3, (8, 16)), 3: (3, (1, 2, 4, 8)), 4: (2, (8, 16)), 6: (4, (8, 16))}
# OpenCV reads into a buffer and converts into its 8-bit BGR result: measured with OpenCV 5 on PNGs (8 and
# 16 bits, gray to RGBA) and JPEGs, the peak is 2 x width x height x 3 bytes; preprocessing the result
# (a color conversion at full size) stays within it
_DECODE_BYTES_PER_PIXEL = 2 * 3


class UnsupportedImage(RequestError):
    status_code = 415


@dataclass(frozen=True)
class ImageHeader:
    format: str  # "png" | "jpeg"
    width: int
    height: int
    channels: int
    bits: int  # per sample
    progressive: bool = False  # a progressive JPEG holds every coefficient until its last scan

    @property
    def decoded_bytes(self) -> int:
        """width x height x channels x bytes per sample: the image at its own depth."""
        return self.width * self.height * self.channels * (2 if self.bits > 8 else 1)

    @property
    def decode_cost_bytes(self) -> int:
        """The most a decode (and the preprocessing at full size) holds at once, from the header alone."""
        pixels = self.width * self.height
        coefficients = pixels * self.channels * 2 if self.progressive else 0
        return max(self.decoded_bytes, pixels * _DECODE_BYTES_PER_PIXEL) + coefficients

    def describe(self) -> str:
        return (f"{self.width}x{self.height} {self.format.upper()}{' (progressive)' if self.progressive else ''}, "
                f"{self.channels} channel{'s' if self.channels != 1 else ''} of {self.bits} bits")


@dataclass(frozen=True)
class ImageLimits:
    """What the image endpoint may take: bytes one decode may hold, decodes at once, and how long a request
    waits for its turn to decode before it gets 503."""

    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
    max_concurrent: int = 2
    wait_s: float = 5.0

    @property
    def ceiling_bytes(self) -> int:
        return self.max_concurrent * self.max_decoded_bytes


def image_header(data: bytes) -> ImageHeader:
    """The header of a JPEG or PNG; UnsupportedImage (415) for other formats, RequestError (400) for a header
    that is cut short or makes no sense."""
    if data.startswith(_PNG):
        return _png_header(data)
    if data.startswith(b"\xff\xd8"):
        return _jpeg_header(data)
    raise UnsupportedImage("the body is not a JPEG or PNG image (post the file's bytes; other formats are not "
                           "taken)")


def _png_header(data: bytes) -> ImageHeader:
    if len(data) < 29 or data[8:16] != b"\x00\x00\x00\x0dIHDR":
        raise RequestError("corrupt PNG: no IHDR header")
    w, h, depth, ctype, compression, filtering, interlace = struct.unpack(">IIBBBBB", data[16:29])
    kind = _PNG_TYPES.get(ctype)
    if kind is None or depth not in kind[1] or compression or filtering or interlace > 1:
        raise RequestError(f"corrupt PNG: IHDR says colour type {ctype}, bit depth {depth}, compression "
                           f"{compression}, filter {filtering}, interlace {interlace}")
    if w < 1 or h < 1:
        raise RequestError(f"the PNG image is {w}x{h} pixels")
    return ImageHeader("png", w, h, kind[0], 8 if ctype == 3 else depth)


def _jpeg_header(data: bytes) -> ImageHeader:
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
        if marker in (0xDA, 0xD9):  # a scan or the end before any frame header
            break
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if length < 2:
            raise RequestError(f"corrupt JPEG: segment length {length} at byte {i}")
        if marker in _JPEG_SOF:
            if i + 10 > len(data) or length < 8:
                break
            precision = data[i + 4]
            h, w = struct.unpack(">HH", data[i + 5:i + 9])
            components = data[i + 9]
            if precision not in (8, 12, 16) or components not in (1, 3, 4):
                raise RequestError(f"corrupt JPEG: frame header says {components} components of {precision} bits")
            if w < 1 or h < 1:
                raise RequestError(f"the JPEG image is {w}x{h} pixels (a height given later, in a DNL marker, "
                                   "is not taken)")
            return ImageHeader("jpeg", w, h, components, precision, marker in _JPEG_PROGRESSIVE)
        i += 2 + length
    raise RequestError("corrupt JPEG: no frame header (truncated?)")


def check_budget(header: ImageHeader, max_decoded_bytes: int) -> None:
    """PayloadTooLarge (413), saying the decoded size and the limit, if decoding ``header``'s image would
    take more than ``max_decoded_bytes``."""
    cost = header.decode_cost_bytes
    if cost <= max_decoded_bytes:
        return
    decoding = f", {cost:,} bytes to decode" if cost != header.decoded_bytes else ""
    raise PayloadTooLarge(f"the image is {header.describe()}: {header.decoded_bytes:,} bytes decoded{decoding}; "
                          f"the limit is {max_decoded_bytes:,} bytes (max_image_decoded_bytes): send a smaller "
                          "image")


_decoder: bool | None = None  # OpenCV importable? (looked up once, without importing it on the event loop)


def _need_decoder() -> None:
    global _decoder
    if _decoder is None:
        import importlib.util

        try:
            _decoder = importlib.util.find_spec("cv2") is not None
        except (ImportError, ValueError):
            _decoder = False
    if not _decoder:
        raise NotInstalled("this agent cannot decode images: the image endpoint needs edgefleet[image] "
                           "(OpenCV), which is not installed: pip install 'edgefleet[image]'; /infer takes tensors")


def check_image(data: bytes, manifest: Manifest, max_decoded_bytes: int) -> ImageHeader:
    """Everything about an upload that can be judged without decoding it: RequestError if the model takes
    no images, the format or header is wrong, or the image is over the budget; NotInstalled (501) on a box
    without edgefleet[image]."""
    _need_decoder()
    if manifest.preprocessing is None:
        raise RequestError(f"model {manifest.name!r} {manifest.version} records no image preprocessing; send "
                           "tensors to /infer instead")
    if len(manifest.inputs) != 1:
        raise RequestError(f"model {manifest.name!r} takes {len(manifest.inputs)} inputs; the image endpoint feeds "
                           "models with one")
    header = image_header(data)
    check_budget(header, max_decoded_bytes)
    return header


def decode_feeds(data: bytes, manifest: Manifest, header: ImageHeader) -> dict[str, np.ndarray]:
    """Decode an upload :func:`check_image` passed -> the model's feeds (a batch of one)."""
    import cv2

    prep: Preprocessing | None = manifest.preprocessing
    assert prep is not None
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if img is None:
        raise RequestError(f"the uploaded {header.format.upper()} image: not a readable image (corrupt or "
                           "truncated?)")
    if img.shape[:2] != (header.height, header.width):  # the header is what the budget was checked against
        raise RequestError(f"the uploaded {header.format.upper()} image decoded to {img.shape[1]}x{img.shape[0]}, "
                           f"its header says {header.width}x{header.height}")
    sample = prep.apply(img)
    del img
    spec = manifest.inputs[0]
    if spec.batch_axis is None:
        return {spec.name: sample}
    return {spec.name: np.expand_dims(sample, spec.batch_axis)}


def preprocess_image(data: bytes, manifest: Manifest,
                     max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> dict[str, np.ndarray]:
    """An uploaded image -> the model's feeds (a batch of one), or RequestError naming what is wrong."""
    return decode_feeds(data, manifest, check_image(data, manifest, max_decoded_bytes))
