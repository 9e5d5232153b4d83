"""Telemetry spool: every record is written to disk first and deleted only once the broker acked it.

    <dir>/<seq:012d>.json   one record per file, written atomically
    <dir>/next_seq          the next sequence number (survives restarts)
    <dir>/stream            a random id made with the spool; the fleet dedupes by (stream, seq)
    <dir>/rejected/         records the fleet said it cannot read (kept, not resent)
    <dir>/dropped           how many records overflow dropped, in total (survives restarts)

Bounded: beyond ``max_records`` the oldest records are dropped and counted; the count travels in
every later telemetry record (``Telemetry.dropped``), so the fleet learns what it will never get.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from ...protocol.fsutil import atomic_write

__all__ = ["Spool"]

log = logging.getLogger("edgefleet.agent.spool")


class Spool:
    def __init__(self, directory: Path, max_records: int = 100_000):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_records = max_records
        self._lock = threading.Lock()
        for tmp in self.dir.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        dropped_text = (self.dir / "dropped").read_text().strip() if (self.dir / "dropped").exists() else ""
        self.dropped = int(dropped_text) if dropped_text.isdigit() else 0
        stream_file = self.dir / "stream"
        stream = stream_file.read_text().strip() if stream_file.exists() else ""
        if len(stream) != 16 or not all(c in "0123456789abcdef" for c in stream):
            stream = secrets.token_hex(8)
            atomic_write(stream_file, stream.encode())
        self.stream = stream
        # the directory is listed once, at start; afterwards an in-memory index of the seqs on disk
        self._seqs: collections.deque[int] = collections.deque(
            sorted(int(p.stem) for p in self.dir.glob("*.json") if p.stem.isdigit()))
        seq_file = self.dir / "next_seq"
        text = seq_file.read_text().strip() if seq_file.exists() else ""
        stored = int(text) if text.isdigit() else 0
        self._next = max([stored] + [s + 1 for s in self._seqs])

    def _path(self, seq: int) -> Path:
        return self.dir / f"{seq:012d}.json"

    def append(self, make: Callable[[int], bytes]) -> int:
        """Write the record ``make(seq)`` under a fresh sequence number (of stream ``self.stream``)."""
        with self._lock:
            seq = self._next
            dropped = 0
            while len(self._seqs) >= self.max_records:  # make room first: the new record counts the drop
                old = self._seqs.popleft()
                self._path(old).unlink(missing_ok=True)
                dropped += 1
                log.warning("telemetry spool full (%d records): dropped record %d", self.max_records, old)
            if dropped:
                self.dropped += dropped
                atomic_write(self.dir / "dropped", str(self.dropped).encode())
            self._next += 1
            atomic_write(self.dir / "next_seq", str(self._next).encode())
            atomic_write(self._path(seq), make(seq))
            self._seqs.append(seq)
            return seq

    def pending(self, limit: int | None = None) -> list[Path]:
        """Paths of unacked records, oldest first (at most ``limit``)."""
        with self._lock:
            seqs = list(itertools.islice(self._seqs, limit))
        return [self._path(s) for s in seqs]

    @property
    def rejected_dir(self) -> Path:
        return self.dir / "rejected"

    def set_aside(self, seq: int) -> bool:
        """Move record ``seq`` out of the queue into ``rejected/``; False if it was not queued."""
        with self._lock:
            try:
                self._seqs.remove(seq)
            except ValueError:
                return False
            self.rejected_dir.mkdir(exist_ok=True)
            src = self._path(seq)
            if src.exists():
                src.replace(self.rejected_dir / src.name)
            return True

    def ack_seq(self, seq: int) -> None:
        """The fleet stored record ``seq``: forget it."""
        with self._lock:
            try:
                self._seqs.remove(seq)  # acks arrive nearly in order: the seq is near the front
            except ValueError:
                return
            self._path(seq).unlink(missing_ok=True)
