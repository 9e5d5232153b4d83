"""A client for the agent's on-box socket (protocol/local.py, served by agent/transports/local.py).

    from edgefleet.agent.transports.local_client import LocalClient
    with LocalClient("/var/lib/edgefleet/local.sock") as c:
        logits = c.infer("digits", {"input": x})["logits"]           # tensors inline
        c.register_region("cam0", "/cam0", 1 << 20)                  # or by reference, in shared memory
        c.infer("digits", {"input": ("cam0", 0, x.nbytes, x.shape)},
                outputs={"logits": ("cam0", 65536, 640)})            # -> its JSON description; data in the region

``LocalClient`` is blocking (one request at a time); ``AsyncLocalClient`` (asyncio) pipelines any number of
requests on one connection, each answered by its request id. Errors are :class:`LocalError` with the agent's
status (as HTTP would have answered) and message. Needs numpy only for ``infer``'s tensors.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ...protocol import local as wire

__all__ = ["AsyncLocalClient", "LocalClient", "LocalError", "decode_result", "infer_request"]

_U16, _U32 = struct.Struct("<H"), struct.Struct("<I")
_HEADER, _MAGIC, _VERSION = wire.HEADER, wire.MAGIC, wire.VERSION
_NP = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32, "INT8": np.int8,
       "UINT8": np.uint8, "BOOL": np.bool_}
_DT = {np.dtype(v).str.lstrip("<|="): k for k, v in _NP.items()}


class LocalError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def infer_request(model: str, inputs: dict[str, Any], outputs: dict[str, tuple[str, int, int]] | None = None,
                  version: str = "") -> bytes:
    """An INFER body. ``inputs``: name -> an array (sent inline as binary data) or (region, offset, byte_size, shape)
    with the datatype FP32 unless a fifth item says otherwise. ``outputs``: name -> (region, offset, byte_size) to
    have them written into shared memory; outputs not named come back inline, binary."""
    docs, blobs = [], []
    for name, v in inputs.items():
        if isinstance(v, tuple):
            region, off, size, shape, *dt = v
            docs.append({"name": name, "shape": list(shape), "datatype": dt[0] if dt else "FP32", "parameters": {
                "shared_memory_region": region, "shared_memory_offset": off, "shared_memory_byte_size": size}})
        else:
            a = np.ascontiguousarray(v)
            data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
            docs.append({"name": name, "shape": list(a.shape), "datatype": _DT[a.dtype.str.lstrip("<|=>")],
                         "parameters": {"binary_data_size": len(data)}})
            blobs.append(data)
    doc: dict[str, Any] = {"inputs": docs, "parameters": {"binary_data_output": True}}
    if outputs:
        doc["outputs"] = [{"name": n, "parameters": {"shared_memory_region": r, "shared_memory_offset": o,
                                                     "shared_memory_byte_size": s}} for n, (r, o, s) in outputs.items()]
    return wire.infer_body(model, json.dumps(doc).encode(), b"".join(blobs), version)


def decode_result(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A RESULT body -> (the JSON response, its inline outputs as arrays by name)."""
    (jl,) = _U32.unpack_from(body, 0)
    doc = json.loads(body[4:4 + jl])
    arrays, pos = {}, 4 + jl
    for o in doc["outputs"]:
        size = o.get("parameters", {}).get("binary_data_size")
        if size is not None:
            arrays[o["name"]] = np.frombuffer(body, _NP[o["datatype"]], count=size // np.dtype(
                _NP[o["datatype"]]).itemsize, offset=pos).reshape(o["shape"])
            pos += size
        elif "data" in o:
            arrays[o["name"]] = np.asarray(o["data"], _NP[o["datatype"]]).reshape(o["shape"])
    return doc, arrays


def _check(kind: int, body: bytes) -> bytes:
    if kind == wire.ERROR:
        (status,) = _U16.unpack_from(body, 0)
        raise LocalError(status, body[2:].decode("utf-8", "replace"))
    return body


class LocalClient:
    """Blocking, one request at a time on one connection."""

    def __init__(self, path: str | Path, timeout_s: float = 60.0, max_frame_bytes: int = 1 << 30):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))
        self.max_frame_bytes = max_frame_bytes
        self._ids = itertools.count(1)

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self) -> tuple[int, int, bytes]:
        """-> (kind, request id, body) of the next frame from the agent."""
        head = self._read(wire.HEADER.size)
        kind, rid, length = wire.unpack_header(head, self.max_frame_bytes)
        return kind, rid, self._read(length)

    def _read(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            c = self.sock.recv(min(n - got, 1 << 20))
            if not c:
                raise ConnectionError("the agent closed the connection")
            chunks.append(c)
            got += len(c)
        return b"".join(chunks)

    def call(self, kind: int, body: bytes = b"") -> bytes:
        rid = next(self._ids) & wire.MAX_REQUEST_ID or 1
        self.sock.sendall(wire.pack(kind, rid, body))
        k, got, answer = self.read_frame()
        if got != rid and not (k == wire.ERROR and got == 0):
            raise ConnectionError(f"answer to request {got}, expected {rid}")
        return _check(k, answer)

    def register_region(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self.call(wire.REGISTER, json.dumps({"name": name, "key": key, "offset": offset,
                                             "byte_size": byte_size}).encode())

    def unregister_region(self, name: str | None = None) -> None:
        self.call(wire.UNREGISTER, json.dumps({} if name is None else {"name": name}).encode())

    def infer_raw(self, body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return decode_result(self.call(wire.INFER, body))

    def infer(self, model: str, inputs: dict[str, Any], outputs: dict[str, tuple[str, int, int]] | None = None,
              version: str = "") -> dict[str, Any]:
        """-> each inline output as an array by name, and each shared-memory output's JSON description."""
        doc, arrays = self.infer_raw(infer_request(model, inputs, outputs, version))
        return {**{o["name"]: o for o in doc["outputs"] if o["name"] not in arrays}, **arrays}


class AsyncLocalClient(asyncio.Protocol):
    """asyncio; any number of requests in flight on one connection. ``await AsyncLocalClient.connect(path)``."""

    def __init__(self, max_frame_bytes: int = 1 << 30) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop  # connection_made
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.buf = bytearray()
        self.out: list[bytes] = []
        self.flushing = False
        self._ids = itertools.count(1)
        self.lost: BaseException | None = None
        self._deadlines: dict[int, float] = {}  # request id -> when its timeout ends (requests with a timeout)
        self._sweep: asyncio.TimerHandle | None = None  # one timer for every timeout: at the earliest deadline
        self._sweep_at = 0.0

    @classmethod
    async def connect(cls, path: str | Path, max_frame_bytes: int = 1 << 30) -> AsyncLocalClient:
        _, proto = await asyncio.get_running_loop().create_unix_connection(lambda: cls(max_frame_bytes), str(path))
        return proto

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()  # kept: get_running_loop() costs a getpid() call on Python 3.11

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("the agent closed the connection")
        for f in self.pending.values():
            if not f.done():
                f.set_exception(self.lost)
        self.pending.clear()
        self._deadlines.clear()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, n, size = 0, len(buf), wire.HEADER.size
        while n - pos >= size:
            kind, rid, length = wire.unpack_header(buf[pos:pos + size], self.max_frame_bytes)
            if n - pos - size < length:
                break
            body = bytes(buf[pos + size:pos + size + length])
            pos += size + length
            if rid == 0 and kind == wire.ERROR:  # the agent could not read a frame: fail everything
                err = LocalError(*_status(body))
                for f in self.pending.values():
                    if not f.done():
                        f.set_exception(err)
                self.pending.clear()
                continue
            waiter = self.pending.pop(rid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result((kind, body))
        del buf[:pos]

    async def call(self, kind: int, body: bytes = b"", timeout_s: float | None = None) -> bytes:
        """One request -> its answer's body; ``timeout_s``: asyncio.TimeoutError (TimeoutError from 3.11) if no
        answer comes within it (the request's answer, should it come later, is dropped). No task per request: the
        answer resolves a future (data_received, by request id), and every timeout is watched by one timer."""
        if self.lost is not None:
            raise ConnectionError(f"the connection is closed ({self.lost})")
        rid = next(self._ids) & wire.MAX_REQUEST_ID or 1
        loop = self.loop
        f = loop.create_future()
        self.pending[rid] = f
        if timeout_s is not None:
            deadline = loop.time() + timeout_s
            self._deadlines[rid] = deadline
            if self._sweep is None or deadline < self._sweep_at:
                if self._sweep is not None:
                    self._sweep.cancel()
                self._sweep_at = deadline
                self._sweep = loop.call_at(deadline, self._expire)
        frame = _HEADER.pack(_MAGIC, _VERSION, kind, 0, rid, len(body)) + body
        if len(self.pending) == 1 and not self.out and self.transport is not None:  # alone: no batching to wait for
            self.transport.write(frame)
        else:
            self.out.append(frame)
            if not self.flushing:  # the requests made in one turn of the loop leave in one write
                self.flushing = True
                loop.call_soon(self._flush)
        try:
            k, answer = await f
        finally:
            self.pending.pop(rid, None)
            if timeout_s is not None:
                self._deadlines.pop(rid, None)
        return _check(k, answer)

    def _expire(self) -> None:
        """The timeout timer: fail every request past its deadline, then wait for the earliest one left."""
        self._sweep = None
        loop = self.loop
        now, nxt = loop.time(), None
        for rid, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[rid]
                f = self.pending.pop(rid, None)
                if f is not None and not f.done():
                    f.set_exception(asyncio.TimeoutError(f"no answer to request {rid} within its timeout"))
            elif nxt is None or deadline < nxt:
                nxt = deadline
        if nxt is not None:
            self._sweep_at = nxt
            self._sweep = loop.call_at(nxt, self._expire)

    def _flush(self) -> None:
        self.flushing = False
        if self.transport is not None and self.out:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    async def register_region(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        await self.call(wire.REGISTER, json.dumps({"name": name, "key": key, "offset": offset,
                                                   "byte_size": byte_size}).encode())

    async def unregister_region(self, name: str | None = None) -> None:
        await self.call(wire.UNREGISTER, json.dumps({} if name is None else {"name": name}).encode())

    async def infer_raw(self, body: bytes, timeout_s: float | None = None) -> bytes:
        """An INFER body -> the RESULT body (decode_result reads it); ``timeout_s`` as for :meth:`call`."""
        return await self.call(wire.INFER, body, timeout_s)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _status(body: bytes) -> tuple[int, str]:
    (status,) = _U16.unpack_from(body, 0)
    return status, body[2:].decode("utf-8", "replace")
