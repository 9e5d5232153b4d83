"""Atomic file writes (stdlib only; used by the agent's store and spool and the fleet's TUF repository):
temp file in the same folder, fsync, os.replace, fsync the folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "clear_unfinished", "fsync_dir"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."  # atomic_write's temp file for NAME: '.NAME.XXXXXXXX.tmp' beside it


def clear_unfinished(path: Path) -> None:
    """Remove the temp files of :func:`atomic_write` to ``path`` that a kill between the write and the rename left."""
    for leftover in path.parent.glob(f"{_temp_prefix(path)}*.tmp"):
        leftover.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
