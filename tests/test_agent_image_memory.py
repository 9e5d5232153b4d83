"""Image requests are bounded in memory (issue "Trust boundaries", finding 6).

The bytes a decode needs are worked out from the image's header (PNG IHDR, JPEG SOFn) and checked against
``max_image_decoded_bytes`` before any decoder runs; at most ``max_concurrent_image_decodes`` images decode
at once. So the agent's memory for images has a ceiling: decodes at once x decoded bytes each.

The agent runs in this process (tests/agent_harness.py runs it in a thread), so its peak RSS is this
process's: the kernel's high-water mark (VmHWM) is reset before the requests and read after them.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest

from edgefleet.agent.errors import RequestError
from tests.agent_harness import post_at_once, preinstall, running_agent

MiB = 1024 * 1024
# what the measurement itself may add on top of the decodes: the request bodies (about 231 KB each), the
# HTTP client's and server's buffers, threads' stacks, allocator slack
SLACK = 32 * MiB


def png_bytes(width: int, height: int, bit_depth: int = 16, colour_type: int = 2) -> bytes:
    """A valid PNG of zeros, compressed one row at a time: a 6300x6300 16-bit RGB one is about 231 KB."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour_type]
    row = b"\x00" + bytes(width * channels * bit_depth // 8)
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset this process's peak RSS to its current RSS (Linux: clear_refs 5); -> the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here ({exc})")
    return _status("VmRSS")


def small_png(test_images) -> bytes:
    ok, buf = cv2.imencode(".png", np.round(test_images[0][0][0] * 255).astype(np.uint8))
    assert ok
    return buf.tobytes()


# -- the header decides, before any decoder ---------------------------------------------------------------
def test_the_decode_cost_comes_from_the_png_header():
    from edgefleet.agent.transports.image import image_header

    h = image_header(png_bytes(6300, 6300, 16, 2))
    assert (h.format, h.width, h.height, h.channels, h.bits) == ("png", 6300, 6300, 3, 16)
    assert h.decoded_bytes == 6300 * 6300 * 3 * 2 == 238_140_000
    gray = image_header(png_bytes(100, 50, 8, 0))
    assert (gray.channels, gray.bits, gray.decoded_bytes) == (1, 8, 100 * 50)
    assert image_header(png_bytes(10, 10, 8, 6)).channels == 4
    # whatever the source, the decode holds at least the 8-bit BGR result and OpenCV's buffer for it
    assert gray.decode_cost_bytes >= 2 * 100 * 50 * 3


def test_the_decode_cost_comes_from_the_jpeg_frame_header():
    from edgefleet.agent.transports.image import image_header

    img = np.zeros((30, 40, 3), np.uint8)
    baseline = cv2.imencode(".jpg", img)[1].tobytes()
    progressive = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    h = image_header(baseline)
    assert (h.format, h.width, h.height, h.channels, h.bits) == ("jpeg", 40, 30, 3, 8)
    assert h.decoded_bytes == 40 * 30 * 3
    # a progressive JPEG keeps every coefficient (2 bytes each) until the last scan
    assert image_header(progressive).decode_cost_bytes >= h.decode_cost_bytes + 40 * 30 * 3 * 2


@pytest.mark.parametrize(("data", "status", "message"), [
    (b"GIF89a\x01\x00\x01\x00", 415, "not a JPEG or PNG image"),
    (b"BM" + bytes(60), 415, "not a JPEG or PNG image"),
    (b"", 415, "not a JPEG or PNG image"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR\x00\x00", 400, "corrupt PNG"),
    (png_bytes(4, 4)[:16] + struct.pack(">IIBBBBB", 4, 4, 16, 3, 0, 0, 0), 400, "corrupt PNG"),  # 16-bit palette
    (png_bytes(4, 4)[:16] + struct.pack(">IIBBBBB", 0, 4, 8, 2, 0, 0, 0), 400, "0x4"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00garbage", 400, "corrupt JPEG"),
])
def test_other_formats_and_unreadable_headers_are_refused(data, status, message):
    from edgefleet.agent.transports.image import image_header

    with pytest.raises(RequestError, match=message) as err:
        image_header(data)
    assert err.value.status_code == status


def test_an_image_over_the_budget_is_refused_before_opencv_sees_it(monkeypatch):
    from edgefleet.agent.transports import image

    def no_decoder(*a, **k):
        raise AssertionError("the decoder ran")

    monkeypatch.setattr(cv2, "imdecode", no_decoder)
    with pytest.raises(RequestError) as err:
        image.check_budget(image.image_header(png_bytes(6300, 6300, 16, 2)), 16 * MiB)
    assert err.value.status_code == 413
    assert "6300x6300" in str(err.value) and "238,140,000 bytes" in str(err.value)
    assert f"{16 * MiB:,} bytes" in str(err.value) and "max_image_decoded_bytes" in str(err.value)


# -- the config --------------------------------------------------------------------------------------------
def test_the_budget_is_in_the_agent_config(tmp_path):
    from edgefleet.agent.config import load_config
    from edgefleet.protocol.errors import ConfigError

    p = tmp_path / "agent.yaml"
    p.write_text(f"device_id: d\nfleet_url: http://x\ndata_dir: {tmp_path}\nmax_image_decoded_bytes: 1000000\n"
                 "max_concurrent_image_decodes: 3\n")
    cfg = load_config(p, {})
    assert (cfg.max_image_decoded_bytes, cfg.max_concurrent_image_decodes) == (1_000_000, 3)
    p.write_text(f"device_id: d\nfleet_url: http://x\ndata_dir: {tmp_path}\nmax_image_decoded: 1000000\n")
    with pytest.raises(ConfigError, match="did you mean 'max_image_decoded_bytes'"):
        load_config(p, {})


# -- a real agent: the 6300x6300 16-bit PNG of the finding, several at once -------------------------------
@pytest.mark.trust("four 6300x6300 16-bit PNG bombs at once at the image endpoint")
def test_decompression_bombs_at_once_stay_under_the_stated_ceiling(tmp_path, image_bundle, test_images):
    budget, at_once = 16 * MiB, 2
    ceiling = at_once * budget  # the stated ceiling: decodes at once x decoded bytes each
    bomb = png_bytes(6300, 6300, 16, 2)
    assert len(bomb) < 300_000  # a small upload
    data = tmp_path / "agent"
    preinstall(data, image_bundle)
    with running_agent(data, max_image_decoded_bytes=budget, max_concurrent_image_decodes=at_once) as (_a, url):
        infer = f"{url}/v2/models/digits/infer/image"
        assert httpx.post(infer, content=small_png(test_images), timeout=30).status_code == 200  # warm
        base = reset_peak_rss()
        responses = post_at_once(infer, [bomb] * 4)
        growth = _status("VmHWM") - base
        for r in responses:
            assert r.status_code == 413, r.text
            msg = r.json()["error"]
            assert "6300x6300" in msg and "238,140,000 bytes" in msg and f"{budget:,} bytes" in msg, msg
        assert growth < ceiling + SLACK, f"peak RSS grew {growth / MiB:.0f} MiB; ceiling {ceiling / MiB:.0f} MiB"
        r = httpx.post(infer, content=small_png(test_images), timeout=30)  # a legit image still works
        assert r.status_code == 200, r.text


def test_images_within_the_budget_decode_a_few_at_a_time(tmp_path, image_bundle, test_images):
    """Large legit images: each within the budget, four sent at once, one decodes at a time; the rest wait
    (or get 503 with Retry-After), and the peak stays under 1 x the budget."""
    from edgefleet.agent.transports.image import image_header

    img = png_bytes(2800, 2800, 8, 2)
    budget, at_once = image_header(img).decode_cost_bytes, 1
    data = tmp_path / "agent"
    preinstall(data, image_bundle)
    with running_agent(data, max_image_decoded_bytes=budget, max_concurrent_image_decodes=at_once) as (_a, url):
        infer = f"{url}/v2/models/digits/infer/image"
        assert httpx.post(infer, content=img, timeout=60).status_code == 200  # warm: the same path once
        base = reset_peak_rss()
        responses = post_at_once(infer, [img] * 4)
        growth = _status("VmHWM") - base
        for r in responses:
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.headers["Retry-After"] and "decod" in r.json()["error"]
        assert any(r.status_code == 200 for r in responses)
        assert growth < at_once * budget + SLACK, f"peak RSS grew {growth / MiB:.0f} MiB"
        assert httpx.post(infer, content=small_png(test_images), timeout=30).status_code == 200
