"""Image requests are bounded in work, not only in memory (issue 30, finding 2).

A decode's cost is not its byte count. A progressive JPEG's every scan is a pass over every block of the image
however few bytes it has: a 2000x2000 grey image whose 14-byte scan is repeated 30,000 times is 420 KB and
took 24 s of CPU, and two of them held both decode slots so healthy images got 503. A PNG whose zlib stream goes
on past its image's rows is inflated to the end (1 MB inflating to 1 GiB after a 100x100 image: 2.2 s). Both are
now refused by a walk of the file before OpenCV sees it (agent/transports/image.py: image_bytes), and PNG chunks OpenCV
does not use for an 8-bit BGR image (text, ICC, EXIF, animation: each compressed one a zlib bomb of its own) never
reach it.

The hostile files are made here, from a real encoder's output.
"""

from __future__ import annotations

import functools
import struct
import zlib

import cv2
import httpx
import numpy as np
import pytest

from edgefleet.agent.errors import RequestError
from edgefleet.agent.transports.image import DEFAULT_MAX_SCANS, MAX_PNG_CHUNKS, image_bytes, image_header
from tests.agent_harness import post_at_once, preinstall, running_agent
from tests.test_agent_image_memory import small_png


# -- hostile files ---------------------------------------------------------------------------------------
def hostile_jpeg(scans: int, size: int = 2000) -> bytes:
    """A progressive grey ``size`` x ``size`` JPEG: an encoder's tables and frame header, then one 14-byte scan
    (a DC first scan of the one component, four bytes of entropy-coded data) ``scans`` times, then EOI."""
    ok, buf = cv2.imencode(".jpg", np.zeros((size, size), np.uint8), [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])
    assert ok
    data = buf.tobytes()
    first_scan = data.index(b"\xff\xda")  # the encoder's tables and SOF2 come before its first scan
    scan = b"\xff\xda" + struct.pack(">HB", 8, 1) + bytes([1, 0x00, 0, 0, 0]) + b"\x00\x00\x00\x00"
    assert len(scan) == 14
    return data[:first_scan] + scan * scans + b"\xff\xd9"


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_of(width: int, height: int, idat: bytes, before_idat: bytes = b"", interlace: int = 0,
           idat_chunk: int | None = None) -> bytes:
    """An 8-bit grey PNG whose image data is the zlib stream ``idat`` (split into chunks of ``idat_chunk``
    bytes if given), with ``before_idat`` (whole chunks) between IHDR and IDAT."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, interlace)
    step = idat_chunk or max(1, len(idat))
    idats = b"".join(chunk(b"IDAT", idat[i:i + step]) for i in range(0, len(idat), step))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + before_idat + idats + chunk(b"IEND", b"")


@functools.cache
def zeros_stream(mib: int) -> bytes:
    """A zlib stream of ``mib`` MiB of zeros, about 1 KB a MiB, made in milliseconds: one MiB deflated after a full
    flush (so every such MiB deflates to the same bytes) repeated, the final block, and the Adler-32 of zeros."""
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    z.compress(bytes(1 << 20))
    z.flush(zlib.Z_FULL_FLUSH)
    block = z.compress(bytes(1 << 20)) + z.flush(zlib.Z_FULL_FLUSH)
    n = mib << 20
    return b"\x78\xda" + block * mib + z.flush() + ((n % 65521) << 16 | 1).to_bytes(4, "big")


def inflate_bomb_png() -> bytes:
    """A 100x100 grey PNG whose image data is a zlib stream of 1 GiB of zeros (the image needs 10,100 bytes)."""
    return png_of(100, 100, zeros_stream(1024))


# -- JPEG: scans counted before the decoder --------------------------------------------------------------
def test_a_jpeg_of_more_scans_than_the_limit_is_refused_before_it_decodes(monkeypatch):
    def no_decoder(*a, **k):
        raise AssertionError("the decoder ran")

    monkeypatch.setattr(cv2, "imdecode", no_decoder)
    data = hostile_jpeg(30_000)
    assert len(data) < 450_000  # the finding's file: small, and it passes the pixel budget
    with pytest.raises(RequestError) as err:
        image_bytes(data, image_header(data))
    assert err.value.status_code == 413
    msg = str(err.value)
    assert f"more than {DEFAULT_MAX_SCANS} scans" in msg and "max_image_scans" in msg, msg


def test_the_scan_limit_is_exact_and_configurable():
    at = hostile_jpeg(10)
    assert image_bytes(at, image_header(at), max_scans=10) == at
    over = hostile_jpeg(11)
    with pytest.raises(RequestError, match="more than 10 scans"):
        image_bytes(over, image_header(over), max_scans=10)


@pytest.mark.parametrize("params", [[], [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]], ids=["baseline", "progressive"])
@pytest.mark.parametrize("channels", [1, 3])
def test_an_encoders_jpegs_pass_and_decode(params, channels):
    img = np.random.default_rng(1).integers(0, 255, (120, 160, channels)[:2 + (channels == 3)], np.uint8)
    ok, buf = cv2.imencode(".jpg", img, params)
    data = buf.tobytes()
    assert image_bytes(data, image_header(data)) == data  # handed to OpenCV unchanged


def test_markers_hidden_in_stuffing_fill_and_restarts_are_found():
    """After the scans, 0xFF00 stuffing, 0xFF fill and restart markers (which are not segments) go on to a run
    of scans past the limit: each one counted, however the bytes between are made."""
    base = hostile_jpeg(1)[:-2]
    scan = hostile_jpeg(1)[-16:-2]
    for filler in (b"\xff\x00" * 50_000, b"\xff" * 100_000, b"\xff\xd3" * 50_000, bytes(100_000)):
        data = base + filler + (scan + filler[:7]) * DEFAULT_MAX_SCANS + b"\xff\xd9"
        with pytest.raises(RequestError, match=f"more than {DEFAULT_MAX_SCANS} scans"):
            image_bytes(data, image_header(data))


def test_a_jpeg_of_endless_empty_segments_is_refused():
    base = hostile_jpeg(1)[:-2]
    data = base + b"\xff\xfe\x00\x02" * 100_000 + b"\xff\xd9"  # 100,000 empty comments
    with pytest.raises(RequestError, match="marker segments"):
        image_bytes(data, image_header(data))


# -- PNG: chunks walked, image data measured, ancillary chunks dropped ----------------------------------
def test_a_png_whose_data_inflates_past_its_rows_is_refused(monkeypatch):
    def no_decoder(*a, **k):
        raise AssertionError("the decoder ran")

    monkeypatch.setattr(cv2, "imdecode", no_decoder)
    data = inflate_bomb_png()
    assert len(data) < 1_100_000
    with pytest.raises(RequestError) as err:
        image_bytes(data, image_header(data))
    assert err.value.status_code == 413
    assert "inflates to more than the 10,100 bytes its header says" in str(err.value)


def test_a_png_of_too_many_chunks_is_refused():
    rows = zlib.compress(b"\x00" + bytes(10)) * 1
    data = png_of(10, 1, rows, before_idat=chunk(b"tEXt", b"k\x00v") * MAX_PNG_CHUNKS)
    with pytest.raises(RequestError, match=f"more than {MAX_PNG_CHUNKS:,} chunks"):
        image_bytes(data, image_header(data))


def test_ancillary_chunks_never_reach_the_decoder():
    """Compressed text and ICC bombs (each inflates to 1 GiB), EXIF and an animation control chunk: dropped; the
    image decodes to the same pixels as without them."""
    img = (np.arange(64 * 48) % 251).astype(np.uint8).reshape(48, 64)
    rows = b"".join(b"\x00" + img[y].tobytes() for y in range(48))
    bomb = zeros_stream(1024)
    extra = (chunk(b"zTXt", b"k\x00\x00" + bomb) + chunk(b"iCCP", b"p\x00\x00" + bomb)
             + chunk(b"eXIf", b"MM\x00*" + bytes(8)) + chunk(b"acTL", struct.pack(">II", 1, 0)))
    data = png_of(64, 48, zlib.compress(rows), before_idat=extra, idat_chunk=100)
    out = image_bytes(data, image_header(data))
    assert len(out) < len(data) - 2 * len(bomb)
    for kind in (b"zTXt", b"iCCP", b"eXIf", b"acTL"):
        assert kind not in out
    got = cv2.imdecode(np.frombuffer(out, np.uint8), cv2.IMREAD_GRAYSCALE)
    assert np.array_equal(got, img)


def test_an_interlaced_png_is_measured_by_its_seven_passes():
    """Adam7: the image data is each pass's rows; a correct stream passes and decodes to the same pixels, one
    byte more is refused."""
    w, h = 13, 11
    img = (np.arange(w * h) * 7 % 256).astype(np.uint8).reshape(h, w)
    passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
    raw = b"".join(b"\x00" + img[y, x0::dx].tobytes() for x0, y0, dx, dy in passes for y in range(y0, h, dy)
                   if x0 < w)
    data = png_of(w, h, zlib.compress(raw), interlace=1)
    out = image_bytes(data, image_header(data))
    assert np.array_equal(cv2.imdecode(np.frombuffer(out, np.uint8), cv2.IMREAD_GRAYSCALE), img)
    longer = png_of(w, h, zlib.compress(raw + b"\x00" * 64), interlace=1)
    with pytest.raises(RequestError, match="inflates to more than"):
        image_bytes(longer, image_header(longer))


@pytest.mark.parametrize(("data", "message"), [
    (png_of(4, 4, zlib.compress(bytes(20)))[:-20], "corrupt PNG"),  # cut short
    (png_of(4, 4, zlib.compress(bytes(20)), before_idat=chunk(b"XYZW", b"")), "unknown critical chunk"),
    (png_of(4, 4, b"not zlib at all"), "not a zlib stream"),
])
def test_corrupt_pngs_are_refused_by_name(data, message):
    with pytest.raises(RequestError, match=message) as err:
        image_bytes(data, image_header(data))
    assert err.value.status_code == 400


# -- a real agent: hostile images in flight, a healthy one still answered --------------------------------
@pytest.mark.trust("progressive JPEGs of 30,000 scans and a PNG inflate bomb at the image endpoint, with a "
                   "healthy image among them")
def test_hostile_images_in_flight_do_not_stop_healthy_ones(tmp_path, image_bundle, test_images):
    """Six hostile uploads at once (four 30,000-scan JPEGs, two inflate-bomb PNGs) beside healthy ones: each
    hostile one refused with 413 naming its limit, every healthy one answered 200. Before, the JPEGs took both
    decode slots for 20 s or more each, and the healthy image got 503 after its 2 s wait."""
    data = tmp_path / "agent"
    preinstall(data, image_bundle)
    jpeg, bomb, good = hostile_jpeg(30_000), inflate_bomb_png(), small_png(test_images)
    with running_agent(data, max_concurrent_image_decodes=2, queue_timeout_ms=2000) as (_a, url):
        infer = f"{url}/v2/models/digits/infer/image"
        bodies = [jpeg] * 4 + [bomb] * 2 + [good] * 2
        responses = post_at_once(infer, bodies, timeout_s=120)
        for r in responses[:4]:
            assert r.status_code == 413, r.text
            assert f"more than {DEFAULT_MAX_SCANS} scans" in r.json()["error"]
        for r in responses[4:6]:
            assert r.status_code == 413, r.text
            assert "inflates to more than" in r.json()["error"]
        for r in responses[6:]:
            assert r.status_code == 200, r.text
        assert httpx.post(infer, content=good, timeout=30).status_code == 200
