"""Fetching bundles: the agent is a TUF client (python-tuf ngclient) of the fleet's repository.

TUF verifies the metadata chain (root -> timestamp -> snapshot -> targets), refuses rollback,
freeze, mix-and-match and endless-data attacks, and checks the bundle's length and hashes. The
desired-state message from MQTT is only a hint: what gets installed is what the signed targets
metadata says.

Every download (metadata and bundles) is bounded in bytes and in total time by agent/link/fetch.py: the bound of a
bundle is its signed length, that of a piece of metadata the length the metadata above it signs (python-tuf's
per-role bound otherwise), and an answer too slow or too long ends the attempt with a FetchError, which the
installer retries with backoff.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tuf.api import exceptions as tuf_exc
from tuf.api.metadata import Metadata, Root
from tuf.ngclient.fetcher import FetcherInterface

from ...protocol.bundle import MAX_BUNDLE_BYTES
from ...protocol.errors import SchemaError
from ...protocol.fsutil import atomic_write, clear_unfinished
from ...protocol.signed_time import MAX_DOCUMENT_BYTES, describe_skew, verify_time
from ...protocol.tuf_target import TargetCustom
from ..errors import DownloadCut, FetchError, TrustError
from .clock import ClockReading, TrustedClock, load_floor, save_floor
from .fetch import FetchLimits, FleetHttp
from .resume import DownloadProgress, Pacer, PartialStore, download_resumable

__all__ = ["BundleFetcher", "FetchedBundle", "GuardedFetcher"]

log = logging.getLogger("edgefleet.agent.updater")


class GuardedFetcher(FetcherInterface):
    """python-tuf's fetcher: agent/link/fetch.py's bounded HTTP. python-tuf names each file's bound when it downloads
    one (``download_file``); that bound is also what the answer's deadline is computed from."""

    def __init__(self, grace_s: float = 30.0, min_bytes_per_s: int = 2048, socket_timeout_s: float = 30.0,
                 user_agent: str = "edgefleet-agent", deadline_s: float = 60.0):
        self.http = FleetHttp(FetchLimits(deadline_s, grace_s, min_bytes_per_s, socket_timeout_s), user_agent)
        self._max_bytes = MAX_BUNDLE_BYTES  # the bound of the file being downloaded (download_file sets it)
        self.bundle: _BundleDownload | None = None  # set for a bundle: downloaded resumably (agent/link/resume.py)

    def download_file(self, url: str, max_length: int) -> AbstractContextManager[IO[bytes]]:  # type: ignore[override]
        self._max_bytes = max_length
        if self.bundle is not None:
            return self._resumed(url, self.bundle, max_length)
        return super().download_file(url, max_length)

    @contextlib.contextmanager
    def _resumed(self, url: str, b: _BundleDownload, length: int) -> Iterator[IO[bytes]]:
        """The whole bundle from its partial file, which python-tuf verifies against the signed length and hashes
        inside this block and copies out; the partial goes afterwards, and also when it failed the check."""
        path = download_resumable(self.http, url, b.store, b.target, b.sha256, length, b.pacer, b.progress,
                                  b.held() if b.held is not None else None)
        try:
            with path.open("rb") as f:
                yield f
        finally:
            b.store.drop(b.sha256)

    def _fetch(self, url: str) -> Iterator[bytes]:
        answer = self.http.open(url, self._max_bytes)
        if answer.status != 200:
            answer.close()
            raise tuf_exc.DownloadHTTPError(f"GET {url}: HTTP {answer.status}", answer.status)
        return self.http.read(answer)


@dataclass(frozen=True)
class _BundleDownload:
    store: PartialStore
    target: str
    sha256: str
    pacer: Pacer
    progress: Callable[[DownloadProgress], None]
    held: Callable[[], dict[str, Path]] | None = None  # files held here by sha256 (agent/link/by_content.py)


@dataclass(frozen=True)
class FetchedBundle:
    path: Path
    sha256: str
    length: int
    custom: TargetCustom  # what the fleet (or CI) signed about the bundle


class BundleFetcher:
    def __init__(self, state_dir: Path, metadata_url: str, targets_url: str, trusted_root: Path | None,
                 root_from_fleet: bytes | None = None, grace_s: float = 30.0, min_bytes_per_s: int = 2048,
                 deadline_s: float = 60.0, time_url: str | None = None, clock_tolerance_s: float = 300.0,
                 max_bytes_per_s: int = 0, held_files: Callable[[], dict[str, Path]] | None = None):
        """``trusted_root`` (root.json from ``edgefleet keys init``) anchors trust. Without it the
        fleet's current root is trusted on first use (``root_from_fleet``), which the caller logs.
        Downloads are bounded as agent/link/fetch.py says (``deadline_s``, ``grace_s``, ``min_bytes_per_s``).
        ``time_url``: the fleet's signed time (``/api/v1/time``), required before each refresh when given;
        TUF's expiry checks use the trusted time (agent/link/clock.py) rather than the local clock.
        ``max_bytes_per_s``: the box's own cap on a bundle download's rate (0: none), agent/link/resume.py's pacer.
        A bundle downloads resumably: its partial file (``state_dir/partial``) survives a cut and a restart.
        ``held_files``: the files this box holds by sha256 (installed models): a bundle's file among them is copied,
        not downloaded (agent/link/by_content.py)."""
        self.held_files = held_files
        self.grace_s = grace_s
        self.max_bytes_per_s = max_bytes_per_s
        self.partials = PartialStore(state_dir / "partial")
        self.progress: DownloadProgress | None = None  # the bundle being downloaded, for telemetry
        self.stop = threading.Event()  # set: a paced download stops waiting for its tokens
        self.min_bytes_per_s = min_bytes_per_s
        self.deadline_s = deadline_s
        self.http = FleetHttp(FetchLimits(deadline_s, grace_s, min_bytes_per_s))
        self.time_url = time_url
        self.floor_file = state_dir / "trusted-time.json"
        self.clock = TrustedClock(load_floor(self.floor_file), clock_tolerance_s)
        self.metadata_dir = state_dir / "metadata"
        self.download_dir = state_dir / "downloads"
        self.metadata_dir.mkdir(parents=True, exist_ok=True)
        self.download_dir.mkdir(parents=True, exist_ok=True)
        self.metadata_url = metadata_url
        self.targets_url = targets_url
        # what a crash mid-download or mid-write left: a partial bundle, python-tuf's temp files
        self.clean()
        for leftover in self.metadata_dir.glob("tmp*"):
            leftover.unlink(missing_ok=True)
        # and atomic_write's own, killed between write and rename: the trusted-time floor's and the root's (CI:
        # '.trusted-time.json.xor42_8c.tmp' after a SIGKILL)
        clear_unfinished(self.floor_file)
        clear_unfinished(self.metadata_dir / "root.json")
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

    def check_time(self) -> ClockReading:
        """Ask the fleet for its signed time with a fresh nonce, verify it with the trusted root (the timestamp
        role's keys), and trust it from now on (kept on disk as the floor). FetchError when it cannot be had (a
        retry may get it), TrustError when it does not verify."""
        if self.time_url is None:
            raise FetchError("no signed-time URL configured")
        nonce = secrets.token_hex(16)
        status, raw = self.http.get(f"{self.time_url}?nonce={nonce}", MAX_DOCUMENT_BYTES)
        if status != 200:
            raise FetchError(f"GET {self.time_url}: HTTP {status} (a fleet older than this agent serves no signed "
                             "time: upgrade the fleet first)")
        try:
            root = Metadata[Root].from_bytes((self.metadata_dir / "root.json").read_bytes()).signed
        except (OSError, ValueError) as exc:
            raise TrustError(f"cannot read the trusted root to verify the fleet's time: {exc}") from exc
        try:
            when = verify_time(raw, root, nonce)
        except SchemaError as exc:
            raise TrustError(str(exc)) from exc
        floor = self.clock.floor
        self.clock.observe_signed(when)
        if self.clock.floor is not None and self.clock.floor != floor:
            save_floor(self.floor_file, self.clock.floor)
        reading = self.clock.reading()
        if reading.skew_s is not None and abs(reading.skew_s) > self.clock.tolerance_s:
            log.warning("this box's clock is %s the fleet's signed time (%s); updates check expiry against the "
                        "signed time: fix its NTP or RTC", describe_skew(reading.skew_s), when.isoformat())
        return reading

    def clock_skew_s(self) -> float | None:
        """How far the local clock is from the trusted time, when past the tolerance (else None)."""
        skew = self.clock.reading().skew_s
        return round(skew, 1) if skew is not None and abs(skew) > self.clock.tolerance_s else None

    def pace_bytes_per_s(self, rollout_cap: int = 0) -> int:
        """The rate a bundle downloads at: the lower of the box's and the rollout's caps (0: none), never below twice
        the slow-retrieval guard's minimum (a cap under it would have the guard refuse every download)."""
        caps = [c for c in (self.max_bytes_per_s, rollout_cap) if c > 0]
        return max(min(caps), 2 * self.min_bytes_per_s) if caps else 0

    def _updater(self) -> Any:
        from tuf.ngclient import Updater, UpdaterConfig

        self._fetcher = GuardedFetcher(self.grace_s, self.min_bytes_per_s, deadline_s=self.deadline_s)
        return Updater(str(self.metadata_dir), self.metadata_url, str(self.download_dir), self.targets_url,
                       fetcher=self._fetcher,
                       config=UpdaterConfig(app_user_agent="edgefleet-agent"), bootstrap=None)

    def _refreshed(self) -> Any:
        """A refreshed python-tuf Updater whose expiry checks used the trusted time."""
        updater = self._updater()
        if self.time_url is not None:
            try:
                self.check_time()
            except TrustError:
                # signed by a timestamp key newer than the root held here (a rotation): walk the root versions
                # forward (a refresh at the end of time stops at "Final root.json is expired", after the roots and
                # before any other metadata is kept), then verify again; a second refusal stands
                _at(updater, dt.datetime.max.replace(tzinfo=dt.timezone.utc))
                with contextlib.suppress(tuf_exc.RepositoryError, tuf_exc.DownloadError):
                    updater.refresh()
                self.check_time()
                updater = self._updater()
        _at(updater, self.clock.reading().trusted)
        updater.refresh()
        return updater

    def fetch(self, target: str, expected_sha256: str,
              precheck: Callable[[TargetCustom], None] | None = None, max_bytes_per_s: int = 0) -> FetchedBundle:
        """Verify the metadata, call ``precheck`` with the target's signed custom fields (it raises to
        refuse the bundle before a byte of it is downloaded), then download and verify the bundle. Custom
        fields this agent cannot read (a field of a newer fleet, a wrong type) are a TrustError naming them.
        An answer too slow or too long (agent/link/fetch.py) is a FetchError: the caller retries; a cut after the
        partial file moved forward is a DownloadCut (a FetchError). ``max_bytes_per_s``: the rollout's rate cap."""
        self.clean()
        before = self.partials.have(expected_sha256) if _hexdigest(expected_sha256) else 0
        try:
            updater = self._refreshed()
            info = updater.get_targetinfo(target)
            if info is None:
                raise TrustError(f"target {target!r} is not in the fleet's signed targets metadata")
            signed_sha = info.hashes.get("sha256")
            if signed_sha != expected_sha256:
                raise TrustError(f"desired state names sha256 {expected_sha256[:12]}… for {target!r}, "
                                 f"the signed metadata says {str(signed_sha)[:12]}…")
            try:
                custom = TargetCustom.parse(info.custom, f"signed target {target!r}")
            except SchemaError as exc:
                raise TrustError(f"{exc}; an agent older than the fleet? upgrade it") from exc
            if precheck is not None:
                precheck(custom)
            dest = self.download_dir / "bundle.tar"
            self._fetcher.bundle = _BundleDownload(self.partials, target, signed_sha,
                                                   Pacer(self.pace_bytes_per_s(max_bytes_per_s), self.stop),
                                                   self._progressed, self.held_files)
            updater.download_target(info, str(dest))
        except tuf_exc.RepositoryError as exc:
            raise TrustError(f"TUF verification failed: {type(exc).__name__}: {exc}") from exc
        except tuf_exc.DownloadError as exc:  # a broken connection, or an answer too slow or too long
            cut = self.partials.have(expected_sha256) > before
            raise (DownloadCut if cut else FetchError)(
                f"download from the fleet failed: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise FetchError(f"download from the fleet failed: {exc}") from exc
        finally:
            self.progress = None
        return FetchedBundle(dest, signed_sha, info.length, custom)

    def _progressed(self, p: DownloadProgress) -> None:
        self.progress = p


def _hexdigest(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def _at(updater: Any, when: dt.datetime) -> None:
    """Set the time python-tuf checks expiry against (``TrustedMetadataSet.reference_time``, which python-tuf 7
    sets to the local clock and offers no argument for)."""
    trusted_set = getattr(updater, "_trusted_set", None)
    if trusted_set is None or not hasattr(trusted_set, "reference_time"):
        raise TrustError("this python-tuf has no TrustedMetadataSet.reference_time: the agent cannot check expiry "
                         "against the fleet's signed time; install the python-tuf version edgefleet pins")
    trusted_set.reference_time = when

