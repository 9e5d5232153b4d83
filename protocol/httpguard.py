"""The HTTP listeners' connection guard (agent and fleet): deadlines, head limits and connection caps.

Both HTTP servers run uvicorn's httptools protocol (llhttp: 1.5-2x h11's requests/s, bench/README.md). llhttp
already refuses request smuggling (a Content-Length with a Transfer-Encoding, two Content-Lengths, a chunked
coding that is not last: 400 and close), but it has no limit on a request head's size, and uvicorn sets no
deadline on a connection before its first request, on a request head or on a body, and no cap on connections.
:func:`guarded` wraps the protocol class (it is handed in: this module imports nothing beyond the standard
library) and adds, per :class:`HttpLimits`:

- a deadline for a connection's first request head and for each later one (from its first byte): 408, close;
- a deadline for a body, earned by its bytes: ``body_grace_s`` plus one second per ``min_body_bytes_per_s``
  received (a drip-fed body ends; a large body sent at a fair rate does not; time while the server itself has
  stopped reading is not counted); 408, close;
- a head of at most ``max_head_bytes`` (counted as it arrives, before llhttp buffers a value) and at most
  ``max_headers`` header lines: 431, close (trailers are bounded with the chunk-size lines);
- chunk-size lines (size and extensions) of at most ``max_chunk_line_bytes`` each: 400, close;
- a client that stops reading its answers (the transport's buffer full) for ``body_grace_s``: closed;
- at most ``max_connections`` connections at once, of them at most ``max_connections_per_peer`` from one
  address: a connection past its address's share is answered 503 and closed at once; at the total cap, the
  connection idle the longest is closed to make room (503 only when none is idle), so connections that send
  nothing, from however many addresses, never lock the others out. :func:`connection_cap` keeps the total
  below the descriptor limit with room for the process's own work (files, database, MQTT).

The idle time between keep-alive requests is uvicorn's own ``timeout_keep_alive`` (give it ``idle_timeout_s``).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Gate", "HttpLimits", "connection_cap", "guarded"]

log = logging.getLogger("edgefleet.http")

_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}
_LOG_EVERY_S = 10.0  # refused connections and requests: one log line with a count per interval


@dataclass(frozen=True)
class HttpLimits:
    head_timeout_s: float = 10.0  # a request head, from the connection's start or the request's first byte
    idle_timeout_s: float = 5.0  # between keep-alive requests (uvicorn's timeout_keep_alive)
    body_grace_s: float = 10.0  # a body's deadline: this (the agent and fleet: their head timeout), plus a second
    # per min_body_bytes_per_s received
    min_body_bytes_per_s: int = 64 * 1024
    max_head_bytes: int = 64 * 1024  # request line and headers
    max_headers: int = 100
    max_chunk_line_bytes: int = 4096
    max_connections: int = 1024  # at once, every peer together (and at most connection_cap's share)
    max_connections_per_peer: int = 256  # at once, from one address
    reserve_fds: int = 128  # descriptors kept for the process's own work
    fd_share: float = 1.0  # the part of the rest this listener may hold (the fleet shares it with its broker)

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "idle_timeout_s", "body_grace_s", "fd_share"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("min_body_bytes_per_s", "max_head_bytes", "max_headers", "max_chunk_line_bytes",
                     "max_connections", "max_connections_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def connection_cap(limits: HttpLimits) -> int:
    """The most connections the listener holds at once: ``max_connections``, lowered to its share of the
    descriptors the process may open past ``reserve_fds`` (RLIMIT_NOFILE's soft limit, as it is now)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, int((soft - limits.reserve_fds) * limits.fd_share)))


class Gate:
    """The connections one listener holds, in all and per address (used on its event loop only). Its
    connections are objects it keeps as keys; ``evict(connection)`` closes one to make room (by default its
    ``transport.close()``), and the listener calls :meth:`release` once it is gone. Also the gRPC port's
    (agent/transports/grpc_front.py); ``what`` names the listener in the log."""

    def __init__(self, cap: int, per_peer: int, what: str = "HTTP",
                 evict: Callable[[Any], None] = lambda c: c.transport.close()):
        self.cap = cap
        self.per_peer = min(per_peer, cap)
        self.what, self.evict = what, evict
        self.total = 0
        self.peers: dict[str, int] = {}
        self.idle: dict[Any, None] = {}  # admitted connections with nothing in progress, idle the longest first
        self.refused: dict[str, int] = {}  # why -> how many since the last log line
        self.logged_at = 0.0

    def admit(self, peer: str) -> bool:
        """Whether a new connection from ``peer`` may stay. At the total cap, the connection idle the longest
        (nothing in progress for the longest time) is closed to make room: connections from many addresses that
        send nothing cannot lock the others out. Past ``peer``'s own cap, or with none idle: no."""
        held = self.peers.get(peer, 0)
        if held >= self.per_peer:
            self.note("connections refused at the per-address cap")
            return False
        if self.total >= self.cap:
            if not self.idle:
                self.note("connections refused at the cap")
                return False
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            self.evict(oldest)  # released when it is lost: the total stays within the cap and this one
            self.note("idle connections closed at the cap for a new one")
        self.total += 1
        self.peers[peer] = held + 1
        return True

    def release(self, peer: str) -> None:
        self.total -= 1
        held = self.peers.pop(peer, 1) - 1
        if held > 0:
            self.peers[peer] = held

    def note(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1
        now = time.monotonic()
        if now - self.logged_at >= _LOG_EVERY_S:
            log.warning("%s: %s in the last %.0f s (%d connections held, cap %d, %d per address)", self.what,
                        ", ".join(f"{n} {w}" for w, n in self.refused.items()), _LOG_EVERY_S, self.total,
                        self.cap, self.per_peer)
            self.refused.clear()
            self.logged_at = now


def _answer(status: int, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _Refused(Exception):
    pass


def _quiet(record: logging.LogRecord) -> bool:
    """uvicorn's line per unparsable request: a client could fill the disk with them (the gate counts them)."""
    return not (record.msg in ("Invalid HTTP request received.", "Unsupported upgrade request.")
                or str(record.msg).startswith("No supported WebSocket library detected"))


_HEAD, _BODY, _BETWEEN = 0, 1, 2  # where the parser is: in a head, in a body, between requests


def guarded(base: type, limits: HttpLimits) -> type:
    """uvicorn's httptools protocol class ``base`` with :class:`HttpLimits` held on every connection; the
    returned class's connections share one cap (make one class per listener)."""
    gate = Gate(connection_cap(limits), limits.max_connections_per_peer)
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _quiet not in uvicorn_log.filters:
        uvicorn_log.addFilter(_quiet)

    class Guarded(base):  # type: ignore[misc, valid-type]
        _gate = gate

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._g_peer = str((self.client or ("?",))[0])
            self._g_timer: Any = None
            self._g_write_timer: Any = None
            self._g_line: int = 0  # bytes of the body's framing since its last chunk-size line began
            self._g_admitted = gate.admit(self._g_peer)
            if not self._g_admitted:
                transport.write(_answer(503, "too many connections; retry later"))
                transport.close()
                return
            self._g_begin_head()
            gate.idle[self] = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._g_admitted:
                self._g_admitted = False
                gate.release(self._g_peer)
                gate.idle.pop(self, None)
            for timer in (self._g_timer, self._g_write_timer):
                if timer is not None:
                    timer.cancel()
            self._g_timer = self._g_write_timer = None
            super().connection_lost(exc)

        def _g_begin_head(self) -> None:
            self._g_phase, self._g_head_bytes, self._g_tail = _HEAD, 0, b""
            self._g_start = self.loop.time()
            if self._g_timer is None:  # one already set fires earlier and sets itself again (_g_expire)
                self._g_timer = self.loop.call_at(self._g_start + limits.head_timeout_s, self._g_expire)

        def data_received(self, data: bytes) -> None:
            gate.idle.pop(self, None)
            while data:
                if self._g_phase == _BETWEEN:  # the first bytes of the next request
                    self._g_begin_head()
                if self._g_phase == _HEAD:  # up to the head's end (CRLF CRLF, as llhttp wants it), if it is here
                    room = limits.max_head_bytes - self._g_head_bytes
                    if room <= 0:
                        self._g_refuse(431, f"the request head is over {limits.max_head_bytes} bytes")
                        return
                    tail = self._g_tail  # the last bytes of the head so far: CRLF CRLF may straddle two reads
                    end = (tail + data[:room]).find(b"\r\n\r\n") - len(tail) if tail else data.find(
                        b"\r\n\r\n", 0, room)
                    cut = min(len(data), room) if end < -len(tail) else end + 4
                    piece, data = (data, b"") if cut >= len(data) else (data[:cut], data[cut:])
                    self._g_head_bytes += len(piece)
                    if end < -len(tail):
                        self._g_tail = (tail + piece)[-3:]
                    super().data_received(piece)
                    if self.transport.is_closing():
                        return
                    continue
                piece, data, body, self._g_chunks, self._g_fresh = data, b"", self._g_body, 0, False  # in a body
                super().data_received(piece)
                if self.transport.is_closing():
                    return
                # the bytes that were not body (chunk-size lines, extensions, trailers), unless a pipelined
                # request's body began in this piece: its count starts with the next one
                if self._g_phase == _BODY and not self._g_fresh:
                    self._g_line = (0 if self._g_chunks else self._g_line) + len(piece) - (self._g_body - body)
                    if self._g_line > (self._g_chunks + 1) * limits.max_chunk_line_bytes:
                        self._g_refuse(400, f"a chunk-size line or the trailers over "
                                            f"{limits.max_chunk_line_bytes} bytes")
                        return

        # -- the parser's callbacks --------------------------------------------------------------------
        def on_message_begin(self) -> None:
            if self._g_phase != _HEAD:  # a pipelined request, begun in the bytes after the last one
                self._g_begin_head()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            # counted once here, not per line: the head's byte limit already bounds what llhttp and uvicorn hold
            if len(self.headers) > limits.max_headers:
                self._g_status = 431
                raise _Refused(f"more than {limits.max_headers} header lines")
            self._g_phase, self._g_body, self._g_line, self._g_chunks, self._g_fresh = _BODY, 0, 0, 0, True
            self._g_start = self._g_checked = self.loop.time()
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._g_body += len(body)
            super().on_body(body)

        def on_chunk_header(self) -> None:
            self._g_chunks += 1

        def on_message_complete(self) -> None:
            self._g_phase = _BETWEEN  # the server's time now: uvicorn's keep-alive timeout follows the response
            if len(self.headers) > limits.max_headers:  # trailers too
                self._g_status = 431
                raise _Refused(f"more than {limits.max_headers} header lines")
            super().on_message_complete()

        # -- a client that does not read its answers ------------------------------------------------------
        def pause_writing(self) -> None:  # the transport's buffer is full: the client is not reading
            super().pause_writing()
            if self._g_write_timer is None:
                self._g_write_timer = self.loop.call_later(limits.body_grace_s, self._g_write_expire)

        def resume_writing(self) -> None:
            if self._g_write_timer is not None:
                self._g_write_timer.cancel()
                self._g_write_timer = None
            super().resume_writing()

        def _g_write_expire(self) -> None:
            self._g_write_timer = None
            if self.transport is not None and not self.transport.is_closing():
                gate.note("connections closed: their client stopped reading")
                self.transport.abort()  # what is buffered for it is dropped: it did not read it in time

        def _should_upgrade_to_ws(self) -> bool:
            # neither listener serves WebSockets, and an upgraded connection would leave this protocol (and the
            # cap's count) for uvicorn's WebSocket one: an Upgrade header is answered as plain HTTP
            return False

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)
            super().on_response_complete()
            if not pipelined and self._g_phase == _BETWEEN and not self.transport.is_closing():
                gate.idle[self] = None  # kept alive for the next request: idle until it begins

        def send_400_response(self, msg: str) -> None:  # uvicorn's answer to a parser error (and to _Refused)
            status = getattr(self, "_g_status", 400)
            self._g_refuse(status, msg if status == 400 else f"more than {limits.max_headers} header lines")

        # -- deadlines and refusals ----------------------------------------------------------------
        def _g_expire(self) -> None:
            self._g_timer = None
            if self.transport is None or self.transport.is_closing() or self._g_phase == _BETWEEN:
                return
            now = self.loop.time()
            if self._g_phase == _HEAD:
                deadline, what = self._g_start + limits.head_timeout_s, "request head"
            else:
                if self.flow is not None and self.flow.read_paused:  # the server is not reading: not counted
                    self._g_start += now - self._g_checked
                self._g_checked = now
                deadline = self._g_start + limits.body_grace_s + self._g_body / limits.min_body_bytes_per_s
                what = "request body"
            if now < deadline:
                self._g_timer = self.loop.call_at(deadline, self._g_expire)
            elif self._g_phase == _HEAD and self._g_head_bytes == 0:  # nothing asked: nothing to answer
                gate.note("idle connections closed")
                self.transport.close()
            else:
                self._g_refuse(408, f"the {what} did not arrive in time")

        def _g_refuse(self, status: int, message: str) -> None:
            gate.note(f"requests refused with {status}")
            cycle = getattr(self, "cycle", None)
            # no second answer to a request already answered (or being answered): the earlier one stands
            if cycle is None or not cycle.response_started or (cycle.response_complete and self._g_phase == _HEAD):
                self.transport.write(_answer(status, message))
            if cycle is not None:
                cycle.keep_alive = False
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
