"""The fleet's TUF repository: bundles are TUF targets, signed with python-tuf.

Its files (served read-only under ``/tuf/``), in a folder or in the fleet's database (:mod:`fleet.tuf_store`)::

    metadata/1.root.json  N.root.json  timestamp.json  N.snapshot.json  N.targets.json
    targets/<dir>/<sha256>.<file>       (consistent snapshots: content-addressed)

Every change bumps targets, snapshot and timestamp together under the store's lock (a file lock, or
PostgreSQL's advisory lock), so several fleet processes sharing the store cannot interleave. Roles
close to expiry are re-signed by :meth:`Repository.refresh_expiring`, which the server calls periodically.
The Repository decides what is published and holds the lock; reading the published set back and signing and
writing a new one is ``_RoleFiles``'s.

Delegated layout (``edgefleet keys create``): the top-level targets metadata is signed offline and
delegates every path to the ``bundles`` role, whose metadata the compiler's CI signs
(``N.bundles.json``). The fleet then holds only the snapshot and timestamp keys: it publishes what
CI signed (:meth:`Repository.publish_bundles`), offline-signed roots and targets
(:meth:`Repository.publish_root`, :meth:`Repository.publish_targets`), and re-signs freshness.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import RepositoryError
from .keys import BUNDLES_ROLE, KeyStore
from .tuf_store import DirStore, SqlStore

__all__ = ["EXPIRY", "Repository"]

EXPIRY = {"targets": dt.timedelta(days=30), "snapshot": dt.timedelta(days=7), "timestamp": dt.timedelta(days=1)}
TARGET_PATH_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


class _RoleFiles:
    """The role metadata in the store: the published set read back (each file named by the version the one above it
    lists), and a new set signed with the keys this fleet holds and written. No lock taken here: the Repository holds
    the store's around every change."""

    def __init__(self, store: DirStore | SqlStore, keys: KeyStore):
        self.store = store
        self.keys = keys

    def read(self, name: str) -> bytes:
        data = self.store.read(name)
        if data is None:
            raise RepositoryError(f"repository metadata {name} is missing")
        return data

    def load(self) -> tuple[Any, Any, Any, Any]:  # (targets, snapshot, timestamp, bundles or None)
        from tuf.api.metadata import Metadata, Snapshot, Targets, Timestamp

        try:
            ts = Metadata[Timestamp].from_bytes(self.read("timestamp.json"))
            snap_v = ts.signed.snapshot_meta.version
            snap = Metadata[Snapshot].from_bytes(self.read(f"{snap_v}.snapshot.json"))
            tgt_v = snap.signed.meta["targets.json"].version
            tgt = Metadata[Targets].from_bytes(self.read(f"{tgt_v}.targets.json"))
            bundles = None
            meta = snap.signed.meta.get(f"{BUNDLES_ROLE}.json")
            if meta is not None:
                bundles = Metadata[Targets].from_bytes(self.read(f"{meta.version}.{BUNDLES_ROLE}.json"))
        except (OSError, KeyError, ValueError) as exc:
            raise RepositoryError(f"repository metadata unreadable ({exc})") from exc
        return tgt, snap, ts, bundles

    def root_bytes(self) -> bytes:
        versions = sorted(int(n.split(".")[0]) for n in self.store.names(".root.json"))
        return self.read(f"{versions[-1]}.root.json")

    def root(self) -> Any:
        from tuf.api.metadata import Metadata, Root

        return Metadata[Root].from_bytes(self.root_bytes())

    def verify_targets(self, targets: Any) -> None:
        from tuf.api.exceptions import UnsignedMetadataError

        try:
            self.root().signed.verify_delegate("targets", targets.signed_bytes, targets.signatures)
        except UnsignedMetadataError as exc:
            raise RepositoryError(f"targets metadata is not signed by the root's targets key(s): {exc}") from exc

    def publish(self, targets: Any, snapshot: Any, timestamp: Any, bundles: Any = None,
                resign_targets: bool | None = None) -> None:
        """Sign targets (unless it is signed offline), snapshot, timestamp (in that order) and write
        them atomically. ``bundles``: the CI-signed delegated metadata to list in the snapshot."""
        from tuf.api.metadata import MetaFile
        from tuf.api.serialization.json import JSONSerializer

        ser = JSONSerializer(compact=True)
        if resign_targets is None:
            resign_targets = bundles is None and self.keys.has("targets")
        if resign_targets:
            targets.signed.expires = _now() + EXPIRY["targets"]
            targets.signatures.clear()
            targets.sign(self.keys.signer("targets"))
            tbytes = targets.to_bytes(ser)
            self.store.write(f"{targets.signed.version}.targets.json", tbytes)

        snapshot.signed.meta["targets.json"] = MetaFile(version=targets.signed.version)
        snapshot.signed.meta.pop(f"{BUNDLES_ROLE}.json", None)
        if bundles is not None:
            snapshot.signed.meta[f"{BUNDLES_ROLE}.json"] = MetaFile(version=bundles.signed.version)
        snapshot.signed.expires = _now() + EXPIRY["snapshot"]
        snapshot.signatures.clear()
        snapshot.sign(self.keys.signer("snapshot"))
        self.store.write(f"{snapshot.signed.version}.snapshot.json", snapshot.to_bytes(ser))

        timestamp.signed.snapshot_meta = MetaFile(version=snapshot.signed.version)
        timestamp.signed.expires = _now() + EXPIRY["timestamp"]
        timestamp.signatures.clear()
        timestamp.sign(self.keys.signer("timestamp"))
        self.store.write("timestamp.json", timestamp.to_bytes(ser))


class Repository:
    def __init__(self, store: Path | DirStore | SqlStore, keys: KeyStore, upload_dir: Path | None = None):
        """``store``: a folder (or a DirStore), or a SqlStore on the fleet's database. ``upload_dir``: where uploads
        wait while they are checked (default: the store's folder; required with a SqlStore)."""
        self.store: DirStore | SqlStore = DirStore(store) if isinstance(store, Path) else store
        self.keys = keys
        self._roles = _RoleFiles(self.store, keys)
        if upload_dir is None:
            upload_dir = self._dir_store().dir
        self.upload_dir = upload_dir

    @property
    def dir(self) -> Path:
        return self._dir_store().dir

    @property
    def metadata_dir(self) -> Path:
        return self._dir_store().metadata_dir

    @property
    def targets_dir(self) -> Path:
        return self._dir_store().targets_dir

    def _dir_store(self) -> DirStore:
        if not isinstance(self.store, DirStore):
            raise RepositoryError("this repository is kept in the database, not in a folder")
        return self.store

    # -- set-up -----------------------------------------------------------------------------
    def init(self) -> None:
        """Create the repository from the key store's root.json, if it does not exist yet."""
        from tuf.api.metadata import Metadata, Snapshot, Targets, Timestamp

        self.store.init()
        with self.store.lock():
            if self.store.read("timestamp.json") is not None:
                self._check_root_matches()
                return
            roots = self.keys.roots()
            for root_bytes in roots:
                root = Metadata.from_bytes(root_bytes)
                self.store.write(f"{root.signed.version}.root.json", root_bytes)
            snapshot = Metadata(Snapshot(expires=_now() + EXPIRY["snapshot"]))
            timestamp = Metadata(Timestamp(expires=_now() + EXPIRY["timestamp"]))
            offline = self.keys.offline_targets
            if offline is None:
                targets = Metadata(Targets(expires=_now() + EXPIRY["targets"]))
                self._roles.publish(targets, snapshot, timestamp)
                return
            targets = Metadata[Targets].from_bytes(offline.read_bytes())
            self._roles.verify_targets(targets)
            self.store.write(f"{targets.signed.version}.targets.json", offline.read_bytes())
            initial = self.keys.initial_bundles
            if initial is None:
                raise RepositoryError(f"{self.keys.directory}: targets.json delegates to {BUNDLES_ROLE!r} but there is "
                                      f"no {BUNDLES_ROLE}.json (from 'edgefleet keys create')")
            bundles = Metadata[Targets].from_bytes(initial.read_bytes())
            targets.signed.verify_delegate(BUNDLES_ROLE, bundles.signed_bytes, bundles.signatures)
            self.store.write(f"{bundles.signed.version}.{BUNDLES_ROLE}.json", initial.read_bytes())
            self._roles.publish(targets, snapshot, timestamp, bundles=bundles)

    def _check_root_matches(self) -> None:
        """The key folder's roots must be the repository's; newer ones (a rotation done offline) and a
        newer offline-signed targets.json are published here."""
        from tuf.api.metadata import Metadata, Targets

        for raw in self.keys.roots():
            ours = Metadata.from_bytes(raw)
            held = self.store.read(f"{ours.signed.version}.root.json")
            if held is not None:
                if Metadata.from_bytes(held).signed != ours.signed:
                    raise RepositoryError("the repository was created with other keys than "
                                          f"{self.keys.directory}; use the matching key store or a fresh --data-dir")
            else:
                self._publish_root_locked(raw)
        offline = self.keys.offline_targets
        if offline is not None:
            tgt, _, _, _ = self._load_all()
            if Metadata[Targets].from_bytes(offline.read_bytes()).signed.version > tgt.signed.version:
                self._publish_targets_locked(offline.read_bytes())

    # -- the delegated layout: metadata signed elsewhere, published here ------------------------
    def delegated(self) -> bool:
        tgt, _, _, _ = self._load_all()
        d = tgt.signed.delegations
        return d is not None and d.roles is not None and BUNDLES_ROLE in d.roles

    def publish_root(self, data: bytes) -> None:
        """Publish a new root version signed offline (key rotation or revocation)."""
        with self.store.lock():
            self._publish_root_locked(data)

    def _publish_root_locked(self, data: bytes) -> None:
        from tuf.api.exceptions import UnsignedMetadataError
        from tuf.api.metadata import Metadata, Root

        try:
            new = Metadata[Root].from_bytes(data)
        except Exception as exc:  # python-tuf raises several types for bad JSON
            raise RepositoryError(f"not a root metadata file: {exc}") from exc
        cur = self._roles.root()
        if new.signed.version != cur.signed.version + 1:
            raise RepositoryError(f"root version {new.signed.version} does not follow the published "
                                  f"{cur.signed.version}; publish the versions in between first")
        try:
            cur.signed.verify_delegate("root", new.signed_bytes, new.signatures)  # the old root vouches
            new.signed.verify_delegate("root", new.signed_bytes, new.signatures)  # and the new one signs
        except UnsignedMetadataError as exc:
            raise RepositoryError(f"root version {new.signed.version} is not signed by the old and the new root "
                                  f"keys: {exc}") from exc
        self.store.write(f"{new.signed.version}.root.json", data)
        tgt, snap, ts, bundles = self._load_all()
        online_changed = any(set(new.signed.roles[r].keyids) != set(cur.signed.roles[r].keyids)
                             for r in ("snapshot", "timestamp", "targets"))
        if online_changed:  # signatures by the old keys no longer count: sign again with the new ones
            if not self.delegated():
                tgt.signed.version += 1
            snap.signed.version += 1
            ts.signed.version += 1
            self._roles.publish(tgt, snap, ts, bundles=bundles)

    def publish_targets(self, data: bytes) -> None:
        """Publish top-level targets metadata signed offline (a new or revoked CI key)."""
        with self.store.lock():
            self._publish_targets_locked(data)

    def _publish_targets_locked(self, data: bytes) -> None:
        from tuf.api.exceptions import UnsignedMetadataError
        from tuf.api.metadata import Metadata, Targets

        new = Metadata[Targets].from_bytes(data)
        self._roles.verify_targets(new)
        tgt, snap, ts, bundles = self._load_all()
        if new.signed.version <= tgt.signed.version:
            raise RepositoryError(f"targets version {new.signed.version} is not newer than the published "
                                  f"{tgt.signed.version}")
        if bundles is not None:
            try:  # the published bundles must still verify under the new delegation, else CI must re-sign
                new.signed.verify_delegate(BUNDLES_ROLE, bundles.signed_bytes, bundles.signatures)
            except UnsignedMetadataError:
                bundles = None  # withdrawn: signed by a revoked key; devices see no bundle until CI re-signs
        self.store.write(f"{new.signed.version}.targets.json", data)
        snap.signed.version += 1
        ts.signed.version += 1
        self._roles.publish(new, snap, ts, bundles=bundles, resign_targets=False)

    def publish_bundles(self, data: bytes) -> dict[str, Any]:
        """Publish ``bundles`` metadata signed by the CI key (verified here first); returns its targets."""
        from tuf.api.exceptions import UnsignedMetadataError
        from tuf.api.metadata import Metadata, Targets

        try:
            new = Metadata[Targets].from_bytes(data)
        except Exception as exc:  # python-tuf raises several types for bad JSON
            raise RepositoryError(f"not a targets metadata file: {exc}") from exc
        with self.store.lock():
            tgt, snap, ts, bundles = self._load_all()
            try:
                tgt.signed.verify_delegate(BUNDLES_ROLE, new.signed_bytes, new.signatures)
            except (UnsignedMetadataError, ValueError) as exc:
                raise RepositoryError(f"{BUNDLES_ROLE} metadata is not signed by a CI key the offline targets "
                                      f"metadata delegates to: {exc}") from exc
            if bundles is not None and new.signed.version <= bundles.signed.version:
                raise RepositoryError(f"{BUNDLES_ROLE} version {new.signed.version} is not newer than the published "
                                      f"{bundles.signed.version}; sign on top of the fleet's current one")
            for path in new.signed.targets:
                if not TARGET_PATH_RE.match(path) or ".." in path:
                    raise RepositoryError(f"target path {path!r} is not a plain relative path")
            self.store.write(f"{new.signed.version}.{BUNDLES_ROLE}.json", data)
            snap.signed.version += 1
            ts.signed.version += 1
            self._roles.publish(tgt, snap, ts, bundles=new, resign_targets=False)
            return dict(new.signed.targets)

    def is_signed(self, target_path: str) -> bool:
        """Delegated layout: has the CI key signed this target in the published bundles metadata?"""
        _, _, _, bundles = self._load_all()
        return bundles is not None and target_path in bundles.signed.targets

    def current_bundles(self) -> bytes:
        """The published ``bundles`` metadata, as CI needs it to sign the next version."""
        _, snap, _, _ = self._load_all()
        meta = snap.signed.meta.get(f"{BUNDLES_ROLE}.json")
        if meta is None:  # withdrawn (signed by a revoked key): CI re-signs on top of the last one
            found = sorted(self.store.names(f".{BUNDLES_ROLE}.json"), key=lambda n: int(n.split(".")[0]))
            if not found:
                raise RepositoryError(f"this repository has no {BUNDLES_ROLE} metadata (not the delegated layout)")
            return self._roles.read(found[-1])
        return self._roles.read(f"{meta.version}.{BUNDLES_ROLE}.json")

    # -- reading ------------------------------------------------------------------------------
    def _load(self) -> tuple[Any, Any, Any]:  # (targets, snapshot, timestamp) Metadata
        tgt, snap, ts, _ = self._load_all()
        return tgt, snap, ts

    def _load_all(self) -> tuple[Any, Any, Any, Any]:  # (targets, snapshot, timestamp, bundles or None)
        return self._roles.load()

    def targets(self) -> dict[str, Any]:
        tgt, _, _, bundles = self._load_all()
        return {**dict(tgt.signed.targets), **(dict(bundles.signed.targets) if bundles is not None else {})}

    def root_bytes(self) -> bytes:
        return self._roles.root_bytes()

    # -- writing ------------------------------------------------------------------------------
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
        dest = f"{dirname}/{digest}.{basename}" if dirname else f"{digest}.{basename}"
        with self.store.lock():
            tgt, snap, ts, bundles = self._load_all()
            if bundles is not None or self.delegated():
                return self._register_signed(target_path, local_file, dest, digest, length, bundles)
            existing = tgt.signed.targets.get(target_path)
            if existing is not None:
                if existing.hashes.get("sha256") == digest:
                    return {"sha256": digest, "length": length, "created": False}
                raise RepositoryError(f"target {target_path!r} already exists with different content; "
                                      "publish a new version instead of replacing one")
            self.store.put_target(dest, local_file)
            tf = TargetFile(length=length, hashes={"sha256": digest}, path=target_path, unrecognized_fields={
                "custom": custom})
            tgt.signed.targets[target_path] = tf
            tgt.signed.version += 1
            snap.signed.version += 1
            ts.signed.version += 1
            self._roles.publish(tgt, snap, ts)
        return {"sha256": digest, "length": length, "created": True}

    def _register_signed(self, target_path: str, local_file: Path, dest: str, digest: str, length: int,
                         bundles: Any) -> dict[str, Any]:
        """Delegated layout: the fleet cannot sign; it stores the file of a target CI already signed."""
        signed = None if bundles is None else bundles.signed.targets.get(target_path)
        if signed is None:
            raise RepositoryError(f"{target_path} is not signed by the CI key: upload it with 'edgefleet fleet "
                                  "upload BUNDLE --sign-key ci/bundles.key'")
        if signed.hashes.get("sha256") != digest or signed.length != length:
            raise RepositoryError(f"{target_path}: this file is not the one the CI key signed")
        created = not self.store.has_target(dest)
        if created:
            self.store.put_target(dest, local_file)
        return {"sha256": digest, "length": length, "created": created}

    def refresh_expiring(self, margin: float = 0.5) -> bool:
        """Re-sign every role this fleet holds the key of when any has less than ``margin`` of its
        lifetime left (targets only in the all-keys layout; signed offline otherwise)."""
        with self.store.lock():
            tgt, snap, ts, bundles = self._load_all()
            now = _now()
            online = [("snapshot", snap), ("timestamp", ts)]
            resign_targets = bundles is None and self.keys.has("targets")
            if resign_targets:
                online.append(("targets", tgt))
            stale = any(md.signed.expires - now < EXPIRY[name] * margin for name, md in online)
            if not stale:
                return False
            if resign_targets:
                tgt.signed.version += 1
            snap.signed.version += 1
            ts.signed.version += 1
            self._roles.publish(tgt, snap, ts, bundles=bundles, resign_targets=resign_targets)
            return True

    def serve(self, kind: str, rel: str) -> Path | bytes | tuple[int, Iterator[bytes]] | None:
        """What a public URL path under /tuf/ names: a file on disk, metadata bytes, or a target as (size,
        chunks); None if there is no such thing (no traversal possible)."""
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            return None
        if isinstance(self.store, DirStore):
            return self.store.metadata_path(rel) if kind == "metadata" else self.store.target(rel)
        if kind == "metadata":
            return self.store.read(rel) if "/" not in rel else None
        return self.store.target(rel)
