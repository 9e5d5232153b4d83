"""The on-device model store. A crash at any point leaves the old model or the new one, never half.

    <data_dir>/models/<name>-<version>-<sha12>/   complete, verified bundles (moved in by rename)
    <data_dir>/staging/                            extraction in progress; emptied at start-up
    <data_dir>/state.json                          which bundle is current and which was before
                                                   (replaced atomically; the commit point)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.errors import TrustError
from agent.trusted import Installed
from protocol.bundle import extract_bundle, sha256_file
from protocol.errors import ContractError
from protocol.fsutil import atomic_write, fsync_dir
from protocol.manifest import MANIFEST_FILENAME, Manifest, parse_manifest

__all__ = ["ModelStore", "StagedModel", "StoreEntry"]

log = logging.getLogger("edgefleet.agent.store")
STATE_VERSION = 1


@dataclass(frozen=True)
class StoreEntry:
    installed: Installed
    directory: str  # relative to models/
    rollout_id: int | None = None


@dataclass(frozen=True)
class StagedModel:
    manifest: Manifest
    directory: Path
    bundle_sha256: str

    @property
    def engine(self) -> Path:
        return self.directory / self.manifest.engine


class ModelStore:
    def __init__(self, root: Path, fault: Callable[[str], None] | None = None):
        self.root = root
        self.models_dir = root / "models"
        self.staging_dir = root / "staging"
        self.state_path = root / "state.json"
        self._fault = fault or (lambda point: None)
        self.current: StoreEntry | None = None
        self.previous: StoreEntry | None = None

    # -- start-up -----------------------------------------------------------------------------
    def recover(self) -> StoreEntry | None:
        """Empty staging, read state.json, verify the current bundle's files; fall back to the previous."""
        for d in (self.models_dir, self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in self.staging_dir.iterdir():
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        for tmp in self.root.glob(".*.tmp"):  # a state.json write a crash interrupted
            tmp.unlink(missing_ok=True)
        self.current = self.previous = None
        if self.state_path.exists():
            try:
                state = json.loads(self.state_path.read_text())
                if state.get("state_version") != STATE_VERSION:
                    raise ValueError(f"state_version {state.get('state_version')!r}")
                self.current = self._entry(state.get("current"))
                self.previous = self._entry(state.get("previous"))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("%s is unreadable (%s); starting with no model", self.state_path, exc)
        for which in ("current", "previous"):
            entry = getattr(self, which)
            if entry is not None:
                try:
                    self.load_manifest(entry)
                except (TrustError, ContractError) as exc:
                    log.error("%s model %s is damaged (%s); dropping it", which, entry.directory, exc)
                    setattr(self, which, None)
        if self.current is None and self.previous is not None:
            self.current, self.previous = self.previous, None
        self._gc()
        return self.current

    @staticmethod
    def _entry(raw: dict | None) -> StoreEntry | None:
        if raw is None:
            return None
        return StoreEntry(Installed(**raw["installed"]), raw["directory"], raw.get("rollout_id"))

    def load_manifest(self, entry: StoreEntry, verify: bool = True) -> Manifest:
        d = self.models_dir / entry.directory
        mf = d / MANIFEST_FILENAME
        if not mf.is_file():
            raise TrustError(f"{d}: no manifest")
        manifest = parse_manifest(mf.read_bytes(), str(mf))
        if verify:
            for name, fe in manifest.files.items():
                p = d / name
                if not p.is_file() or sha256_file(p) != fe.sha256:
                    raise TrustError(f"{p}: missing or does not match its sha256")
        return manifest

    # -- install ------------------------------------------------------------------------------
    def stage(self, bundle: Path, bundle_sha256: str) -> StagedModel:
        """Extract and verify a downloaded bundle, then move it into models/ (atomic rename)."""
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.staging_dir, prefix="stage-"))
        try:
            try:
                manifest = extract_bundle(bundle, tmp)
            except ContractError as exc:
                raise TrustError(str(exc)) from exc
            for p in tmp.iterdir():
                with p.open("rb") as f:
                    os.fsync(f.fileno())
            fsync_dir(tmp)
            self._fault("extracted")
            final = self.models_dir / f"{manifest.name}-{manifest.version}-{bundle_sha256[:12]}"
            if final.exists():  # an earlier identical install; the content is addressed by hash
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, final)
                fsync_dir(self.models_dir)
            self._fault("moved")
            return StagedModel(manifest, final, bundle_sha256)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def commit(self, staged: StagedModel, rollout_id: int | None) -> StoreEntry:
        """Make ``staged`` the current model (the single atomic commit point)."""
        m = staged.manifest
        entry = StoreEntry(Installed(m.name, m.version, staged.bundle_sha256, m.profile), staged.directory.name,
                           rollout_id)
        self._fault("before_commit")
        prev = self.current if self.current is not None and self.current.directory != entry.directory else self.previous
        state = {"state_version": STATE_VERSION,
                 "current": {**asdict(entry)}, "previous": None if prev is None else {**asdict(prev)}}
        atomic_write(self.state_path, (json.dumps(state, indent=2) + "\n").encode())
        self.current, self.previous = entry, prev
        self._fault("after_commit")
        self._gc()
        return entry

    def revert(self) -> StoreEntry | None:
        """Make the previous model current again (the current one failed to load or swap in); the
        failed one's folder is removed."""
        prev = self.previous
        state = {"state_version": STATE_VERSION, "current": None if prev is None else {**asdict(prev)},
                 "previous": None}
        atomic_write(self.state_path, (json.dumps(state, indent=2) + "\n").encode())
        self.current, self.previous = prev, None
        self._gc()
        return prev

    def discard(self, staged: StagedModel) -> None:
        """Remove a staged model that failed to load or self-test (never the current or previous one)."""
        keep = {e.directory for e in (self.current, self.previous) if e is not None}
        if staged.directory.name not in keep:
            shutil.rmtree(staged.directory, ignore_errors=True)

    def _gc(self) -> None:
        keep = {e.directory for e in (self.current, self.previous) if e is not None}
        for d in self.models_dir.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
