"""The agent's local inference API: the Open Inference Protocol (KServe v2) over HTTP, and Prometheus metrics.

    GET  /v2/health/live                      the process is up
    GET  /v2/health/ready                     at least one model is loaded and serving
    GET  /v2                                  server metadata (name, version, extensions)
    GET  /v2/models/{m}[/versions/{v}]        model metadata (inputs, outputs, versions)
    GET  /v2/models/{m}[/versions/{v}]/ready
    GET  /v2/models/{m}[/versions/{v}]/config model configuration (Triton's layout: batching, instances)
    GET  /v2/models/{m}[/versions/{v}]/stats  statistics of one model; GET /v2/models/stats: every model
    POST /v2/repository/index                 the models this agent knows and their state
    POST /v2/repository/models/{m}/load|unload  refused (503): the fleet's desired state says what is served
    POST /v2/models/{m}[/versions/{v}]/infer  tensors in, tensors out: JSON, or the binary tensor data
                                              extension (header Inference-Header-Content-Length; 0: Triton's
                                              raw binary request, the body the model's one input)
    POST /v2/models/{m}[/versions/{v}]/infer/image
                                              JPEG or PNG bytes in (the body is the file), the bundle's
                                              recorded preprocessing applied, JSON tensors out
    GET  /v2/systemsharedmemory[/region/{r}]/status, POST .../region/{r}/register, .../region/{r}/unregister,
         POST /v2/systemsharedmemory/unregister   Triton's system shared-memory extension (agent/transports/shm.py)
    /v2/cudasharedmemory/...                  none can be registered (400); status and unregister answer as for none
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
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ... import protocol
from ..core.host import EXTENSIONS, LARGE_BODY, ModelHost, Served, model_config
from ..core.metrics import CONTENT_TYPE
from ..errors import AgentError, PayloadTooLarge, RequestError, Unavailable
from .image import ImageLimits, check_image, decode_feeds
from .kserve import (
    CUDA_SHM_REFUSED,
    HEADER_LENGTH,
    MODEL_CONTROL_REFUSED,
    InferRequest,
    encode_response,
    parse_body,
)
from .openapi import openapi
from .peer import PeerCell, tcp_peer
from .shm import SharedMemory

__all__ = ["connection_peer", "create_app", "peer_tagging"]

log = logging.getLogger("edgefleet.agent.http")


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


GET, POST = ["GET"], ["POST"]  # route methods


class _HttpApi:
    """The HTTP transport: each handler decodes a request, asks the host (agent/core/host.py) and encodes its answer.
    The routes come in areas (:meth:`server_routes`, :meth:`model_routes`, :meth:`metrics_routes`, and the shared
    memory's, :class:`_ShmApi`); :func:`create_app` puts them behind Starlette and the infer fast path."""

    def __init__(self, host: ModelHost, max_body_bytes: int, device_id: str, max_inflight_body_bytes: int,
                 image_limits: ImageLimits | None, shm: SharedMemory | None):
        self.host, self.max_body_bytes, self.device_id = host, max_body_bytes, device_id
        self.shm_api = _ShmApi(shm)
        self.budget = _ByteBudget(max_inflight_body_bytes)
        # decoding JSON expands it 10-30x in memory and holds the GIL: two large bodies at a time at most
        self.large_decodes = asyncio.Semaphore(2)
        # images: each checked against its decode budget from its header, then at most this many decode at once
        self.images = image_limits or ImageLimits()
        self.image_decodes = asyncio.Semaphore(self.images.max_concurrent)

    def routes(self) -> list[Route]:
        # /v2/models/stats before /v2/models/{name}: Starlette takes the first route that matches
        return [*self.server_routes(), *self.model_routes(), *self.shm_api.routes(), *self.metrics_routes()]

    def resolve(self, request: Request) -> Served:
        return self.host.get(request.path_params["name"], request.path_params.get("version"))

    # -- the server: health, metadata, the repository index --------------------------------------------------
    def server_routes(self) -> list[Route]:
        return [Route("/v2/health/live", self.live, methods=GET), Route("/v2/health/ready", self.ready, methods=GET),
                Route("/v2", self.server_meta, methods=GET),
                Route("/v2/repository/index", self.repository_index, methods=POST),
                Route("/v2/models/stats", self.stats, methods=GET),
                Route("/v2/repository/models/{name}/load", _model_control, methods=POST),
                Route("/v2/repository/models/{name}/unload", _model_control, methods=POST)]

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        ok = self.host.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def server_meta(self, request: Request) -> Response:
        return JSONResponse({"name": "edgefleet-agent", "version": protocol.__version__, "device_id": self.device_id,
                             "extensions": EXTENSIONS})

    async def repository_index(self, request: Request) -> Response:
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
        return JSONResponse(self.host.repository_index(ready_only=doc.get("ready", False)))

    # -- one model: metadata, readiness, configuration, statistics, inference -------------------------------
    def model_routes(self) -> list[Route]:
        routes = []
        for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            routes += [
                Route(base, self.model_meta, methods=GET), Route(f"{base}/ready", self.model_ready, methods=GET),
                Route(f"{base}/config", self.config, methods=GET), Route(f"{base}/stats", self.stats, methods=GET),
                Route(f"{base}/infer", self.infer, methods=POST),
                Route(f"{base}/infer/image", self.infer_image, methods=POST),
            ]
        return routes

    async def model_meta(self, request: Request) -> Response:
        try:
            served = self.resolve(request)
        except AgentError as exc:
            return _agent_error(exc)
        m = served.manifest
        return JSONResponse({
            # the bundle's semantic version; Triton's integer one (statistics, config) as version_number
            "name": m.name, "versions": [m.version], "version_number": self.host.version_number(served),
            "platform": m.backend, "precision": m.precision,
            "profile": m.profile,
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in m.inputs],
            "outputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in m.outputs],
            "accuracy": m.accuracy.model_dump(), "labels": list(m.labels) if m.labels else None,
            "max_batch_size": served.settings.request_limit, "instances": len(served.backends),
            "devices": [getattr(b, "device", "?") for b in served.backends],
        })

    async def model_ready(self, request: Request) -> Response:
        try:
            self.resolve(request)
        except AgentError as exc:
            return JSONResponse({"name": request.path_params["name"], "ready": False, "error": str(exc)},
                                status_code=getattr(exc, "status_code", 503))
        return JSONResponse({"name": request.path_params["name"], "ready": True})

    async def config(self, request: Request) -> Response:
        try:
            served = self.resolve(request)
            return JSONResponse(model_config(served, self.host.version_number(served)))
        except AgentError as exc:
            return _agent_error(exc)

    async def stats(self, request: Request) -> Response:
        if "name" not in request.path_params:
            host = self.host
            return JSONResponse({"model_stats": [host.model_stats(s) for _, s in sorted(host.models.items())]})
        try:
            return JSONResponse({"model_stats": [self.host.model_stats(self.resolve(request))]})
        except AgentError as exc:
            return _agent_error(exc)

    async def infer_core(self, name: str, version: str | None, header: Callable[[str], str | None],
                         receive: Receive, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One infer request, from its path parameters, headers and body -> (status, headers, body)."""
        host = self.host
        view = self.shm_api.caller_view(scope)
        t0 = time.perf_counter()
        status = 500
        served: Served | None = None
        held = [0]
        try:
            served = host.get(name, version)  # fail fast: 404
            header_length = header(HEADER_LENGTH)
            # binary tensors: read into a buffer where they start 64-byte aligned, so they need no copy of their own
            align_at = int(header_length) if header_length is not None and header_length.isdigit() else None
            body = await _receive_body(receive, header("content-length"), self.max_body_bytes, self.budget, held,
                                       align_at)
            # resolved again after the body arrived: a swap during a slow upload serves the new version
            served = host.get(name, version)
            m = served.manifest
            if header_length is None and len(body) > LARGE_BODY:
                async with self.large_decodes:
                    req = await run_in_threadpool(parse_body, body, header_length, m.inputs, m.outputs, view)
            else:
                req = parse_body(body, header_length, m.inputs, m.outputs, view)
            del body
            outs = await host.infer(served, req)
            content, json_length = encode_response(m.name, m.version, outs, m.outputs, req, view, describe_shm=False)
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
            self.budget.give(held[0])
            host.record(served, name, time.perf_counter() - t0, status)

    async def infer(self, request: Request) -> Response:
        status, headers, content = await self.infer_core(request.path_params["name"],
                                                         request.path_params.get("version"), request.headers.get,
                                                         request.receive, request.scope)
        return Response(content, status_code=status, headers={k.decode(): v.decode() for k, v in headers})

    async def infer_image(self, request: Request) -> Response:
        images = self.images
        t0 = time.perf_counter()
        status = 500
        served: Served | None = None
        held = [0]
        try:
            served = self.resolve(request)
            body = await _receive_body(request.receive, request.headers.get("content-length"), self.max_body_bytes,
                                       self.budget, held)
            served = self.resolve(request)
            m = served.manifest
            header = check_image(body, m, images.max_decoded_bytes)  # before any decoder: 4xx, no slot taken
            try:
                await asyncio.wait_for(self.image_decodes.acquire(), images.wait_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                raise Unavailable(f"{images.max_concurrent} images are decoding (max_concurrent_image_decodes) and "
                                  f"this one waited {images.wait_s:g} s for its turn; retry") from None
            try:  # the thread is never abandoned (anyio waits for it), so the slot is given back after it
                # its work bounded first (scans, chunks), then OpenCV, which releases the GIL
                feeds = await run_in_threadpool(decode_feeds, body, m, header, images.max_scans)
            finally:
                self.image_decodes.release()
            del body
            req = InferRequest(feeds, None, frozenset())
            outs = await self.host.infer(served, req)
            if served.pipeline is not None:  # its boxes and what it read in each, decoded (agent.core.pipeline)
                from ..core.pipeline import image_answer  # a pipeline's (and the judge's): not on a model's start

                status = 200
                return JSONResponse(image_answer(m, outs))
            content, _ = encode_response(m.name, m.version, outs, m.outputs, req)
            status = 200
            return Response(content, media_type="application/json")
        except AgentError as exc:
            status = getattr(exc, "status_code", 500)
            return _agent_error(exc)
        except Exception as exc:
            log.exception("unexpected error in infer/image")
            return _error(500, f"internal error: {exc}")
        finally:
            self.budget.give(held[0])
            self.host.record(served, request.path_params["name"], time.perf_counter() - t0, status)

    # -- metrics and the API's description ----------------------------------------------------------------
    def metrics_routes(self) -> list[Route]:
        return [Route("/metrics", self.prometheus, methods=GET), Route("/metrics/summary", self.summary, methods=GET),
                Route("/openapi.json", self.openapi_doc, methods=GET)]

    async def prometheus(self, request: Request) -> Response:
        return Response(self.host.metrics.exposition(), media_type=CONTENT_TYPE)

    async def summary(self, request: Request) -> Response:
        host, metrics = self.host, self.host.metrics
        cur = host.current
        return JSONResponse({"requests": metrics.total_requests, "errors": metrics.total_errors,
                             "model": cur.manifest.name if cur else None,
                             "version": cur.manifest.version if cur else None,
                             "models": {n: s.manifest.version for n, s in sorted(host.models.items())}})

    async def openapi_doc(self, request: Request) -> Response:
        return JSONResponse(openapi(protocol.__version__, self.max_body_bytes,
                                    {n: s.manifest.version for n, s in self.host.models.items()}))


class _ShmApi:
    """The HTTP API's shared-memory area: Triton's system shared-memory extension over the registry
    (agent/transports/shm.py; None: the extension is off), and the CUDA one's answers for none registered."""

    def __init__(self, shm: SharedMemory | None):
        self.shm = shm

    def caller_view(self, scope: Scope) -> SharedMemory | None:
        """The shared-memory registry as this request's client may use it (its connection's view)."""
        if self.shm is None:
            return None
        cell = connection_peer(scope)
        view = cell.shm_view
        if view is None:
            view = cell.shm_view = self.shm.as_caller(cell)
        return view

    def routes(self) -> list[Route]:
        return [Route("/v2/systemsharedmemory/status", self.status, methods=GET),
                Route("/v2/systemsharedmemory/region/{region}/status", self.status, methods=GET),
                Route("/v2/systemsharedmemory/region/{region}/register", self.register, methods=POST),
                Route("/v2/systemsharedmemory/region/{region}/unregister", self.unregister, methods=POST),
                Route("/v2/systemsharedmemory/unregister", self.unregister, methods=POST),
                # CUDA shared memory: none can be registered; status and unregister answer as for none registered
                # (perf_analyzer unregisters both kinds at its end)
                Route("/v2/cudasharedmemory/status", _cuda_status, methods=GET),
                Route("/v2/cudasharedmemory/region/{region}/status", _cuda_status, methods=GET),
                Route("/v2/cudasharedmemory/region/{region}/register", _cuda_register, methods=POST),
                Route("/v2/cudasharedmemory/region/{region}/unregister", _cuda_unregister, methods=POST),
                Route("/v2/cudasharedmemory/unregister", _cuda_unregister, methods=POST)]

    @staticmethod
    def no_shm() -> Response:
        return _error(400, "system shared memory is off on this agent")

    async def status(self, request: Request) -> Response:
        view = self.caller_view(request.scope)
        if view is None:
            return self.no_shm()
        try:
            return JSONResponse(view.status(request.path_params.get("region")))
        except AgentError as exc:
            return _agent_error(exc)

    async def register(self, request: Request) -> Response:
        if self.shm is None:
            return self.no_shm()
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
        peer = connection_peer(request.scope).get()
        # max_shm_regions_per_client counts each local user apart, by its user alone: a user that connects from
        # 127.0.0.2, .3, ... (each reaches a loopback listener) or ::1 is still one client (it took every region)
        client = f"uid {peer.uid}"
        try:
            self.shm.register(request.path_params["region"], doc["key"], doc.get("offset", 0), doc["byte_size"],
                              client, peer)
        except AgentError as exc:
            return _agent_error(exc)
        return JSONResponse({})

    async def unregister(self, request: Request) -> Response:
        view = self.caller_view(request.scope)
        if view is None:
            return self.no_shm()
        try:
            view.unregister(request.path_params.get("region"))
        except AgentError as exc:
            return _agent_error(exc)
        return JSONResponse({})


async def _model_control(request: Request) -> Response:
    """Triton's model control (load, unload): refused with 503, Triton's answer when its model control is not
    explicit, as over gRPC (UNAVAILABLE): the agent serves what its fleet's desired state names."""
    return _error(503, MODEL_CONTROL_REFUSED)


async def _cuda_status(request: Request) -> Response:
    region = request.path_params.get("region")
    if region is not None:
        return _error(400, f"no CUDA shared-memory region {region!r} is registered ({CUDA_SHM_REFUSED})")
    return JSONResponse([])


async def _cuda_register(request: Request) -> Response:
    return _error(400, CUDA_SHM_REFUSED)


async def _cuda_unregister(request: Request) -> Response:
    return JSONResponse({})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error(404, f"no such endpoint: {request.method} {request.url.path}")
    if exc.status_code == 405:
        return _error(405, f"{request.method} is not allowed on {request.url.path}",
                      dict(exc.headers or {}))
    return _error(exc.status_code, str(exc.detail))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s: %r", request.url.path, exc)
    return _error(500, f"internal error: {exc}")


def create_app(host: ModelHost, max_body_bytes: int, device_id: str,
               max_inflight_body_bytes: int = 256 * 1024 * 1024, image_limits: ImageLimits | None = None,
               shm: SharedMemory | None = None) -> ASGIApp:
    """``shm``: the system shared-memory regions (shared with the gRPC server); None: the extension is off."""
    api = _HttpApi(host, max_body_bytes, device_id, max_inflight_body_bytes, image_limits, shm)
    slow = Starlette(routes=api.routes(), exception_handlers={HTTPException: _http_error, Exception: _server_error})
    infer_core = api.infer_core

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
    """The user of the client of this request's connection (agent/transports/peer.py): the connection's own cell where
    the server tags its connections (:func:`peer_tagging`), looked up at most once per connection; otherwise a cell
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
    # (a JSON header with no binary after it, as Triton's clients send shared-memory requests: plain bytes, no copy)
    if align_at is not None and declared is not None and declared.isdigit() and 0 <= align_at < int(declared):
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
