"""bench/serve.py's load: each variant's request bodies, the closed-loop clients (HTTP, gRPC, shared memory, the
agent's Unix socket) in a load-generator process of its own, one load level with where the CPU went and what the
agent's statistics say of it, and the JSON decode cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_limit  # serve_limit.PIN: set at run time


def bodies(kind: str, model: str, images: np.ndarray,
           input_name: str = "input") -> tuple[str, list[bytes], dict[str, str]]:
    """-> (path, one body per image, extra headers) for one variant. grpc: serialized ModelInferRequests; shm: the
    images' raw bytes (the load generator writes them into its shared-memory region). ``input_name``: the model's
    input (digits': 'input'; the OCR pipeline's: 'x'); every output is asked for, as perf_analyzer asks."""
    if kind == "grpc":
        from tritonclient.grpc import service_pb2

        out = []
        for img in images:
            r = service_pb2.ModelInferRequest(model_name=model)
            r.inputs.add(name=input_name, datatype="FP32", shape=[1, *images.shape[1:]])
            r.raw_input_contents.append(np.ascontiguousarray(img[None], dtype=np.float32).tobytes())
            out.append(r.SerializeToString())
        return "/inference.GRPCInferenceService/ModelInfer", out, {}
    if kind in ("shm", "local"):
        return f"/v2/models/{model}/infer", [np.ascontiguousarray(i[None], np.float32).tobytes() for i in images], {}
    if kind == "local-inline":
        from edgefleet.agent.transports.local_client import infer_request

        return model, [infer_request(model, {input_name: np.ascontiguousarray(i[None], np.float32)})
                       for i in images], {}
    if kind == "naive":
        return "/predict", [np.ascontiguousarray(img[None]).tobytes() for img in images], {}
    path = f"/v2/models/{model}/infer"
    shape = [1, *images.shape[1:]]
    if kind == "json":
        return path, [json.dumps({"inputs": [{"name": input_name, "shape": shape, "datatype": "FP32",
                                              "data": img.reshape(-1).tolist()}]}).encode() for img in images], {}
    out = []
    for img in images:
        raw = np.ascontiguousarray(img[None], dtype=np.float32).tobytes()
        head = json.dumps({"inputs": [{"name": input_name, "shape": shape, "datatype": "FP32",
                                       "parameters": {"binary_data_size": len(raw)}}],
                           "parameters": {"binary_data_output": True}}).encode()
        out.append(len(head).to_bytes(4, "little") + head + raw)  # the header length rides in front, split later
    return path, out, {}


def _request(host: str, port: int, path: str, body: bytes, kind: str) -> bytes:
    extra = ""
    if kind == "binary":
        hl = int.from_bytes(body[:4], "little")
        body = body[4:]
        extra = f"Inference-Header-Content-Length: {hl}\r\n"
    ctype = "application/json" if kind == "json" else "application/octet-stream"
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {ctype}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _post(conn: list[Any], host: str, port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    if not conn:
        r, w = await asyncio.open_connection(host, port)
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn[:] = [r, w]
    reader, writer = conn
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        return int(head[9:12]), headers, await reader.readexactly(int(headers[b"content-length"]))
    except BaseException:
        writer.close()
        conn.clear()
        raise


def _top1(kind: str, headers: dict[bytes, bytes], content: bytes) -> int:
    if kind == "naive":
        return int(np.frombuffer(content, np.float32).argmax())
    if kind == "binary":
        hl = int(headers[b"inference-header-content-length"])
        return int(np.frombuffer(content, np.float32, offset=hl).argmax())
    return int(np.argmax(json.loads(content)["outputs"][0]["data"]))


# What a request's label is compared with: 'top1', the first output's largest entry (digits' class; the fast paths
# read only that), or 'texts', a detect-then-read pipeline's strings for its image (every output decoded by name)
ANSWERS = ("top1", "texts")
_DTYPES: dict[str, Any] = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT8": np.int8,
                           "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8,
                           "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64, "BOOL": np.bool_}


def texts(outputs: dict[str, np.ndarray]) -> list[str]:
    """A detect-then-read pipeline's answer for one image, as its label is compared: the strings it read (the first
    'count' rows of its [1, K, B] 'text', NUL-padded UTF-8)."""
    count = int(outputs["count"].reshape(-1)[0])
    return [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in outputs["text"][0, :count]]


def _outputs_http(headers: dict[bytes, bytes], content: bytes) -> dict[str, np.ndarray]:
    """An HTTP answer's outputs by name: the binary ones in order after its JSON header, the others from the JSON."""
    hl = int(headers.get(b"inference-header-content-length", len(content)))
    out: dict[str, np.ndarray] = {}
    at = hl
    for o in json.loads(content[:hl])["outputs"]:
        dt = np.dtype(_DTYPES[o["datatype"]])
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out[o["name"]] = np.asarray(o["data"], dt).reshape(o["shape"])
        else:
            out[o["name"]] = np.frombuffer(content, dt, int(size) // dt.itemsize, at).reshape(o["shape"])
            at += int(size)
    return out


def _outputs_grpc(r: Any) -> dict[str, np.ndarray]:
    """A ModelInferResponse's outputs by name (raw_output_contents, in the outputs' order)."""
    return {o.name: np.frombuffer(raw, _DTYPES[o.datatype]).reshape(list(o.shape))
            for o, raw in zip(r.outputs, r.raw_output_contents, strict=True)}


def _outputs_shm(doc: dict[str, Any], buf: Any, offsets: dict[str, int]) -> dict[str, np.ndarray]:
    """A shared-memory answer's outputs by name: their shapes and types from its JSON ``doc``, their bytes copied out
    of the region ``buf`` at ``offsets`` (where the request put each)."""
    out = {}
    for o in doc["outputs"]:
        dt = np.dtype(_DTYPES[o["datatype"]])
        at = offsets[o["name"]]
        out[o["name"]] = np.frombuffer(bytes(buf[at:at + dt.itemsize * int(np.prod(o["shape"]))]),
                                       dt).reshape(o["shape"])
    return out


class _Tally:
    """What a closed loop's timed requests came to: latencies of the good ones, errors (the first one kept), wrong
    answers; and the generator's own CPU and wall time over the timed phase."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.bad = {"errors": 0, "wrong": 0}
        self.first_error: str | None = None
        self.cpu0 = self.t0 = 0.0

    def add(self, t0: float, err: str | None, wrong: bool) -> None:
        if err is None:
            self.lat.append(time.perf_counter() - t0)
            self.bad["wrong"] += wrong
        else:
            self.bad["errors"] += 1
            self.first_error = self.first_error or err[:300]

    def start(self, timed: Callable[[], object] | None) -> None:
        if timed is not None:
            timed()
        self.cpu0, self.t0 = time.process_time(), time.perf_counter()

    def result(self) -> dict[str, Any]:
        return {"wall": time.perf_counter() - self.t0, "latencies": self.lat, **self.bad,
                "first_error": self.first_error, "load_cpu_s": time.process_time() - self.cpu0}


async def _closed_loop(clients: int, total: int, warmup: int, n_reqs: int,
                       one: Callable[[int, int], Awaitable[tuple[str | None, bool]]],
                       timed: Callable[[], object] | None) -> dict[str, Any]:
    """Closed-loop load: each of ``clients`` sends ``warmup`` untimed requests, then its share of ``total`` timed
    ones, one at a time. ``one(slot, i)`` sends request ``i`` for client ``slot`` and returns (the error, or None;
    whether the answer's top-1 is wrong). ``timed``, if given, is called as the timed phase starts."""
    tally = _Tally()

    async def client(slot: int, n: int, record: bool) -> None:
        i = (slot * 7919) % n_reqs
        for _ in range(n):
            t0 = time.perf_counter()
            try:
                err, wrong = await one(slot, i)
            except Exception as exc:
                err, wrong = repr(exc), False
            if record:
                tally.add(t0, err, wrong)
            i = (i + 1) % n_reqs

    await asyncio.gather(*(client(k, warmup, False) for k in range(clients)))
    tally.start(timed)
    await asyncio.gather(*(client(k, max(1, total // clients), True) for k in range(clients)))
    return tally.result()


def _closed_loop_one(total: int, warmup: int, n_reqs: int, one: Callable[[int], tuple[str | None, bool]],
                     timed: Callable[[], object] | None) -> dict[str, Any]:
    """_closed_loop for one client, blocking: ``one(i)`` sends request ``i`` and waits for its answer, no event loop
    in between (at one client the generator's CPU per request is on the latency path)."""
    tally = _Tally()
    for record, n in ((False, warmup), (True, total)):
        if record:
            tally.start(timed)
        for k in range(n):
            t0 = time.perf_counter()
            try:
                err, wrong = one(k % n_reqs)
            except Exception as exc:
                err, wrong = repr(exc), False
            if record:
                tally.add(t0, err, wrong)
    return tally.result()


async def _drive(url: str, kind: str, path: str, reqs: list[bytes], labels: list[Any], clients: int, total: int,
                 warmup: int, timed: Callable[[], object] | None = None, shape: list[int] | None = None,
                 answer: str = "top1") -> dict[str, Any]:
    """``timed``, if given, is called as the timed phase starts (the parent then reads the servers' CPU clocks).
    ``answer``: of ANSWERS, what each answer's label is compared with."""
    if answer not in ANSWERS or (answer != "top1" and kind in ("local", "local-inline", "naive")):
        raise ValueError(f"answer {answer!r}: not read from {kind!r} answers")
    if kind in ("local", "local-inline"):
        return await _drive_socket(url, kind, path, reqs, labels, clients, total, warmup, timed, shape)
    host, port_s = url.removeprefix("http://").rsplit(":", 1)
    port = int(port_s)
    if clients == 1 and os.environ.get("EDGEFLEET_BENCH_ONE") != "async":
        from serve_one import drive_one  # here: serve_one builds on this module

        return drive_one(host, port, kind, path, reqs, labels, total, warmup, timed, shape, answer)
    if kind in ("grpc", "shm"):
        return await _drive_local(host, port, kind, path, reqs, labels, clients, total, warmup, timed, shape, answer)
    prebuilt = [_request(host, port, path, b, kind) for b in reqs]
    conns: list[list[Any]] = [[] for _ in range(clients)]

    async def one(slot: int, i: int) -> tuple[str | None, bool]:
        status, headers, content = await asyncio.wait_for(_post(conns[slot], host, port, prebuilt[i]), 60)
        if status != 200:
            return f"{status}: {content[:200]!r}", False
        if answer == "texts":
            return None, texts(_outputs_http(headers, content)) != labels[i]
        return None, _top1(kind, headers, content) != labels[i]

    try:
        return await _closed_loop(clients, total, warmup, len(prebuilt), one, timed)
    finally:
        for c in conns:
            if c:
                c[1].close()


async def _drive_local(host: str, port: int, kind: str, path: str, reqs: list[bytes], labels: list[Any],
                       clients: int, total: int, warmup: int, timed: Callable[[], object] | None,
                       shape: list[int] | None = None, answer: str = "top1") -> dict[str, Any]:
    """The on-box clients: ``grpc`` (one grpc.aio channel, requests prebuilt) to the agent's gRPC port (``port`` is
    then that port), or ``shm``: binary-free HTTP requests whose input and outputs live in one POSIX shared-memory
    region this process registers (each client its own slice; it writes its image there before each request and
    reads the outputs back from it)."""
    in_bytes, out_bytes = len(reqs[0]) if kind == "shm" else 0, 4096  # 4 KiB an output is plenty here
    region: Any = None
    call: Callable[[int, int], Any]
    if kind == "grpc":
        import grpc  # type: ignore[import-untyped]
        from tritonclient.grpc import service_pb2  # type: ignore[import-untyped]

        channel = grpc.aio.insecure_channel(f"{host}:{port}", options=[("grpc.max_receive_message_length", 1 << 26),
                                                                       ("grpc.max_send_message_length", 1 << 26)])
        infer = channel.unary_unary(path, request_serializer=None,
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)

        async def call(slot: int, i: int) -> Any:
            r = await infer(reqs[i], timeout=60)
            if answer == "texts":
                return texts(_outputs_grpc(r))
            return int(np.frombuffer(r.raw_output_contents[0], np.float32).argmax())
    else:
        region, prebuilt, offsets = _shm_setup(host, port, path, clients, in_bytes, out_bytes, shape)
        slot_bytes = in_bytes + out_bytes * len(offsets)
        conns: list[list[Any]] = [[] for _ in range(clients)]
        buf = region.buf

        async def call(slot: int, i: int) -> Any:
            base = slot * slot_bytes
            buf[base:base + in_bytes] = reqs[i]
            status, _, content = await _post(conns[slot], host, port, _request(host, port, path, prebuilt[slot],
                                                                               "json"))
            if status != 200:
                raise RuntimeError(f"{status}: {content[:200]!r}")
            if answer == "texts":
                return texts(_outputs_shm(json.loads(content), buf, {k: base + v for k, v in offsets.items()}))
            # the output's size from its shape (FP32): an HTTP answer describes a shared-memory output by no
            # parameters, as Triton's does (its C++ client reads output parameters as binary data)
            n = 4 * int(np.prod(json.loads(content)["outputs"][0]["shape"]))
            return int(np.frombuffer(buf[base + in_bytes:base + in_bytes + n], np.float32).argmax())

    async def one(slot: int, i: int) -> tuple[str | None, bool]:
        # gRPC's own deadline (timeout=60 above) times a call out: no task per request as asyncio.wait_for makes
        # (measured at one client: the generator's CPU per request is what parts it from perf_analyzer's rate)
        got = await (call(slot, i) if kind == "grpc" else asyncio.wait_for(call(slot, i), 60))
        return None, got != labels[i]

    try:
        return await _closed_loop(clients, total, warmup, len(reqs), one, timed)
    finally:
        if kind == "grpc":
            await channel.close()
        if region is not None:
            _shm_teardown(host, port, region)


def _shm_setup(host: str, port: int, path: str, clients: int, in_bytes: int, out_bytes: int,
               shape: list[int] | None = None) -> tuple[Any, list[bytes], dict[str, int]]:
    """The ``shm`` variant's region (each client a slice: its input, then ``out_bytes`` for each of the model's
    outputs, in the metadata's order, as perf_analyzer asks for every output), registered with the agent, and each
    client's request header (JSON) naming its slice. ``shape``: the input's, [1, ...] (default: the model's, its
    open batch 1). -> (region, headers, each output's offset in a slice)."""
    from multiprocessing import shared_memory

    with urllib.request.urlopen(f"http://{host}:{port}{path.removesuffix('/infer')}", timeout=30) as r:
        meta = json.loads(r.read())  # loopback: the agent under test
    offsets = {o["name"]: in_bytes + k * out_bytes for k, o in enumerate(meta["outputs"])}
    slot_bytes = in_bytes + out_bytes * len(offsets)
    key = f"edgefleet-bench-{os.getpid()}"
    region = shared_memory.SharedMemory(key, create=True, size=slot_bytes * clients)
    try:
        reg = json.dumps({"key": "/" + key, "offset": 0, "byte_size": slot_bytes * clients}).encode()
        req = urllib.request.Request(f"http://{host}:{port}/v2/systemsharedmemory/region/{key}/register", data=reg,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:  # loopback: the agent under test; not 200 raises
            r.read()
    except BaseException as exc:
        region.close()
        region.unlink()
        raise RuntimeError(f"registering the shared-memory region: {exc}") from exc
    shape = shape or [1 if d == -1 else d for d in meta["inputs"][0]["shape"]]
    heads = []
    for slot in range(clients):
        base = slot * slot_bytes
        heads.append(json.dumps({
            "inputs": [{"name": meta["inputs"][0]["name"], "shape": shape, "datatype": "FP32", "parameters": {
                "shared_memory_region": key, "shared_memory_byte_size": in_bytes, "shared_memory_offset": base}}],
            "outputs": [{"name": name, "parameters": {
                "shared_memory_region": key, "shared_memory_byte_size": out_bytes,
                "shared_memory_offset": base + at}} for name, at in offsets.items()]}).encode())
    return region, heads, offsets


def _shm_teardown(host: str, port: int, region: Any) -> None:
    with contextlib.suppress(Exception):
        req = urllib.request.Request(f"http://{host}:{port}/v2/systemsharedmemory/unregister", data=b"",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:  # loopback: the agent under test
            r.read()
    region.close()
    region.unlink()


async def _drive_socket(sock_path: str, kind: str, path: str, reqs: list[bytes], labels: list[int], clients: int,
                        total: int, warmup: int, timed: Callable[[], object] | None,
                        shape: list[int] | None = None) -> dict[str, Any]:
    """The agent's on-box socket (agent/transports/local_client.py): every client on one connection, its requests
    pipelined. ``local``: the input and the output in one shared-memory region (each client its own slice, as for
    ``shm``); ``local-inline``: the input bytes in the frame (``reqs`` are prebuilt INFER bodies), the output in the
    answer."""
    from multiprocessing import shared_memory

    import orjson

    from edgefleet.agent.transports.local_client import AsyncLocalClient, decode_result, infer_request

    region: Any = None
    conn = await AsyncLocalClient.connect(sock_path)
    call: Callable[[int, int], Any]
    # A/B of the load generator itself: EDGEFLEET_BENCH_SOCKET_WAIT_FOR=1 times each request out with
    # asyncio.wait_for (a task per request, as before) instead of the client's timeout_s
    wait_for = os.environ.get("EDGEFLEET_BENCH_SOCKET_WAIT_FOR") == "1"
    timeout_s = None if wait_for else 60.0
    if kind == "local":
        in_bytes, out_bytes = len(reqs[0]), 4096
        slot_bytes = in_bytes + out_bytes
        key = f"edgefleet-bench-{os.getpid()}"
        region = shared_memory.SharedMemory(key, create=True, size=slot_bytes * clients)
        await conn.register_region(key, "/" + key, slot_bytes * clients)
        # input [1, *shape] (default: the digits model's [1, 1, 8, 8]), output logits
        prebuilt = [infer_request(path.split("/")[3], {"input": (key, s * slot_bytes, in_bytes, shape or [1, 1, 8, 8])},
                                  outputs={"logits": (key, s * slot_bytes + in_bytes, out_bytes)})
                    for s in range(clients)]
        buf = region.buf

        async def call(slot: int, i: int) -> int:
            base = slot * slot_bytes
            buf[base:base + in_bytes] = reqs[i]
            body = await conn.infer_raw(prebuilt[slot], timeout_s)
            jl = int.from_bytes(body[:4], "little")
            n = orjson.loads(body[4:4 + jl])["outputs"][0]["parameters"]["shared_memory_byte_size"]
            return int(np.frombuffer(buf[base + in_bytes:base + in_bytes + n], np.float32).argmax())
    else:
        async def call(slot: int, i: int) -> int:
            return int(decode_result(await conn.infer_raw(reqs[i], timeout_s))[1]["logits"].argmax())

    async def one(slot: int, i: int) -> tuple[str | None, bool]:
        # the client's own timeout (one timer for all): no task per request as asyncio.wait_for makes
        top1 = await (asyncio.wait_for(call(slot, i), 60) if wait_for else call(slot, i))
        return None, top1 != labels[i]

    try:
        return await _closed_loop(clients, total, warmup, len(reqs), one, timed)
    finally:
        conn.close()
        if region is not None:
            del buf
            region.close()
            region.unlink()


def _load_worker(args: tuple, results: Any, cpus: frozenset[int] | None = None) -> None:
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # --pin: the load generator off the inference CPUs
        url, kind, path, reqs, labels, clients, total, warmup, shape, answer = args
        results.put(asyncio.run(_drive(url, kind, path, reqs, labels, clients, total, warmup,
                                       timed=lambda: results.put({"timed": True}), shape=shape, answer=answer)))
    except BaseException as exc:
        results.put({"fatal": f"{type(exc).__name__}: {exc}"})


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, by thread id (Linux /proc)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def run_level(url: str, kind: str, path: str, reqs: list[bytes], labels: list[Any], clients: int, total: int,
              warmup: int, timeout_s: float = 600, server_pid: int | None = None,
              stats_url: str | None = None, shape: list[int] | None = None, answer: str = "top1") -> dict[str, Any]:
    """One closed-loop level from a separate (spawned) load-generator process. With ``server_pid``, also where
    the machine's CPU went during the timed phase, in cores: the server's main (event-loop) thread, its other
    threads (inference), and the load generator. With ``stats_url`` (the agent's Triton statistics), the mean
    time its runtime took per batch-1 call during the timed phase: the raw call of that very run. ``shape``: the
    ``local`` and ``shm`` variants' input shape, [1, ...] (default: digits'; shm: the model's, its batch 1).
    ``answer``: of ANSWERS, what each answer's label is compared with (``labels[i]`` for ``reqs[i]``: a class for
    'top1', a list of strings for 'texts')."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    w = ctx.Process(target=_load_worker, daemon=True,
                    args=((url, kind, path, reqs, labels, clients, total, warmup, shape, answer), results,
                          serve_limit.PIN[1] if serve_limit.PIN else None))
    w.start()
    before: dict[str, float] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            out = results.get(timeout=max(0.0, deadline - time.monotonic()))
            if "timed" not in out:
                break
            if server_pid is not None:
                before = _thread_cpu_s(server_pid)
            if stats_url is not None:
                b1_before = _batch1_compute(stats_url)
                sizes_before = _batches(stats_url)
                phases_before = _phases(stats_url)
    except queue.Empty as exc:
        raise RuntimeError(f"the load generator did not finish in {timeout_s:.0f}s") from exc
    finally:
        w.join(10)
        if w.is_alive():
            w.terminate()
    if "fatal" in out:
        raise RuntimeError(f"load generator: {out['fatal']}")
    lat = np.array(out["latencies"]) * 1000
    n = len(lat)
    res = {"requests": n, "errors": out["errors"], "wrong": out["wrong"], "first_error": out["first_error"],
           "req_per_s": n / out["wall"] if out["wall"] > 0 else float("nan"),
           "p50_ms": float(np.percentile(lat, 50)) if n else float("nan"),
           "p99_ms": float(np.percentile(lat, 99)) if n else float("nan"),
           "load_cores": out["load_cpu_s"] / out["wall"] if out["wall"] > 0 else float("nan")}
    if server_pid is not None and out["wall"] > 0:
        res["server_main_cores"], res["server_other_cores"] = thread_cores(server_pid, before, out["wall"])
    if stats_url is not None:
        (n1, ns1), (n0, ns0) = _batch1_compute(stats_url), b1_before
        res["compute_b1_ms"] = (ns1 - ns0) / (n1 - n0) / 1e6 if n1 > n0 else float("nan")
        # the batches the agent formed in the timed phase, and the share of it its runtime was running one
        formed = batches_since(stats_url, sizes_before)
        res["batches_formed"] = {b: c for b, (c, _) in sorted(formed.items())}
        # images per second of the agent's runtime while it ran a batch: against the bare limit, what its calls cost
        ran_s = sum(ns for _, ns in formed.values()) / 1e9
        res["runtime_img_s"] = sum(b * c for b, (c, _) in formed.items()) / ran_s if ran_s > 0 else float("nan")
        res["runtime_busy"] = sum(ns for _, ns in formed.values()) / 1e9 / out["wall"] if out["wall"] > 0 else 0.0
        # per request, in the agent: from its handler's start to its answer (success), in the queue until its batch
        # started (queue), in the runtime (compute); means over the timed phase
        after_ph = _phases(stats_url)
        res["agent_ms"] = {k: (after_ph[k][1] - phases_before[k][1]) / (after_ph[k][0] - phases_before[k][0]) / 1e6
                           for k in after_ph if after_ph[k][0] > phases_before[k][0]}
    return res


def _phases(stats_url: str) -> dict[str, tuple[int, int]]:
    """success / queue / compute_infer -> (count, nanoseconds) so far, from the agent's Triton statistics."""
    with urllib.request.urlopen(stats_url, timeout=30) as r:  # loopback: the agent under test
        doc = json.loads(r.read())
    st = doc["model_stats"][0]["inference_stats"]
    return {k: (int(st[k]["count"]), int(st[k]["ns"])) for k in ("success", "queue", "compute_infer")}


def _batches(stats_url: str) -> dict[int, tuple[int, int]]:
    """batch size -> (batches run, nanoseconds in the runtime) so far, from the agent's Triton statistics."""
    with urllib.request.urlopen(stats_url, timeout=30) as r:  # loopback: the agent under test
        doc = json.loads(r.read())
    return {int(b["batch_size"]): (int(b["compute_infer"]["count"]), int(b["compute_infer"]["ns"]))
            for b in doc["model_stats"][0]["batch_stats"]}


def batches_since(stats_url: str, before: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """batch size -> (batches run, nanoseconds in the runtime) since ``before`` (a _batches reading)."""
    formed = {b: (c - before.get(b, (0, 0))[0], ns - before.get(b, (0, 0))[1])
              for b, (c, ns) in _batches(stats_url).items()}
    return {b: v for b, v in formed.items() if v[0] > 0}


def thread_cores(pid: int, before: dict[str, float], wall: float) -> tuple[float, float]:
    """(the main thread's cores, the other threads' cores) of process ``pid`` over ``wall`` seconds since
    ``before`` (a _thread_cpu_s reading)."""
    used = {t: v - before.get(t, 0.0) for t, v in _thread_cpu_s(pid).items()}
    return used.get(str(pid), 0.0) / wall, sum(v for t, v in used.items() if t != str(pid)) / wall


def _batch1_compute(stats_url: str) -> tuple[int, int]:
    """(batch-1 calls, nanoseconds in the runtime) so far, from the agent's Triton statistics."""
    with urllib.request.urlopen(stats_url, timeout=30) as r:  # loopback: the agent under test
        doc = json.loads(r.read())
    for b in doc["model_stats"][0]["batch_stats"]:
        if b["batch_size"] == 1:
            return int(b["compute_infer"]["count"]), int(b["compute_infer"]["ns"])
    return 0, 0


def json_decode_ms(body: bytes, repeats: int = 5, loads: Callable[[bytes], Any] = json.loads) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        doc = loads(body)
        np.asarray(doc["inputs"][0]["data"], dtype=np.float32)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000
