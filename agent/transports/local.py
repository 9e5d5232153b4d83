"""The on-box socket: the Open Inference Protocol over a Unix-domain socket, without HTTP (protocol/local.py).

For clients on the device, where HTTP itself is the cost (a small model: digits answers in 12 us, HTTP's
parsing and its loopback TCP writes take most of the event loop's time per request). The same decoding
(agent.transports.kserve.parse_body / encode_response), the same shared-memory registry (agent/transports/shm.py, one
scoped view per connection) and the same batcher as HTTP and gRPC: a request from here can share a batch with HTTP's.

Served on the agent's event loop with an ``asyncio.Protocol`` (no streams, no per-connection task): frames are
cut from what each read brings, requests pipelined on one connection run concurrently, and the answers finished
in one turn of the loop leave in one write. A request that starts with the same bytes (model, version, JSON
header) as one decoded before on the connection -- a camera loop's every frame -- takes the fast path (_quick):
its cached template decodes it with every check that depends on more than the header made again, the batcher
queues it without an asyncio task (Batcher.enqueue), and its answer is written from the future's callback, its
JSON reused where every output goes to shared memory. Anything else, and any request the fast path would refuse,
goes through _infer for the exact verdict. A pipeline's requests (agent/core/pipeline.py: two stages, no one batcher
queue) are never cached, so they go to _infer decoded once. Off unless ``local_socket`` is set (a path;
relative: under the data dir). The socket file is made mode 0660 before the agent listens (so no one connects in
between): the agent's user and group may connect, nobody else -- stricter than the loopback HTTP port any local
user reaches.
A stale socket at the path is replaced; any other file there is refused.

Bounds: ``max_connections`` connections (one more is answered ERROR 503 and closed), at most
``max_connections_per_user`` of them one user's (told by SO_PEERCRED; one more is answered ERROR 503 naming the
limit and closed), so one user's connections -- idle ones too -- never lock the others out; a connection with
nothing in flight and no byte from its client for ``idle_timeout_s`` is answered ERROR 408 and closed (checked
every ``idle_timeout_s`` / 4, at most every 5 s). ``max_inflight``
requests in flight per connection (reading pauses beyond it, and while the client does not read its answers),
``max_inflight_bytes`` of request bodies in flight over all connections, frames still being read included
(beyond it: 503), a frame at most
``max_body_bytes`` (the agent's), a frame whole within ``frame_timeout_s`` of its first byte (local_frame_timeout_s,
30 s by default: protocol.local.FRAME_TIMEOUT_S), or ERROR 408 and a close. A connection's regions are unregistered
when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

import orjson

from ...protocol import local as wire
from ...protocol.manifest import TensorSpec
from ..core.host import LARGE_BODY, ModelHost, Served
from ..errors import AgentError, RequestError
from .kserve import (
    InferRequest,
    RequestTemplate,
    encode_response,
    parse_body,
    request_template,
)
from .peer import Peer, PeerCell, unix_peer
from .shm import SharedMemory

__all__ = ["LocalServer"]

log = logging.getLogger("edgefleet.agent.local")

_U16, _U32 = struct.Struct("<H"), struct.Struct("<I")
_HEAD = wire.HEADER.size
# decoded JSON headers kept per connection (RequestTemplate): at most this many, each at most this long
TEMPLATES_PER_CONNECTION, TEMPLATE_MAX_HEADER = 64, 4096


class LocalServer:
    def __init__(self, host: ModelHost, shm: SharedMemory | None, max_body_bytes: int, max_connections: int = 32,
                 max_inflight: int = 256, max_inflight_bytes: int = 256 * 1024 * 1024,
                 frame_timeout_s: float = wire.FRAME_TIMEOUT_S, max_connections_per_user: int | None = None,
                 idle_timeout_s: float = 300.0):
        self.host, self.shm = host, shm
        self.max_body_bytes, self.max_connections, self.max_inflight = max_body_bytes, max_connections, max_inflight
        self.max_inflight_bytes, self.frame_timeout_s = max_inflight_bytes, frame_timeout_s
        # None: half the connections (at least 1), so one user leaves the other half to everyone else
        self.max_connections_per_user = max_connections_per_user or max(1, max_connections // 2)
        self.idle_timeout_s = idle_timeout_s
        self.inflight_bytes = 0
        self.connections: set[_Connection] = set()
        self.per_user: dict[int | None, int] = {}  # open connections by the client's uid (None: not told)
        self._reaper: asyncio.Task | None = None
        self.path: Path | None = None
        self._server: asyncio.AbstractServer | None = None
        self._numbers = itertools.count(1)
        self.large_decodes = asyncio.Semaphore(2)  # as HTTP's: big JSON bodies decode off the loop, two at a time

    async def start(self, path: Path) -> Path:
        """Listen on ``path`` (mode 0660) -> the path. On the event loop that serves."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise OSError(f"local_socket: {path} exists and is not a socket; remove it or choose another path")
            path.unlink()  # a socket left by an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o660)  # before listen(): nobody can connect yet
            sock.listen(128)
            sock.setblocking(False)
            self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Connection(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        self.path = path
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())
        return path

    async def _reap_idle(self) -> None:
        """Close the connections idle for ``idle_timeout_s``: nothing in flight, no byte from the client."""
        every = min(5.0, self.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for c in [c for c in self.connections if not c.inflight and now - c.active > self.idle_timeout_s]:
                c._fatal(408, f"no request for {self.idle_timeout_s:g} s (local_idle_timeout_s); closing this idle "
                              "connection")

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; requests in flight get ``grace_s`` to finish; then every connection is closed."""
        if self._server is None:
            return
        self._server.close()
        if self._reaper is not None:
            self._reaper.cancel()
        deadline = time.monotonic() + grace_s
        while any(c.inflight for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            c.close()
        self._server = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()


class _Templates(dict[bytes, tuple[str, str | None, RequestTemplate]]):
    """One connection's requests decoded before, by the exact bytes of their model, version and JSON header -> (model,
    version, RequestTemplate): at most TEMPLATES_PER_CONNECTION (the oldest goes first), none of a header over
    TEMPLATE_MAX_HEADER bytes. _Connection._quick decodes a request that starts with such bytes with its template,
    without parsing it."""

    def find(self, body: bytes) -> tuple[str, str | None, RequestTemplate, int] | None:
        """The cached template of an INFER body that starts with the bytes of one decoded before -> (model, version,
        template, where the binary data starts), or None."""
        n = len(body)
        if n < 8:
            return None
        ml = body[0] | body[1] << 8
        if n < 8 + ml:
            return None
        vl = body[2 + ml] | body[3 + ml] << 8
        jpos = 8 + ml + vl
        if n < jpos:
            return None
        jl = int.from_bytes(body[4 + ml + vl:jpos], "little")
        end = jpos + jl
        if jl > TEMPLATE_MAX_HEADER or end > n:
            return None
        q = self.get(body[:end] if end < n else body)
        return None if q is None else (*q, end)

    def decode(self, key: bytes, model: str, version: str | None, rest: memoryview, json_length: int,
               header: str | None, specs: tuple[TensorSpec, ...], out_specs: tuple[TensorSpec, ...],
               shm: SharedMemory | None, cache: bool = True) -> InferRequest:
        """parse_body; a header it accepts is kept as a RequestTemplate under ``key`` (the body's bytes up to the end
        of its JSON header: the model, the version and the header), for _quick to decode the next request that
        starts with the same bytes without parsing it. ``cache`` False (a pipeline's request: it runs through
        ModelHost.infer, never _quick's batcher queue) keeps none, so the next such request is decoded once, here,
        not first by a template whose work _quick would throw away."""
        req = parse_body(rest, header, specs, out_specs, shm)
        if not cache or json_length > TEMPLATE_MAX_HEADER:
            return req
        try:
            doc = orjson.loads(rest[:json_length])  # what parse_body read (it tries orjson first)
        except orjson.JSONDecodeError:  # parse_body took it with the json module: no template
            return req
        t = request_template(doc, req, specs, out_specs, header is not None)
        if t is not None:
            if len(self) >= TEMPLATES_PER_CONNECTION and key not in self:
                del self[next(iter(self))]  # the oldest
            self[key] = (model, version, t)
        return req


class _Connection(asyncio.Protocol):
    def __init__(self, srv: LocalServer):
        self.srv = srv
        self.number = next(srv._numbers)
        self.client = f"local#{self.number}"
        self.cred: tuple[int, int] | None = None  # its uid and gid, from SO_PEERCRED (connection_made)
        self.counted = False  # in srv.connections and srv.per_user
        self.active = time.monotonic()  # the last byte from the client
        # its user, with groups, looked up at REGISTER. Its regions are its own: only this connection names them
        # (a scoped view), so each use needs no check of its user
        self.peer = PeerCell(lambda: Peer(None) if self.cred is None else unix_peer(*self.cred))
        self.shm = srv.shm.scoped(f"L{self.number}") if srv.shm is not None else None
        self.buf = bytearray()
        self.held_bytes = 0  # of buf, counted in srv.inflight_bytes (_hold)
        self.waiting = False  # buf holds whole frames waiting for room (max_inflight), not a partial one
        self.resuming = False
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop  # connection_made
        self.tasks: set[asyncio.Task] = set()
        self.out: list[bytes] = []
        self.flushing = False
        self.paused_reading = self.paused_writing = False
        self.stall: asyncio.TimerHandle | None = None
        self.closed = False
        self.quick = _Templates()  # requests decoded before, for the fast path (_quick)
        self.pending: set[Any] = set()  # fast-path requests in flight (Batcher.enqueue entries)

    # -- the connection ------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()  # kept: get_running_loop() costs a getpid() call on Python 3.11
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError, struct.error):
            pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            self.client = f"local#{self.number} (pid {pid}, uid {uid})"
            # whose objects it may use as regions (agent/transports/peer.py, looked up at REGISTER)
            self.cred = (uid, gid)
        srv = self.srv
        uid = None if self.cred is None else self.cred[0]
        mine = srv.per_user.get(uid, 0)
        refusal = None
        if len(srv.connections) >= srv.max_connections:
            refusal = (f"{len(srv.connections)} local connections are open, the most allowed (local_max_connections "
                       f"{srv.max_connections}); retry")
        elif mine >= srv.max_connections_per_user:
            who = f"this user (uid {uid}) holds" if uid is not None else "clients whose user cannot be told hold"
            refusal = (f"{who} {mine} local connections, the most one user may (local_max_connections_per_user "
                       f"{srv.max_connections_per_user}); close one, or retry")
        if refusal is not None:
            transport.write(_error(0, 503, refusal))
            transport.close()
            self.closed = True
            return
        srv.connections.add(self)
        srv.per_user[uid] = mine + 1
        self.counted = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.srv.connections.discard(self)
        if self.counted:
            self.counted = False
            uid = None if self.cred is None else self.cred[0]
            left = self.srv.per_user.get(uid, 1) - 1
            if left > 0:
                self.srv.per_user[uid] = left
            else:
                self.srv.per_user.pop(uid, None)
        self._release()
        if self.stall is not None:
            self.stall.cancel()
        for t in self.tasks:  # a request still queued is dropped from the batch; its answer has nowhere to go
            t.cancel()
        for q in list(self.pending):  # the same for the fast path's (_quick): their callbacks answer nowhere
            q.future.cancel()
        if self.shm is not None:
            self.shm.unregister(None)  # this connection's regions

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    @property
    def inflight(self) -> int:
        """Requests of this connection not answered yet."""
        return len(self.tasks) + len(self.pending)

    def pause_writing(self) -> None:  # the client does not read its answers: stop taking its requests
        self.paused_writing = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.paused_writing = False
        self._update_reading()

    def _update_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        if self.waiting and self.inflight < self.srv.max_inflight and not self.resuming:
            self.resuming = True  # room again for the whole frames left in buf: dispatched in the next turn
            self.loop.call_soon(self._resume)
        want_pause = self.paused_writing or self.inflight >= self.srv.max_inflight or self.waiting
        if want_pause and not self.paused_reading:
            self.transport.pause_reading()
        elif not want_pause and self.paused_reading:
            self.transport.resume_reading()
        self.paused_reading = want_pause

    # -- frames in -----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.active = time.monotonic()
        self.buf += data
        self._frames()

    def _frames(self) -> None:
        """Dispatch the whole frames in ``buf`` while this connection has room (``max_inflight``); what is left (a
        partial frame, or whole ones waiting for room: _update_reading resumes them) counts against the server's
        ``max_inflight_bytes`` (_hold), as the requests it will become do."""
        srv = self.srv
        srv.inflight_bytes -= self.held_bytes  # held until now; each whole frame is charged as it is dispatched
        self.held_bytes = 0
        buf = self.buf
        pos, n = 0, len(buf)
        full = False
        while n - pos >= _HEAD:
            if self.inflight >= srv.max_inflight:
                full = True  # the rest waits for answers to free room, in buf
                break
            try:
                kind, rid, length = wire.unpack_header(buf[pos:pos + _HEAD], srv.max_body_bytes)
            except wire.FrameError as exc:
                self._fatal(413 if "exceeds" in str(exc) else 400, str(exc))
                return
            end = pos + _HEAD + length
            if end > n:
                break
            body = bytes(buf[pos + _HEAD:end])
            pos = end
            self._dispatch(kind, rid, body)
            if self.closed:
                return
        del buf[:pos]
        self.waiting = full and bool(buf)
        if buf and not self._hold():
            return
        if buf and not self.waiting:
            if self.stall is None:
                self.stall = self.loop.call_later(srv.frame_timeout_s, self._stalled)
        elif self.stall is not None:  # nothing partial, or whole frames waiting on this agent, not on the client
            self.stall.cancel()
            self.stall = None
        self._update_reading()

    def _hold(self) -> bool:
        """Charge the bytes left in ``buf`` to the server's in-flight byte budget -> False where they do not fit: then
        the connection is refused (503) and closed, a frame it cannot finish reading."""
        srv, held = self.srv, len(self.buf)
        if srv.inflight_bytes + held > srv.max_inflight_bytes:
            self._fatal(503, f"too many request bytes in flight ({srv.inflight_bytes} of {srv.max_inflight_bytes}) "
                             f"to hold the {held} bytes of a frame not read yet; retry")
            return False
        srv.inflight_bytes += held
        self.held_bytes = held
        return True

    def _release(self) -> None:
        """The bytes held in ``buf`` leave the budget (the connection failed or closed)."""
        self.srv.inflight_bytes -= self.held_bytes
        self.held_bytes = 0
        self.buf.clear()

    def _resume(self) -> None:
        self.resuming = False
        if self.waiting and not self.closed:
            self._frames()

    def _stalled(self) -> None:
        self.stall = None
        if self.buf and not self.closed:
            self._fatal(408, f"a frame did not arrive whole within {self.srv.frame_timeout_s:g} s")

    def _fatal(self, status: int, message: str) -> None:
        """A frame that cannot be read: say why (request id 0) and close; the stream cannot be resynchronised."""
        log.info("local client %s: %s; closing its connection", self.client, message)
        self._send(_error(0, status, message))
        self._flush()
        self._release()
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    def _dispatch(self, kind: int, rid: int, body: bytes) -> None:
        if kind == wire.INFER:
            srv = self.srv
            if srv.inflight_bytes + len(body) > srv.max_inflight_bytes:
                self._send(_error(rid, 503, f"too many request bytes in flight ({srv.inflight_bytes} of "
                                            f"{srv.max_inflight_bytes}); retry"))
                return
            srv.inflight_bytes += len(body)
            if self._quick(rid, body):
                return
            task = self.loop.create_task(self._infer(rid, body))
            self.tasks.add(task)
            task.add_done_callback(self._done)
            if len(self.tasks) >= srv.max_inflight:
                self._update_reading()
        elif kind in (wire.REGISTER, wire.UNREGISTER):
            try:
                self._shm_call(kind, body)
            except AgentError as exc:
                self._send(_error(rid, getattr(exc, "status_code", 400), str(exc)))
            else:
                self._send(wire.pack(wire.OK, rid))
        else:
            self._send(_error(rid, 400, f"unknown frame kind {kind:#x}; requests are INFER {wire.INFER}, REGISTER "
                                        f"{wire.REGISTER}, UNREGISTER {wire.UNREGISTER}"))

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if self.paused_reading:
            self._update_reading()

    def _shm_call(self, kind: int, body: bytes) -> None:
        if self.shm is None:
            raise RequestError("system shared memory is off on this agent (max_shm_regions 0)")
        try:
            doc = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"the body is not valid JSON: {exc}") from None
        if kind == wire.REGISTER:
            if not isinstance(doc, dict) or set(doc) - {"name", "key", "offset", "byte_size"} \
                    or not {"name", "key", "byte_size"} <= set(doc):
                raise RequestError('REGISTER takes a JSON object {"name": ..., "key": "/object", "offset": 0, '
                                   '"byte_size": N}')
            # its user (untold: no shared-memory regions)
            self.shm.register(doc["name"], doc["key"], doc.get("offset", 0), doc["byte_size"], self.client,
                              self.peer.get())
        else:
            if not isinstance(doc, dict) or set(doc) - {"name"} or not isinstance(doc.get("name", ""), str):
                raise RequestError('UNREGISTER takes a JSON object {"name": "region"}, or {} for every region of '
                                   "this connection")
            self.shm.unregister(doc.get("name"))

    def _quick(self, rid: int, body: bytes) -> bool:
        """A request whose model, version and JSON header are byte-for-byte those of one decoded before on this
        connection (a camera loop's every frame) goes straight to the batcher, without a task: its cached
        RequestTemplate decodes it (regions, bounds, binary length, NaN all checked again), ``Batcher.enqueue``
        queues it and its answer is written from the future's callback (_answered). -> False where it is not such
        a request (not cached yet, the model was swapped, a check failed, a large header): _infer then takes it,
        whose verdict is exact."""
        q = self.quick.find(body)
        if q is None:
            return False
        n = len(body)
        t0 = time.perf_counter()
        model, version, t, end = q
        served: Served | None = None
        try:
            served = self.srv.host.get(model, version)
            m = served.manifest
            if t.specs is not m.inputs or t.out_specs is not m.outputs or served.pipeline is not None:
                return False  # another version serves now (or a pipeline: no one batcher to queue in): decoded afresh
            req = t.apply(memoryview(body)[end:] if t.has_binary else None, self.shm)
            pending = self.srv.host.enqueue(served, req)
        except RequestError:
            return False  # _infer says exactly why
        except AgentError as exc:  # queue full, model being replaced, none loaded: as _infer would answer
            status = getattr(exc, "status_code", 500)
            self._send(_error(rid, status, str(exc)))
            self.srv.inflight_bytes -= n
            self.srv.host.record(served, None, time.perf_counter() - t0, status)
            return True
        except Exception:  # nothing was queued: _infer decodes it afresh and answers exactly
            log.warning("local client %s: the cached decode failed unexpectedly; decoding afresh", self.client,
                        exc_info=True)
            return False
        self.pending.add(pending)
        pending.future.add_done_callback(
            functools.partial(self._answered, rid, served, req, t0, n, pending, t.answers))
        if self.inflight >= self.srv.max_inflight:
            self._update_reading()
        return True

    def _answered(self, rid: int, served: Served, req: InferRequest, t0: float, nbytes: int, pending: Any,
                  answers: dict[tuple, bytes], fut: asyncio.Future) -> None:
        """A fast-path request's outputs (or error) are in: answer it (as _infer would)."""
        served.batcher.settle(pending)
        self.srv.inflight_bytes -= nbytes
        status = 500
        try:
            if fut.cancelled():
                status = 499  # the client went away
                return
            exc = fut.exception()
            if exc is not None:
                raise exc
            outs = fut.result()
            self.srv.host.offer_shadow(served, req, outs)
            self._result(rid, served, req, outs, answers)
            status = 200
        except Exception as exc:  # never let one request take the server down
            status = self._refuse(rid, exc)
        finally:
            self.pending.discard(pending)
            served.metrics.request(time.perf_counter() - t0, status)
            if self.paused_reading:
                self._update_reading()

    async def _infer(self, rid: int, body: bytes) -> None:
        srv, host = self.srv, self.srv.host
        t0 = time.perf_counter()
        status = 500
        served: Served | None = None
        model = ""
        try:
            try:
                model, version, json_length, rest = wire.parse_infer(memoryview(body))
            except ValueError as exc:
                raise RequestError(str(exc)) from None
            served = host.get(model, version)
            m = served.manifest
            header = str(json_length) if json_length < len(rest) else None  # binary tensors follow the JSON
            if header is None and len(rest) > LARGE_BODY:
                async with srv.large_decodes:
                    req = await asyncio.get_running_loop().run_in_executor(
                        None, parse_body, rest, header, m.inputs, m.outputs, self.shm)
            else:
                req = self.quick.decode(body[:len(body) - len(rest) + json_length], model, version, rest,
                                        json_length, header, m.inputs, m.outputs, self.shm,
                                        cache=served.pipeline is None)
            del rest
            outs = await host.infer(served, req)
            self._result(rid, served, req, outs)
            status = 200
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        except Exception as exc:  # never let one request take the server down
            status = self._refuse(rid, exc)
        finally:
            srv.inflight_bytes -= len(body)
            host.record(served, model, time.perf_counter() - t0, status)

    def _result(self, rid: int, served: Served, req: InferRequest, outs: list, answers: dict | None = None) -> None:
        """Send the RESULT frame of ``outs`` (``answers``: the request's template's, encode_response's memo)."""
        m = served.manifest
        content, json_len = encode_response(m.name, m.version, outs, m.outputs, req, self.shm, answers)
        self._send(b"".join([wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.RESULT, 0, rid, 4 + len(content)),
                             _U32.pack(len(content) if json_len is None else json_len), content]))

    def _refuse(self, rid: int, exc: Exception) -> int:
        """Send the ERROR frame a request that failed with ``exc`` gets -> its status (an AgentError's own; anything
        else is this agent's fault: 500, logged)."""
        if isinstance(exc, AgentError):
            status = getattr(exc, "status_code", 500)
            self._send(_error(rid, status, str(exc)))
            return status
        log.error("unexpected error in a local infer", exc_info=exc)
        self._send(_error(rid, 500, f"internal error: {exc}"))
        return 500

    # -- frames out ----------------------------------------------------------------------------------
    def _send(self, frame: bytes) -> None:
        """Queue a frame; the frames queued in one turn of the event loop leave in one write. A lone request's
        answer (nothing else in flight on this connection) leaves at once: no turn of the loop to wait for."""
        if self.closed:
            return
        if not self.out and self.inflight <= 1 and self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame)
            return
        self.out.append(frame)
        if not self.flushing:
            self.flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flushing = False
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.out[0] if len(self.out) == 1 else b"".join(self.out))
        self.out.clear()


def _error(rid: int, status: int, message: str) -> bytes:
    return wire.pack(wire.ERROR, rid, _U16.pack(status) + message.encode("utf-8", "replace"))
