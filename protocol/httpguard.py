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
- at most ``max_pipelined`` requests read and waiting behind the one being answered, per connection. uvicorn parses
  every request in what it has read and queues those it cannot begin yet (its ``pipeline``: ~2.6 KB of objects
  per 40-byte GET, 90 MB in 3 s from 40 connections that never read their answers); past the cap the guard feeds
  the parser no further, keeps the rest of that read and stops reading (``pause_reading``, which uvicorn's own
  resumes after each answer leave alone meanwhile) until one is answered. Feeding stops at a request's end: a
  body's by its Content-Length, a chunked one's by following its framing;
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
import re
import resource
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Gate", "HttpLimits", "connection_cap", "guarded"]

log = logging.getLogger("edgefleet.http")

_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}
_LOG_EVERY_S = 10.0  # refused connections and requests: one log line with a count per interval
# a chunk-size line, as llhttp takes it: its start (at most 64 bytes of it), and the line whole
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;|\r?$)")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\n]*)?\r?\n")


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
    max_pipelined: int = 16  # requests read and waiting behind the one being answered, per connection
    max_connections: int = 1024  # at once, every peer together (and at most connection_cap's share)
    max_connections_per_peer: int = 256  # at once, from one address
    reserve_fds: int = 128  # descriptors kept for the process's own work
    fd_share: float = 1.0  # the part of the rest this listener may hold (the fleet shares it with its broker)

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "idle_timeout_s", "body_grace_s", "fd_share"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("min_body_bytes_per_s", "max_head_bytes", "max_headers", "max_chunk_line_bytes",
                     "max_pipelined", "max_connections", "max_connections_per_peer"):
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
            self._g_held, self._g_held_at = b"", 0  # a read's bytes from _g_held_at on: not fed while at the cap
            self._g_refeed_due = False
            self._g_framed = False  # _g_length and the _g_ck_ fields read for the body being read
            self._g_length: int | None = 0  # the body's Content-Length; None: chunked, its framing followed in:
            self._g_ck_left, self._g_ck_line = 0, b""  # the chunk's bytes left (and CRLF), a size line's start
            self._g_ck_trailers, self._g_ck_done = False, False  # in the trailers; past the body's end
            self._g_admitted = gate.admit(self._g_peer)
            if not self._g_admitted:
                transport.write(_answer(503, "too many connections; retry later"))
                transport.close()
                return
            self._g_begin_head()
            gate.idle[self] = None
            # uvicorn resumes reading after each answer and when a handler reads: not while bytes are held (the
            # connection is referred to weakly: no cycle through its flow control)
            me = weakref.ref(self)

            def resume_reading() -> None:
                g = me()
                if g is not None and not g._g_held:
                    type(g.flow).resume_reading(g.flow)
            self.flow.resume_reading = resume_reading

        def connection_lost(self, exc: Exception | None) -> None:
            if self._g_admitted:
                self._g_admitted = False
                gate.release(self._g_peer)
                gate.idle.pop(self, None)
            for timer in (self._g_timer, self._g_write_timer):
                if timer is not None:
                    timer.cancel()
            self._g_timer = self._g_write_timer = None
            self._g_held, self._g_held_at = b"", 0
            super().connection_lost(exc)

        def _g_begin_head(self) -> None:
            self._g_phase, self._g_head_bytes, self._g_tail = _HEAD, 0, b""
            self._g_start = self.loop.time()
            if self._g_timer is None:  # one already set fires earlier and sets itself again (_g_expire)
                self._g_timer = self.loop.call_at(self._g_start + limits.head_timeout_s, self._g_expire)

        def data_received(self, data: bytes) -> None:
            gate.idle.pop(self, None)
            if self._g_held:  # reading is paused while bytes are held: only a read already under way lands here
                self._g_held, self._g_held_at = self._g_held[self._g_held_at:] + data, 0
                return
            self._g_feed(data, 0)

        def _g_feed(self, data: bytes, at: int) -> None:
            """Feed the parser ``data`` from ``at`` on, a request's head or body at a time; the rest is held when
            the next request would wait behind ``max_pipelined`` others."""
            view, n = memoryview(data), len(data)
            while at < n:
                if self._g_phase == _BETWEEN:  # the first bytes of the next request
                    if len(self.pipeline) >= limits.max_pipelined:  # read on once one of them is answered
                        self._g_held, self._g_held_at = data, at
                        self.flow.pause_reading()
                        return
                    self._g_begin_head()
                if self._g_phase == _HEAD:  # up to the head's end (CRLF CRLF, as llhttp wants it), if it is here
                    room = limits.max_head_bytes - self._g_head_bytes
                    if room <= 0:
                        self._g_refuse(431, f"the request head is over {limits.max_head_bytes} bytes")
                        return
                    stop, tail, end = min(n, at + room), self._g_tail, -1
                    if tail:  # the last bytes of the head so far: CRLF CRLF may straddle two reads
                        end = (tail + data[at:min(stop, at + 3)]).find(b"\r\n\r\n")
                        end = at + end + 4 - len(tail) if end >= 0 else -1
                    if end < 0:
                        end = data.find(b"\r\n\r\n", at, stop)
                        end = end + 4 if end >= 0 else -1
                    cut = stop if end < 0 else end
                    self._g_head_bytes += cut - at
                    if end < 0:
                        self._g_tail = (tail + data[max(at, cut - 3):cut])[-3:]
                    piece, at = view[at:cut], cut
                    super().data_received(piece)
                    if self.transport.is_closing():
                        return
                    continue
                # in a body: up to its end if it is in this read, so that a request after it is fed on its own
                end, body, self._g_chunks, self._g_fresh = self._g_body_end(data, at), self._g_body, 0, False
                piece, size, at = view[at:end], end - at, end
                super().data_received(piece)
                if self.transport.is_closing():
                    return
                # the bytes that were not body (chunk-size lines, extensions, trailers), unless a pipelined
                # request's body began in this piece: its count starts with the next one
                if self._g_phase == _BODY and not self._g_fresh:
                    self._g_line = (0 if self._g_chunks else self._g_line) + size - (self._g_body - body)
                    if self._g_line > (self._g_chunks + 1) * limits.max_chunk_line_bytes:
                        self._g_refuse(400, f"a chunk-size line or the trailers over "
                                            f"{limits.max_chunk_line_bytes} bytes")
                        return

        def _g_body_end(self, data: bytes, at: int) -> int:
            """Where in ``data`` the body being read ends: by its Content-Length, or for a chunked one past its
            last line, following its framing (llhttp checks it: framing it refuses ends the connection anyway).
            The read's end if the body goes on past it, or where this reading and llhttp's would part."""
            n = len(data)
            if not self._g_framed:  # llhttp has checked the headers: one Content-Length of digits, or chunked
                framing = dict(h for h in self.headers if h[0] in (b"content-length", b"transfer-encoding"))
                length = framing.get(b"content-length", b"0")
                self._g_length = None if b"transfer-encoding" in framing else int(length) if length.isdigit() else 0
                self._g_ck_left, self._g_ck_line, self._g_ck_trailers, self._g_ck_done = 0, b"", False, False
                self._g_framed = True
            if self._g_length is not None:
                end = at + self._g_length - self._g_body
                return min(n, end) if end > at else n
            while at < n and not self._g_ck_done:
                if self._g_ck_left:  # a chunk's data and its CRLF
                    step = min(self._g_ck_left, n - at)
                    self._g_ck_left -= step
                    at += step
                    continue
                whole = None if self._g_ck_line or self._g_ck_trailers else _CHUNK_LINE.match(data, at)
                if whole is not None:  # a chunk-size line whole in this read, as most are
                    size, at = whole[1], whole.end()
                else:
                    nl = data.find(b"\n", at)
                    # of a line, its start is all that is needed (a chunk's size; whether a trailer line is empty)
                    line = (self._g_ck_line + data[at:min(n if nl < 0 else nl, at + 64)])[:64]
                    if nl < 0:
                        self._g_ck_line = line
                        return n
                    self._g_ck_line, at = b"", nl + 1
                    if self._g_ck_trailers:
                        if line in (b"", b"\r"):  # the empty line that ends the trailers, and the body
                            self._g_ck_done = True
                            return at
                        continue
                    start = _CHUNK_SIZE.match(line)
                    if start is None:  # llhttp refuses it
                        self._g_ck_done = True
                        break
                    size = start[1]
                left = int(size, 16)
                if left == 0:  # the last chunk: trailers follow
                    self._g_ck_trailers = True
                else:  # its data and CRLF, as far as they are in this read
                    step = min(left + 2, n - at)
                    self._g_ck_left, at = left + 2 - step, at + step
            return n

        def _g_refeed(self) -> None:
            """After an answer: the bytes held at the cap, fed as if just read; reading resumes once none is left
            (as uvicorn asked after its answer, unless the feed pauses it again)."""
            self._g_refeed_due = False
            if not self._g_held or self.transport.is_closing():
                return
            data, at = self._g_held, self._g_held_at
            self._g_held, self._g_held_at = b"", 0
            self.flow.resume_reading()  # no read comes before this callback returns: the feed may pause again
            self._g_feed(data, at)

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
            self._g_framed = False  # how its body ends: read from these headers at its first bytes
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
            super().on_response_complete()  # begins the next request waiting, if one is
            if self.transport.is_closing():
                return
            if self._g_held:  # one fewer waits: read on (soon: not inside the handler's last send)
                if not self._g_refeed_due:
                    self._g_refeed_due = True
                    self.loop.call_soon(self._g_refeed)
            elif not pipelined and self._g_phase == _BETWEEN:
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
