"""bench/serve_load.py's one-client levels, blocking (issue 41): at one closed-loop client the load generator's own
CPU per request is on the latency path, so these send each request and read its answer with no event loop in
between, every request built once before the timed phase (serve_load._drive takes them at one client, unless
EDGEFLEET_BENCH_ONE=async)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
from serve_load import (
    _closed_loop_one,
    _outputs_grpc,
    _outputs_http,
    _outputs_shm,
    _request,
    _shm_setup,
    _shm_teardown,
    _top1,
    texts,
)

__all__ = ["drive_one"]


def drive_one(host: str, port: int, kind: str, path: str, reqs: list[bytes], labels: list[Any], total: int,
               warmup: int, timed: Callable[[], object] | None, shape: list[int] | None = None,
               answer: str = "top1") -> dict[str, Any]:
    """One client, blocking, with no event loop. At one client the generator's CPU per request is on the latency
    path: grpc.aio cost ~210-260 us of CPU a request, the async shared-memory client ~136 us and the async HTTP one
    135-141 us, against perf_analyzer's ~50-90 (bench/perf_analyzer_vs_serve.py --split-cpus 0:1). HTTP (``binary``,
    ``json``, ``naive``): one TCP connection, each request prebuilt, the answer read with ``_read_answer``.
    ``grpc``: bench/grpc_h2.py's
    HTTP/2 client, each call's frames prebuilt (grpcio's synchronous stub, ~150-200 us a call, where a request is
    over one HTTP/2 frame); ``shm``: one TCP connection and the whole HTTP request built once (per call the image
    is written into the region, the request sent, the answer read).

    A/B of the load generator itself: EDGEFLEET_BENCH_ONE=async drives one client with the asyncio path (as many
    clients), EDGEFLEET_BENCH_ONE=stub gRPC's with grpcio's synchronous stub."""
    if kind == "grpc":
        return _drive_one_grpc(host, port, path, reqs, labels, total, warmup, timed, answer)
    if kind != "shm":
        return _drive_one_http(host, port, kind, path, reqs, labels, total, warmup, timed, answer)
    return _drive_one_shm(host, port, path, reqs, labels, total, warmup, timed, shape, answer)


def _drive_one_http(host: str, port: int, kind: str, path: str, reqs: list[bytes], labels: list[Any], total: int,
                    warmup: int, timed: Callable[[], object] | None, answer: str = "top1") -> dict[str, Any]:
    prebuilt = [_request(host, port, path, b, kind) for b in reqs]
    conn = _Http(host, port)

    def one(i: int) -> tuple[str | None, bool]:
        status, content, head = conn.exchange(prebuilt[i])
        if status != 200:
            return f"{status}: {content[:200]!r}", False
        headers = {b"inference-header-content-length": _header(head, b"inference-header-content-length")}
        if answer == "texts":
            return None, texts(_outputs_http(headers, content)) != labels[i]
        return None, _top1(kind, headers, content) != labels[i]

    try:
        return _closed_loop_one(total, warmup, len(reqs), one, timed)
    finally:
        conn.close()


def _drive_one_grpc(host: str, port: int, path: str, reqs: list[bytes], labels: list[Any], total: int, warmup: int,
                    timed: Callable[[], object] | None, answer: str = "top1") -> dict[str, Any]:
    from tritonclient.grpc import service_pb2  # type: ignore[import-untyped]

    parse = service_pb2.ModelInferResponse.FromString

    def read(r: Any) -> Any:
        if answer == "texts":
            return texts(_outputs_grpc(r))
        return int(np.frombuffer(r.raw_output_contents[0], np.float32).argmax())

    if max(len(r) for r in reqs) + 5 <= 16384 and os.environ.get("EDGEFLEET_BENCH_ONE") != "stub":
        # one DATA frame within HTTP/2's default frame size and stream window
        from grpc_h2 import UnaryClient

        client = UnaryClient(host, port, path, timeout_s=60)
        prepared = [client.prepare(r) for r in reqs]

        def one(i: int) -> tuple[str | None, bool]:
            return None, read(parse(client.call(prepared[i]))) != labels[i]

        try:
            return _closed_loop_one(total, warmup, len(reqs), one, timed)
        finally:
            client.close()

    import grpc  # type: ignore[import-untyped]

    channel = grpc.insecure_channel(f"{host}:{port}", options=[("grpc.max_receive_message_length", 1 << 26),
                                                               ("grpc.max_send_message_length", 1 << 26)])
    infer = channel.unary_unary(path, request_serializer=None, response_deserializer=parse)

    def one_stub(i: int) -> tuple[str | None, bool]:
        return None, read(infer(reqs[i], timeout=60)) != labels[i]

    try:
        return _closed_loop_one(total, warmup, len(reqs), one_stub, timed)
    finally:
        channel.close()


def _drive_one_shm(host: str, port: int, path: str, reqs: list[bytes], labels: list[Any], total: int, warmup: int,
                   timed: Callable[[], object] | None, shape: list[int] | None = None,
                   answer: str = "top1") -> dict[str, Any]:

    in_bytes, out_bytes = len(reqs[0]), 4096
    region, heads, offsets = _shm_setup(host, port, path, 1, in_bytes, out_bytes, shape)
    request = _request(host, port, path, heads[0], "json")
    buf = region.buf
    conn = _Http(host, port)
    sizes: dict[bytes, int] = {}

    def one(i: int) -> tuple[str | None, bool]:
        buf[:in_bytes] = reqs[i]
        status, content, _ = conn.exchange(request)
        if status != 200:
            return f"{status}: {content[:200]!r}", False
        if answer == "texts":
            return None, texts(_outputs_shm(json.loads(content), buf, offsets)) != labels[i]
        n = sizes.get(content)  # the same answer every call: its output's size read once
        if n is None:  # from its shape (FP32), as in _drive_local
            n = sizes[content] = 4 * int(np.prod(json.loads(content)["outputs"][0]["shape"]))
        return None, int(np.frombuffer(buf[in_bytes:in_bytes + n], np.float32).argmax()) != labels[i]

    try:
        return _closed_loop_one(total, warmup, len(reqs), one, timed)
    finally:
        conn.close()
        _shm_teardown(host, port, region)


def _header(head: bytes, name: bytes) -> bytes:
    """A header's value from an answer's head as _read_answer returns it (lowercased); b"" when absent."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return b""
    at += len(name) + 3
    stop = head.find(b"\r\n", at)
    return head[at:stop if stop >= 0 else len(head)].strip()


class _Http:
    """One blocking HTTP/1.1 connection to the agent, opened again after a failed exchange."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.sock: socket.socket | None = None
        self.pending = bytearray()

    def exchange(self, request: bytes) -> tuple[int, bytes, bytes]:
        """Send ``request`` and read its answer -> (status, body, head lowercased)."""
        from grpc_h2 import connect

        if self.sock is None:
            self.sock = connect(self.host, self.port, 60)
            self.pending.clear()
        try:
            self.sock.sendall(request)
            return _read_answer(self.sock, self.pending)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _read_answer(sock: socket.socket, pending: bytearray) -> tuple[int, bytes, bytes]:
    """One HTTP/1.1 answer from a blocking socket (its body sized by Content-Length) -> (status, body, its head
    lowercased); ``pending`` holds bytes read past it."""
    while (end := pending.find(b"\r\n\r\n")) < 0:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("the agent closed the connection")
        pending += got
    head = bytes(pending[:end]).lower()
    size = int(_header(head, b"content-length"))
    start = end + 4
    while len(pending) < start + size:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("the agent closed the connection")
        pending += got
    body = bytes(pending[start:start + size])
    del pending[:start + size]
    return int(head[9:12]), body, head
