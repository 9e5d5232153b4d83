"""The fleet's TUF repository: bundles are TUF targets, signed with python-tuf.

On disk (served read-only under ``/tuf/``)::

    metadata/1.root.json  N.root.json  timestamp.json  N.snapshot.json  N.targets.json
    targets/<dir>/<sha256>.<file>       (consistent snapshots: content-addressed)

Every change bumps targets, snapshot and timestamp together under a file lock, so several fleet
processes sharing the folder cannot interleave. Roles close to expiry are re-signed by
:meth:`Repository.refresh_expiring`, which the server calls periodically.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleet.errors import RepositoryError
from fleet.keys import KeyStore
from protocol.fsutil import atomic_write

__all__ = ["EXPIRY", "Repository"]

EXPIRY = {"targets": dt.timedelta(days=30), "snapshot": dt.timedelta(days=7), "timestamp": dt.timedelta(days=1)}
TARGET_PATH_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


class Repository:
    def __init__(self, directory: Path, keys: KeyStore):
        self.dir = directory
        self.keys = keys
        self.metadata_dir = directory / "metadata"
        self.targets_dir = directory / "targets"

    # -- set-up -----------------------------------------------------------------------------
    def init(self) -> None:
        """Create the repository from the key store's root.json, if it does not exist yet."""
        from tuf.api.metadata import Metadata, Snapshot, Targets, Timestamp

        self.metadata_dir.mkdir(parents=True, exist_ok=True)
        self.targets_dir.mkdir(parents=True, exist_ok=True)
        with self._lock():
            if (self.metadata_dir / "timestamp.json").exists():
                self._check_root_matches()
                return
            root_bytes = self.keys.root_json.read_bytes()
            root = Metadata.from_bytes(root_bytes)
            atomic_write(self.metadata_dir / f"{root.signed.version}.root.json", root_bytes)
            targets = Metadata(Targets(expires=_now() + EXPIRY["targets"]))
            snapshot = Metadata(Snapshot(expires=_now() + EXPIRY["snapshot"]))
            timestamp = Metadata(Timestamp(expires=_now() + EXPIRY["timestamp"]))
            self._publish(targets, snapshot, timestamp)

    def _check_root_matches(self) -> None:
        from tuf.api.metadata import Metadata

        ours = Metadata.from_bytes(self.keys.root_json.read_bytes())
        path = self.metadata_dir / f"{ours.signed.version}.root.json"
        if not path.exists() or Metadata.from_bytes(path.read_bytes()).signed != ours.signed:
            raise RepositoryError(f"{self.dir}: the repository was created with other keys than {self.keys.directory}; "
                                  "use the matching key store or a fresh --data-dir")

    @contextmanager
    def _lock(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- reading ------------------------------------------------------------------------------
    def _load(self) -> tuple[Any, Any, Any]:  # (targets, snapshot, timestamp) Metadata
        from tuf.api.metadata import Metadata, Snapshot, Targets, Timestamp

        try:
            ts = Metadata[Timestamp].from_file(str(self.metadata_dir / "timestamp.json"))
            snap_v = ts.signed.snapshot_meta.version
            snap = Metadata[Snapshot].from_file(str(self.metadata_dir / f"{snap_v}.snapshot.json"))
            tgt_v = snap.signed.meta["targets.json"].version
            tgt = Metadata[Targets].from_file(str(self.metadata_dir / f"{tgt_v}.targets.json"))
        except (OSError, KeyError, ValueError) as exc:
            raise RepositoryError(f"{self.metadata_dir}: repository metadata unreadable ({exc})") from exc
        return tgt, snap, ts

    def targets(self) -> dict[str, Any]:
        tgt, _, _ = self._load()
        return dict(tgt.signed.targets)

    def root_bytes(self) -> bytes:
        versions = sorted(int(p.name.split(".")[0]) for p in self.metadata_dir.glob("*.root.json"))
        return (self.metadata_dir / f"{versions[-1]}.root.json").read_bytes()

    # -- writing ------------------------------------------------------------------------------
    def _publish(self, targets: Any, snapshot: Any, timestamp: Any) -> None:
        """Bump and sign targets, snapshot, timestamp (in that order) and write them atomically."""
        from tuf.api.metadata import MetaFile
        from tuf.api.serialization.json import JSONSerializer

        ser = JSONSerializer(compact=True)
        targets.signed.expires = _now() + EXPIRY["targets"]
        targets.signatures.clear()
        targets.sign(self.keys.signer("targets"))
        tbytes = targets.to_bytes(ser)
        atomic_write(self.metadata_dir / f"{targets.signed.version}.targets.json", tbytes)

        snapshot.signed.meta["targets.json"] = MetaFile(version=targets.signed.version)
        snapshot.signed.expires = _now() + EXPIRY["snapshot"]
        snapshot.signatures.clear()
        snapshot.sign(self.keys.signer("snapshot"))
        atomic_write(self.metadata_dir / f"{snapshot.signed.version}.snapshot.json", snapshot.to_bytes(ser))

        timestamp.signed.snapshot_meta = MetaFile(version=snapshot.signed.version)
        timestamp.signed.expires = _now() + EXPIRY["timestamp"]
        timestamp.signatures.clear()
        timestamp.sign(self.keys.signer("timestamp"))
        atomic_write(self.metadata_dir / "timestamp.json", timestamp.to_bytes(ser))

    def add_target(self, target_path: str, local_file: Path, custom: dict[str, Any]) -> dict[str, Any]:
        """Publish ``local_file`` as the TUF target ``target_path``; returns {sha256, length, url_path}."""
        from tuf.api.metadata import TargetFile

        if not TARGET_PATH_RE.match(target_path) or ".." in target_path:
            raise RepositoryError(f"target path {target_path!r} is not a plain relative path")
        h = hashlib.sha256()
        with local_file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()
        length = local_file.stat().st_size
        dirname, _, basename = target_path.rpartition("/")
        dest_dir = self.targets_dir / dirname if dirname else self.targets_dir
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / f"{digest}.{basename}"
        with self._lock():
            tgt, snap, ts = self._load()
            existing = tgt.signed.targets.get(target_path)
            if existing is not None:
                if existing.hashes.get("sha256") == digest:
                    return {"sha256": digest, "length": length, "created": False}
                raise RepositoryError(f"target {target_path!r} already exists with different content; "
                                      "publish a new version instead of replacing one")
            if not dest.exists():
                tmp = dest.with_name(dest.name + ".tmp")
                shutil.copyfile(local_file, tmp)
                os.replace(tmp, dest)
            tf = TargetFile(length=length, hashes={"sha256": digest}, path=target_path, unrecognized_fields={
                "custom": custom})
            tgt.signed.targets[target_path] = tf
            tgt.signed.version += 1
            snap.signed.version += 1
            ts.signed.version += 1
            self._publish(tgt, snap, ts)
        return {"sha256": digest, "length": length, "created": True}

    def refresh_expiring(self, margin: float = 0.5) -> bool:
        """Re-sign every role when any has less than ``margin`` of its lifetime left."""
        with self._lock():
            tgt, snap, ts = self._load()
            now = _now()
            stale = any(md.signed.expires - now < EXPIRY[name] * margin
                        for name, md in (("targets", tgt), ("snapshot", snap), ("timestamp", ts)))
            if not stale:
                return False
            tgt.signed.version += 1
            snap.signed.version += 1
            ts.signed.version += 1
            self._publish(tgt, snap, ts)
            return True

    def resolve_file(self, kind: str, rel: str) -> Path | None:
        """The on-disk file for a public URL path under /tuf/, or None (no traversal possible)."""
        base = self.metadata_dir if kind == "metadata" else self.targets_dir
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            return None
        p = (base / rel).resolve()
        if not p.is_relative_to(base.resolve()) or not p.is_file() or p.name.startswith("."):
            return None
        return p
