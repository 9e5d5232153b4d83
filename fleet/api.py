"""REST API (``/api/v1``), the TUF repository (``/tuf``) and the console (``/``)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgefleet.fleet import console, drift
from edgefleet.fleet import schemas as out
from edgefleet.fleet import service as svc
from edgefleet.fleet.auth import ROLES, Caller, TokenStore
from edgefleet.fleet.enroll import Enrollment
from edgefleet.fleet.errors import BadRequest, FleetError, Forbidden, NotFound, RepositoryError, Unauthorized
from edgefleet.fleet.rollout import MAX_GRACE_S, Gates, RolloutSpec, ShadowGate
from edgefleet.fleet.service import FleetService
from edgefleet.fleet.tuf_repo import Repository
from edgefleet.protocol import jsonlimits
from edgefleet.protocol.errors import ContractError

__all__ = ["COOKIE", "create_app"]

COOKIE = "edgefleet_token"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite (1e400 is refused)


_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
RolloutId = Annotated[int, PathParam(ge=1, lt=2**62, description="a rollout's id")]  # fits BIGINT
# label keys and values and tags have a length (fleet.service.check_labels says the same for the console and CLI)
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=svc.MAX_LABEL_KEY_CHARS)]
LabelValue = Annotated[str, StringConstraints(max_length=svc.MAX_LABEL_VALUE_CHARS)]
Tag = Annotated[str, StringConstraints(min_length=1, max_length=svc.MAX_TAG_CHARS)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=svc.MAX_LABELS)]
Tags = Annotated[list[Tag], Field(max_length=svc.MAX_TAGS)]
# a query's offset: a row count no table reaches, far below a database's 64-bit limit
Offset = Annotated[int, Query(ge=0, le=out.MAX_OFFSET)]


class DeviceIn(_Body):
    device_id: str = Field(min_length=1, max_length=64)
    labels: Labels | None = None
    group: str | None = Field(default=None, pattern=_NAME)
    tags: Tags | None = None
    profile: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")


MAX_BATCH_DEVICES = 5000  # devices per bulk registration (a request body stays well under MAX_BODY_BYTES)


class DeviceBatchIn(_Body):
    devices: list[DeviceIn] = Field(min_length=1, max_length=MAX_BATCH_DEVICES)


class DevicePatch(_Body):
    group: str | None = Field(default=None, pattern=r"^$|" + _NAME)  # "" clears it
    tags: Tags | None = None
    profile: str | None = Field(default=None, pattern=r"^$|^[a-z0-9][a-z0-9._-]{0,63}$")


class RolloutIn(_Body):
    """Target: ``devices``, or a ``group``, ``tags`` (all of them) and/or a hardware ``profile``. With a device
    list, ``profile`` also says which build devices of unknown profile get."""

    model: str = Field(max_length=64)
    version: str = Field(max_length=32)
    devices: list[Annotated[str, StringConstraints(max_length=64)]] | None = Field(default=None, min_length=1,
                                                                                   max_length=100_000)
    group: str | None = Field(default=None, max_length=64)
    tags: Tags | None = None
    profile: str | None = Field(default=None, max_length=64)
    waves: list[Annotated[str, StringConstraints(max_length=16)]] = Field(
        default=["100%"], min_length=1, max_length=20,
        description="cumulative ends: counts ('5') or percentages ('10%')")
    soak_s: list[Annotated[float, Field(ge=0, le=7 * 86400)]] = Field(
        default=[0.0], min_length=1, max_length=20, description="per wave, 0-604800 s; the last repeats")
    gates: Gates = Gates()
    shadow: ShadowGate | None = Field(default=None, description="run each wave's candidate in shadow first")
    on_failure: Literal["pause", "abort"] = "abort"
    rollback_on_failure: bool = False
    offline_grace_s: float = Field(default=300.0, ge=0, le=MAX_GRACE_S)
    require_telemetry: bool = False


class EnrollTokenIn(_Body):
    ttl_s: float = Field(default=86400.0, gt=0, le=30 * 86400, description="how long the token can be redeemed")


class EnrollIn(_Body):
    token: str = Field(min_length=8, max_length=256)


class TokenIn(_Body):
    name: str = Field(min_length=1, max_length=64)
    role: str = Field(pattern="^(viewer|operator|admin)$")


MAX_BODY_BYTES = 1024 * 1024  # every request body but a bundle upload (own limit) and signed metadata
MAX_METADATA_BYTES = 16 * 1024 * 1024
_OWN_LIMIT = ("/api/v1/bundles",)


class BodyLimit:
    """Every request body is bounded before any handler reads it: the declared length is checked first,
    a chunked body is read (at most the limit) and replayed. Bundle uploads stream under their own limit."""

    def __init__(self, app: Any, on_reject: Callable[[str, str], None]):
        self.app = app
        self.on_reject = on_reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS") or scope["path"] in _OWN_LIMIT:
            await self.app(scope, receive, send)
            return
        limit = MAX_METADATA_BYTES if scope["path"] == "/api/v1/bundles/signed-metadata" else MAX_BODY_BYTES
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._too_large(scope, send, limit)
            return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(scope, send, limit)
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        ctype = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
        if body and (ctype == b"application/json" or ctype.endswith(b"+json")):
            try:  # parsed once more here, bounded, so no handler's parser meets a body nested too deep
                jsonlimits.loads(body, source="request body", max_bytes=limit)
            except ContractError as exc:
                client = scope.get("client") or ("?",)
                self.on_reject(str(client[0]), f"{scope['path']}: {exc}")
                await JSONResponse({"error": str(exc)}, status_code=400)(scope, None, send)  # type: ignore[arg-type]
                return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict[str, Any], send: Any, limit: int) -> None:
        client = scope.get("client") or ("?",)
        self.on_reject(str(client[0]), f"{scope['path']}: request body over {limit} bytes")
        await JSONResponse({"error": f"request body exceeds the {limit}-byte limit of {scope['path']}"},
                           status_code=413)(scope, None, send)  # type: ignore[arg-type]


def create_app(service: FleetService, repo: Repository, bootstrap: dict[str, Any],
               health: Callable[[], dict[str, Any]], max_upload_bytes: int,
               tokens: TokenStore | None = None, enrollment: Enrollment | None = None,
               replica_stats: Callable[[], dict[str, Any]] | None = None) -> FastAPI:
    app = FastAPI(title="edgefleet fleet server", version="0.1.0",
                  responses={"4XX": {"model": out.Error, "description": "the request was refused; why"}},
                  description="Registry, signed model repository and rollouts for edgefleet agents. Every "
                              "/api/v1 endpoint but health and bootstrap needs 'Authorization: Bearer <token>' "
                              f"of a role ({' < '.join(ROLES)}).")
    store = tokens or TokenStore(service.sessions)

    @app.exception_handler(FleetError)
    async def _fleet_error(request: Request, exc: FleetError) -> JSONResponse:
        if isinstance(exc, Unauthorized) or exc.status_code == 403:
            service.rejections.add("api_" + ("unauthorized" if isinstance(exc, Unauthorized) else "forbidden"),
                                   request.client.host if request.client else "?", f"{request.url.path}: {exc}")
        return JSONResponse({"error": str(exc)}, status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own errors (a body it cannot parse, an unknown route, a wrong method) in the same
        ``{"error": ...}`` shape as every other."""
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 with one line per problem, counted like every other rejected input."""
        def where(e: Any) -> str:  # a location names keys the caller sent: each cut to 40 characters
            return ".".join(f"{str(p)[:40]}..." if len(str(p)) > 40 else str(p) for p in e.get("loc", ()))

        problems = "; ".join(f"{where(e)}: {str(e.get('msg'))[:200]}" for e in exc.errors()[:10])
        service.rejections.add("api_invalid_request", request.client.host if request.client else "?",
                               f"{request.method} {request.url.path}: {problems}")
        return JSONResponse({"error": f"invalid request: {problems}"}, status_code=422)

    def caller(authorization: str | None = Header(default=None)) -> Caller:
        return store.check(authorization)

    def viewer(c: Caller = Depends(caller)) -> Caller:
        return c

    def operator(c: Caller = Depends(caller)) -> Caller:
        c.require("operator", "this change")
        return c

    def admin(c: Caller = Depends(caller)) -> Caller:
        c.require("admin", "managing tokens")
        return c

    @app.get("/api/v1/health", response_model=out.Health)
    def get_health() -> dict[str, Any]:
        """Liveness (always 200 while the server answers) and whether device messages reach the database:
        ``status`` is "ok" only then, "degraded" with ``problems`` otherwise."""
        return health()

    @app.get("/api/v1/bootstrap", response_model=out.Bootstrap)
    def get_bootstrap() -> dict[str, Any]:
        """What an agent needs to find the broker and the TUF repository."""
        return bootstrap

    @app.get("/api/v1/devices", response_model=list[out.Device])
    def list_devices(response: Response, limit: int | None = Query(default=None, ge=0, le=out.MAX_PAGE),
                     offset: Offset = 0, group: str | None = Query(default=None, max_length=64),
                     state: str | None = Query(default=None, max_length=32),
                     q: str | None = Query(default=None, max_length=64),
                     _: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        """Devices by id; ``limit``/``offset`` page them, ``group``/``state``/``q`` filter (fleet.schemas)."""
        page, total = service.find_devices(limit, offset, group, state, q)
        response.headers["X-Total-Count"] = str(total)
        return page

    @app.post("/api/v1/devices", status_code=201, response_model=out.Device)
    def register_device(body: DeviceIn, c: Caller = Depends(operator)) -> dict[str, Any]:
        return service.register_device(body.device_id, body.labels, body.group, body.tags, body.profile, c.name)

    @app.post("/api/v1/devices/batch", status_code=201)
    def register_devices(body: DeviceBatchIn, c: Caller = Depends(operator)) -> dict[str, int]:
        """Register up to MAX_BATCH_DEVICES devices at once (all or none): {"registered": new, "updated": known}."""
        return service.register_devices([d.model_dump() for d in body.devices], c.name)

    @app.patch("/api/v1/devices/{device_id}", response_model=out.Device)
    def update_device(device_id: str, body: DevicePatch, c: Caller = Depends(operator)) -> dict[str, Any]:
        return service.update_device(device_id, body.group, body.tags, body.profile, c.name)

    @app.get("/api/v1/devices/{device_id}", response_model=out.Device)
    def get_device(device_id: str, _: Caller = Depends(viewer)) -> dict[str, Any]:
        return service.get_device(device_id)

    def _enrollment() -> Enrollment:
        if enrollment is None:
            raise NotFound("this fleet does not enroll devices (no MQTT accounts are managed here)")
        return enrollment

    @app.post("/api/v1/devices/{device_id}/enrollment-token", status_code=201, response_model=out.EnrollmentToken)
    def issue_enrollment_token(device_id: str, body: EnrollTokenIn | None = None,
                               c: Caller = Depends(operator)) -> dict[str, Any]:
        """A one-time token (shown only here; the fleet keeps its hash) that the device trades for its own
        MQTT credentials with POST /api/v1/enroll. Registers the device if it is new."""
        import datetime as dt

        ttl = (body or EnrollTokenIn()).ttl_s
        try:
            doc = service.get_device(device_id)
        except NotFound:
            service.register_device(device_id, actor=c.name)
        else:
            if doc.get("online"):  # its new credentials would lock the running agent out: a decommission
                c.require("admin", f"re-enrolling {device_id}, which is online (its agent would be locked out)")
        token = _enrollment().issue_token(device_id, dt.timedelta(seconds=ttl))
        service.device_audit(device_id, c.name, "enrollment_token_issued", ttl_s=ttl)
        return {"device_id": device_id, "token": token, "expires_in_s": ttl}

    @app.post("/api/v1/enroll", response_model=out.Enrolled)
    def enroll(body: EnrollIn, request: Request) -> dict[str, Any]:
        """For devices: trade a one-time enrollment token (it is the authorization) for this device's MQTT
        username and password, returned once, with what /api/v1/bootstrap says."""
        try:
            creds = _enrollment().redeem(body.token)
        except BadRequest as exc:
            service.rejections.add("enroll_refused", request.client.host if request.client else "?", str(exc))
            raise
        service.device_enrolled(creds.device_id)
        service.device_audit(creds.device_id, creds.device_id, "device_enrolled")
        return {"device_id": creds.device_id, "mqtt_username": creds.username, "mqtt_password": creds.password,
                **bootstrap}

    @app.post("/api/v1/devices/{device_id}/decommission", response_model=out.Device)
    def decommission(device_id: str, c: Caller = Depends(caller)) -> dict[str, Any]:
        """Revoke the device's MQTT credentials (it can no longer connect) and mark it decommissioned; its
        history stays. Enrolling it again takes a new token. Admin role."""
        c.require("admin", "decommissioning a device")
        doc = service.decommission_device(device_id, c.name)
        try:
            _enrollment().decommission(device_id)
        except NotFound:
            pass  # never enrolled: nothing to revoke
        return doc

    @app.get("/api/v1/devices/{device_id}/telemetry", response_model=list[out.TelemetryRecord])
    def get_telemetry(device_id: str, limit: int = Query(default=50, ge=1, le=1000),
                      _: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        return service.device_telemetry(device_id, limit)

    @app.get("/api/v1/devices/{device_id}/drift", response_model=list[drift.DriftRecord])
    def get_drift(device_id: str, limit: int = Query(default=200, ge=1, le=drift.MAX_LIST),
                  _: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        """The device's drift score over time, newest first: one per telemetry record with answer counts (fleet.drift:
        PSI against the compile-time reference; 0.1 watch, 0.25 drift; under 200 answers insufficient)."""
        return drift.device_drift(service.sessions, service.rollouts.drift, device_id, limit)

    @app.get("/api/v1/groups", response_model=list[out.Group])
    def list_groups(_: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        return service.list_groups()

    @app.get("/api/v1/models", response_model=list[out.ModelBuild])
    def list_models(_: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        return service.list_models()

    @app.get("/api/v1/stats", response_model=out.Stats, response_model_exclude_unset=True)
    def stats(_: Caller = Depends(viewer)) -> dict[str, Any]:
        """Device and telemetry counts (the database's), counters of rejected input by kind, and what this
        replica handled from MQTT (with several replicas, each answers for itself)."""
        return {"rejected": service.rejections.snapshot(), **service.counts(),
                **({"replica": replica_stats()} if replica_stats is not None else {})}

    @app.post("/api/v1/bundles", status_code=201, response_model=out.ModelBuild)
    async def upload_bundle(request: Request, _: Caller = Depends(operator)) -> dict[str, Any]:
        """Upload a bundle archive as the raw request body (Content-Type: application/x-tar)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_upload_bytes:
            raise BadRequest(f"bundle of {declared} bytes exceeds the {max_upload_bytes}-byte limit", 413)
        repo.upload_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=".tar", dir=repo.upload_dir)
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

    @app.get("/api/v1/bundles/signed-metadata", response_model=out.SignedMetadata)
    def get_bundles_metadata(_: Caller = Depends(operator)) -> Response:
        """Delegated signing: the published ``bundles`` TUF metadata, which the compiler's CI extends with a new
        bundle and signs with its key (``edgefleet fleet upload BUNDLE --sign-key``)."""
        try:
            return Response(repo.current_bundles(), media_type="application/json")
        except RepositoryError as exc:
            raise BadRequest(f"{exc}; this fleet signs bundles itself: upload them without --sign-key", 409) from exc

    @app.post("/api/v1/bundles/signed-metadata", status_code=201, response_model=out.Published)
    async def publish_bundles_metadata(request: Request, _: Caller = Depends(operator)) -> dict[str, Any]:
        """Publish ``bundles`` metadata signed by a CI key the offline targets metadata delegates to; then the
        bundles it lists can be uploaded."""
        body = await request.body()  # at most MAX_METADATA_BYTES: BodyLimit
        if not body:
            raise BadRequest("send the signed bundles metadata (JSON, at most 16 MiB) as the request body")
        try:
            repo.publish_bundles(body)
        except RepositoryError as exc:
            raise BadRequest(str(exc), 422) from exc
        return {"published": True}

    @app.get("/api/v1/rollouts", response_model=list[out.Rollout], response_model_exclude_unset=True)
    def list_rollouts(limit: int = Query(default=100, ge=1, le=1000),
                      _: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        """Newest first, at most ``limit`` (up to 1000), without their target lists."""
        return service.list_rollouts(limit)

    @app.post("/api/v1/rollouts", status_code=201, response_model=out.Rollout, response_model_exclude_unset=True)
    def create_rollout(body: RolloutIn, c: Caller = Depends(operator)) -> dict[str, Any]:
        try:
            spec = RolloutSpec(waves=tuple(body.waves), soak_s=tuple(body.soak_s), gates=body.gates, shadow=body.shadow,
                               on_failure=body.on_failure, rollback_on_failure=body.rollback_on_failure,
                               offline_grace_s=body.offline_grace_s, require_telemetry=body.require_telemetry)
        except ValueError as exc:
            raise BadRequest(f"bad rollout spec: {exc}", 422) from exc
        return service.create_rollout(body.model, body.version, body.devices, body.profile, body.group, body.tags,
                                      spec, c.name)

    @app.get("/api/v1/rollouts/{rollout_id}", response_model=out.Rollout, response_model_exclude_unset=True)
    def get_rollout(rollout_id: RolloutId, targets: bool = True,
                    targets_limit: int | None = Query(default=None, ge=0, le=out.MAX_PAGE),
                    targets_offset: Offset = 0,
                    targets_state: str | None = Query(default=None, max_length=32),
                    _: Caller = Depends(viewer)) -> dict[str, Any]:
        """With ``targets_limit`` (or ``targets_state``/``targets_offset``): one page of targets and their total."""
        paged = targets and (targets_limit is not None or targets_state or targets_offset)
        r = service.get_rollout(rollout_id, with_targets=targets and not paged)
        if paged:
            limit = out.MAX_PAGE if targets_limit is None else targets_limit
            r["targets"], r["targets_total"] = service.rollout_targets(rollout_id, limit, targets_offset,
                                                                       targets_state)
        return r

    @app.post("/api/v1/rollouts/{rollout_id}/{action}", response_model=out.Rollout,
              response_model_exclude_unset=True)
    def rollout_action(rollout_id: RolloutId, action: str, c: Caller = Depends(operator)) -> dict[str, Any]:
        """``action``: pause, resume, abort or rollback."""
        if action not in ("pause", "resume", "abort", "rollback"):
            raise BadRequest(f"unknown action {action!r}: pause, resume, abort or rollback", 404)
        return service.rollout_action(rollout_id, action, c.name)

    @app.get("/api/v1/rollouts/{rollout_id}/drift", response_model=drift.RolloutDrift)
    def get_rollout_drift(rollout_id: RolloutId, _: Caller = Depends(viewer)) -> dict[str, Any]:
        """Each wave's new version against its compile-time reference and against the version its devices ran before
        (what the max_drift_psi gate judges)."""
        return drift.rollout_drift(service.sessions, service.rollouts.drift, rollout_id)

    @app.get("/api/v1/rollouts/{rollout_id}/audit", response_model=list[out.AuditEntry])
    def rollout_audit(rollout_id: RolloutId, _: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        service.get_rollout(rollout_id, with_targets=False)
        return service.audit_log(rollout_id)

    @app.get("/api/v1/audit", response_model=list[out.AuditEntry])
    def audit_log(limit: int = Query(default=200, ge=1, le=5000), _: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        return service.audit_log(None, limit)

    @app.get("/api/v1/tokens", response_model=list[out.Token])
    def list_tokens(_: Caller = Depends(admin)) -> list[dict[str, Any]]:
        return store.list()

    @app.post("/api/v1/tokens", status_code=201, response_model=out.TokenCreated)
    def create_token(body: TokenIn, c: Caller = Depends(admin)) -> dict[str, str]:
        """The token is in this answer only; the fleet keeps its SHA-256."""
        return store.create(body.name, body.role, c.name)

    @app.delete("/api/v1/tokens/{name}", status_code=204)
    def revoke_token(name: str, c: Caller = Depends(admin)) -> None:
        store.revoke(name, c.name)

    safe = re.compile(r"^[A-Za-z0-9._/-]+$")

    @app.get("/tuf/{kind}/{rel:path}")
    def tuf_file(kind: str, rel: str) -> Response:
        if kind not in ("metadata", "targets") or not safe.match(rel):
            raise BadRequest("not found", 404)
        found = repo.serve(kind, rel)
        if found is None:
            raise BadRequest(f"{kind}/{rel} not found", 404)
        media = "application/json" if kind == "metadata" else "application/octet-stream"
        headers = {"Cache-Control": "no-store"}
        if isinstance(found, Path):
            return FileResponse(found, media_type=media, headers=headers)
        if isinstance(found, bytes):
            return Response(found, media_type=media, headers=headers)
        size, chunks = found  # a target kept in the database, streamed a chunk at a time
        return StreamingResponse(chunks, media_type=media, headers={**headers, "Content-Length": str(size)})

    def console_caller(request: Request) -> Caller | None:
        header = request.headers.get("authorization")
        token = request.cookies.get(COOKIE)
        try:
            return store.check(header or f"Bearer {token}") if (header or token) else None
        except Unauthorized:
            return None

    def can_operate(c: Caller) -> bool:
        return ROLES.index(c.role) >= ROLES.index("operator")

    def _int_param(request: Request, name: str) -> int:
        raw = request.query_params.get(name, "")
        return min(int(raw), 10**9) if raw.isdigit() else 0

    def _str_param(request: Request, name: str) -> str:
        return request.query_params.get(name, "").strip()[:64]

    def render_index(request: Request, operate: bool, message: str | None = None) -> str:
        """The overview with one page of devices, filtered and paged in the database (?group=&state=&q=&offset=)."""
        filters = {k: _str_param(request, k) for k in ("group", "state", "q")}
        offset = _int_param(request, "offset")
        page, matching = service.find_devices(console.PAGE_SIZE, offset, filters["group"] or None,
                                              filters["state"] or None, filters["q"] or None)
        return console.render(page, service.list_models(), service.list_rollouts(20), operate, message,
                              fleet=service.device_counts(), matching=matching, filters=filters, offset=offset)

    def render_rollout(rollout_id: int, request: Request, operate: bool, message: str | None = None) -> str:
        """A rollout with its wave counters and one page of its targets (?state=&offset=), never all of them."""
        state, offset = _str_param(request, "state"), _int_param(request, "offset")
        r = service.get_rollout(rollout_id, with_targets=False)
        r["targets"], r["targets_total"] = service.rollout_targets(rollout_id, console.PAGE_SIZE, offset,
                                                                   state or None)
        devices = service.devices_by_id([t["device_id"] for t in r["targets"]])
        return console.rollout_page(r, devices, operate, message, state=state, offset=offset)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request) -> Any:
        c = console_caller(request)
        if c is None:
            return HTMLResponse(console.login_page(), status_code=401)
        return render_index(request, can_operate(c))

    @app.get("/rollouts/{rollout_id}", response_class=HTMLResponse, include_in_schema=False)
    def console_rollout(rollout_id: RolloutId, request: Request) -> Any:
        c = console_caller(request)
        if c is None:
            return HTMLResponse(console.login_page(), status_code=401)
        return render_rollout(rollout_id, request, can_operate(c))

    @app.get("/devices/{device_id}", response_class=HTMLResponse, include_in_schema=False)
    def console_device(device_id: str, request: Request) -> Any:
        c = console_caller(request)
        if c is None:
            return HTMLResponse(console.login_page(), status_code=401)
        return console.device_page(service.get_device(device_id), service.device_telemetry(device_id, 200),
                                   drift.device_drift(service.sessions, service.rollouts.drift, device_id, 200))

    def _same_origin(request: Request) -> None:
        """Console forms are signed in by cookie, which a browser also sends with a form another site posts
        here (SameSite=strict aside, older browsers and same-site subdomains do): a POST must come from a
        page of this console, by its Origin header (or Referer, which browsers send when Origin is absent)."""
        from urllib.parse import urlsplit

        source = request.headers.get("origin") or request.headers.get("referer")
        host = request.headers.get("host", "")
        if not source or source == "null" or urlsplit(source).netloc.lower() != host.lower():
            service.rejections.add("console_cross_origin", request.client.host if request.client else "?",
                                   f"{request.url.path}: origin {source!r}, console {host!r}")
            raise Forbidden(f"cross-origin form refused: this console only takes forms from its own pages "
                            f"(origin {source!r} is not {host!r}); use the API with a token from elsewhere")

    async def _form(request: Request) -> dict[str, str]:
        from urllib.parse import parse_qs

        body = await request.body()  # bounded by BodyLimit
        return {k: v[0].strip() for k, v in parse_qs(body.decode(errors="replace")).items()}

    def _console_operator(request: Request) -> Caller:
        _same_origin(request)
        c = console_caller(request)
        if c is None:
            raise Unauthorized("sign in to the console first")
        c.require("operator", "this change")
        return c

    @app.post("/console/rollouts", include_in_schema=False)
    async def console_create_rollout(request: Request) -> Any:
        """The console's new-rollout form: the same checks as POST /api/v1/rollouts, errors shown on the page."""
        c = _console_operator(request)
        f = await _form(request)

        def split(key: str) -> list[str]:
            return [x.strip() for x in f.get(key, "").split(",") if x.strip()]

        def num(key: str) -> float | None:
            return float(f[key]) if f.get(key) else None

        try:
            name, _, version = f.get("model_version", "").partition(" ")
            gates = Gates(install_success_min=num("install_success_min"), error_rate_max=num("error_rate_max"),
                          p99_ratio_max=num("p99_ratio_max"))
            shadow = ShadowGate(agreement_min=num("shadow_agreement") or 0.99,
                                min_samples=int(num("shadow_samples") or 100)) if f.get("shadow") == "1" else None
            spec = RolloutSpec(waves=tuple(split("waves") or ["100%"]), shadow=shadow,
                               soak_s=tuple(float(x) for x in split("soak_s") or ["0"]), gates=gates,
                               on_failure="abort" if f.get("on_failure") == "abort" else "pause",
                               rollback_on_failure=f.get("rollback_on_failure") == "1")
            r = service.create_rollout(name, version, split("devices") or None, f.get("profile") or None,
                                       f.get("group") or None, split("tags") or None, spec, c.name)
        except (ValueError, OverflowError, FleetError) as exc:  # a number past its range too (int of 1e400)
            return HTMLResponse(render_index(request, True, f"rollout not started: {exc}"), status_code=400)
        return RedirectResponse(f"/rollouts/{r['id']}", status_code=303)

    @app.post("/console/rollouts/{rollout_id}/{action}", include_in_schema=False)
    async def console_rollout_action(rollout_id: RolloutId, action: str, request: Request) -> Any:
        c = _console_operator(request)
        if action not in ("pause", "resume", "abort", "rollback"):
            raise BadRequest(f"unknown action {action!r}", 404)
        try:
            service.rollout_action(rollout_id, action, c.name)
        except FleetError as exc:
            return HTMLResponse(render_rollout(rollout_id, request, True, str(exc)), status_code=exc.status_code)
        return RedirectResponse(f"/rollouts/{rollout_id}", status_code=303)

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Any:
        from urllib.parse import parse_qs

        _same_origin(request)
        body = await request.body()
        token = (parse_qs(body[:4096].decode(errors="replace")).get("token") or [""])[0]
        try:
            store.check(f"Bearer {token.strip()}")
        except Unauthorized as exc:
            return HTMLResponse(console.login_page(str(exc)), status_code=401)
        r = RedirectResponse("/", status_code=303)
        tls = request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"
        r.set_cookie(COOKIE, token.strip(), httponly=True, samesite="strict", secure=tls)
        return r

    app.add_middleware(BodyLimit, on_reject=lambda who, what: service.rejections.add("api_body_too_large", who,
                                                                                       what))
    return app
