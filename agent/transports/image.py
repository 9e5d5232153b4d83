"""The image endpoint's decoding: JPEG or PNG bytes -> one model input sample, through the bundle's recorded
preprocessing (:mod:`protocol.preprocess`, the same code the compiler runs on calibration images).

Memory is bounded before any decoder runs. The image's header (PNG IHDR: width, height, bit depth, colour
type; JPEG SOFn: width, height, components, precision) gives its decoded size, width x height x channels
x bytes per sample, and the bytes a decode takes at its peak (:attr:`ImageHeader.decode_cost_bytes`);
an image whose decode would take more than ``max_image_decoded_bytes`` is refused with 413, so a small
upload cannot make the agent allocate gigabytes (a decompression bomb). Other formats are 415, an
unreadable header 400. The server lets at most ``max_concurrent_image_decodes`` decode at once, so images
never hold more than ``max_concurrent_image_decodes x max_image_decoded_bytes`` at a time.

Work is bounded too, not only memory: a decode's cost is not its byte count. A progressive JPEG's every scan is a
pass over every block of the image, however few bytes it has (a 436 KB file of 30,000 14-byte scans of a
2000x2000 image took 24 s of CPU), and a PNG's zlib stream may go on far past the image's own rows (1 MB that
inflates to 1 GiB after a 100x100 image took 2.2 s). So before OpenCV sees an image (:func:`image_bytes`, on the
decode thread): a JPEG's marker stream is walked and more than ``max_scans`` scans (``max_image_scans``, 100 by
default: an encoder's progressive JPEG has about 10, a baseline one 1-4; NVIDIA's nvImageCodec refuses more than
256) or more than ``_jpeg_max_segments`` marker segments are refused with 413; a PNG's chunks are walked (at most
``MAX_PNG_CHUNKS``), its image data inflated at most to the size its header gives (more is refused with 413), and
OpenCV gets only its critical chunks (IHDR, PLTE, tRNS, IDAT, IEND): text, ICC, EXIF and animation chunks, which
OpenCV does not use for an 8-bit BGR image, can then cost nothing (a compressed text chunk is a zlib bomb of its
own). A refused image holds a decode slot only while its bytes are walked (a few milliseconds for 16 MB).

OpenCV decodes to 8-bit BGR whatever the source (a 16-bit PNG is never held at 16 bits per sample, nor as
float64) and ignores EXIF orientation, as the compiler's ``decode_image`` does. OpenCV is imported only
when an image is decoded.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from ...protocol.manifest import Manifest
from ...protocol.preprocess import Preprocessing
from ..errors import NotInstalled, PayloadTooLarge, RequestError

__all__ = ["DEFAULT_MAX_DECODED_BYTES", "DEFAULT_MAX_SCANS", "MAX_PNG_CHUNKS", "ImageHeader", "ImageLimits",
           "UnsupportedImage", "check_budget", "check_image", "decode_feeds", "image_bytes", "image_header",
           "preprocess_image"]

DEFAULT_MAX_DECODED_BYTES = 96 * 1024 * 1024
DEFAULT_MAX_SCANS = 100  # JPEG scans: libjpeg's progressive script writes 10 (6 for grey), a baseline JPEG 1-4
MAX_PNG_CHUNKS = 16_384  # a PNG's chunks, all kinds: 1 KiB a chunk on average at a 16 MiB body
# what OpenCV's 8-bit BGR decode of a PNG reads; every other chunk is dropped before it (image_bytes)
_PNG_KEEP = {b"IHDR", b"PLTE", b"tRNS", b"IDAT", b"IEND"}
_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel as stored
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_INFLATE_STEP = 1 << 20  # bytes of inflated PNG data held at once while it is measured
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
    max_scans: int = DEFAULT_MAX_SCANS  # of a JPEG: each is a pass over every block of the image

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
        raise RequestError("not a readable image: corrupt PNG: no IHDR header")
    w, h, depth, ctype, compression, filtering, interlace = struct.unpack(">IIBBBBB", data[16:29])
    kind = _PNG_TYPES.get(ctype)
    if kind is None or depth not in kind[1] or compression or filtering or interlace > 1:
        raise RequestError(f"not a readable image: corrupt PNG: IHDR says colour type {ctype}, bit depth {depth}, "
                           f"compression {compression}, filter {filtering}, interlace {interlace}")
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


def _jpeg_max_segments(max_scans: int) -> int:
    """Marker segments a JPEG may have: its scans, a table or two before each, and 1024 others (APPn, COM; an ICC
    profile takes at most 255 APP2 segments)."""
    return 1024 + 4 * max_scans


def _jpeg_next_marker(data: bytes, a: np.ndarray, i: int) -> int:
    """Where the next marker at or after byte ``i`` starts (0xFF, then a byte that is not a stuffed 0x00, a
    restart marker D0-D7 or more 0xFF fill); -1: none. ``a``: ``data`` as uint8. The first few 0xFF bytes are
    looked at one by one (a segment's next marker is usually right after it); past them, in windows that double
    from 4 KiB to 1 MiB, vectorised: linear in the bytes skipped (entropy-coded data, fill or garbage alike,
    about 1-2 ms a MiB), however many 0xFF bytes they hold."""
    n = len(data)
    for _ in range(8):
        j = data.find(b"\xff", i, n - 1)
        if j < 0:
            return -1
        b = data[j + 1]
        if b != 0 and b != 0xFF and not 0xD0 <= b <= 0xD7:
            return j
        i = j + 1
    step = 4096
    one, rst = np.uint8(1), np.uint8(0xD0)
    while i < n - 1:
        end = min(n, i + step + 1)
        nxt = a[i + 1:end]
        hit = a[i:end - 1] == 0xFF
        hit &= (nxt - one) < np.uint8(0xFE)  # not 0x00, not 0xFF (uint8 arithmetic wraps)
        hit &= (nxt - rst) > np.uint8(7)  # not D0-D7
        found = np.flatnonzero(hit)
        if found.size:
            return i + int(found[0])
        i = end - 1
        step = min(step * 2, 1 << 20)
    return -1


def _jpeg_scans(data: bytes, max_scans: int) -> int:
    """The scans of a JPEG, walked as libjpeg walks them (a segment's length, then the next marker after whatever
    bytes follow: entropy-coded data, or garbage it would skip); PayloadTooLarge past ``max_scans`` scans or
    ``_jpeg_max_segments`` segments. Stops at EOI, where libjpeg stops."""
    max_segments = _jpeg_max_segments(max_scans)
    scans = segments = 0
    i, n = 2, len(data)
    a = np.frombuffer(data, np.uint8)
    while True:
        i = _jpeg_next_marker(data, a, i)
        if i < 0:  # the end without EOI: libjpeg ends the image there too
            return scans
        marker = data[i + 1]
        segments += 1
        if segments > max_segments:
            raise PayloadTooLarge(f"the JPEG image has more than {max_segments:,} marker segments; the most taken is "
                                  f"{max_segments:,} (1024 + 4 x max_image_scans {max_scans})")
        if marker == 0xD9:  # EOI
            return scans
        if marker in (0xD8, 0x01):  # no length
            i += 2
            continue
        if i + 4 > n:
            return scans
        length = data[i + 2] << 8 | data[i + 3]
        if length < 2:
            raise RequestError(f"corrupt JPEG: segment length {length} at byte {i}")
        if marker == 0xDA:
            scans += 1
            if scans > max_scans:
                raise PayloadTooLarge(
                    f"the JPEG image has more than {max_scans} scans; the most taken is {max_scans} "
                    f"(max_image_scans): each scan is a pass over every block of the image, however few bytes it "
                    f"has (an encoder's progressive JPEG has about 10). Re-encode it (e.g. as a baseline JPEG)")
        i += 2 + length


def _png_raw_bytes(data: bytes) -> int:
    """The bytes a PNG's image data inflates to, from its IHDR: each row's filter byte and packed samples, over
    the seven Adam7 passes if it is interlaced."""
    w, h, depth, ctype, _c, _f, interlace = struct.unpack(">IIBBBBB", data[16:29])
    bits = _PNG_SAMPLES[ctype] * depth

    def rows(pw: int, ph: int) -> int:
        return ph * (1 + (pw * bits + 7) // 8) if pw and ph else 0

    if not interlace:
        return rows(w, h)
    return sum(rows((w - x0 + dx - 1) // dx if w > x0 else 0, (h - y0 + dy - 1) // dy if h > y0 else 0)
               for x0, y0, dx, dy in _ADAM7)


def _png_critical(data: bytes) -> bytes:
    """The PNG with only the chunks OpenCV decodes it from, after checking its image data inflates to no more
    than its header says (PayloadTooLarge otherwise: a zlib stream that goes on past the image's rows costs
    the decoder its whole length). Bounded: at most MAX_PNG_CHUNKS chunks are walked, and at most the image's
    own size (+1 MiB) is inflated, a MiB at a time."""
    view = memoryview(data)
    keep = [view[:8]]
    idat: list[memoryview] = []
    pos, n, chunks = 8, len(data), 0
    while pos < n:
        if pos + 12 > n:
            raise RequestError(f"not a readable image: corrupt PNG: a chunk cut short at byte {pos} (truncated?)")
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if end > n:
            raise RequestError(f"not a readable image: corrupt PNG: chunk {kind!r} at byte {pos} says {length:,} "
                               "bytes, past the end of the file (truncated?)")
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise PayloadTooLarge(f"the PNG image has more than {MAX_PNG_CHUNKS:,} chunks, the most taken (write "
                                  "its image data in fewer, larger IDAT chunks)")
        if kind in _PNG_KEEP:
            keep.append(view[pos:end])
            if kind == b"IDAT":
                idat.append(view[pos + 8:end - 4])
            elif kind == b"IEND":
                break
        elif not kind[0] & 0x20:  # an unknown critical chunk: no decoder may skip it
            raise RequestError(f"not a readable image: corrupt PNG: unknown critical chunk {kind!r} at byte {pos}")
        pos = end
    expected = _png_raw_bytes(data)
    z = zlib.decompressobj()
    total = 0
    try:
        for chunk_data in idat:
            piece: bytes | memoryview = chunk_data
            while piece and not z.eof:
                total += len(z.decompress(piece, _INFLATE_STEP))
                if total > expected:
                    raise PayloadTooLarge(f"the PNG image's data inflates to more than the {expected:,} bytes its "
                                          "header says (a zlib stream that goes on past the image's rows); "
                                          "re-encode it")
                piece = z.unconsumed_tail
            if z.eof:
                break
    except zlib.error as exc:
        raise RequestError(f"not a readable image: corrupt PNG: its image data is not a zlib stream ({exc})") from None
    return b"".join(keep)


def image_bytes(data: bytes, header: ImageHeader, max_scans: int = DEFAULT_MAX_SCANS) -> bytes:
    """The bytes to hand OpenCV for an upload :func:`check_image` passed, after the work its decode would take is
    bounded: a JPEG's scans counted (at most ``max_scans``), a PNG's chunks walked, its image data measured and
    its ancillary chunks dropped. PayloadTooLarge (413) naming the limit, RequestError (400) for a corrupt
    file. Linear in the bytes; run it where the decode runs (it may take milliseconds for a large body)."""
    if header.format == "jpeg":
        _jpeg_scans(data, max_scans)
        return data
    return _png_critical(data)


def decode_feeds(data: bytes, manifest: Manifest, header: ImageHeader,
                 max_scans: int = DEFAULT_MAX_SCANS) -> dict[str, np.ndarray]:
    """Decode an upload :func:`check_image` passed -> the model's feeds (a batch of one); its work is bounded
    first (:func:`image_bytes`)."""
    import cv2

    prep: Preprocessing | None = manifest.preprocessing
    assert prep is not None
    data = image_bytes(data, header, max_scans)
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    del data
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


def preprocess_image(data: bytes, manifest: Manifest, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                     max_scans: int = DEFAULT_MAX_SCANS) -> dict[str, np.ndarray]:
    """An uploaded image -> the model's feeds (a batch of one), or RequestError naming what is wrong."""
    return decode_feeds(data, manifest, check_image(data, manifest, max_decoded_bytes), max_scans)
