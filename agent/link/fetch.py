"""Every HTTP exchange the agent has with its fleet (bootstrap, the first root, enrollment, TUF metadata and
bundles, the signed time) goes through ``FleetHttp``: each answer is bounded in bytes and in total time.

Bounds of one answer (``FleetHttp.read``, the one place they are checked):

- bytes: at most ``max_bytes`` (a fixed bound for bootstrap, enrollment and the signed time; the signed length
  for a bundle; python-tuf's per-role bound or the signed length for metadata). One byte more ends it;
- time: the whole answer, head and body, from the request on, within ``deadline_s + max_bytes / min_bytes_per_s``
  seconds (the allowance plus the time to move the bound at the minimum speed), however the bytes arrive: at the
  deadline a watchdog shuts the socket down, so no read stays blocked past it;
- speed: once ``grace_s`` have passed, at least ``min_bytes_per_s`` on average (like curl's --speed-limit), so a
  dribbling server is cut off long before the deadline;
- gaps: no read waits longer than ``socket_timeout_s``.

A broken bound raises python-tuf's download errors (``SlowRetrievalError``, ``DownloadLengthMismatchError``):
under the TUF client they are what python-tuf expects of a fetcher, and the callers outside it (``get_json``)
translate them into ``FetchError``, which every caller retries with backoff while the served model keeps serving.

Proxies: the proxy ``HTTP_PROXY`` / ``HTTPS_PROXY`` name is used, except for the hosts ``NO_PROXY`` lists, by
urllib's own rules; an https request is tunnelled (CONNECT), so TLS is still checked against the fleet's name.

Kept apart from the TUF client (agent/link/updater.py) so that a range request (a resumed download) is one more
argument to ``open``, read under the same bounds.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import math
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from tuf.api import exceptions as tuf_exc

from ...protocol import jsonlimits
from ...protocol.errors import ContractError
from ..errors import FetchError

__all__ = ["SMALL_ANSWER_BYTES", "FetchLimits", "FleetHttp", "proxy_for"]

SMALL_ANSWER_BYTES = 64 * 1024  # bootstrap, enrollment, the signed time: a few hundred bytes each


@dataclass(frozen=True)
class FetchLimits:
    deadline_s: float = 60.0  # a whole answer's allowance, plus max_bytes at min_bytes_per_s
    grace_s: float = 30.0  # no speed check before this much time has passed
    min_bytes_per_s: int = 2048  # average speed an answer must keep after grace_s (0: none)
    socket_timeout_s: float = 30.0  # connect, and the longest gap between two reads

    def __post_init__(self) -> None:
        for name in ("deadline_s", "grace_s", "socket_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 86_400):
                raise ValueError(f"{name} must be in (0, 86400] seconds, not {v!r}")
        if not (isinstance(self.min_bytes_per_s, int) and self.min_bytes_per_s >= 0):
            raise ValueError(f"min_bytes_per_s must be an integer >= 0, not {self.min_bytes_per_s!r}")

    def deadline_for(self, max_bytes: int) -> float:
        """Seconds a whole answer of at most ``max_bytes`` may take."""
        return self.deadline_s + (max_bytes / self.min_bytes_per_s if self.min_bytes_per_s else 0.0)


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


class _Watchdog:
    """Shuts the connection's socket down at the answer's deadline: a recv blocked in the head (http.client reads
    it line by line, each recv with its own timeout) or in the body returns at once, however the bytes drip."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: float):
        self.conn, self.deadline = conn, deadline
        self.fired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


@dataclass(frozen=True)
class Answer:
    """An open answer: its status, and its body to read under the bounds (``FleetHttp.read``)."""

    url: str
    status: int
    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    started: float  # time.monotonic() when the request was sent
    max_bytes: int  # the body's bound, and what the deadline was computed from
    watchdog: _Watchdog

    def close(self) -> None:
        self.watchdog.cancel()
        self.conn.close()


class FleetHttp:
    """HTTP to the fleet with the bounds of the module docstring."""

    def __init__(self, limits: FetchLimits | None = None, user_agent: str = "edgefleet-agent"):
        self.limits = limits or FetchLimits()
        self.user_agent = user_agent

    def _late(self, url: str, started: float, max_bytes: int, got: int | None = None) -> tuf_exc.SlowRetrievalError:
        what = "its head" if got is None else f"{got} bytes"
        allowed = self.limits.deadline_for(max_bytes)
        return tuf_exc.SlowRetrievalError(
            f"GET {url}: {what} in {time.monotonic() - started:.0f}s, past the {allowed:.0f}s deadline of an "
            f"answer of at most {max_bytes} bytes (slow-retrieval attack or a dying link)")

    def open(self, url: str, max_bytes: int, method: str = "GET", body: bytes | None = None,
             headers: dict[str, str] | None = None) -> Answer:
        """Send the request and read the answer's head, both within the answer's deadline (``max_bytes``: the
        body's bound, which the deadline is computed from)."""
        started = time.monotonic()
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise tuf_exc.DownloadError(f"unsupported URL {url!r}")
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        sent = {"User-Agent": self.user_agent, **(headers or {})}
        try:
            port = u.port
        except ValueError as exc:
            raise tuf_exc.DownloadError(f"unsupported URL {url!r}: {exc}") from exc
        via = proxy_for(u.scheme, u.hostname, port)
        timeout = self.limits.socket_timeout_s
        conn: http.client.HTTPConnection
        if via is None:
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conn = cls(u.hostname, port, timeout=timeout)
        elif u.scheme == "https":  # a tunnel through the proxy; TLS end to end with the fleet
            conn = http.client.HTTPSConnection(via[0], via[1], timeout=timeout)
            conn.set_tunnel(u.hostname, port, headers=via[2])
        else:  # the proxy fetches the absolute URL
            conn = http.client.HTTPConnection(via[0], via[1], timeout=timeout)
            path = f"http://{u.netloc.rpartition('@')[2]}{path}"
            sent.update(via[2])
        watchdog = _Watchdog(conn, started + self.limits.deadline_for(max_bytes))
        try:
            conn.request(method, path, body=body, headers=sent)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            watchdog.cancel()
            conn.close()
            if watchdog.fired:
                raise self._late(url, started, max_bytes) from exc
            raise tuf_exc.DownloadError(f"{method} {url}: {exc}") from exc
        if watchdog.fired:  # a head cut short by the watchdog can parse as a complete one
            watchdog.cancel()
            conn.close()
            raise self._late(url, started, max_bytes)
        return Answer(url, resp.status, conn, resp, started, max_bytes, watchdog)

    def read(self, answer: Answer, prior_bytes: int = 0, prior_s: float = 0.0) -> Iterator[bytes]:
        """The answer's body in chunks, within its bounds; the connection is closed at the end, or on any error.
        ``prior_bytes`` in ``prior_s`` seconds: what earlier answers of a resumed download brought, counted in the
        speed check (agent/link/resume.py), so a link that drips a little per connection stays refused."""
        lim, max_bytes = self.limits, answer.max_bytes
        got = 0
        try:
            while True:
                try:
                    chunk = answer.resp.read1(64 * 1024)  # returns what has arrived; never waits to fill
                except (OSError, http.client.HTTPException) as exc:
                    if answer.watchdog.fired:
                        raise self._late(answer.url, answer.started, max_bytes, got) from exc
                    raise tuf_exc.DownloadError(f"GET {answer.url}: {exc}") from exc
                if answer.watchdog.fired:  # the socket was shut down: what came before it may end "cleanly"
                    raise self._late(answer.url, answer.started, max_bytes, got)
                if not chunk:
                    return
                got += len(chunk)
                if got > max_bytes:
                    raise tuf_exc.DownloadLengthMismatchError(
                        f"GET {answer.url}: more than the {max_bytes} bytes expected (endless data?)")
                elapsed = time.monotonic() - answer.started + prior_s
                if elapsed > lim.grace_s and (got + prior_bytes) / elapsed < lim.min_bytes_per_s:
                    raise tuf_exc.SlowRetrievalError(
                        f"GET {answer.url}: {got + prior_bytes} bytes in {elapsed:.0f}s, below the "
                        f"{lim.min_bytes_per_s} B/s minimum (slow-retrieval attack or a dying link)")
                yield chunk
        finally:
            answer.close()

    def get(self, url: str, max_bytes: int = SMALL_ANSWER_BYTES, method: str = "GET", body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """(status, body) of a small answer, whatever its status; FetchError when it breaks a bound or the
        connection fails (a retry may fix it)."""
        try:
            answer = self.open(url, max_bytes, method, body, headers)
            return answer.status, b"".join(self.read(answer))
        except tuf_exc.DownloadError as exc:
            raise FetchError(f"{type(exc).__name__}: {exc}") from exc

    def get_ok(self, url: str, max_bytes: int = SMALL_ANSWER_BYTES) -> bytes:
        """The body of an answer the fleet gives with 200; FetchError otherwise."""
        status, data = self.get(url, max_bytes)
        if status != 200:
            raise FetchError(f"GET {url}: HTTP {status}")
        return data

    def get_json(self, url: str, max_bytes: int = SMALL_ANSWER_BYTES) -> Any:
        """A JSON document the fleet answers with 200 (parsed within jsonlimits' bounds); FetchError otherwise."""
        data = self.get_ok(url, max_bytes)
        try:
            return jsonlimits.loads(data, source=f"GET {url}", max_bytes=max_bytes)
        except ContractError as exc:
            raise FetchError(str(exc)) from exc
