"""The agent's local inference API: the Open Inference Protocol (KServe v2) over HTTP, and Prometheus metrics.

    GET  /v2/health/live                      the process is up
    GET  /v2/health/ready                     at least one model is loaded and serving
    GET  /v2                                  server metadata (name, version, extensions)
    GET  /v2/models/{m}[/versions/{v}]        model metadata (inputs, outputs, versions)
    GET  /v2/models/{m}[/versions/{v}]/ready
    GET  /v2/models/{m}[/versions/{v}]/config model configuration (Triton's layout: batching, instances)
    GET  /v2/models/{m}[/versions/{v}]/stats  statistics of one model; GET /v2/models/stats: every model
    POST /v2/repository/index                 the models this agent knows and their state
    POST /v2/models/{m}[/versions/{v}]/infer  tensors in, tensors out: JSON, or the binary tensor data
                                              extension (header Inference-Header-Content-Length)
    POST /v2/models/{m}[/versions/{v}]/infer/image
                                              JPEG or PNG bytes in (the body is the file), the bundle's
                                              recorded preprocessing applied, JSON tensors out
    GET  /v2/systemsharedmemory[/region/{r}]/status, POST .../region/{r}/register, .../region/{r}/unregister,
         POST /v2/systemsharedmemory/unregister   Triton's system shared-memory extension (agent/shm.py)
    GET  /metrics                             Prometheus text exposition
    GET  /metrics/summary                     counters since start (JSON)

Every error, unknown routes and wrong methods included, is JSON ``{"error": "..."}`` with a 4xx or 5xx
status; a full queue is 429 with ``Retry-After``. Infer request parameters (Triton's): ``priority``
(1 high, 0 or 2 normal), ``timeout`` (microseconds in the queue), ``binary_data_output``; per output
``binary_data``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from edgefleet import protocol
from edgefleet.agent.batcher import BATCH_TOLERANCE, HIGH, NORMAL, Batcher, BatchSettings, BatchTuning, ComputeGate
from edgefleet.agent.errors import AgentError, ModelNotFound, PayloadTooLarge, RequestError, Unavailable
from edgefleet.agent.image import ImageLimits, check_image, decode_feeds
from edgefleet.agent.kserve import HEADER_LENGTH, InferRequest, encode_response, parse_body
from edgefleet.agent.metrics import CONTENT_TYPE, Metrics, ModelMetrics
from edgefleet.agent.openapi import openapi
from edgefleet.agent.peer import PeerCell, tcp_peer
from edgefleet.agent.shm import SharedMemory
from edgefleet.engines import Engine
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.manifest import Manifest

__all__ = ["IndexEntry", "ModelHost", "Served", "create_app", "model_config"]

log = logging.getLogger("edgefleet.agent.http")

TRITON_TYPES = {"FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "INT8": "TYPE_INT8", "UINT8": "TYPE_UINT8",
                "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL"}
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "model_repository_index", "image_infer",
              "system_shared_memory"]


@dataclass
class Served:
    manifest: Manifest
    backends: tuple[Engine, ...]
    batcher: Batcher
    settings: BatchSettings
    metrics: ModelMetrics
    loaded_at: float = field(default_factory=time.time)
    tuning: BatchTuning | None = None  # how its batch sizes were chosen (None: the host's defaults, untold)
    serving: proto.ServingChoice | None = None  # precision, batch sizes and layout as chosen here (install report)

    @property
    def backend(self) -> Engine:
        """The first instance (every instance describes the same model)."""
        return self.backends[0]


@dataclass(frozen=True)
class IndexEntry:
    """A model the agent knows of, for ``/v2/repository/index`` (state: READY, UNAVAILABLE, LOADING)."""

    name: str
    version: str
    state: str
    reason: str = ""


class ModelHost:
    """The models being served, one version each; swaps a new version in without dropping requests.

    ``swap`` starts serving a model version (with one or more backend instances, one inference thread
    each) and retires the version of the same name it replaces once its queue is empty; other models
    keep serving. ``index``, if the lifecycle code sets it, lists the versions on disk for the repository
    index (served versions are always listed as READY). Every version of a model shares one
    :class:`ComputeGate` (``gate``): the old version's last batch, the new one's self-test and warm-up calls
    and its first batch take turns on the cores.
    """

    def __init__(self, settings: BatchSettings, metrics: Metrics, inference_cpus: Collection[int] | None = None):
        self.settings = settings  # the default for models swapped in without their own
        self.metrics = metrics
        self.inference_cpus = inference_cpus  # where every batcher's inference threads run (None: anywhere)
        self.models: dict[str, Served] = {}
        self.current: Served | None = None  # the version swapped in last
        self.index: Callable[[], Sequence[IndexEntry]] | None = None
        self.shadow: Any = None  # agent.shadow.ShadowMirror of a candidate in shadow, if any
        self._swap_lock = asyncio.Lock()
        self._gates: dict[str, ComputeGate] = {}

    def gate(self, name: str, permits: int) -> ComputeGate:
        """Model ``name``'s compute gate (``permits``: its instance count; a new count starts a new gate)."""
        g = self._gates.get(name)
        if g is None or g.permits != permits:
            g = self._gates[name] = ComputeGate(permits)
        return g

    async def swap(self, manifest: Manifest, backends: Engine | Sequence[Engine],
                   settings: BatchSettings | None = None, tuning: BatchTuning | None = None,
                   serving: proto.ServingChoice | None = None) -> None:
        """Start serving ``backends`` (loaded instances of one model version) with ``settings`` (default: the
        host's), chosen as ``tuning`` says; the version it replaces finishes its queue, then closes. Runs on the
        server loop."""
        instances = (backends,) if isinstance(backends, Engine) else tuple(backends)
        s = settings or self.settings
        if not manifest.batchable and s.request_limit != 1:  # an unbatched input: one request at a time
            s = BatchSettings(**{**s.__dict__, "max_batch_size": 1, "preferred_batch_sizes": (),
                                 "max_request_batch_size": None})
            tuning = None
        async with self._swap_lock:
            mm = self.metrics.for_model(manifest.name, manifest.version)
            batcher = Batcher(instances, s, mm, self.gate(manifest.name, len(instances)), self.inference_cpus)
            batcher.start()
            served = Served(manifest, instances, batcher, s, mm, tuning=tuning, serving=serving)
            old = self.models.get(manifest.name)
            self.models[manifest.name] = served
            self.current = served
            self.metrics.model_event(manifest.name, manifest.version, "swap" if old is not None else "load")
            if old is not None:
                await self._retire(old)
        log.info("now serving %s %s (%d instance%s)", manifest.name, manifest.version, len(instances),
                 "" if len(instances) == 1 else "s")

    async def remove(self, name: str) -> None:
        """Stop serving model ``name`` (its queued requests are answered first)."""
        async with self._swap_lock:
            old = self.models.pop(name, None)
            if old is None:
                return
            if self.current is old:
                self.current = next(reversed(self.models.values()), None)
            await self._retire(old)

    async def _retire(self, old: Served) -> None:
        now = self.models.get(old.manifest.name)
        if now is None or now.manifest.version != old.manifest.version:
            self.metrics.model_event(old.manifest.name, old.manifest.version, "unload")
        try:  # best effort: whatever serves now already does, whatever happens here
            await old.batcher.close()
            loop = asyncio.get_running_loop()
            for b in old.backends:
                await loop.run_in_executor(None, b.close)
        except Exception:
            log.exception("retiring %s %s failed", old.manifest.name, old.manifest.version)

    async def close(self) -> None:
        async with self._swap_lock:  # an install racing shutdown finishes its swap first
            for served in list(self.models.values()):
                await served.batcher.close()
                for b in served.backends:
                    b.close()
            self.models.clear()
            self.current = None

    def get(self, name: str, version: str | None = None) -> Served:
        served = self.models.get(name)
        if served is None:
            if not self.models:
                raise Unavailable("no model is loaded yet; the agent is waiting for its first install")
            raise ModelNotFound(f"unknown model {name!r}; this agent serves {_names(self.models)}")
        if version is not None and version != served.manifest.version:
            raise ModelNotFound(f"model {name!r} version {version!r} is not loaded; serving {served.manifest.version}")
        return served

    async def infer(self, served: Served, req: InferRequest) -> list[np.ndarray]:
        """Queue a decoded request in ``served``'s batcher and wait for its outputs (and offer it to a shadow
        candidate): what every transport does with a request once decoded (HTTP, gRPC, the local socket)."""
        pending = self.enqueue(served, req)
        try:
            outs = await pending.future
        finally:
            served.batcher.settle(pending)
        self.offer_shadow(served, req, outs)
        return outs

    @staticmethod
    def enqueue(served: Served, req: InferRequest) -> Any:
        """``infer`` without a coroutine (the local socket's fast path): queue ``req`` -> its batcher entry, whose
        ``future`` gets the outputs; then ``served.batcher.settle(entry)`` and ``offer_shadow`` are the caller's."""
        return served.batcher.enqueue(req.feeds, HIGH if req.priority == 1 else NORMAL,
                                      None if req.timeout_us is None else req.timeout_us / 1e6)

    def offer_shadow(self, served: Served, req: InferRequest, outs: list[np.ndarray]) -> None:
        if self.shadow is not None:
            self.shadow.offer(served.manifest.name, req.feeds, outs)

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        entries: dict[tuple[str, str], IndexEntry] = {}
        if self.index is not None:
            for e in self.index():
                entries[(e.name, e.version)] = e
        for s in self.models.values():
            entries[(s.manifest.name, s.manifest.version)] = IndexEntry(s.manifest.name, s.manifest.version, "READY")
        return [{"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
                for _, e in sorted(entries.items()) if not ready_only or e.state == "READY"]


def _names(models: dict[str, Served]) -> str:
    return ", ".join(repr(n) for n in sorted(models))


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _agent_error(exc: AgentError) -> JSONResponse:
    status = getattr(exc, "status_code", 500)
    return _error(status, str(exc), {"Retry-After": "1"} if status in (429, 503) else None)


class _ByteBudget:
    """Bytes of request bodies held at once, across all requests (bounded memory under a flood)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise Unavailable(f"too many request bytes in flight ({self.used} of {self.limit}); retry")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


LARGE_BODY = 256 * 1024  # JSON bodies above this are decoded off the event loop


def model_config(served: Served) -> dict[str, Any]:
    """Triton's model configuration layout (what ``tritonclient`` get_model_config returns). ``max_batch_size``
    is the largest request accepted; ``batch_tuning`` (edgefleet's) says how the batches formed were sized."""
    m, s, t = served.manifest, served.settings, served.tuning
    batched = m.batchable and s.request_limit > 1

    def dims(spec: Any) -> list[int]:
        shape = list(spec.shape)
        if batched and spec.batch_axis == 0:
            return shape[1:]
        return shape

    return {
        "name": m.name, "version": m.version, "platform": m.backend, "backend": m.backend,
        "max_batch_size": s.request_limit if batched else 0,
        "input": [{"name": t.name, "data_type": TRITON_TYPES.get(t.datatype, t.datatype), "dims": dims(t)}
                  for t in m.inputs],
        "output": [{"name": t.name, "data_type": TRITON_TYPES.get(t.datatype, t.datatype), "dims": dims(t)}
                   for t in m.outputs],
        "dynamic_batching": {
            "preferred_batch_size": list(s.preferred_batch_sizes),
            "max_queue_delay_microseconds": s.max_queue_delay_us,
            "priority_levels": 2, "default_priority_level": 2,
            "default_queue_policy": {"timeout_action": "REJECT",
                                     "default_timeout_microseconds": int(s.queue_timeout_s * 1e6),
                                     "allow_timeout_override": True, "max_queue_size": s.max_queue_size},
        },
        "instance_group": [{"name": f"{m.name}_0", "kind": "KIND_GPU" if any(
            "CUDA" in b.device or "TensorRT" in b.device for b in served.backends if hasattr(b, "device"))
            else "KIND_CPU", "count": len(served.backends)}],
        "version_policy": {"specific": {"versions": [m.version]}},
        "parameters": {"precision": {"string_value": m.precision}, "profile": {"string_value": m.profile}},
        "image_preprocessing": m.preprocessing.model_dump() if m.preprocessing else None,
        "batch_tuning": None if t is None else {
            "mode": t.mode, "max_formed_batch_size": s.max_batch_size,
            "images_per_second": {str(n): v for n, v in t.images_per_s},
            "tolerance": BATCH_TOLERANCE if t.mode == "measured" else None,
            # instances x intra-op threads each: measured here (each candidate's best images/s and lone batch-1
            # call), set by the operator, or the default
            "layout": None if t.layout is None else {
                "instances": t.layout[0], "threads": t.layout[1], "source": t.layout_source,
                "measured": {f.name: {"images_per_second": f.best, "lone_call_ms": f.lone_ms} for f in t.layouts}}},
        # edgefleet's: the precisions this bundle carries and how this device chose among them (timed here, or not)
        "precision_choice": {
            "precision": m.precision, "available": list(m.precisions),
            "source": served.serving.precision_source if served.serving else "bundle",
            "items_per_second": {pt.precision: pt.items_per_s for pt in served.serving.precisions}
            if served.serving else {}},
        # the runtime serving the bundle's file (onnxruntime, OpenVINO) and how this device chose it (issue 35)
        "runtime_choice": None if served.serving is None or served.serving.runtime is None else {
            "runtime": served.serving.runtime.runtime, "source": served.serving.runtime.source,
            "items_per_second": {rt.runtime: rt.items_per_s for rt in served.serving.runtime.runtimes}},
    }


def create_app(host: ModelHost, max_body_bytes: int, device_id: str,
               max_inflight_body_bytes: int = 256 * 1024 * 1024, image_limits: ImageLimits | None = None,
               shm: SharedMemory | None = None) -> ASGIApp:
    """``shm``: the system shared-memory regions (shared with the gRPC server); None: the extension is off."""
    metrics = host.metrics
    budget = _ByteBudget(max_inflight_body_bytes)
    # decoding JSON expands it 10-30x in memory and holds the GIL: two large bodies at a time at most
    large_decodes = asyncio.Semaphore(2)
    # images: each checked against its decode budget from its header, then at most this many decode at once
    images = image_limits or ImageLimits()
    image_decodes = asyncio.Semaphore(images.max_concurrent)

    def resolve(request: Request) -> Served:
        return host.get(request.path_params["name"], request.path_params.get("version"))

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        ok = bool(host.models)
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def server_meta(request: Request) -> Response:
        return JSONResponse({"name": "edgefleet-agent", "version": protocol.__version__, "device_id": device_id,
                             "extensions": EXTENSIONS})

    async def model_meta(request: Request) -> Response:
        try:
            served = resolve(request)
        except AgentError as exc:
            return _agent_error(exc)
        m = served.manifest
        return JSONResponse({
            "name": m.name, "versions": [m.version], "platform": m.backend, "precision": m.precision,
            "profile": m.profile,
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in m.inputs],
            "outputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in m.outputs],
            "accuracy": m.accuracy.model_dump(), "labels": list(m.labels) if m.labels else None,
            "max_batch_size": served.settings.request_limit, "instances": len(served.backends),
            "devices": [getattr(b, "device", "?") for b in served.backends],
        })

    async def model_ready(request: Request) -> Response:
        try:
            resolve(request)
        except AgentError as exc:
            return JSONResponse({"name": request.path_params["name"], "ready": False, "error": str(exc)},
                                status_code=getattr(exc, "status_code", 503))
        return JSONResponse({"name": request.path_params["name"], "ready": True})

    async def config(request: Request) -> Response:
        try:
            return JSONResponse(model_config(resolve(request)))
        except AgentError as exc:
            return _agent_error(exc)

    async def stats(request: Request) -> Response:
        if "name" not in request.path_params:
            return JSONResponse({"model_stats": [s.metrics.stats() for _, s in sorted(host.models.items())]})
        try:
            return JSONResponse({"model_stats": [resolve(request).metrics.stats()]})
        except AgentError as exc:
            return _agent_error(exc)

    async def repository_index(request: Request) -> Response:
        try:
            raw = await _small_body(request)
        except RequestError as exc:
            return _agent_error(exc)
        if raw is None:
            return _error(413, f"the body must be empty or a JSON object like {{\"ready\": true}} (at most "
                               f"{SMALL_BODY} bytes)")
        try:
            doc = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply, an int of too many digits
            return _error(400, "the body must be empty or a JSON object like {\"ready\": true}")
        if not isinstance(doc, dict) or not isinstance(doc.get("ready", False), bool):
            return _error(400, "the body must be empty or a JSON object like {\"ready\": true}")
        return JSONResponse(host.repository_index(ready_only=doc.get("ready", False)))

    def finish(request: Request, served: Served | None, t0: float, status: int) -> None:
        dt = time.perf_counter() - t0
        if served is not None:
            served.metrics.request(dt, status)
        else:  # label values from the URL only when they name a served model: bounded label sets
            name = request.path_params["name"]
            metrics.rejected(dt, status, name if name in host.models else None)

    def caller_shm(scope: Scope) -> SharedMemory | None:
        """The shared-memory registry as this request's client may use it (its connection's view)."""
        if shm is None:
            return None
        cell = connection_peer(scope)
        view = cell.shm_view
        if view is None:
            view = cell.shm_view = shm.as_caller(cell)
        return view

    async def infer_core(name: str, version: str | None, header: Callable[[str], str | None],
                         receive: Receive, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One infer request, from its path parameters, headers and body -> (status, headers, body)."""
        view = caller_shm(scope)
        t0 = time.perf_counter()
        status = 500
        served: Served | None = None
        held = [0]
        try:
            served = host.get(name, version)  # fail fast: 404
            header_length = header(HEADER_LENGTH)
            # binary tensors: read into a buffer where they start 64-byte aligned, so they need no copy of their own
            align_at = int(header_length) if header_length is not None and header_length.isdigit() else None
            body = await _receive_body(receive, header("content-length"), max_body_bytes, budget, held, align_at)
            # resolved again after the body arrived: a swap during a slow upload serves the new version
            served = host.get(name, version)
            m = served.manifest
            if header_length is None and len(body) > LARGE_BODY:
                async with large_decodes:
                    req = await run_in_threadpool(parse_body, body, header_length, m.inputs, m.outputs, view)
            else:
                req = parse_body(body, header_length, m.inputs, m.outputs, view)
            del body
            outs = await host.infer(served, req)
            content, json_length = encode_response(m.name, m.version, outs, m.outputs, req, view)
            status = 200
            if json_length is None:
                return 200, [(b"content-type", b"application/json")], content
            return 200, [(b"content-type", b"application/octet-stream"),
                         (b"inference-header-content-length", str(json_length).encode())], content
        except AgentError as exc:
            status = getattr(exc, "status_code", 500)
            retry = [(b"retry-after", b"1")] if status in (429, 503) else []
            return status, [(b"content-type", b"application/json"), *retry], _error_body(str(exc))
        except Exception as exc:  # never let one request take the server down
            log.exception("unexpected error in infer")
            return 500, [(b"content-type", b"application/json")], _error_body(f"internal error: {exc}")
        finally:
            budget.give(held[0])
            dt = time.perf_counter() - t0
            if served is not None:
                served.metrics.request(dt, status)
            else:  # label values from the URL only when they name a served model: bounded label sets
                metrics.rejected(dt, status, name if name in host.models else None)

    async def infer(request: Request) -> Response:
        status, headers, content = await infer_core(request.path_params["name"], request.path_params.get("version"),
                                                    request.headers.get, request.receive, request.scope)
        return Response(content, status_code=status, headers={k.decode(): v.decode() for k, v in headers})

    async def infer_image(request: Request) -> Response:
        t0 = time.perf_counter()
        status = 500
        served: Served | None = None
        held = [0]
        try:
            served = resolve(request)
            body = await _receive_body(request.receive, request.headers.get("content-length"), max_body_bytes,
                                       budget, held)
            served = resolve(request)
            m = served.manifest
            header = check_image(body, m, images.max_decoded_bytes)  # before any decoder: 4xx, no slot taken
            try:
                await asyncio.wait_for(image_decodes.acquire(), images.wait_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                raise Unavailable(f"{images.max_concurrent} images are decoding (max_concurrent_image_decodes) and "
                                  f"this one waited {images.wait_s:g} s for its turn; retry") from None
            try:  # the thread is never abandoned (anyio waits for it), so the slot is given back after it
                # its work bounded first (scans, chunks), then OpenCV, which releases the GIL
                feeds = await run_in_threadpool(decode_feeds, body, m, header, images.max_scans)
            finally:
                image_decodes.release()
            del body
            outs = await served.batcher.submit(feeds)
            if host.shadow is not None:
                host.shadow.offer(m.name, feeds, outs)
            content, _ = encode_response(m.name, m.version, outs, m.outputs,
                                         InferRequest(feeds, None, frozenset()))
            status = 200
            return Response(content, media_type="application/json")
        except AgentError as exc:
            status = getattr(exc, "status_code", 500)
            return _agent_error(exc)
        except Exception as exc:
            log.exception("unexpected error in infer/image")
            return _error(500, f"internal error: {exc}")
        finally:
            budget.give(held[0])
            finish(request, served, t0, status)

    # -- system shared memory (Triton's extension; agent/shm.py) ------------------------------------------
    def no_shm() -> Response:
        return _error(400, "system shared memory is off on this agent")

    async def shm_status(request: Request) -> Response:
        view = caller_shm(request.scope)
        if view is None:
            return no_shm()
        try:
            return JSONResponse(view.status(request.path_params.get("region")))
        except AgentError as exc:
            return _agent_error(exc)

    async def shm_register(request: Request) -> Response:
        if shm is None:
            return no_shm()
        try:
            raw = await _small_body(request)
        except RequestError as exc:
            return _agent_error(exc)
        if raw is None:
            return _error(413, "a register request is a small JSON object {\"key\", \"offset\", \"byte_size\"}")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply, an int of too many digits
            doc = None
        if not isinstance(doc, dict) or set(doc) - {"key", "offset", "byte_size"} or "key" not in doc \
                or "byte_size" not in doc:
            return _error(400, "the body must be a JSON object {\"key\": \"/name\", \"offset\": 0, \"byte_size\": N}")
        host = request.client.host if request.client else None
        peer = connection_peer(request.scope).get()
        client = f"{host or '?'} uid {peer.uid}"  # max_shm_regions_per_client counts each local user apart
        try:
            shm.register(request.path_params["region"], doc["key"], doc.get("offset", 0), doc["byte_size"], client,
                         peer)
        except AgentError as exc:
            return _agent_error(exc)
        return JSONResponse({})

    async def shm_unregister(request: Request) -> Response:
        view = caller_shm(request.scope)
        if view is None:
            return no_shm()
        try:
            view.unregister(request.path_params.get("region"))
        except AgentError as exc:
            return _agent_error(exc)
        return JSONResponse({})

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def summary(request: Request) -> Response:
        cur = host.current
        return JSONResponse({"requests": metrics.total_requests, "errors": metrics.total_errors,
                             "model": cur.manifest.name if cur else None,
                             "version": cur.manifest.version if cur else None,
                             "models": {n: s.manifest.version for n, s in sorted(host.models.items())}})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return _error(404, f"no such endpoint: {request.method} {request.url.path}")
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path}",
                          dict(exc.headers or {}))
        return _error(exc.status_code, str(exc.detail))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s: %r", request.url.path, exc)
        return _error(500, f"internal error: {exc}")

    get, post = ["GET"], ["POST"]
    routes = [
        Route("/v2/health/live", live, methods=get), Route("/v2/health/ready", ready, methods=get),
        Route("/v2", server_meta, methods=get),
        Route("/v2/repository/index", repository_index, methods=post),
        Route("/v2/models/stats", stats, methods=get),
    ]
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(base, model_meta, methods=get), Route(f"{base}/ready", model_ready, methods=get),
            Route(f"{base}/config", config, methods=get), Route(f"{base}/stats", stats, methods=get),
            Route(f"{base}/infer", infer, methods=post), Route(f"{base}/infer/image", infer_image, methods=post),
        ]
    async def openapi_doc(request: Request) -> Response:
        return JSONResponse(openapi(protocol.__version__, max_body_bytes,
                                    {n: s.manifest.version for n, s in host.models.items()}))

    routes += [Route("/v2/systemsharedmemory/status", shm_status, methods=get),
               Route("/v2/systemsharedmemory/region/{region}/status", shm_status, methods=get),
               Route("/v2/systemsharedmemory/region/{region}/register", shm_register, methods=post),
               Route("/v2/systemsharedmemory/region/{region}/unregister", shm_unregister, methods=post),
               Route("/v2/systemsharedmemory/unregister", shm_unregister, methods=post)]
    routes += [Route("/metrics", prometheus, methods=get), Route("/metrics/summary", summary, methods=get),
               Route("/openapi.json", openapi_doc, methods=get)]
    slow = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        """The infer routes straight to the handler (Starlette's routing, request objects and middleware cost
        more than the rest of a small model's request); everything else through Starlette."""
        if scope["type"] == "http" and scope["method"] == "POST":
            parts = scope["path"].split("/")
            n = len(parts)
            if (n == 5 or (n == 7 and parts[4] == "versions")) and parts[-1] == "infer" and parts[1] == "v2" \
                    and parts[2] == "models" and parts[0] == "":
                headers = dict(scope["headers"])

                def header(key: str) -> str | None:
                    v = headers.get(key.encode())
                    return None if v is None else v.decode("latin-1")

                status, out_headers, content = await infer_core(parts[3], parts[5] if n == 7 else None, header,
                                                                receive, scope)
                await send({"type": "http.response.start", "status": status,
                            "headers": [*out_headers, (b"content-length", str(len(content)).encode())]})
                await send({"type": "http.response.body", "body": content})
                return
        await slow(scope, receive, send)

    return app


SMALL_BODY = 64 * 1024  # bytes: the most a small JSON request (register, repository index) may have

# the ASGI scope key under which a connection's PeerCell travels (peer_tagging); without it, one per request
CONNECTION_PEER = "edgefleet.peer"


def connection_peer(scope: Scope) -> PeerCell:
    """The user of the client of this request's connection (agent/peer.py): the connection's own cell where the
    server tags its connections (:func:`peer_tagging`), looked up at most once per connection; otherwise a cell
    for this request alone."""
    cell = scope.get(CONNECTION_PEER)
    if cell is None:
        host, port = scope.get("client") or (None, None)
        server_host, server_port = scope.get("server") or (None, None)
        cell = scope[CONNECTION_PEER] = PeerCell(lambda: tcp_peer(host, port, server_port, server_host))
    return cell


def peer_tagging(base: type) -> type:
    """uvicorn's HTTP protocol class ``base`` (one instance per connection), its requests' scopes carrying that
    connection's PeerCell: a keep-alive connection's client is told once, however many requests it sends. The
    cell lives and dies with the connection object, so a later connection from the same address and port (a
    reused port, perhaps another user's) never inherits it."""

    class PeerTagged(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            inner = getattr(self, "app", None)
            if inner is None:  # not the uvicorn this was written for: a cell per request instead
                return
            host, port = getattr(self, "client", None) or (None, None)
            server_host, server_port = getattr(self, "server", None) or (None, None)
            cell = PeerCell(lambda: tcp_peer(host, port, server_port, server_host))

            async def app(scope: Scope, receive: Receive, send: Send) -> None:
                scope[CONNECTION_PEER] = cell
                await inner(scope, receive, send)

            self.app = app

    PeerTagged.__name__ = PeerTagged.__qualname__ = f"PeerTagged{base.__name__}"
    return PeerTagged


async def _small_body(request: Request) -> bytes | None:
    """The body of a request that is a small JSON object -> its bytes; None (read no further) past SMALL_BODY, by
    its Content-Length or, sent chunked, as it arrives. RequestError if the client goes away before it ends."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > SMALL_BODY:
        return None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > SMALL_BODY:
                return None
            chunks.append(chunk)
    except ClientDisconnect:  # not the agent's fault: no 500, no error in its log
        raise RequestError("the client went away before the body arrived") from None
    return b"".join(chunks)


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}, ensure_ascii=False).encode()


ALIGN = 64  # bytes: what onnxruntime and numpy's SIMD loops like a tensor's first byte to be aligned to


async def _receive_body(receive: Receive, declared: str | None, limit: int, budget: _ByteBudget,
                        held: list[int], align_at: int | None = None) -> Any:
    """Read at most ``limit`` bytes, charging them to ``budget`` (``held[0]`` says how much to give back). With
    ``align_at`` and a declared length, the body is copied once, as it arrives, into a buffer where byte
    ``align_at`` is ``ALIGN``-aligned (-> a memoryview); otherwise -> bytes."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    if align_at is not None and declared is not None and declared.isdigit() and 0 <= align_at <= int(declared):
        return await _receive_aligned(receive, int(declared), align_at, budget, held)
    chunks, size = [], 0
    async for chunk in _body_chunks(receive):
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        budget.take(len(chunk))
        held[0] += len(chunk)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The body's non-empty chunks as the ASGI server hands them over; RequestError if the client goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError("the client went away before the body arrived")
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _receive_aligned(receive: Receive, length: int, align_at: int, budget: _ByteBudget,
                           held: list[int]) -> memoryview:
    budget.take(length)  # the whole buffer at once: it is allocated at once
    held[0] += length
    raw = np.empty(length + ALIGN, dtype=np.uint8)
    start = (-(raw.ctypes.data + align_at)) % ALIGN
    buf = memoryview(raw[start:start + length].data).cast("B")
    pos = 0
    async for chunk in _body_chunks(receive):
        if pos + len(chunk) > length:
            raise RequestError(f"the body is longer than its Content-Length ({length} bytes)")
        buf[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    if pos != length:
        raise RequestError(f"the body has {pos} bytes; its Content-Length says {length}")
    return buf
