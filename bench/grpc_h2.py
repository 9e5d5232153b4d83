"""A lean, blocking gRPC unary client for bench/serve_load.py's one-client level: HTTP/2 over one TCP socket, one call
in flight, each call's frames prebuilt (only the stream id is written per call).

Why: at one closed-loop client the client's CPU per request is on the latency path. grpcio's synchronous stub
costs ~150-200 us of CPU a call on this box (its Cython layer and a completion queue per call), grpc.aio ~210-260,
perf_analyzer's C++ client ~50 (bench/perf_analyzer_vs_serve.py --split-cpus 0:1). This speaks just enough
HTTP/2 for unary calls to a gRPC server: the connection preface and SETTINGS (answered), PING (answered),
WINDOW_UPDATE (both directions' connection windows tracked), GOAWAY and RST_STREAM (errors), HEADERS with
CONTINUATION, padded DATA, and HPACK decoding with the dynamic table (no Huffman decoding: gRPC core codes no
non-binary value so; a Huffman-coded grpc-status is an error, never read as OK). A call succeeds only with
grpc-status 0 in its trailers and one uncompressed message.

    c = UnaryClient("127.0.0.1", port, "/inference.GRPCInferenceService/ModelInfer")
    call = c.prepare(serialized_request)      # once per distinct request
    message = c.call(call)                   # the serialized response; GrpcError(status, message) otherwise
"""

from __future__ import annotations

import socket
import struct

__all__ = ["GrpcError", "UnaryClient", "connect"]

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_HEAD = struct.Struct(">HBBBI")  # length (24 bits: high 16, low 8), type, flags, stream id
_MAX_WINDOW = (1 << 31) - 1
_RECV_WINDOW_TOP_UP = 1 << 30  # our connection window is topped up once this much of it is used
_MAX_FRAME = 1 << 24  # refuse a peer's frame longer than this (bytes)

_STATIC = [  # RFC 7541 appendix A (index 1..61)
    (b":authority", b""), (b":method", b"GET"), (b":method", b"POST"), (b":path", b"/"), (b":path", b"/index.html"),
    (b":scheme", b"http"), (b":scheme", b"https"), (b":status", b"200"), (b":status", b"204"), (b":status", b"206"),
    (b":status", b"304"), (b":status", b"400"), (b":status", b"404"), (b":status", b"500"), (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"), (b"accept-language", b""), (b"accept-ranges", b""), (b"accept", b""),
    (b"access-control-allow-origin", b""), (b"age", b""), (b"allow", b""), (b"authorization", b""),
    (b"cache-control", b""), (b"content-disposition", b""), (b"content-encoding", b""), (b"content-language", b""),
    (b"content-length", b""), (b"content-location", b""), (b"content-range", b""), (b"content-type", b""),
    (b"cookie", b""), (b"date", b""), (b"etag", b""), (b"expect", b""), (b"expires", b""), (b"from", b""),
    (b"host", b""), (b"if-match", b""), (b"if-modified-since", b""), (b"if-none-match", b""), (b"if-range", b""),
    (b"if-unmodified-since", b""), (b"last-modified", b""), (b"link", b""), (b"location", b""),
    (b"max-forwards", b""), (b"proxy-authenticate", b""), (b"proxy-authorization", b""), (b"range", b""),
    (b"referer", b""), (b"refresh", b""), (b"retry-after", b""), (b"server", b""), (b"set-cookie", b""),
    (b"strict-transport-security", b""), (b"transfer-encoding", b""), (b"user-agent", b""), (b"vary", b""),
    (b"via", b""), (b"www-authenticate", b"")]


class GrpcError(Exception):
    """A call that did not succeed: its gRPC status (an int; -1 where none was read) and message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"gRPC status {status}: {message}")
        self.status, self.message = status, message


class _Hpack:
    """HPACK decoding (RFC 7541) with the dynamic table; a Huffman-coded string decodes to None."""

    def __init__(self, max_size: int = 4096):
        self.table: list[tuple[bytes | None, bytes | None]] = []
        self.size, self.max_size, self.limit = 0, max_size, max_size
        self.version = 0  # counts the table's changes
        self.seen: dict[bytes, tuple[int, dict[bytes | None, bytes | None]]] = {}

    def _int(self, b: bytes, i: int, bits: int) -> tuple[int, int]:
        mask = (1 << bits) - 1
        v = b[i] & mask
        i += 1
        if v < mask:
            return v, i
        shift = 0
        while True:
            c = b[i]
            i += 1
            v += (c & 0x7F) << shift
            shift += 7
            if not c & 0x80:
                return v, i

    def _str(self, b: bytes, i: int) -> tuple[bytes | None, int]:
        huffman = b[i] & 0x80
        n, i = self._int(b, i, 7)
        if i + n > len(b):
            raise GrpcError(-1, "HPACK: a string past its header block")
        return (None if huffman else b[i:i + n]), i + n

    def _get(self, index: int) -> tuple[bytes | None, bytes | None]:
        if 1 <= index <= len(_STATIC):
            return _STATIC[index - 1]
        if 0 <= index - len(_STATIC) - 1 < len(self.table):
            return self.table[index - len(_STATIC) - 1]
        raise GrpcError(-1, f"HPACK: no header at index {index}")

    def _add(self, name: bytes | None, value: bytes | None) -> None:
        self.version += 1
        self.table.insert(0, (name, value))
        self.size += 32 + len(name or b"") + len(value or b"")  # a Huffman-coded string counts as empty (unread)
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            n, v = self.table.pop()
            self.size -= 32 + len(n or b"") + len(v or b"")

    def decode(self, b: bytes) -> dict[bytes | None, bytes | None]:
        """A header block's fields; a block seen before, with the table as it was then and left unchanged by it,
        from a cache (a server sends the same blocks call after call)."""
        hit = self.seen.get(b)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        version = self.version
        out = self._decode(b)
        if self.version == version:
            if len(self.seen) >= 64:
                self.seen.clear()
            self.seen[b] = (version, out)
        return out

    def _decode(self, b: bytes) -> dict[bytes | None, bytes | None]:
        out: dict[bytes | None, bytes | None] = {}
        i = 0
        while i < len(b):
            c = b[i]
            if c & 0x80:  # indexed
                index, i = self._int(b, i, 7)
                name, value = self._get(index)
            elif c & 0x40:  # literal, added to the table
                index, i = self._int(b, i, 6)
                name = self._get(index)[0] if index else None
                if not index:
                    name, i = self._str(b, i)
                value, i = self._str(b, i)
                self._add(name, value)
            elif c & 0x20:  # the table's size
                size, i = self._int(b, i, 5)
                if size > self.limit:
                    raise GrpcError(-1, f"HPACK: table size {size} over the {self.limit} allowed")
                self.max_size = size
                self.version += 1
                self._evict()
                continue
            else:  # literal, not added (0000) or never added (0001)
                index, i = self._int(b, i, 4)
                name = self._get(index)[0] if index else None
                if not index:
                    name, i = self._str(b, i)
                value, i = self._str(b, i)
            out[name] = value
        return out


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection, Nagle off, in blocking mode with the kernel's send and receive timeouts: Python's own
    timeout would poll() before every send and receive (a system call more each; a timeout here raises OSError)."""
    s = socket.create_connection((host, port), timeout=timeout_s)
    s.settimeout(None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tv = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    return s


def _lit(name: bytes, value: bytes) -> bytes:
    """HPACK: a literal header, new name, not added to the table, no Huffman coding (lengths < 127)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload


class UnaryClient:
    """One HTTP/2 connection to a gRPC server (plaintext), unary calls one at a time. ``timeout_s`` bounds every
    read and write. A failed call closes the connection; the next call opens a new one."""

    def __init__(self, host: str, port: int, path: str, timeout_s: float = 60.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.block = (b"\x83\x86" + _lit(b":path", path.encode()) + _lit(b":authority", f"{host}:{port}".encode())
                      + _lit(b"content-type", b"application/grpc") + _lit(b"te", b"trailers"))
        self.sock: socket.socket | None = None

    def prepare(self, message: bytes) -> tuple[bytearray, int]:
        """A call's frames (HEADERS, then the message in one DATA frame), built once: -> (frames, message bytes)."""
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        frames = bytearray(_frame(_HEADERS, _END_HEADERS, 0, self.block) + _frame(_DATA, _END_STREAM, 0, body))
        return frames, len(body)

    def _connect(self) -> None:
        s = connect(self.host, self.port, self.timeout_s)
        self.sock, self.buf, self.pos = s, bytearray(), 0
        self.hpack = _Hpack()
        self.sid = 1
        self.send_window = self.stream_window = 65535  # the server's, until its SETTINGS say
        self.max_frame = 16384
        self.received = 0  # of our connection window, since it was last topped up
        settings = struct.pack(">HI", 0x2, 0) + struct.pack(">HI", 0x4, _MAX_WINDOW)  # no push; stream window
        s.sendall(_PREFACE + _frame(_SETTINGS, 0, 0, settings)
                  + _frame(_WINDOW_UPDATE, 0, 0, (_MAX_WINDOW - 65535).to_bytes(4, "big")))
        self.server_settings = False
        while not self.server_settings:  # its first frame; the window and frame size before the first call
            self._frame_in(0)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def call(self, prepared: tuple[bytearray, int]) -> bytes:
        """Send one prepared call and return its response message; GrpcError or OSError otherwise."""
        try:
            return self._call(*prepared)
        except BaseException:
            self.close()
            raise

    def _call(self, frames: bytearray, body_len: int) -> bytes:
        if self.sock is None:
            self._connect()
        if body_len > self.max_frame or body_len > self.stream_window:
            raise GrpcError(-1, f"a {body_len}-byte message is over one frame or the server's stream window")
        while self.send_window < body_len:  # the server's connection window: wait for its WINDOW_UPDATE
            self._frame_in(0)
        sid = self.sid
        self.sid += 2
        struct.pack_into(">I", frames, 5, sid)
        struct.pack_into(">I", frames, 9 + len(self.block) + 5, sid)
        assert self.sock is not None
        self.sock.sendall(frames)
        self.send_window -= body_len
        self.headers: dict[bytes | None, bytes | None] = {}
        self.data = bytearray()
        self.done = False
        while not self.done:
            self._frame_in(sid)
        if self.sid > _MAX_WINDOW - 2:  # stream ids run out: a new connection next time
            self.close()
        h = self.headers
        status = h.get(b"grpc-status")
        if status != b"0":
            message = (h.get(b"grpc-message") or b"").decode(errors="replace")
            raise GrpcError(int(status) if status and status.isdigit() else -1,
                            message or f"no readable grpc-status (headers {sorted(str(k) for k in h)})")
        d = self.data
        if len(d) < 5 or d[0] != 0 or int.from_bytes(d[1:5], "big") != len(d) - 5:
            raise GrpcError(-1, f"not one uncompressed message ({len(d)} bytes of DATA)")
        return bytes(d[5:])

    def _read(self, n: int) -> bytes:
        """The next ``n`` bytes received."""
        self._fill(n)
        got = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return got

    def _fill(self, n: int) -> None:
        """At least ``n`` bytes received and not yet read in ``buf``, from ``pos``."""
        while len(self.buf) - self.pos < n:
            if self.pos:
                del self.buf[:self.pos]
                self.pos = 0
            assert self.sock is not None
            got = self.sock.recv(65536)
            if not got:
                raise ConnectionError("the server closed the connection")
            self.buf += got

    def _frame_in(self, sid: int) -> None:
        """Read and act on one frame; a frame of stream ``sid`` adds to the call's headers or data."""
        self._fill(9)
        hi, lo, kind, flags, stream = _HEAD.unpack_from(self.buf, self.pos)
        stream &= _MAX_WINDOW
        n = hi << 8 | lo
        if n > _MAX_FRAME:
            raise ConnectionError(f"a {n}-byte HTTP/2 frame")
        self._fill(9 + n)
        payload = bytes(self.buf[self.pos + 9:self.pos + 9 + n])
        self.pos += 9 + n
        assert self.sock is not None
        if kind == _DATA:
            self.received += n
            if self.received >= _RECV_WINDOW_TOP_UP:
                self.sock.sendall(_frame(_WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big")))
                self.received = 0
            if stream == sid:
                self.data += payload[1:n - payload[0]] if flags & _PADDED else payload
                self.done = bool(flags & _END_STREAM)
        elif kind in (_HEADERS, _CONTINUATION):
            block = payload
            if kind == _HEADERS:
                if flags & _PADDED:
                    block = block[1:n - block[0]]
                if flags & _PRIORITY:
                    block = block[5:]
            end_stream = bool(flags & _END_STREAM)
            while not flags & _END_HEADERS:
                hi, lo, kind, flags, _ = _HEAD.unpack(self._read(9))
                if kind != _CONTINUATION:
                    raise ConnectionError("HTTP/2: a header block not continued")
                block += self._read(hi << 8 | lo)
            decoded = self.hpack.decode(block)  # every block: the dynamic table follows them all
            if stream == sid:
                self.headers.update(decoded)
                self.done = end_stream
        elif kind == _SETTINGS:
            if not flags & _ACK:
                for k, v in struct.iter_unpack(">HI", payload):
                    if k == 0x4:
                        self.stream_window = v
                    elif k == 0x5:
                        self.max_frame = v
                self.sock.sendall(_frame(_SETTINGS, _ACK, 0))
                self.server_settings = True
        elif kind == _PING:
            if not flags & _ACK:
                self.sock.sendall(_frame(_PING, _ACK, 0, payload))
        elif kind == _WINDOW_UPDATE:
            if stream == 0:
                self.send_window += int.from_bytes(payload, "big") & _MAX_WINDOW
        elif kind == _RST_STREAM:
            if stream == sid:
                raise GrpcError(-1, f"the server reset the call (HTTP/2 error {int.from_bytes(payload, 'big')})")
        elif kind == _GOAWAY:
            raise ConnectionError(f"the server said GOAWAY (HTTP/2 error {int.from_bytes(payload[4:8], 'big')})")
