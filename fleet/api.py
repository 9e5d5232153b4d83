"""REST API (``/api/v1``), the TUF repository (``/tuf``) and the console (``/``)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fleet import console
from fleet.errors import BadRequest, FleetError
from fleet.service import FleetService
from fleet.tuf_repo import Repository

__all__ = ["create_app"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceIn(_Body):
    device_id: str = Field(min_length=1, max_length=64)
    labels: dict[str, str] | None = None


class RolloutIn(_Body):
    model: str
    version: str
    devices: list[str] = Field(min_length=1, max_length=10000)
    profile: str | None = None


def create_app(service: FleetService, repo: Repository, bootstrap: dict[str, Any],
               mqtt_connected: Callable[[], bool], max_upload_bytes: int) -> FastAPI:
    app = FastAPI(title="edgefleet fleet server", version="0.1.0",
                  description="Registry, signed model repository and rollouts for edgefleet agents.")

    @app.exception_handler(FleetError)
    async def _fleet_error(request: Request, exc: FleetError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status_code)

    @app.get("/api/v1/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "mqtt_connected": mqtt_connected()}

    @app.get("/api/v1/bootstrap")
    def get_bootstrap() -> dict[str, Any]:
        """What an agent needs to find the broker and the TUF repository."""
        return bootstrap

    @app.get("/api/v1/devices")
    def list_devices() -> list[dict[str, Any]]:
        return service.list_devices()

    @app.post("/api/v1/devices", status_code=201)
    def register_device(body: DeviceIn) -> dict[str, Any]:
        return service.register_device(body.device_id, body.labels)

    @app.get("/api/v1/devices/{device_id}")
    def get_device(device_id: str) -> dict[str, Any]:
        return service.get_device(device_id)

    @app.get("/api/v1/devices/{device_id}/telemetry")
    def get_telemetry(device_id: str, limit: int = 50) -> list[dict[str, Any]]:
        return service.device_telemetry(device_id, limit)

    @app.get("/api/v1/models")
    def list_models() -> list[dict[str, Any]]:
        return service.list_models()

    @app.post("/api/v1/bundles", status_code=201)
    async def upload_bundle(request: Request) -> dict[str, Any]:
        """Upload a bundle archive as the raw request body (Content-Type: application/x-tar)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_upload_bytes:
            raise BadRequest(f"bundle of {declared} bytes exceeds the {max_upload_bytes}-byte limit", 413)
        fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=".tar", dir=repo.dir)
        try:
            size = 0
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_upload_bytes:
                        raise BadRequest(f"bundle exceeds the {max_upload_bytes}-byte limit", 413)
                    f.write(chunk)
            if size == 0:
                raise BadRequest("empty body: send the bundle archive as the request body")
            from starlette.concurrency import run_in_threadpool

            return await run_in_threadpool(service.upload_bundle, Path(tmp))
        finally:
            Path(tmp).unlink(missing_ok=True)

    @app.get("/api/v1/rollouts")
    def list_rollouts(limit: int = 100) -> list[dict[str, Any]]:
        """Newest first, at most ``limit`` (up to 1000)."""
        return service.list_rollouts(limit)

    @app.post("/api/v1/rollouts", status_code=201)
    def create_rollout(body: RolloutIn) -> dict[str, Any]:
        return service.create_rollout(body.model, body.version, body.devices, body.profile)

    @app.get("/api/v1/rollouts/{rollout_id}")
    def get_rollout(rollout_id: int) -> dict[str, Any]:
        return service.get_rollout(rollout_id)

    safe = re.compile(r"^[A-Za-z0-9._/-]+$")

    @app.get("/tuf/{kind}/{rel:path}")
    def tuf_file(kind: str, rel: str) -> FileResponse:
        if kind not in ("metadata", "targets") or not safe.match(rel):
            raise BadRequest("not found", 404)
        path = repo.resolve_file(kind, rel)
        if path is None:
            raise BadRequest(f"{kind}/{rel} not found", 404)
        media = "application/json" if kind == "metadata" else "application/octet-stream"
        return FileResponse(path, media_type=media, headers={"Cache-Control": "no-store"})

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return console.render(service.list_devices(), service.list_models(), service.list_rollouts(20))

    return app
