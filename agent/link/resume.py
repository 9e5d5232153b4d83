"""Resumable, paced bundle downloads: a cut download goes on from the last byte kept, with an HTTP range request.

The partial file lives in the agent's data dir (``<data>/tuf/partial/<sha256>.part``) next to a small record of what
it must become, taken from the signed targets metadata: its sha256 and length, the bytes kept, the seconds spent on
it. The data is fsynced before the record that counts it is written (atomically), so after a crash or a restart the
file is cut back to what the record says and no torn tail is ever trusted. The file is only a cache of bytes: the
TUF client checks the whole file against its signed length and hashes before anything uses it (python-tuf's
``verify_length_and_hashes``), and a file that fails that is deleted.

Each request is one answer under agent/link/fetch.py's bounds (its bytes bound is what is still missing). The
slow-retrieval guard spans the resumes: the average speed counts every attempt's bytes and seconds, so a link that
drips a little per connection is still refused once ``grace_s`` have been spent on it, and a refused partial is
dropped (the next attempt starts over, under a fresh guard). A server that ignores the range (200 to a range
request) costs a restart from byte 0; a 206 whose Content-Range is not the range asked for, or a 416, drops the
partial.

Pacing: a token bucket (``Pacer``) in the read loop holds the download to a byte rate; reading slower lets TCP's
window close, so the box's telemetry and its clients keep their share of a capped link.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tuf.api import exceptions as tuf_exc

from ...protocol.fsutil import atomic_write
from .fetch import FleetHttp

__all__ = ["MIN_PACE_BYTES_PER_S", "DownloadProgress", "Pacer", "Partial", "PartialStore", "download_resumable"]

CHECKPOINT_BYTES = 1024 * 1024  # fsync the data and record the count at least this often
MIN_PACE_BYTES_PER_S = 4096  # the lowest rate cap a config or a rollout may set (0: none)
log = logging.getLogger("edgefleet.agent.updater")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RECORD_MAX_BYTES = 4096


@dataclass(frozen=True)
class DownloadProgress:
    """What telemetry reports of the bundle being downloaded."""

    target: str
    bytes_done: int
    bytes_total: int
    bytes_per_s: float  # the current attempt's average (0 before its first bytes)
    eta_s: float | None  # at that rate; None while unknown
    resumes: int  # attempts after the first


@dataclass(frozen=True)
class Partial:
    """The record kept next to a partial file."""

    sha256: str
    length: int
    have: int = 0  # bytes kept, fsynced
    spent_s: float = 0.0  # seconds of attempts that added to it (the slow-retrieval guard's time)
    received: int = 0  # bytes received over the network for it, restarts included
    attempts: int = 0
    restarts: int = 0  # times it went back to byte 0 (a server that ignored the range)
    by_content: bool = True  # still to be assembled from files held here where it can (agent/link/by_content.py)
    copied: int = 0  # bytes of it copied from files held here


class PartialStore:
    """The partial files of ``directory``: at most one, that of the bundle being downloaded."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def data(self, sha256: str) -> Path:
        return self.dir / f"{sha256}.part"

    def _record(self, sha256: str) -> Path:
        return self.dir / f"{sha256}.json"

    def load(self, sha256: str, length: int) -> Partial:
        """The partial of this bundle (its data cut back to the bytes its record counts); any other partial, or one
        whose record does not match (another length, an unreadable record), is dropped."""
        if not _SHA256.fullmatch(sha256):
            raise tuf_exc.DownloadError(f"signed sha256 {sha256[:80]!r} is not 64 hex digits")
        for f in self.dir.iterdir():
            if not f.name.startswith(sha256 + "."):
                f.unlink(missing_ok=True)
        p = Partial(sha256, length)
        try:
            raw = self._record(sha256).read_bytes()[:_RECORD_MAX_BYTES]
            doc = json.loads(raw)
            kept = Partial(**doc)
            if kept.sha256 == sha256 and kept.length == length and 0 <= kept.have <= length:
                p = kept
        except (OSError, ValueError, TypeError):
            pass
        data = self.data(sha256)
        size = data.stat().st_size if data.exists() else 0
        p = replace(p, have=min(p.have, size))
        with data.open("ab") as part:
            part.truncate(p.have)
        self.save(p)
        return p

    def have(self, sha256: str) -> int:
        """The bytes the partial of this bundle counts (0: none), read without changing anything."""
        try:
            return int(json.loads(self._record(sha256).read_bytes()[:_RECORD_MAX_BYTES])["have"])
        except (OSError, ValueError, TypeError, KeyError):
            return 0

    def save(self, p: Partial) -> None:
        atomic_write(self._record(p.sha256), json.dumps(asdict(p)).encode())

    def drop(self, sha256: str) -> None:
        self.data(sha256).unlink(missing_ok=True)
        self._record(sha256).unlink(missing_ok=True)


class Pacer:
    """A token bucket: ``take(n)`` sleeps until ``n`` bytes fit under ``bytes_per_s`` (0: never sleeps). The bucket
    holds at most a second of bytes, so a pause is not followed by a burst."""

    def __init__(self, bytes_per_s: int, stop: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] | None = None):
        self.rate = bytes_per_s
        self.stop = stop or threading.Event()
        self.clock, self.sleep = clock, sleep or self.stop.wait  # a stop ends a wait at once
        self._tokens = float(bytes_per_s)
        self._at = clock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = self.clock()
        self._tokens = min(float(self.rate), self._tokens + (now - self._at) * self.rate) - n
        self._at = now
        if self._tokens < 0:
            self.sleep(-self._tokens / self.rate)


def _expected_range(have: int, length: int) -> str:
    return f"bytes {have}-{length - 1}/{length}"


def _by_content(http: FleetHttp, url: str, store: PartialStore, p: Partial, held: dict[str, Path],
                pacer: Pacer | None, target: str, progress: Callable[[DownloadProgress], None] | None) -> Partial:
    """The partial carried as far as agent/link/by_content.py gets it (the whole bundle, or up to a cut: then the
    DownloadError goes on up with the bytes kept; or up to where it cannot go on: then plain downloads from there)."""
    from .by_content import NotAssembled, assemble

    with store.data(p.sha256).open("r+b") as f:
        f.seek(p.have)
        fetched, started = 0, time.monotonic()

        def take(n: int) -> None:  # each piece from the fleet: paced, and reported
            nonlocal fetched
            fetched += n
            if progress is not None:
                done, elapsed = min(f.tell() + n, p.length), time.monotonic() - started
                rate = fetched / elapsed if elapsed > 0 else 0.0
                progress(DownloadProgress(target, done, p.length, round(rate, 1),
                                          (p.length - done) / rate if rate > 0 else None, p.attempts - 1))
            if pacer is not None:
                pacer.take(n)

        try:
            got = assemble(http, url, p.length, f, p.have, held, take, (p.received, p.spent_s))
            p = replace(p, copied=p.copied + got.copied)
        except NotAssembled as exc:
            log.info("bundle %s… not assembled by content (%s): downloading it", p.sha256[:12], exc)
            p = replace(p, by_content=False)
        except tuf_exc.SlowRetrievalError:
            f.close()
            store.drop(p.sha256)
            raise
        except tuf_exc.DownloadError:
            f.flush()
            os.fsync(f.fileno())
            store.save(replace(p, have=f.tell(), received=p.received + fetched,
                               spent_s=p.spent_s + time.monotonic() - started))
            raise
        f.flush()
        os.fsync(f.fileno())
        p = replace(p, have=f.tell(), received=p.received + fetched, spent_s=p.spent_s + time.monotonic() - started)
    store.save(p)
    return p


def download_resumable(http: FleetHttp, url: str, store: PartialStore, target: str, sha256: str, length: int,
                       pacer: Pacer | None = None, progress: Callable[[DownloadProgress], None] | None = None,
                       held: dict[str, Path] | None = None) -> Path:
    """One attempt at the bundle ``url``: the bytes still missing from its partial file are asked for and appended
    (``held``: files held here by sha256, which the archive is first assembled from where it can).
    Returns the whole file (``length`` bytes, still to be verified by the caller); raises python-tuf's
    DownloadError (a cut, a refused range) or SlowRetrievalError (then the partial is dropped)."""
    p = store.load(sha256, length)
    if p.have == length:
        return store.data(sha256)
    p = replace(p, attempts=p.attempts + 1)
    if held and p.by_content:
        p = _by_content(http, url, store, p, held, pacer, target, progress)
        if p.have == length:
            return store.data(sha256)
    resumes = p.attempts - 1
    headers = {"Range": f"bytes={p.have}-"} if p.have else {}
    lim = http.limits
    started = time.monotonic()
    answer = http.open(url, length - p.have, headers=headers)
    if answer.status == 206 and answer.resp.getheader("Content-Range", "") != _expected_range(p.have, length):
        got = answer.resp.getheader("Content-Range", "")[:80]
        answer.close()
        store.drop(sha256)
        raise tuf_exc.DownloadError(f"GET {url}: asked for bytes {p.have}- of {length}, answered {got!r}; "
                                    "the partial download is dropped")
    if answer.status == 416:
        answer.close()
        store.drop(sha256)
        raise tuf_exc.DownloadError(f"GET {url}: the fleet refused bytes {p.have}- of {length} (416); the partial "
                                    "download is dropped")
    if answer.status == 200 and p.have:  # the range was ignored: the whole file again, from byte 0
        p = replace(p, have=0, spent_s=0.0, restarts=p.restarts + 1)
        answer = replace(answer, max_bytes=length)
    elif answer.status not in (200, 206):
        answer.close()
        raise tuf_exc.DownloadHTTPError(f"GET {url}: HTTP {answer.status}", answer.status)
    prior_bytes, prior_s = p.have, p.spent_s
    unsynced = 0
    with store.data(sha256).open("r+b") as f:
        f.truncate(p.have)
        f.seek(p.have)

        def checkpoint() -> None:
            nonlocal p, unsynced
            f.flush()
            os.fsync(f.fileno())
            store.save(p)
            unsynced = 0

        try:
            for chunk in http.read(answer, prior_bytes=prior_bytes, prior_s=prior_s):
                f.write(chunk)
                unsynced += len(chunk)
                elapsed = time.monotonic() - started
                p = replace(p, have=p.have + len(chunk), received=p.received + len(chunk),
                            spent_s=prior_s + elapsed)
                if unsynced >= CHECKPOINT_BYTES:
                    checkpoint()
                if progress is not None:
                    rate = (p.have - prior_bytes) / elapsed if elapsed > 0 else 0.0
                    eta = (length - p.have) / rate if rate > 0 else None
                    progress(DownloadProgress(target, p.have, length, round(rate, 1), eta, resumes))
                if pacer is not None:
                    pacer.take(len(chunk))
        except tuf_exc.SlowRetrievalError:
            f.close()
            store.drop(sha256)
            raise
        except tuf_exc.DownloadError:
            checkpoint()
            raise
        p = replace(p, spent_s=prior_s + time.monotonic() - started)
        checkpoint()
    if p.have < length:
        raise tuf_exc.DownloadError(f"GET {url}: cut after {p.have} of {length} bytes (resumes from byte {p.have}, "
                                    f"{lim.deadline_s:.0f}s allowance per answer)")
    return store.data(sha256)
