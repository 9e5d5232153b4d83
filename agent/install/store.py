"""The on-device model store. A crash at any point leaves the old model or the new one, never half.

    <data_dir>/models/<name>-<version>-<sha12>/   complete, verified bundles (moved in by rename)
    <data_dir>/staging/                            extraction in progress; emptied at start-up
    <data_dir>/state.json                          which bundle is current and which was before
                                                   (replaced atomically; the commit point)
    <data_dir>/trusted.json                        the trusted record: the highest version and its
                                                   sha256 of every model ever installed here
                                                   (:class:`agent.install.trusted.TrustedRecord`; replaced
                                                   atomically just before state.json)

Several models live side by side, one active version each, with the version before it kept for
rollback. ``current``/``previous`` are the model installed last (the one the fleet's desired state
names); ``others`` are the rest, by name. state.json keeps that shape (``current``, ``previous``,
``others``), so an agent of the previous release still reads its model from it.

The trusted record only moves forward: :meth:`ModelStore.commit` refuses what it refuses (a downgrade or a
rebuilt version of any model ever installed, whichever runs now), rollback and removal leave it as it is,
and a store from before the record existed starts it from the versions state.json names. An unreadable
record is not an empty one: every commit is refused until it is restored.
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

from ...protocol.bundle import extract_bundle, sha256_file
from ...protocol.errors import ContractError
from ...protocol.fsutil import atomic_write, fsync_dir
from ...protocol.manifest import MANIFEST_FILENAME, Manifest, parse_manifest
from ..errors import TrustError
from .trusted import Installed, TrustedRecord

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
        self.trusted_path = root / "trusted.json"
        self._fault = fault or (lambda point: None)
        self.current: StoreEntry | None = None
        self.previous: StoreEntry | None = None
        self.others: dict[str, tuple[StoreEntry, StoreEntry | None]] = {}  # name -> (active, previous)
        self.trusted = TrustedRecord()
        self.trusted_error: str | None = None  # the record could not be read: every commit is refused

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
        self.others = {}
        listed: list[Installed] = []  # every version state.json names, damaged or not (for the record)
        if self.state_path.exists():
            try:
                state = json.loads(self.state_path.read_text())
                if state.get("state_version") != STATE_VERSION:
                    raise ValueError(f"state_version {state.get('state_version')!r}")
                self.current = self._entry(state.get("current"))
                self.previous = self._entry(state.get("previous"))
                for name, slot in (state.get("others") or {}).items():
                    active = self._entry(slot["current"])
                    if active is not None:
                        self.others[str(name)] = (active, self._entry(slot.get("previous")))
                listed = [e.installed for pair in self.active().values() for e in pair if e is not None]
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.error("%s is unreadable (%s); starting with no model", self.state_path, exc)
                self.current = self.previous = None
                self.others = {}
        self._load_trusted(listed)
        for name, (active, prev) in list(self.others.items()):
            good = [e for e in (active, prev) if e is not None and self._intact(e, name)]
            if good:
                self.others[name] = (good[0], good[1] if len(good) > 1 else None)
            else:
                del self.others[name]
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
        if self.current is None and self.others:
            self.current, self.previous = self.others.pop(next(reversed(self.others)))
        self._gc()
        return self.current

    def _load_trusted(self, listed: list[Installed]) -> None:
        """Read trusted.json; without one (a store from before the record), start it from what state.json
        names and write it at once."""
        self.trusted, self.trusted_error = TrustedRecord(), None
        try:
            self.trusted = TrustedRecord.from_json(json.loads(self.trusted_path.read_bytes()))
            return
        except FileNotFoundError:
            self.trusted = TrustedRecord.from_installed(listed)
            if listed:
                log.warning("no %s: starting the trusted record from the models on disk (%s)", self.trusted_path,
                            ", ".join(f"{n} {s.version}" for n, s in self.trusted.models.items()))
            self._write_trusted(self.trusted)
            return
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            err = exc
        self.trusted = TrustedRecord.from_installed(listed)  # for reading only: commits are refused
        self.trusted_error = (f"the trusted record {self.trusted_path} is unreadable ({err}); every update is "
                              "refused until it is restored (removing it starts a new record from the models "
                              "on disk, forgetting any other model this device ran)")
        log.error("%s", self.trusted_error)

    def _write_trusted(self, record: TrustedRecord) -> None:
        atomic_write(self.trusted_path, (json.dumps(record.to_json(), indent=2) + "\n").encode())

    def _intact(self, entry: StoreEntry, which: str) -> bool:
        try:
            self.load_manifest(entry)
        except (TrustError, ContractError) as exc:
            log.error("%s model %s is damaged (%s); dropping it", which, entry.directory, exc)
            return False
        return True

    def active(self) -> dict[str, tuple[StoreEntry, StoreEntry | None]]:
        """Every model on disk: name -> (active version, previous version kept for rollback)."""
        out = dict(self.others)
        if self.current is not None:
            out[self.current.installed.name] = (self.current, self.previous)
        return out

    def _write_state(self) -> None:
        def slot(entry: StoreEntry | None) -> dict | None:
            return None if entry is None else {**asdict(entry)}

        state = {"state_version": STATE_VERSION, "current": slot(self.current), "previous": slot(self.previous),
                 "others": {name: {"current": slot(a), "previous": slot(p)} for name, (a, p) in self.others.items()}}
        atomic_write(self.state_path, (json.dumps(state, indent=2) + "\n").encode())

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
        """Make ``staged`` the current model (the single atomic commit point). The trusted record moves
        first (RefusedUpdate if it refuses: a downgrade or a rebuilt version of a model ever installed;
        TrustError if it is unreadable); a crash between the two leaves the record ahead, never behind."""
        m = staged.manifest
        entry = StoreEntry(Installed(m.name, m.version, staged.bundle_sha256, m.profile), staged.directory.name,
                           rollout_id)
        if self.trusted_error is not None:
            raise TrustError(self.trusted_error)
        record = self.trusted.advance(m.name, m.version, staged.bundle_sha256)
        self._fault("before_commit")
        if record != self.trusted:
            self._write_trusted(record)
            self.trusted = record
        cur, prev, others = self.current, self.previous, dict(self.others)
        if cur is not None and cur.installed.name != m.name:  # another model: it keeps serving beside this one
            others[cur.installed.name] = (cur, prev)
            cur, prev = others.pop(m.name, (None, None))
        new_prev = cur if cur is not None and cur.directory != entry.directory else prev
        old = (self.current, self.previous, self.others)
        self.current, self.previous, self.others = entry, new_prev, others
        try:
            self._write_state()
        except BaseException:
            self.current, self.previous, self.others = old
            raise
        self._fault("after_commit")
        self._gc()
        return entry

    def revert(self) -> StoreEntry | None:
        """Make the previous model current again (the current one failed to load or swap in); the
        failed one's folder is removed."""
        if self.current is None:
            return None
        self._set_slot(self.current.installed.name, self.previous, None)
        self._gc()
        return self.current

    def rollback(self, name: str) -> StoreEntry:
        """Make model ``name``'s previous version active again; the version rolled back from becomes the
        previous one (so the rollback itself can be undone). Raises KeyError naming what is missing."""
        slots = self.active()
        if name not in slots:
            raise KeyError(f"no model {name!r} is installed (installed: {', '.join(sorted(slots)) or 'none'})")
        active, prev = slots[name]
        if prev is None:
            raise KeyError(f"{name} has no previous version to roll back to (active: {active.installed.version})")
        self._set_slot(name, prev, active)
        return prev

    def remove(self, name: str) -> None:
        """Forget model ``name`` (both versions); its folders go."""
        if name not in self.active():
            raise KeyError(f"no model {name!r} is installed")
        self._set_slot(name, None, None)
        self._gc()

    def _set_slot(self, name: str, active: StoreEntry | None, prev: StoreEntry | None) -> None:
        old = (self.current, self.previous, dict(self.others))
        if self.current is not None and self.current.installed.name == name:
            self.current, self.previous = active, prev
            if active is None and self.others:  # the primary model went: the last other one takes its place
                promoted = next(reversed(self.others))
                self.current, self.previous = self.others.pop(promoted)
        elif active is None:
            self.others.pop(name, None)
        else:
            self.others[name] = (active, prev)
        try:
            self._write_state()
        except BaseException:
            self.current, self.previous, self.others = old
            raise

    def _kept(self) -> set[str]:
        return {e.directory for pair in self.active().values() for e in pair if e is not None}

    def discard(self, staged: StagedModel) -> None:
        """Remove a staged model that failed to load or self-test (never one the state names)."""
        keep = self._kept()
        if staged.directory.name not in keep:
            shutil.rmtree(staged.directory, ignore_errors=True)

    def _gc(self) -> None:
        keep = self._kept()
        for d in self.models_dir.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
