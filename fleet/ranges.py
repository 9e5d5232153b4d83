"""HTTP range requests on the TUF targets the fleet serves (``/tuf/targets/...``): an agent whose download was cut
asks for the rest (``Range: bytes=N-``) and verifies the whole file against its signed length and hashes once it has
it; the fleet only answers the bytes asked for.

One range only (``bytes=A-B``, ``bytes=A-``, ``bytes=-N``); a header longer than ``MAX_RANGE_HEADER`` characters,
several ranges, another unit or a range that starts past the end is answered 416 with ``Content-Range: bytes
*/SIZE`` and a message that names the problem (RFC 9110 lets a server ignore such a header; refusing it tells a
broken client so, and a 200 would cost it the whole file)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_RANGE_HEADER", "ByteRange", "RangeNotSatisfiable", "parse_range", "slice_chunks", "slice_file"]

MAX_RANGE_HEADER = 100  # "bytes=" and two 20-digit numbers fit many times over
_ONE = re.compile(r"bytes=(\d{0,19})-(\d{0,19})")
_READ_BYTES = 256 * 1024


class RangeNotSatisfiable(ValueError):
    """A Range header the fleet does not answer (416)."""


@dataclass(frozen=True)
class ByteRange:
    start: int
    end: int  # inclusive, as in Content-Range
    size: int  # the whole file

    @property
    def length(self) -> int:
        return self.end - self.start + 1

    def content_range(self) -> str:
        return f"bytes {self.start}-{self.end}/{self.size}"


def parse_range(header: str, size: int) -> ByteRange:
    """The one byte range ``header`` asks of a file of ``size`` bytes; RangeNotSatisfiable naming the problem."""
    if len(header) > MAX_RANGE_HEADER:
        raise RangeNotSatisfiable(f"Range header of {len(header)} characters (at most {MAX_RANGE_HEADER})")
    m = _ONE.fullmatch(header.strip())
    if m is None:
        raise RangeNotSatisfiable(f"Range {header[:40]!r}: one range of bytes only (bytes=START-END, bytes=START- "
                                  "or bytes=-SUFFIX)")
    first, last = m.group(1), m.group(2)
    if not first and not last:
        raise RangeNotSatisfiable("Range 'bytes=-': no start and no suffix length")
    if not first:  # the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"Range {header!r}: an empty suffix of a {size}-byte file")
        return ByteRange(max(0, size - n), size - 1, size)
    start = int(first)
    end = size - 1 if not last else min(int(last), size - 1)
    if start >= size or (last and int(last) < start):
        raise RangeNotSatisfiable(f"Range {header!r}: not within the file's {size} bytes")
    return ByteRange(start, end, size)


def slice_file(path: Path, r: ByteRange) -> Iterator[bytes]:
    """The range's bytes of a file on disk, a bounded read at a time."""
    with path.open("rb") as f:
        f.seek(r.start)
        left = r.length
        while left > 0:
            data = f.read(min(_READ_BYTES, left))
            if not data:
                raise OSError(f"{path}: shorter than the {r.size} bytes it was served as")
            left -= len(data)
            yield data


def slice_chunks(chunks: Iterable[bytes], r: ByteRange) -> Iterator[bytes]:
    """The range's bytes of a target streamed as chunks (the database store); chunks before it are skipped."""
    pos = 0
    for chunk in chunks:
        lo, hi = max(r.start - pos, 0), min(r.end + 1 - pos, len(chunk))
        pos += len(chunk)
        if lo < hi:
            yield chunk[lo:hi]
        if pos > r.end:
            return
