"""Which update the agent accepts: plain decisions, no I/O, like TUF's trusted set.

The trusted record (:class:`TrustedRecord`) is one object that only moves forward, per model name: for every
model this device has ever installed, the highest version and the sha256 of its bundle. A desired state is
accepted when it names a newer version of a model than the record holds, the very build the record holds,
or a model never installed; the same version with other content is refused as tampering; an older version
is refused as a downgrade (publish the old build under a new version instead), whichever model runs now.
The store (:mod:`agent.install.store`) loads and saves the record; nothing here touches the disk. A bundle built
for a profile this device does not run is refused, and so is one that needs CPU instruction sets this
device lacks (``check_cpu``, decided from the signed target metadata before the download and again from
the manifest).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from ...protocol.cpu import missing_features
from ...protocol.manifest import version_key
from ..errors import RefusedUpdate

__all__ = ["RECORD_VERSION", "Decision", "Installed", "Seen", "TrustedRecord", "check_cpu", "decide"]

RECORD_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Installed:
    name: str
    version: str
    sha256: str  # of the bundle archive (the TUF target)
    profile: str


@dataclass(frozen=True)
class Decision:
    action: Literal["install", "keep", "refuse"]
    reason: str


@dataclass(frozen=True)
class Seen:
    """The highest version of one model this device has installed, and its bundle's sha256."""

    version: str
    sha256: str


def _cmp(a: str, b: str) -> int:
    ka, kb = version_key(a), version_key(b)
    return (ka > kb) - (ka < kb)


@dataclass(frozen=True)
class TrustedRecord:
    """Model name -> :class:`Seen`, for every model ever installed. Immutable: :meth:`advance` returns the
    next record, or raises RefusedUpdate for a step backwards."""

    models: Mapping[str, Seen] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrustedRecord) and dict(self.models) == dict(other.models)

    def __hash__(self) -> int:
        return hash(frozenset(self.models.items()))

    def check(self, name: str, version: str, sha256: str) -> Decision:
        """May ``name`` ``version`` (bundle ``sha256``) be installed, as far as the record goes?"""
        seen = self.models.get(name)
        if seen is None:
            return Decision("install", f"{name} was never installed here")
        cmp = _cmp(version, seen.version)
        if cmp < 0:
            return Decision("refuse", f"downgrade refused: {name} {seen.version} was installed on this device, "
                                      f"offered {version}; publish the older build under a new version to roll "
                                      "back")
        if cmp == 0 and sha256 != seen.sha256:
            return Decision("refuse", f"{name} {version} was installed here with other content (sha256 "
                                      f"{seen.sha256[:12]}…, offered {sha256[:12]}…); a version is never rebuilt "
                                      "in place")
        return Decision("install", f"{name} {version} is {'newer than' if cmp else 'the build'} "
                                   f"{seen.version} {'on record' if cmp else 'recorded'}")

    def advance(self, name: str, version: str, sha256: str) -> TrustedRecord:
        """The record once ``name`` ``version`` is installed (itself when nothing moves); RefusedUpdate if
        :meth:`check` refuses it."""
        decision = self.check(name, version, sha256)
        if decision.action != "install":
            raise RefusedUpdate(decision.reason)
        seen = self.models.get(name)
        if seen is not None and seen.version == version:
            return self
        return TrustedRecord({**self.models, name: Seen(version, sha256)})

    @classmethod
    def from_installed(cls, entries: Iterable[Installed]) -> TrustedRecord:
        """The record of a store from before records existed: per name, the highest version it holds (of two
        builds of one version, the first listed)."""
        models: dict[str, Seen] = {}
        for e in entries:
            seen = models.get(e.name)
            if seen is None or _cmp(e.version, seen.version) > 0:
                models[e.name] = Seen(e.version, e.sha256)
        return cls(models)

    def to_json(self) -> dict[str, Any]:
        return {"record_version": RECORD_VERSION,
                "models": {n: {"version": s.version, "sha256": s.sha256} for n, s in sorted(self.models.items())}}

    @classmethod
    def from_json(cls, doc: object) -> TrustedRecord:
        """The record from :meth:`to_json`'s form; ValueError for anything else (never an empty record)."""
        if not isinstance(doc, dict) or doc.get("record_version") != RECORD_VERSION:
            raise ValueError(f"not a trusted record of version {RECORD_VERSION}")
        raw = doc.get("models")
        if not isinstance(raw, dict):
            raise ValueError("no 'models' mapping")
        models: dict[str, Seen] = {}
        for name, seen in raw.items():
            if not isinstance(seen, dict) or not isinstance(seen.get("version"), str) \
                    or not isinstance(seen.get("sha256"), str) or not _SHA256.fullmatch(seen["sha256"]):
                raise ValueError(f"model {name!r}: expected {{version, sha256}}")
            version_key(seen["version"])  # ValueError unless MAJOR.MINOR.PATCH
            models[str(name)] = Seen(seen["version"], seen["sha256"])
        return cls(models)


def decide(record: TrustedRecord, current: Installed | None, name: str, version: str, sha256: str,
           profile: str | None, accepted_profiles: tuple[str, ...],
           failed_sha256: frozenset[str] = frozenset()) -> Decision:
    """What to do with a desired state: ``current`` is the model the fleet last had this device run."""
    if profile is not None and profile not in accepted_profiles:
        return Decision("refuse", f"bundle is built for profile {profile!r}; this device runs "
                                  f"{', '.join(accepted_profiles)}")
    if current is not None and current.name == name and current.sha256 == sha256:
        return Decision("keep", f"{name} {version} is already running")
    decision = record.check(name, version, sha256)
    if decision.action == "refuse":
        return decision
    if sha256 in failed_sha256:
        return Decision("refuse", f"{name} {version} already failed to install on this device")
    return Decision("install", f"install {name} {version}")


def check_cpu(profile: str, required: tuple[str, ...] | list[str], have: frozenset[str]) -> Decision:
    """Refuse a bundle whose profile promises instruction sets this CPU does not have: its engine
    would compute other answers than the ones it was gated on (or not run at all)."""
    missing = missing_features(required, have)
    if missing:
        return Decision("refuse", f"bundle for profile {profile!r} needs CPU features {', '.join(missing)}, which "
                                  f"this CPU lacks (it has {', '.join(sorted(have)) or 'none known'}); roll out "
                                  "a build for a profile whose cpu_features this CPU has")
    return Decision("install", f"this CPU has {', '.join(required) or 'what the bundle needs'}")
