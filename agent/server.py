"""The agent's local inference API: Open Inference Protocol (KServe v2) over HTTP.

    GET  /v2/health/live            the process is up
    GET  /v2/health/ready           a model is loaded and serving
    GET  /v2                        server metadata
    GET  /v2/models/{name}          model metadata (inputs, outputs, version, accuracy)
    GET  /v2/models/{name}/ready
    POST /v2/models/{name}/infer    JSON tensors in, JSON tensors out (also under /versions/{v}/)
    GET  /metrics/summary           counters since start (JSON)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import protocol
from agent.backends.base import Backend
from agent.batcher import Batcher, BatchSettings
from agent.errors import AgentError, ModelNotFound, PayloadTooLarge, RequestError, Unavailable
from agent.kserve import decode_request, encode_response
from agent.metrics import Metrics
from protocol.manifest import Manifest

__all__ = ["ModelHost", "Served", "create_app"]

log = logging.getLogger("edgefleet.agent.http")


@dataclass
class Served:
    manifest: Manifest
    backend: Backend
    batcher: Batcher


class ModelHost:
    """Holds the model being served; swaps a new one in without dropping requests."""

    def __init__(self, settings: BatchSettings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.current: Served | None = None
        self._swap_lock = asyncio.Lock()

    async def swap(self, manifest: Manifest, backend: Backend) -> None:
        """Start serving ``backend``; the old model finishes its queue, then closes. Runs on the server loop."""
        async with self._swap_lock:
            batcher = Batcher(backend, self.settings, self.metrics)
            batcher.start()
            old, self.current = self.current, Served(manifest, backend, batcher)
            if old is not None:  # best effort: the new model already serves whatever happens here
                try:
                    await old.batcher.close()
                    await asyncio.get_running_loop().run_in_executor(None, old.backend.close)
                except Exception:
                    log.exception("retiring %s %s failed", old.manifest.name, old.manifest.version)
        log.info("now serving %s %s", manifest.name, manifest.version)

    async def close(self) -> None:
        async with self._swap_lock:  # an install racing shutdown finishes its swap first
            if self.current is not None:
                await self.current.batcher.close()
                self.current.backend.close()
                self.current = None

    def get(self, name: str, version: str | None = None) -> Served:
        cur = self.current
        if cur is None:
            raise Unavailable("no model is loaded yet; the agent is waiting for its first install")
        if name != cur.manifest.name:
            raise ModelNotFound(f"unknown model {name!r}; this agent serves {cur.manifest.name!r}")
        if version is not None and version != cur.manifest.version:
            raise ModelNotFound(f"model {name!r} version {version!r} is not loaded; serving {cur.manifest.version}")
        return cur


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


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


def create_app(host: ModelHost, max_body_bytes: int, device_id: str,
               max_inflight_body_bytes: int = 256 * 1024 * 1024) -> Starlette:
    metrics = host.metrics
    budget = _ByteBudget(max_inflight_body_bytes)
    # decoding JSON expands it 10-30x in memory and holds the GIL: two large bodies at a time at most
    large_decodes = asyncio.Semaphore(2)

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        ok = host.current is not None
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def server_meta(request: Request) -> Response:
        return JSONResponse({"name": "edgefleet-agent", "version": protocol.__version__, "device_id": device_id,
                             "extensions": []})

    async def model_meta(request: Request) -> Response:
        try:
            served = host.get(request.path_params["name"], request.path_params.get("version"))
        except AgentError as exc:
            return _error(getattr(exc, "status_code", 500), str(exc))
        m = served.manifest
        return JSONResponse({
            "name": m.name, "versions": [m.version], "platform": m.backend, "precision": m.precision,
            "profile": m.profile,
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in m.inputs],
            "outputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in m.outputs],
            "accuracy": m.accuracy.model_dump(), "labels": list(m.labels) if m.labels else None,
            "max_batch_size": host.settings.max_batch_size,
        })

    async def model_ready(request: Request) -> Response:
        try:
            host.get(request.path_params["name"], request.path_params.get("version"))
        except AgentError as exc:
            return JSONResponse({"name": request.path_params["name"], "ready": False, "error": str(exc)},
                                status_code=getattr(exc, "status_code", 503))
        return JSONResponse({"name": request.path_params["name"], "ready": True})

    async def infer(request: Request) -> Response:
        t0 = time.perf_counter()
        ok = False
        held = [0]
        try:
            host.get(request.path_params["name"], request.path_params.get("version"))  # fail fast: 404
            body = await _read_body(request, max_body_bytes, budget, held)
            # resolved again after the body arrived: a swap during a slow upload serves the new model
            served = host.get(request.path_params["name"], request.path_params.get("version"))
            if len(body) > LARGE_BODY:
                async with large_decodes:
                    feeds, wanted, req_id = await run_in_threadpool(_decode, body, served.manifest)
            else:
                feeds, wanted, req_id = _decode(body, served.manifest)
            del body
            outs = await served.batcher.submit(feeds)
            resp = encode_response(served.manifest.name, served.manifest.version, outs, served.manifest.outputs,
                                   wanted, req_id)
            ok = True
            return JSONResponse(resp)
        except AgentError as exc:
            status = getattr(exc, "status_code", 500)
            headers = {"Retry-After": "1"} if status == 503 else None
            return JSONResponse({"error": str(exc)}, status_code=status, headers=headers)
        except Exception as exc:  # never let one request take the server down
            log.exception("unexpected error in infer")
            return _error(500, f"internal error: {exc}")
        finally:
            budget.give(held[0])
            metrics.request_done(time.perf_counter() - t0, ok)

    async def summary(request: Request) -> Response:
        cur = host.current
        return JSONResponse({"requests": metrics.total_requests, "errors": metrics.total_errors,
                             "model": cur.manifest.name if cur else None,
                             "version": cur.manifest.version if cur else None})

    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server_meta),
        Route("/v2/models/{name}", model_meta), Route("/v2/models/{name}/versions/{version}", model_meta),
        Route("/v2/models/{name}/ready", model_ready),
        Route("/v2/models/{name}/versions/{version}/ready", model_ready),
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
        Route("/metrics/summary", summary),
    ]
    return Starlette(routes=routes)


async def _read_body(request: Request, limit: int, budget: _ByteBudget, held: list[int]) -> bytes:
    """Read at most ``limit`` bytes, charging them to ``budget`` (``held[0]`` says how much to give back)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        budget.take(len(chunk))
        held[0] += len(chunk)
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(body: bytes, manifest: Manifest) -> tuple[dict[str, Any], list[str] | None, str | None]:
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise RequestError("the body's JSON is nested too deeply") from exc
    return decode_request(doc, manifest.inputs, manifest.outputs)
