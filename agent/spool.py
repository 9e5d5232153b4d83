"""Telemetry spool: every record is written to disk first and deleted only once the broker acked it.

    <dir>/<seq:012d>.json   one record per file, written atomically
    <dir>/next_seq          the next sequence number (survives restarts)
    <dir>/stream            a random id made with the spool; the fleet dedupes by (stream, seq)

Bounded: beyond ``max_records`` the oldest records are dropped and counted.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from protocol.fsutil import atomic_write

__all__ = ["Spool"]

log = logging.getLogger("edgefleet.agent.spool")


class Spool:
    def __init__(self, directory: Path, max_records: int = 100_000):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_records = max_records
        self.dropped = 0
        self._lock = threading.Lock()
        for tmp in self.dir.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        stream_file = self.dir / "stream"
        stream = stream_file.read_text().strip() if stream_file.exists() else ""
        if len(stream) != 16 or not all(c in "0123456789abcdef" for c in stream):
            stream = secrets.token_hex(8)
            atomic_write(stream_file, stream.encode())
        self.stream = stream
        files = self._files()
        seq_file = self.dir / "next_seq"
        stored = int(seq_file.read_text()) if seq_file.exists() and seq_file.read_text().strip().isdigit() else 0
        self._next = max([stored] + [int(p.stem) + 1 for p in files])

    def _files(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("*.json") if p.stem.isdigit())

    def append(self, make: Callable[[int], bytes]) -> int:
        """Write the record ``make(seq)`` under a fresh sequence number (of stream ``self.stream``)."""
        with self._lock:
            seq = self._next
            self._next += 1
            atomic_write(self.dir / "next_seq", str(self._next).encode())
            atomic_write(self.dir / f"{seq:012d}.json", make(seq))
            files = self._files()
            for old in files[: max(0, len(files) - self.max_records)]:
                old.unlink(missing_ok=True)
                self.dropped += 1
                log.warning("telemetry spool full (%d records): dropped %s", self.max_records, old.name)
            return seq

    def pending(self) -> list[Path]:
        with self._lock:
            return self._files()

    def ack(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def ack_seq(self, seq: int) -> None:
        """The fleet stored record ``seq``: forget it."""
        (self.dir / f"{seq:012d}.json").unlink(missing_ok=True)
