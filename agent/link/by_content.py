"""Fetching a bundle by content (issue 43.3): the files of a new bundle that this box already holds (by sha256, in a
model it has installed) are copied from its disk; only the rest of the archive is asked of the fleet, by byte ranges.

A bundle is a tar archive (protocol/bundle.py's ``write_bundle``: ``manifest.json`` first, then the files it lists,
PAX headers) and its whole sha256 and length are signed in the TUF targets metadata. The assembler walks the archive
as it lies on the fleet: it reads each member's header (and a PAX header's records) by range, reads the manifest by
range, and for each member whose manifest entry names a sha256 held here copies that file (hashing it as it copies:
a file that changed on disk is fetched instead); every other byte is fetched by range. The result is the same
archive byte for byte, written into the partial file of agent/link/resume.py, and python-tuf checks it whole against
the signed length and hashes before anything uses it: a wrong guess here can cost a download, never trust.

What it cannot read (a server that ignores ranges, an archive it does not understand) ends the assembly with
``NotAssembled``, and the caller downloads the bundle as usual; a cut is the DownloadError it always is, and the next
try walks the archive again, reading what the partial file already holds from the disk.
"""

from __future__ import annotations

import hashlib
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tuf.api import exceptions as tuf_exc

from ...protocol.errors import ContractError
from ...protocol.manifest import MANIFEST_FILENAME, MAX_MANIFEST_BYTES, parse_manifest
from .fetch import FleetHttp

__all__ = ["Assembled", "NotAssembled", "assemble", "installed_files"]

BLOCK = 512
WINDOW = 8 * 1024  # one range request reads at least this much of headers and small members
MAX_MEMBERS = 4096  # a bundle lists far fewer files; a bound on the walk
MAX_MODEL_DIRS = 64  # installed models looked at for files held here
_COPY = 1024 * 1024


class NotAssembled(Exception):
    """The archive could not be assembled by content (the caller downloads it as usual)."""


@dataclass(frozen=True)
class Assembled:
    fetched: int  # bytes asked of the fleet
    copied: int  # bytes copied from files held here


def installed_files(models_dir: Path) -> dict[str, Path]:
    """sha256 -> a file with that content in an installed model (its manifest.json says so; the copy checks it)."""
    found: dict[str, Path] = {}
    if not models_dir.is_dir():
        return found
    for n, d in enumerate(sorted(models_dir.iterdir())):
        if n >= MAX_MODEL_DIRS:
            break
        try:
            m = parse_manifest((d / MANIFEST_FILENAME).read_bytes()[: MAX_MANIFEST_BYTES + 1], str(d))
        except (OSError, ContractError):
            continue
        for name, entry in m.files.items():
            found.setdefault(entry.sha256, d / name)
    return found


class _Remote:
    """Byte ranges of the bundle: from the partial file below ``have``, else from the fleet (a window cached)."""

    def __init__(self, http: FleetHttp, url: str, length: int, out: IO[bytes], have: int,
                 take: Callable[[int], None], prior: tuple[int, float]):
        self.http, self.url, self.length, self.out, self.have, self.take = http, url, length, out, have, take
        self.fetched = 0
        self.prior, self.started = prior, time.monotonic()  # the slow-retrieval guard spans the resumes
        self._win_at, self._win = 0, b""

    def _chunks(self, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) from the fleet as they arrive; a short answer is a cut (DownloadError)."""
        answer = self.http.open(self.url, end - start, headers={"Range": f"bytes={start}-{end - 1}"})
        if answer.status != 206 or answer.resp.getheader("Content-Range", "") != f"bytes {start}-{end - 1}/" \
                f"{self.length}":
            answer.close()
            raise NotAssembled(f"GET {self.url}: HTTP {answer.status} to a range request")
        got = 0
        before_s = self.prior[1] + answer.started - self.started
        for chunk in self.http.read(answer, self.prior[0] + self.fetched, before_s):
            got += len(chunk)
            self.fetched += len(chunk)
            self.take(len(chunk))
            yield chunk
        if got != end - start:
            raise tuf_exc.DownloadError(f"GET {self.url}: cut after {got} of bytes {start}-{end - 1}")

    def _ranged(self, start: int, end: int) -> bytes:
        return b"".join(self._chunks(start, end))

    def get(self, start: int, end: int, ahead: int = WINDOW) -> bytes:
        """Bytes [start, end) of the bundle (a header, a manifest: small), read on to ``start + ahead`` when fetched;
        a window that holds the first part is read on from its end, not fetched again."""
        if end > self.length or end - start > MAX_MANIFEST_BYTES + WINDOW:
            raise NotAssembled(f"a member past the end of the {self.length}-byte archive")
        if end <= self.have:
            self.out.seek(start)
            data = self.out.read(end - start)
            self.out.seek(0, 2)
            return data
        win_end = self._win_at + len(self._win)
        if not (self._win_at <= start and end <= win_end):
            upto = min(self.length, max(end, start + ahead))
            kept = self._win[start - self._win_at:] if self._win_at <= start <= win_end else b""
            self._win_at = start
            self._win = kept + self._ranged(start + len(kept), upto)
        return self._win[start - self._win_at:end - self._win_at]

    def emit(self, start: int, end: int) -> None:
        """Append bytes [start, end) of the bundle to the output (skipping what it holds already)."""
        start = max(start, self.have)
        if self._win_at <= start < self._win_at + len(self._win):
            piece = self._win[start - self._win_at:end - self._win_at]
            self.out.write(piece)
            start += len(piece)
            self.have = start
        if start < end:
            for chunk in self._chunks(start, end):  # written as it arrives: a cut keeps what came
                self.out.write(chunk)
                self.have += len(chunk)


def _copy(src: Path, sha256: str, size: int, out: IO[bytes]) -> bool:
    """Append ``src`` to ``out`` if it still has that content; else leave ``out`` as it was and say no."""
    at = out.tell()
    h = hashlib.sha256()
    n = 0
    try:
        with src.open("rb") as f:
            while chunk := f.read(_COPY):
                h.update(chunk)
                n += len(chunk)
                out.write(chunk)
    except OSError:
        pass
    if n == size and h.hexdigest() == sha256:
        return True
    out.seek(at)
    out.truncate(at)
    return False


def assemble(http: FleetHttp, url: str, length: int, out: IO[bytes], have: int, held: dict[str, Path],
             take: Callable[[int], None] = lambda n: None, prior: tuple[int, float] = (0, 0.0)) -> Assembled:
    """Write the bundle at ``url`` (``length`` bytes, ``have`` of them already in ``out``, which is positioned at its
    end) by content: see the module docstring. ``take``: the pacer's, called with each byte count fetched;
    ``prior``: bytes and seconds of the earlier tries, for the slow-retrieval guard (agent/link/fetch.py)."""
    r = _Remote(http, url, length, out, have, take, prior)
    files: dict[str, tuple[str, int]] | None = None  # member name -> (sha256, size), from the manifest
    to_come: list[str] = []  # the members still expected, in the order write_bundle writes them (sorted)
    copied = off = 0
    pax: dict[str, str] = {}
    for _ in range(MAX_MEMBERS):
        if off + BLOCK > length:
            raise NotAssembled("the archive ends inside a header")
        # a header is read on into its member's data (one request for a small member), unless the member expected
        # next is one held here: its data is copied, and bytes read ahead of it would be fetched for nothing
        nxt = (files or {}).get(to_come[0]) if to_come else None
        head = r.get(off, off + BLOCK, BLOCK if nxt is not None and nxt[0] in held else WINDOW)
        if head == b"\0" * BLOCK:  # the end-of-archive blocks and the record's padding: as they are on the fleet
            r.emit(off, length)
            return Assembled(r.fetched, copied)
        try:
            ti = tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
        except tarfile.TarError as exc:
            raise NotAssembled(f"member header at byte {off}: {exc}") from exc
        try:
            size = int(pax.get("size", ti.size))
        except ValueError as exc:
            raise NotAssembled(f"member at byte {off}: a PAX size that is not a number") from exc
        name = pax.get("path", ti.name)
        data_at, padded = off + BLOCK, -(-size // BLOCK) * BLOCK
        r.emit(off, data_at)
        if ti.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):
            if size > WINDOW:
                raise NotAssembled(f"a PAX header of {size} bytes")
            # read on to the member's own header (which follows the records), and no further
            records = r.get(data_at, data_at + size, padded + BLOCK)
            pax = _pax_records(records) if ti.type == tarfile.XHDTYPE else pax
            r.emit(data_at, data_at + padded)
        elif name == MANIFEST_FILENAME and files is None:
            try:  # read with its padding: one request, the next header's read starts where it ends
                m = parse_manifest(r.get(data_at, data_at + padded, 0)[:size], "the new bundle's manifest")
            except ContractError as exc:
                raise NotAssembled(str(exc)) from exc
            files = {n: (e.sha256, e.size_bytes) for n, e in m.files.items()}
            to_come = sorted(files)
            r.emit(data_at, data_at + padded)
            pax = {}
        else:
            if name in to_come:
                to_come.remove(name)
            want = (files or {}).get(name)
            src = held.get(want[0]) if want is not None and want[1] == size else None
            if src is not None and data_at >= r.have and want is not None and _copy(src, want[0], size, out):
                copied += size
                r.have = data_at + size
                out.write(b"\0" * (padded - size))  # tar pads each member with NULs
                r.have = data_at + padded
            else:
                r.emit(data_at, data_at + padded)
            pax = {}
        off = data_at + padded
    raise NotAssembled(f"more than {MAX_MEMBERS} members")


def _pax_records(data: bytes) -> dict[str, str]:
    """A PAX extended header's records ("LEN key=value\\n"), bounded by its size."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos, pos + 20)
        if sp < 0:
            raise NotAssembled("a PAX record without its length")
        try:
            n = int(data[pos:sp])
        except ValueError as exc:
            raise NotAssembled("a PAX record's length is not a number") from exc
        rec = data[sp + 1:pos + n]
        if n <= 0 or pos + n > len(data) or not rec.endswith(b"\n") or b"=" not in rec:
            raise NotAssembled("a malformed PAX record")
        k, _, v = rec[:-1].partition(b"=")
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        pos += n
    return out
