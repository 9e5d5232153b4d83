"""compiler/cache.py's BuildCache under concurrent writers: two compiles on one box (a CI runner's matrix, `make
test-haswell`'s two precisions) may store the same key at once. Each entry must be the whole bundle, and no
half-written folder may stay behind."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from pathlib import Path

from edgefleet.compiler.cache import BuildCache


def _put_at(cache_root: str, src: str, at: float) -> None:
    while time.time() < at:
        pass
    BuildCache(Path(cache_root)).put("k" * 32, Path(src))


def test_writers_storing_one_key_at_once_leave_one_whole_entry(tmp_path):
    src = tmp_path / "bundle.tar"
    src.write_bytes(os.urandom(8 << 20))  # big enough that copies overlap
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    ctx = multiprocessing.get_context("fork")
    for round_ in range(8):
        root = tmp_path / f"cache{round_}"
        at = time.time() + 0.3
        procs = [ctx.Process(target=_put_at, args=(str(root), str(src), at)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        entry = root / ("k" * 32) / "bundle.tar"
        assert entry.is_file(), sorted(p.name for p in root.iterdir())
        assert hashlib.sha256(entry.read_bytes()).hexdigest() == want
        assert sorted(p.name for p in root.iterdir()) == ["k" * 32]  # no temporary folder left


def test_a_stale_temporary_folder_is_pruned(tmp_path):
    cache = BuildCache(tmp_path / "cache")
    src = tmp_path / "bundle.tar"
    src.write_bytes(b"x" * 1024)
    stale = cache.root / ".deadbeef.1.0.tmp"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))  # a crashed writer's, long ago
    fresh = cache.root / ".cafe.2.0.tmp"
    fresh.mkdir()  # a writer's at work now
    cache.put("a" * 32, src)
    assert not stale.exists() and fresh.exists()
