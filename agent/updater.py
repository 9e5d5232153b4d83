"""Fetching bundles: the agent is a TUF client (python-tuf ngclient) of the fleet's repository.

TUF verifies the metadata chain (root -> timestamp -> snapshot -> targets), refuses rollback,
freeze, mix-and-match and endless-data attacks, and checks the bundle's length and hashes. The
desired-state message from MQTT is only a hint: what gets installed is what the signed targets
metadata says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import FetchError, TrustError
from protocol.fsutil import atomic_write

__all__ = ["BundleFetcher", "FetchedBundle"]

log = logging.getLogger("edgefleet.agent.updater")


@dataclass(frozen=True)
class FetchedBundle:
    path: Path
    sha256: str
    length: int
    custom: dict[str, Any]


class BundleFetcher:
    def __init__(self, state_dir: Path, metadata_url: str, targets_url: str, trusted_root: Path | None,
                 root_from_fleet: bytes | None = None):
        """``trusted_root`` (root.json from ``edgefleet keys init``) anchors trust. Without it the
        fleet's current root is trusted on first use (``root_from_fleet``), which the caller logs."""
        self.metadata_dir = state_dir / "metadata"
        self.download_dir = state_dir / "downloads"
        self.metadata_dir.mkdir(parents=True, exist_ok=True)
        self.download_dir.mkdir(parents=True, exist_ok=True)
        self.metadata_url = metadata_url
        self.targets_url = targets_url
        root = self.metadata_dir / "root.json"
        if not root.exists():  # afterwards TUF itself moves the root forward (key rotation)
            if trusted_root is not None:
                try:
                    data = trusted_root.read_bytes()
                except OSError as exc:
                    raise TrustError(f"cannot read the trusted root {trusted_root}: {exc}") from exc
            elif root_from_fleet is not None:
                data = root_from_fleet
            else:
                raise TrustError("no trusted root.json: pass --trusted-root (from 'edgefleet keys init')")
            atomic_write(root, data)

    def clean(self) -> None:
        """Delete downloaded bundles (after they were staged, or failed)."""
        for leftover in self.download_dir.iterdir():
            leftover.unlink(missing_ok=True)

    def fetch(self, target: str, expected_sha256: str,
              precheck: Callable[[dict[str, Any]], None] | None = None) -> FetchedBundle:
        """Verify the metadata, call ``precheck`` with the target's signed custom fields (it raises to
        refuse the bundle before a byte of it is downloaded), then download and verify the bundle."""
        from tuf.api import exceptions as tuf_exc
        from tuf.ngclient import Updater, UpdaterConfig

        self.clean()
        try:
            updater = Updater(str(self.metadata_dir), self.metadata_url, str(self.download_dir), self.targets_url,
                              config=UpdaterConfig(app_user_agent="edgefleet-agent"), bootstrap=None)
            updater.refresh()
            info = updater.get_targetinfo(target)
            if info is None:
                raise TrustError(f"target {target!r} is not in the fleet's signed targets metadata")
            signed_sha = info.hashes.get("sha256")
            if signed_sha != expected_sha256:
                raise TrustError(f"desired state names sha256 {expected_sha256[:12]}… for {target!r}, "
                                 f"the signed metadata says {str(signed_sha)[:12]}…")
            if precheck is not None:
                precheck(dict(info.custom))
            dest = self.download_dir / "bundle.tar"
            updater.download_target(info, str(dest))
        except (tuf_exc.RepositoryError, tuf_exc.DownloadLengthMismatchError) as exc:
            # a length mismatch is the endless-data attack, not a network fault: never retried
            raise TrustError(f"TUF verification failed: {type(exc).__name__}: {exc}") from exc
        except tuf_exc.DownloadError as exc:
            raise FetchError(f"download from the fleet failed: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise FetchError(f"download from the fleet failed: {exc}") from exc
        return FetchedBundle(dest, signed_sha, info.length, dict(info.custom))
