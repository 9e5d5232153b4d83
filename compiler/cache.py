"""A content-addressed cache of built bundles, so an unchanged re-run takes seconds.

The key covers everything the bundle depends on: the model, profile and data files (by hash), the
options, the toolchain versions and the build host's CPU features (the gate and the benchmark ran
on it). Only bundles that passed are cached. Entries are written atomically; the oldest beyond
``MAX_ENTRIES`` are pruned.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from edgefleet.protocol.bundle import read_manifest, sha256_file
from edgefleet.protocol.manifest import Manifest

__all__ = ["BuildCache", "default_cache_dir"]

MAX_ENTRIES = 200


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
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            shutil.copyfile(bundle, tmp / "bundle.tar")
            final = self.root / key
            if final.exists():
                shutil.rmtree(tmp)
            else:
                tmp.rename(final)
            self._prune()
        except OSError:  # a cache that cannot be written only costs time
            pass

    def _prune(self) -> None:
        entries = sorted((d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")),
                         key=lambda d: d.stat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            shutil.rmtree(old, ignore_errors=True)
