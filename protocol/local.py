"""The agent's on-box socket protocol, version 1: the Open Inference Protocol without HTTP, over a Unix socket.

A local client (a process on the device) connects to the agent's Unix-domain socket (``local_socket`` in
agent.yaml, e.g. ``<data_dir>/local.sock``, mode 0660) and exchanges *frames*. Every frame, both ways, is a
16-byte header followed by ``length`` bytes of body; all integers are little-endian:

    offset  size  field
    0       4     magic       b"EFLP"
    4       1     version     1
    5       1     kind        see below
    6       2     flags       0 (reserved; a frame with other flags is refused)
    8       4     request_id  chosen by the client; the agent's answer carries the same one
    12      4     length      body bytes that follow, at most the agent's max_body_bytes

A client may send several requests without waiting (pipelining); answers come back as they finish, not
necessarily in order, each with its request's ``request_id``. Client -> agent kinds:

    INFER       u16 model-name length, the model name (UTF-8), u16 version length (0: the served version), the
                version, u32 JSON length, the JSON infer request of the Open Inference Protocol (the same document
                an HTTP client POSTs to /v2/models/{name}/infer), then the binary tensors of the inputs that give
                ``binary_data_size``, in order (the binary tensor data extension). Inputs and outputs may name a
                system shared-memory region registered on this connection (``shared_memory_region``,
                ``shared_memory_byte_size``, ``shared_memory_offset``): tensors by reference, no copy through
                the socket.
    REGISTER    JSON {"name": ..., "key": "/shm-object", "offset": 0, "byte_size": N}: map a POSIX shared-memory
                object's bytes as a region. A region belongs to the connection that registered it: other
                connections (and HTTP/gRPC clients) cannot use it, and it is unregistered when the connection
                closes, or after the agent's shm_idle_timeout_s unused.
    UNREGISTER  JSON {"name": ...} (one region) or {} (every region of this connection).

Agent -> client kinds:

    RESULT      u32 JSON length, the JSON infer response, then the binary outputs it describes (as over HTTP)
    OK          an empty body: REGISTER or UNREGISTER done
    ERROR       u16 status (the HTTP status the same failure gets: 400, 404, 413, 429, 503, 500), then the
                message (UTF-8). request_id 0 answers a frame that could not be read: a bad magic, version,
                flags or length; the agent then closes the connection (the stream cannot be resynchronised).
                Any other error leaves the connection open.

Bounds (the agent's): a frame's body at most max_body_bytes; at most ``local_max_connections`` connections and
``local_max_inflight`` requests in flight per connection (the agent stops reading a connection beyond that);
a frame must arrive whole within ``local_frame_timeout_s`` (``FRAME_TIMEOUT_S``, 30 s, by default) of its first
byte, or the agent answers ERROR 408 and closes the connection; a connection idle for ``local_idle_timeout_s`` is
closed the same way; at most ``local_max_connections_per_user`` connections are one user's. Shared-memory regions
are bounded as over HTTP (max_shm_regions_per_client per connection, max_shm_regions, max_shm_bytes).
"""

from __future__ import annotations

import struct

__all__ = ["ERROR", "FRAME_TIMEOUT_S", "HEADER", "INFER", "MAGIC", "OK", "REGISTER", "RESULT", "UNREGISTER",
           "VERSION", "FrameError", "infer_body", "pack", "parse_infer", "unpack_header"]

MAGIC = b"EFLP"
VERSION = 1
HEADER = struct.Struct("<4sBBHII")  # magic, version, kind, flags, request_id, length
INFER, REGISTER, UNREGISTER = 1, 2, 3
RESULT, OK, ERROR = 0x81, 0x82, 0xFF
REQUEST_KINDS = frozenset({INFER, REGISTER, UNREGISTER})
FRAME_TIMEOUT_S = 30.0
MAX_REQUEST_ID = 0xFFFFFFFF
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


class FrameError(ValueError):
    """A frame header that cannot be read: the connection cannot continue after it."""


def pack(kind: int, request_id: int, body: bytes | bytearray | memoryview = b"") -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, 0, request_id, len(body)) + bytes(body)


def unpack_header(head: bytes | bytearray | memoryview, max_length: int) -> tuple[int, int, int]:
    """A frame's 16 header bytes -> (kind, request_id, length); FrameError says precisely what is wrong."""
    magic, version, kind, flags, request_id, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"not an edgefleet local frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"frame version {version} is not supported; this agent speaks version {VERSION}")
    if flags:
        raise FrameError(f"frame flags {flags:#x}: no flags are defined in version {VERSION}")
    if length > max_length:
        raise FrameError(f"a frame body of {length} bytes exceeds this agent's limit of {max_length} "
                         "(max_body_bytes)")
    return kind, request_id, length


def infer_body(model: str, header: bytes, binary: bytes | memoryview = b"", version: str = "") -> bytes:
    """An INFER frame's body: the model (and version), the JSON infer request, the binary tensors."""
    m, v = model.encode(), version.encode()
    return b"".join([_U16.pack(len(m)), m, _U16.pack(len(v)), v, _U32.pack(len(header)), header, binary])


def parse_infer(body: memoryview) -> tuple[str, str | None, int, memoryview]:
    """An INFER body -> (model, version or None, the JSON header's length, the JSON header and the binary data after
    it); ValueError says what is wrong."""
    pos, n = 0, len(body)
    fields: list[memoryview] = []
    for what, size, fmt in (("model name", 2, _U16), ("version", 2, _U16)):
        if pos + size > n:
            raise ValueError(f"the INFER body ends before the length of its {what} ({n} bytes)")
        (length,) = fmt.unpack_from(body, pos)
        pos += size
        if pos + length > n:
            raise ValueError(f"the INFER body's {what} is {length} bytes, but only {n - pos} follow")
        fields.append(body[pos:pos + length])
        pos += length
    if pos + 4 > n:
        raise ValueError(f"the INFER body ends before the length of its JSON header ({n} bytes)")
    (json_length,) = _U32.unpack_from(body, pos)
    pos += 4
    if pos + json_length > n:
        raise ValueError(f"the INFER body's JSON header is {json_length} bytes, but only {n - pos} follow")
    try:
        model, version = bytes(fields[0]).decode(), bytes(fields[1]).decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"the model name or version is not UTF-8 ({exc})") from None
    if not model:
        raise ValueError("the INFER body names no model")
    return model, version or None, json_length, body[pos:]
