"""The gRPC port's front: a per-address connection cap, and room made at the total cap (issue 45.1).

gRPC core shows no code a connection before its first call and can only refuse one past its total cap, so one
address that opened ``grpc_max_connections`` connections locked every other client out. The agent's gRPC server
therefore listens on a Unix socket in a folder of its own (mode 0700: no other user reaches it), and this front
takes the public TCP port: each connection it accepts is admitted by the same accounting as the HTTP listeners
(protocol/httpguard.py's :class:`Gate`: at most ``per_peer`` from one address, past that closed as accepted; at
the total cap, the connection idle the longest is closed to make room, and only with none idle is the new one
closed), then spliced, bytes both ways, to a connection of its own to the gRPC server.

"Idle" is gRPC's own sense (``grpc.max_connection_idle_ms``): no call in progress. The front reads the 9-byte
HTTP/2 frame headers going by (never a payload; the port is plaintext h2c): a client's HEADERS on a new stream
starts a call, the server's END_STREAM or either side's RST_STREAM ends it. A connection is idle from its start
and from the end of its last call; frames that are no call (PING, SETTINGS, WINDOW_UPDATE) neither refresh nor
hide it. A connection with more than ``MAX_OPEN_STREAMS`` calls open is closed.

A call's request must arrive within ``stall_timeout_s`` of its HEADERS, plus a second per
``MIN_REQUEST_BYTES_PER_S`` of it received (its END_STREAM ends the count); else its connection is closed, and gRPC
core cancels its calls. gRPC core has no such deadline: calls begun and never sent held every slot of the agent's
concurrent calls (``grpc_concurrency``), so that every other call, health too, got RESOURCE_EXHAUSTED for as long
as their client liked. Within the deadline one address may have at most ``sending_per_peer`` calls begun and not
wholly sent (a quarter of the slots): the connection whose call passes that is closed. A client that sends each
request whole at once (as gRPC's do for a small message) never comes near it.

Back-pressure passes through: a side whose buffer is full pauses reading the other. A client that reads none of
its answers for ``stall_timeout_s`` is cut off (its buffered bytes dropped). The handshake and idle timeouts are
gRPC core's, on the inner connection: when it closes, so does the client's.

Who the client is (for system shared memory, agent/transports/peer.py): each inner connection is bound to an
abstract Unix address the kernel picks (autobind), which gRPC shows as the call's peer ("unix-abstract:..."):
:meth:`GrpcFront.origin` maps it back to the client's TCP address. A peer it does not know (a connection made
straight to the private socket, or one whose client has gone) has no address: it cannot register a region.

Cost (bench/grpc_front.py, digits over gRPC, 4 clients, against gRPC core's socket directly in the same run, on a
loaded 2-core box): 0.706 against 0.669 ms of the agent's CPU per request (+5.5%); bench/README.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any, cast

from ...protocol.httpguard import Gate

__all__ = ["MAX_OPEN_STREAMS", "GrpcFront"]

MAX_OPEN_STREAMS = 1024  # calls open at once on one connection (the server runs at most grpc_concurrency)
_PREFACE_BYTES = 24  # "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", before the client's first frame
_FRAME_HEAD = struct.Struct(">BHBBI")  # length (24 bits: high byte, low 16), type, flags, R + stream id
_DATA, _HEADERS, _RST_STREAM, _END_STREAM = 0, 1, 3, 0x1
MIN_REQUEST_BYTES_PER_S = 64 * 1024  # a call's request earns a second of its deadline per this many bytes
_ABSTRACT = "unix-abstract:"
_EARLY_BYTES = 256 * 1024  # held from a client before its inner connection is made (one read or a few)


class _Frames:
    """One direction's HTTP/2 frames, walked by their headers across reads; payloads are skipped unread."""

    __slots__ = ("head", "skip")

    def __init__(self, skip: int = 0):
        self.skip = skip  # bytes still to pass before the next frame header
        self.head = b""  # a frame header split between two reads

    def feed(self, data: bytes) -> list[tuple[int, int, int, int]]:
        """The (type, flags, stream id, payload length) of each frame whose header ends in ``data``."""
        frames = []
        n = len(data)
        i = min(self.skip, n)
        self.skip -= i
        while i < n:
            if self.head or n - i < 9:
                head = self.head + data[i:i + 9 - len(self.head)]
                i += len(head) - len(self.head)
                if len(head) < 9:
                    self.head = head
                    break
                self.head = b""
                hi, lo, kind, flags, sid = _FRAME_HEAD.unpack(head)
            else:
                hi, lo, kind, flags, sid = _FRAME_HEAD.unpack_from(data, i)
                i += 9
            length = hi << 16 | lo
            frames.append((kind, flags, sid & 0x7FFFFFFF, length))
            if length > n - i:
                self.skip = length - (n - i)
                break
            i += length
        return frames


class GrpcFront:
    """The public TCP listener in front of the gRPC server's Unix socket ``upstream``."""

    def __init__(self, upstream: str, cap: int, per_peer: int, stall_timeout_s: float, sending_per_peer: int = 16):
        self.upstream, self.stall_timeout_s = upstream, stall_timeout_s
        self.sending_per_peer = sending_per_peer
        self.sending_by_peer: dict[str, int] = {}  # calls begun and not yet wholly sent, per address
        self.gate = Gate(cap, per_peer, "gRPC", evict=lambda c: c.close())
        self.origins: dict[str, tuple[str, int, str]] = {}  # inner connection's abstract name -> the client's
        # (address, port) and the address it reached
        self.conns: set[_Client] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port) -> the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Client(self), host, port, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        """Stop accepting and cut every connection left (call after the gRPC server's own graceful stop)."""
        self.stop_accepting()
        for c in list(self.conns):
            c.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def sending(self, peer: str, change: int) -> bool:
        """Count ``change`` calls begun (or, negative, sent or gone) by ``peer`` -> whether it is within its share."""
        n = self.sending_by_peer.get(peer, 0) + change
        if n > 0:
            self.sending_by_peer[peer] = n
        else:
            self.sending_by_peer.pop(peer, None)
        return n <= self.sending_per_peer

    def origin(self, peer: str) -> tuple[str, int, str] | None:
        """gRPC's peer of a call -> the client's (address, port) and the address it connected to; None: no client
        of this front (or one gone)."""
        return self.origins.get(peer[len(_ABSTRACT):]) if peer.startswith(_ABSTRACT) else None


class _Inner(asyncio.Protocol):
    """The front's connection to the gRPC server, for one client."""

    def __init__(self, client: _Client):
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.from_server(data)

    def eof_received(self) -> bool:
        return False  # closed: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()

    def pause_writing(self) -> None:  # the server is not reading: neither does the client's side
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        self.client.transport.resume_reading()


class _Client(asyncio.Protocol):
    """One client's connection to the public port."""

    transport: asyncio.Transport
    inner: asyncio.Transport | None = None

    def __init__(self, front: GrpcFront):
        self.front = front
        self.admitted = False
        self.key: str | None = None
        self.calls: set[int] = set()  # the streams of calls in progress
        self.sending: dict[int, float] = {}  # of them, those whose request is still coming -> its deadline
        self.deadline: asyncio.TimerHandle | None = None
        self.sent, self.got = _Frames(_PREFACE_BYTES), _Frames()
        self.stall: asyncio.TimerHandle | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.early = b""  # what the client sent before the inner connection was made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is none of asyncio's classes
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else "?"
        if not self.front.gate.admit(self.peer):
            transport.abort()
            return
        self.admitted = True
        self.front.conns.add(self)
        self.front.gate.idle[self] = None
        transport.pause_reading()  # until the inner connection is made
        self.connecting = asyncio.get_running_loop().create_task(self._connect(peer, transport.get_extra_info(
            "sockname")))

    async def _connect(self, peer: Any, sockname: Any) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind("")  # autobind: an abstract address of the kernel's choice, the call's peer in gRPC
            sock.setblocking(False)
            inner, _ = await asyncio.wait_for(self._open(sock), self.front.stall_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            self.front.gate.note(f"connections closed: the gRPC server did not take them ({type(exc).__name__})")
            self.transport.abort()
            return
        except BaseException:  # cancelled: the client left first
            sock.close()
            raise
        if self.transport.is_closing():
            inner.abort()
            return
        self.inner = inner
        self.key = sock.getsockname()[1:].decode("ascii", "replace")  # b"\0" + five hex digits
        self.front.origins[self.key] = (str(peer[0]), int(peer[1]), str(sockname[0]))
        if self.early:
            early, self.early = self.early, b""
            self.data_received(early)
        self.transport.resume_reading()

    async def _open(self, sock: socket.socket) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, self.front.upstream)
        return await loop.create_unix_connection(lambda: _Inner(self), sock=sock)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:  # before the inner connection is made (uvloop may read once after pause_reading)
            self.early += data
            self.transport.pause_reading()
            if len(self.early) > _EARLY_BYTES:
                self.transport.abort()
            return
        self.inner.write(data)
        sending = self.sending
        for kind, flags, sid, length in self.sent.feed(data):
            if kind == _DATA:
                if sid in sending:
                    if flags & _END_STREAM:
                        self._sent(sid)
                    else:
                        sending[sid] += length / MIN_REQUEST_BYTES_PER_S
            elif kind == _HEADERS and sid not in self.calls and sid & 1:  # a call begins (its trailers add none)
                if not self.calls:
                    self.front.gate.idle.pop(self, None)
                self.calls.add(sid)
                if not flags & _END_STREAM:
                    sending[sid] = asyncio.get_running_loop().time() + self.front.stall_timeout_s
                    if not self.front.sending(self.peer, 1):
                        self.front.gate.note("connections closed: their address's share of calls being sent")
                        self.transport.abort()
                        return
                if len(self.calls) > MAX_OPEN_STREAMS:
                    self.front.gate.note("connections closed: too many calls open")
                    self.transport.abort()
                    return
            elif kind == _HEADERS and flags & _END_STREAM:  # a request's trailers end it
                self._sent(sid)
            elif kind == _RST_STREAM:
                self._ended(sid)
        if sending and self.deadline is None:
            self.deadline = asyncio.get_running_loop().call_at(min(sending.values()), self._expire)

    def _expire(self) -> None:
        """A call's request that has not arrived by its deadline (its grace, plus a second per
        MIN_REQUEST_BYTES_PER_S of it received) ends its connection: gRPC core sets no deadline on it, and each
        one holds a slot of the server's concurrent calls."""
        self.deadline = None
        if not self.sending or self.transport.is_closing():
            return
        first = min(self.sending.values())
        if first > asyncio.get_running_loop().time():
            self.deadline = asyncio.get_running_loop().call_at(first, self._expire)
            return
        self.front.gate.note("connections closed: a call's request did not arrive in time")
        self.transport.abort()

    def from_server(self, data: bytes) -> None:
        self.transport.write(data)
        for kind, flags, sid, _length in self.got.feed(data):
            if (kind == _HEADERS and flags & _END_STREAM) or kind == _RST_STREAM:
                self._ended(sid)

    def _sent(self, sid: int) -> None:
        if self.sending.pop(sid, None) is not None:
            self.front.sending(self.peer, -1)

    def _ended(self, sid: int) -> None:
        self._sent(sid)
        if sid in self.calls:
            self.calls.discard(sid)
            if not self.calls and self.admitted:
                self.front.gate.idle[self] = None  # idle from now: the newest in the order

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:  # the client is not reading its answers
        if self.inner is not None:
            self.inner.pause_reading()
        if self.stall is None:
            self.stall = asyncio.get_running_loop().call_later(self.front.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if self.inner is not None:
            self.inner.resume_reading()

    def _stalled(self) -> None:
        self.stall = None
        self.front.gate.note("connections closed: their client stopped reading")
        self.transport.abort()

    def close(self) -> None:
        """Close both sides: buffered answers still go out, but a client that reads none of them is cut off at
        the stall timeout."""
        if self.transport.is_closing():
            return
        self.transport.close()
        if self.stall is None and self.transport.get_write_buffer_size():
            self.stall = asyncio.get_running_loop().call_later(self.front.stall_timeout_s, self._stalled)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.front.gate.release(self.peer)
            self.front.gate.idle.pop(self, None)
            self.front.conns.discard(self)
        if self.key is not None:
            self.front.origins.pop(self.key, None)
        if self.sending:
            self.front.sending(self.peer, -len(self.sending))
            self.sending.clear()
        for timer in (self.stall, self.deadline):
            if timer is not None:
                timer.cancel()
        self.stall = self.deadline = None
        if self.connecting is not None and not self.connecting.done():
            self.connecting.cancel()
        if self.inner is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed at shutdown
                self.inner.close()
