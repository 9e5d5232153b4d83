"""A content-addressed cache of built bundles, so an unchanged re-run takes seconds.

The key covers everything the bundle depends on: the model, profile and data files (by hash), the
options, the toolchain versions and the build host's CPU features (the gate and the benchmark ran
on it). Only bundles that passed are cached. Entries are written atomically, each writer in a folder of its own
(concurrent compiles may store one key at once); the oldest beyond ``MAX_ENTRIES`` are pruned, and temporary folders
older than an hour (a writer that died).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from ..protocol.bundle import read_manifest, sha256_file
from ..protocol.manifest import Manifest

__all__ = ["BuildCache", "default_cache_dir"]

MAX_ENTRIES = 200
STALE_TMP_S = 3600.0  # a temporary folder this old is a dead writer's


def default_cache_dir() -> Path:
    base = os.environ.get("EDGEFLEET_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "edgefleet") / "builds"


class BuildCache:
    def __init__(self, root: Path):
        self.root = root

    @staticmethod
    def key(files: list[Path | None], params: dict[str, Any]) -> str:
        h = hashlib.sha256()
        for f in files:
            h.update(b"-" if f is None else sha256_file(f).encode())
        h.update(json.dumps(params, sort_keys=True, default=str).encode())
        return h.hexdigest()[:32]

    def get(self, key: str, out_path: Path) -> Manifest | None:
        entry = self.root / key / "bundle.tar"
        if not entry.is_file():
            return None
        try:
            manifest = read_manifest(entry)
        except Exception:  # a damaged entry is a miss, never an error
            shutil.rmtree(entry.parent, ignore_errors=True)
            return None
        tmp = out_path.with_name(out_path.name + ".tmp")
        shutil.copyfile(entry, tmp)
        tmp.replace(out_path)
        os.utime(entry.parent)  # most recently used
        return manifest

    def put(self, key: str, bundle: Path) -> None:
        """Store ``bundle`` under ``key``: written in a folder of this writer's own, then renamed into place (atomic;
        two compiles storing one key at once each write their own, and the first rename wins)."""
        tmp = self.root / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            shutil.copyfile(bundle, tmp / "bundle.tar")
            final = self.root / key
            if not final.exists():
                tmp.rename(final)  # OSError if another writer's rename came first: its entry is as good
            self._prune()
        except OSError:  # a cache that cannot be written only costs time
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _prune(self) -> None:
        entries = sorted((d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")),
                         key=lambda d: d.stat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            shutil.rmtree(old, ignore_errors=True)
        stale = time.time() - STALE_TMP_S  # a writer that died mid-copy left its folder
        for d in self.root.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if d.stat().st_mtime < stale:
                    shutil.rmtree(d, ignore_errors=True)
