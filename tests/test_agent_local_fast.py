"""The on-box socket's fast paths (issue 21): the per-connection cache of decoded requests (agent/transports/local.py
_Templates: decode and find, as _quick uses them; agent/transports/kserve.py RequestTemplate) never lets a request
through that decode_request would refuse, and answers exactly as it would; AsyncLocalClient's timeouts (one timer for
all, no task per request)."""

import asyncio
import json
import uuid
from multiprocessing import shared_memory

import numpy as np
import pytest

from edgefleet.agent.errors import RequestError
from edgefleet.agent.transports.kserve import parse_body
from edgefleet.agent.transports.local import TEMPLATES_PER_CONNECTION, LocalServer, _Connection
from edgefleet.agent.transports.local_client import AsyncLocalClient, infer_request
from edgefleet.agent.transports.shm import SharedMemory
from edgefleet.protocol import local as wire
from edgefleet.protocol.manifest import TensorSpec

SPECS = (TensorSpec(name="input", datatype="FP32", shape=(-1, 1, 8, 8)),)
OUT = (TensorSpec(name="logits", datatype="FP32", shape=(-1, 10)),)


@pytest.fixture
def conn():
    shm = SharedMemory(max_regions=8, max_per_client=8, max_bytes=1 << 20)
    c = _Connection(LocalServer(None, shm, 1 << 20))  # type: ignore[arg-type]
    yield c
    shm.close()


@pytest.fixture
def region():
    name = f"edgefleet-fast-{uuid.uuid4().hex[:12]}"
    r = shared_memory.SharedMemory(name, create=True, size=8192)
    yield "/" + name, r
    r.close()
    r.unlink()


def split(body: bytes):
    """An INFER body -> what _Templates.decode is given."""
    _, _, jl, rest = wire.parse_infer(memoryview(body))
    return rest, jl, (str(jl) if jl < len(rest) else None)


def verdict(fn):
    try:
        r = fn()
    except RequestError as exc:
        return ("refused", str(exc))
    return ("ok", {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in r.feeds.items()}, r.outputs,
            r.binary_outputs, r.id, r.priority, r.timeout_us, r.shm_outputs)


def cached_decode(conn, body, specs=SPECS, out_specs=OUT):
    """What the connection does with an INFER body (_quick, then _infer): a template cached under the body's first
    bytes decodes it unless one of its checks fails; otherwise (and then) the uncached decode, which caches it."""
    hit = conn.quick.find(body)
    if hit is not None and hit[2].specs is specs and hit[2].out_specs is out_specs:
        t, end = hit[2], hit[3]
        try:
            return t.apply(memoryview(body)[end:] if t.has_binary else None, conn.shm)
        except RequestError:
            pass  # _infer's uncached decode says exactly why
    model, version, jl, rest = wire.parse_infer(memoryview(body))
    header = str(jl) if jl < len(rest) else None
    return conn.quick.decode(body[:len(body) - len(rest) + jl], model, version, rest, jl, header, specs, out_specs,
                             conn.shm)


def both(conn, body):
    """The cached path's verdict and the uncached one's (parse_body, as before): they must agree."""
    rest, jl, header = split(body)
    uncached = verdict(lambda: parse_body(rest, header, SPECS, OUT, conn.shm))
    cached = verdict(lambda: cached_decode(conn, body))
    assert cached == uncached
    return cached


def test_the_template_cache_never_lets_through_what_decoding_refuses(conn, region):
    key, r = region
    x = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8)
    r.buf[:256] = x.tobytes()
    conn.shm.register("io", key, 0, 8192, "test")
    by_ref = infer_request("digits", {"input": ("io", 0, 256, [1, 1, 8, 8])}, outputs={"logits": ("io", 4096, 40)})
    assert both(conn, by_ref)[0] == "ok" and len(conn.quick) == 1
    assert both(conn, by_ref)[0] == "ok"  # from the template
    import edgefleet.agent.transports.local as local_mod

    real, local_mod.parse_body = local_mod.parse_body, None  # type: ignore[assignment]
    try:  # a hit does not decode the header again
        assert cached_decode(conn, by_ref).feeds["input"].tobytes() == x.tobytes()
    finally:
        local_mod.parse_body = real
    r.buf[:4] = np.float32(np.nan).tobytes()  # NaN in the region: refused, as uncached
    assert "NaN" in both(conn, by_ref)[1]
    r.buf[:256] = x.tobytes()
    conn.shm.unregister("io")  # the region gone: the same header bytes are refused
    assert "no shared-memory region 'io'" in both(conn, by_ref)[1]
    conn.shm.register("io", key, 0, 1024, "test")  # again, but smaller: the output no longer fits
    assert "beyond shared-memory region 'io'" in both(conn, by_ref)[1]
    conn.shm.unregister("io")
    conn.shm.register("io", key, 0, 8192, "test")
    assert both(conn, by_ref)[0] == "ok"
    # inline: the same header with other data, then too little or too much of it
    inline = infer_request("digits", {"input": x})
    assert both(conn, inline)[0] == "ok"
    other = infer_request("digits", {"input": x + 1})
    assert both(conn, other)[1]["input"][2] == (x + 1).tobytes()
    assert "truncated" in both(conn, inline[:-4])[1] or "binary" in both(conn, inline[:-4])[1]
    assert both(conn, inline + b"\0" * 4)[0] == "refused"
    assert both(conn, inline[:-256])[0] == "refused"  # no binary data at all after the header
    nan = x.copy()
    nan[0, 0, 0, 0] = np.inf
    assert "NaN or infinity" in both(conn, infer_request("digits", {"input": nan}))[1]
    # another shape is another header (its own verdict); a header refused is never cached
    n = len(conn.quick)
    assert both(conn, infer_request("digits", {"input": np.zeros((1, 1, 8, 7), np.float32)}))[0] == "refused"
    assert len(conn.quick) == n
    # JSON data inputs are never cached (their values are in the header)
    data = json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()
    assert both(conn, wire.infer_body("digits", data))[0] == "ok" and len(conn.quick) == n
    # other specs (a model swapped in under the same header): not the template's
    specs2 = (TensorSpec(name="input", datatype="FP16", shape=(-1, 1, 8, 8)),)
    with pytest.raises(RequestError):
        cached_decode(conn, inline, specs2)


def test_the_template_cache_is_bounded(conn):
    for i in range(TEMPLATES_PER_CONNECTION + 20):
        body = infer_request("digits", {"input": np.full((1, 1, 8, 8), i, np.float32)}, version=str(i))
        head = json.dumps({"id": str(i), "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                                     "parameters": {"binary_data_size": 256}}]}).encode()
        body = wire.infer_body("digits", head, np.full(64, i, np.float32).tobytes())
        assert both(conn, body)[4] == str(i)
    assert len(conn.quick) == TEMPLATES_PER_CONNECTION


async def _silent_server(path):
    """A Unix server that reads everything and answers only REGISTER frames (OK), at once."""
    async def handle(reader, writer):
        buf = b""
        while chunk := await reader.read(65536):
            buf += chunk
            while len(buf) >= 16:
                _, _, kind, _, rid, length = wire.HEADER.unpack(buf[:16])
                if len(buf) < 16 + length:
                    break
                buf = buf[16 + length:]
                if kind == wire.REGISTER:
                    writer.write(wire.pack(wire.OK, rid))
        writer.close()
    return await asyncio.start_unix_server(handle, path)


STILL_WAITING_S = 0.05  # the time a request without a timeout is given to (wrongly) end: an absence, not a wait


def test_async_client_timeouts(tmp_path):
    path = str(tmp_path / "s.sock")

    async def main():
        server = await _silent_server(path)
        c = await AsyncLocalClient.connect(path)
        try:
            # answered before their timeout: no error later, the timer gone once nothing waits
            for _ in range(3):
                assert await c.call(wire.REGISTER, b"{}", timeout_s=0.3) == b""
            assert not c._deadlines and not c.pending
            # never answered: TimeoutError at its timeout, the shorter first; one without a timeout still waits
            forever = asyncio.ensure_future(c.infer_raw(b"x"))
            long = asyncio.ensure_future(c.infer_raw(b"y", timeout_s=3.0))
            # asyncio.TimeoutError: the builtin TimeoutError only from Python 3.11 (the agent runs on 3.10 too)
            with pytest.raises(asyncio.TimeoutError):
                await c.infer_raw(b"z", timeout_s=0.2)
            assert not long.done()  # its later deadline has not fired with the earlier one
            with pytest.raises(asyncio.TimeoutError):
                await long
            await asyncio.sleep(STILL_WAITING_S)
            assert not forever.done() and list(c.pending) and not c._deadlines
            assert await c.call(wire.REGISTER, b"{}", timeout_s=5) == b""  # the connection still serves
            c.close()
            with pytest.raises(ConnectionError):
                await forever
            assert c._sweep is None
        finally:
            c.close()
            server.close()

    asyncio.run(main())


def test_answers_kept_per_template_are_the_answers_built_afresh(conn, region):
    """encode_response's memo (a template's answers, where every output goes to shared memory): the same bytes as an
    answer built afresh, the outputs written each time, and every check still made (the region, its size, NaN)."""
    from edgefleet.agent.errors import InferenceFailed
    from edgefleet.agent.transports.kserve import encode_response

    key, r = region
    conn.shm.register("io", key, 0, 8192, "test")
    body = infer_request("digits", {"input": ("io", 0, 256, [1, 1, 8, 8])}, outputs={"logits": ("io", 4096, 40)})
    r.buf[:256] = np.ones(64, np.float32).tobytes()
    req = cached_decode(conn, body)
    memo: dict = {}
    for i in range(3):
        out = [np.arange(10, dtype=np.float32).reshape(1, 10) + i]
        fresh = encode_response("digits", "1", out, OUT, req, conn.shm)
        r.buf[4096:4136] = bytes(40)
        assert encode_response("digits", "1", out, OUT, req, conn.shm, memo) == fresh
        assert np.frombuffer(r.buf[4096:4136], np.float32).tolist() == out[0].reshape(-1).tolist()
    assert len(memo) == 1
    assert encode_response("digits", "2", out, OUT, req, conn.shm, memo) != fresh  # another version: its own
    nan = [np.full((1, 10), np.nan, np.float32)]
    with pytest.raises(InferenceFailed, match="NaN"):
        encode_response("digits", "1", nan, OUT, req, conn.shm, memo)
    conn.shm.unregister("io")
    with pytest.raises(RequestError, match="no shared-memory region 'io'"):
        encode_response("digits", "1", out, OUT, req, conn.shm, memo)
    conn.shm.register("io", key, 0, 4100, "test")  # too small for the output now
    with pytest.raises(RequestError, match="beyond shared-memory region 'io'"):
        encode_response("digits", "1", out, OUT, req, conn.shm, memo)
