"""Fetching bundles: the agent is a TUF client (python-tuf ngclient) of the fleet's repository.

TUF verifies the metadata chain (root -> timestamp -> snapshot -> targets), refuses rollback,
freeze, mix-and-match and endless-data attacks, and checks the bundle's length and hashes. The
desired-state message from MQTT is only a hint: what gets installed is what the signed targets
metadata says.

Slow retrieval: python-tuf bounds only the gap between two reads, so a server dribbling a byte now
and then could hold a download forever. Every download here must also average at least
``min_bytes_per_s`` once ``grace_s`` have passed (like curl's --speed-limit), or it is aborted.

Proxies: downloads go through the proxy that ``HTTP_PROXY`` / ``HTTPS_PROXY`` name, except to the hosts
``NO_PROXY`` lists, read by urllib's own rules, as the agent's bootstrap and enrollment (urllib.request)
do: an https download is tunnelled (CONNECT), so TLS is still checked against the fleet's name.
"""

from __future__ import annotations

import base64
import http.client
import logging
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tuf.api import exceptions as tuf_exc
from tuf.ngclient.fetcher import FetcherInterface

from edgefleet.agent.errors import FetchError, TrustError
from edgefleet.protocol.errors import SchemaError
from edgefleet.protocol.fsutil import atomic_write
from edgefleet.protocol.target import TargetCustom

__all__ = ["BundleFetcher", "FetchedBundle", "GuardedFetcher"]

log = logging.getLogger("edgefleet.agent.updater")


def proxy_for(scheme: str, host: str, port: int | None) -> tuple[str, int, dict[str, str]] | None:
    """The proxy urllib.request would use for this URL (``HTTP(S)_PROXY``, less ``NO_PROXY``): (host, port,
    headers to send it), or None to go direct. Only http:// proxies (or a bare host:port), as urllib."""
    proxy = urllib.request.getproxies().get(scheme)
    if not proxy or urllib.request.proxy_bypass(f"{host}:{port}" if port else host):
        return None
    p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if p.scheme != "http" or not p.hostname:
        raise tuf_exc.DownloadError(f"the {scheme} proxy {proxy!r} is not an http:// proxy (host:port) the agent "
                                    f"can use; fix {scheme.upper()}_PROXY or list the fleet in NO_PROXY")
    try:
        proxy_port = p.port or 80
    except ValueError as exc:
        raise tuf_exc.DownloadError(f"the {scheme} proxy {proxy!r}: {exc}") from exc
    headers = {}
    if p.username is not None:
        cred = f"{unquote(p.username)}:{unquote(p.password or '')}".encode()
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(cred).decode()
    return p.hostname, proxy_port, headers


class GuardedFetcher(FetcherInterface):
    """A python-tuf fetcher (http.client) that also refuses slow retrieval (see the module docstring) and goes
    through the proxy the environment names, as urllib does (``proxy_for``)."""

    def __init__(self, grace_s: float = 30.0, min_bytes_per_s: int = 2048, socket_timeout_s: float = 30.0,
                 user_agent: str = "edgefleet-agent"):
        self.grace_s = grace_s  # no speed check before this much time has passed
        self.min_bytes_per_s = min_bytes_per_s  # average speed a download must keep after grace_s
        self.socket_timeout_s = socket_timeout_s  # connect, and longest gap between two reads
        self.user_agent = user_agent

    def _fetch(self, url: str) -> Iterator[bytes]:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise tuf_exc.DownloadError(f"unsupported URL {url!r}")
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        headers = {"User-Agent": self.user_agent}
        try:
            port = u.port
        except ValueError as exc:
            raise tuf_exc.DownloadError(f"unsupported URL {url!r}: {exc}") from exc
        via = proxy_for(u.scheme, u.hostname, port)
        conn: http.client.HTTPConnection
        if via is None:
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conn = cls(u.hostname, port, timeout=self.socket_timeout_s)
        elif u.scheme == "https":  # a tunnel through the proxy; TLS end to end with the fleet
            conn = http.client.HTTPSConnection(via[0], via[1], timeout=self.socket_timeout_s)
            conn.set_tunnel(u.hostname, port, headers=via[2])
        else:  # the proxy fetches the absolute URL
            conn = http.client.HTTPConnection(via[0], via[1], timeout=self.socket_timeout_s)
            path = f"http://{u.netloc.rpartition('@')[2]}{path}"
            headers.update(via[2])
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise tuf_exc.DownloadError(f"GET {url}: {exc}") from exc
        if resp.status != 200:
            conn.close()
            raise tuf_exc.DownloadHTTPError(f"GET {url}: HTTP {resp.status}", resp.status)
        return self._chunks(url, conn, resp)

    def _chunks(self, url: str, conn: http.client.HTTPConnection,
                resp: http.client.HTTPResponse) -> Iterator[bytes]:
        start = time.monotonic()
        got = 0
        try:
            while True:
                try:
                    chunk = resp.read1(64 * 1024)  # returns what has arrived; never waits to fill
                except (OSError, http.client.HTTPException) as exc:
                    raise tuf_exc.DownloadError(f"GET {url}: {exc}") from exc
                if not chunk:
                    return
                got += len(chunk)
                elapsed = time.monotonic() - start
                if elapsed > self.grace_s and got / elapsed < self.min_bytes_per_s:
                    raise tuf_exc.SlowRetrievalError(
                        f"GET {url}: {got} bytes in {elapsed:.0f}s, below the {self.min_bytes_per_s} B/s "
                        "minimum (slow-retrieval attack or a dying link)")
                yield chunk
        finally:
            conn.close()


@dataclass(frozen=True)
class FetchedBundle:
    path: Path
    sha256: str
    length: int
    custom: TargetCustom  # what the fleet (or CI) signed about the bundle


class BundleFetcher:
    def __init__(self, state_dir: Path, metadata_url: str, targets_url: str, trusted_root: Path | None,
                 root_from_fleet: bytes | None = None, grace_s: float = 30.0, min_bytes_per_s: int = 2048):
        """``trusted_root`` (root.json from ``edgefleet keys init``) anchors trust. Without it the
        fleet's current root is trusted on first use (``root_from_fleet``), which the caller logs.
        Every download must average ``min_bytes_per_s`` once ``grace_s`` have passed."""
        self.grace_s = grace_s
        self.min_bytes_per_s = min_bytes_per_s
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
              precheck: Callable[[TargetCustom], None] | None = None) -> FetchedBundle:
        """Verify the metadata, call ``precheck`` with the target's signed custom fields (it raises to
        refuse the bundle before a byte of it is downloaded), then download and verify the bundle. Custom
        fields this agent cannot read (a field of a newer fleet, a wrong type) are a TrustError naming them."""
        from tuf.api import exceptions as tuf_exc
        from tuf.ngclient import Updater, UpdaterConfig

        self.clean()
        try:
            updater = Updater(str(self.metadata_dir), self.metadata_url, str(self.download_dir), self.targets_url,
                              fetcher=GuardedFetcher(self.grace_s, self.min_bytes_per_s),
                              config=UpdaterConfig(app_user_agent="edgefleet-agent"), bootstrap=None)
            updater.refresh()
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
            updater.download_target(info, str(dest))
        except (tuf_exc.RepositoryError, tuf_exc.DownloadLengthMismatchError) as exc:
            # a length mismatch is the endless-data attack, not a network fault: never retried
            raise TrustError(f"TUF verification failed: {type(exc).__name__}: {exc}") from exc
        except tuf_exc.DownloadError as exc:
            raise FetchError(f"download from the fleet failed: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise FetchError(f"download from the fleet failed: {exc}") from exc
        return FetchedBundle(dest, signed_sha, info.length, custom)
