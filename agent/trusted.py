"""Which update the agent accepts: plain decisions, no I/O, like TUF's trusted set.

The record only moves forward. A desired state is installed when it names a newer version of the
running model (or another model); the same version with other content is refused as tampering; an
older version is refused as a downgrade (publish the old build under a new version instead). A
bundle built for a profile this device does not run is refused, and so is one that needs CPU
instruction sets this device lacks (``check_cpu``, decided from the signed target metadata before
the download and again from the manifest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.cpu import missing_features
from protocol.manifest import version_key

__all__ = ["Decision", "Installed", "check_cpu", "decide"]


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


def decide(current: Installed | None, name: str, version: str, sha256: str, profile: str | None,
           accepted_profiles: tuple[str, ...], failed_sha256: frozenset[str] = frozenset()) -> Decision:
    if profile is not None and profile not in accepted_profiles:
        return Decision("refuse", f"bundle is built for profile {profile!r}; this device runs "
                                  f"{', '.join(accepted_profiles)}")
    if current is not None and current.name == name:
        if current.sha256 == sha256:
            return Decision("keep", f"{name} {version} is already running")
        new, old = version_key(version), version_key(current.version)
        cmp = (new > old) - (new < old)
        if cmp == 0:
            return Decision("refuse", f"{name} {version} is running with other content (sha256 {current.sha256[:12]}…, "
                                      f"offered {sha256[:12]}…); a version is never rebuilt in place")
        if cmp < 0:
            return Decision("refuse", f"downgrade refused: running {name} {current.version}, offered {version}; "
                                      "publish the older build under a new version to roll back")
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
