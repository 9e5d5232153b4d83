"""REST API (``/api/v1``), the TUF repository (``/tuf``) and the console (``/``): the app factory. Each area's
routes are a router in fleet/routes/ (devices, models, rollouts, tokens, health, console); here are what applies
to all of them: the request body limit, the error shape, and the OpenAPI document's header."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..protocol import jsonlimits
from ..protocol.errors import ContractError
from . import schemas as out
from .auth import ROLES, TokenStore
from .enroll import Enrollment
from .errors import FleetError, Unauthorized
from .routes import console, devices, models, rollouts, windows
from .routes import health as health_routes
from .routes import tokens as tokens_routes
from .routes.console import COOKIE
from .routes.context import Fleet, roles
from .service import FleetService
from .tuf_repo import Repository

__all__ = ["COOKIE", "CSP", "MAX_BODY_BYTES", "BodyLimit", "SecurityHeaders", "create_app"]

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
        if scope["type"] == "http" and ("\x00" in scope["path"] or b"\x00" in unquote_to_bytes(
                scope.get("query_string", b""))):
            await self._nul(scope, send, "the path or query")
            return
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
                data = jsonlimits.loads(body, source="request body", max_bytes=limit)
            except ContractError as exc:
                client = scope.get("client") or ("?",)
                self.on_reject(str(client[0]), f"{scope['path']}: {exc}")
                await JSONResponse({"error": str(exc)}, status_code=400)(scope, None, send)  # type: ignore[arg-type]
                return
            if b"\\u0000" in body and _holds_nul(data):
                await self._nul(scope, send, "the request body")
                return
        elif body and ctype == b"application/x-www-form-urlencoded" and b"\x00" in unquote_to_bytes(body):
            await self._nul(scope, send, "the form")
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _nul(self, scope: dict[str, Any], send: Any, where: str) -> None:
        """A NUL character: no name, label or filter holds one, and PostgreSQL's text cannot (it answered 500)."""
        client = scope.get("client") or ("?",)
        self.on_reject(str(client[0]), f"{scope['path']!r}: a NUL character in {where}")
        await JSONResponse({"error": f"{where} holds a NUL character (%00 or \\u0000), which no name, label or "
                                     "filter admits"}, status_code=400)(scope, None, send)  # type: ignore[arg-type]

    async def _too_large(self, scope: dict[str, Any], send: Any, limit: int) -> None:
        client = scope.get("client") or ("?",)
        self.on_reject(str(client[0]), f"{scope['path']}: request body over {limit} bytes")
        await JSONResponse({"error": f"request body exceeds the {limit}-byte limit of {scope['path']}"},
                           status_code=413)(scope, None, send)  # type: ignore[arg-type]


# console pages: no script at all, styles only inline (the pages' own <style> and style attributes), forms only to
# this console, never framed; an API answer (JSON) loads nothing
CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; "
       "base-uri 'none'")
_SECURITY_HEADERS = [(b"x-frame-options", b"DENY"), (b"x-content-type-options", b"nosniff"),
                     (b"referrer-policy", b"same-origin")]
_CSP = [(b"content-security-policy", CSP.encode())]
_SWAGGER = ("/docs", "/docs/oauth2-redirect", "/redoc")  # FastAPI's pages load their scripts from a CDN: no CSP


class SecurityHeaders:
    """Every answer, console page or API: never framed (X-Frame-Options DENY), its declared type only
    (nosniff), no full referrer to other sites; and the console's Content-Security-Policy (:data:`CSP`) on all
    but FastAPI's /docs and /redoc."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = _SECURITY_HEADERS if scope["path"] in _SWAGGER else _SECURITY_HEADERS + _CSP

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _holds_nul(data: Any) -> bool:
    """Whether a parsed JSON document holds a NUL character in a key or a string (one iterative pass)."""
    stack = [data]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


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
    fleet = Fleet(service, repo, store, roles(store), bootstrap, health, max_upload_bytes, enrollment, replica_stats)
    _error_handlers(app, service)
    for area in (health_routes, devices, models, rollouts, windows, tokens_routes, console):
        app.include_router(area.router(fleet))
    app.add_middleware(BodyLimit, on_reject=lambda who, what: service.rejections.add("api_body_too_large", who,
                                                                                       what))
    app.add_middleware(SecurityHeaders)  # outermost: BodyLimit's own refusals carry the headers too
    return app


def _error_handlers(app: FastAPI, service: FleetService) -> None:
    """Every refusal in one shape, ``{"error": ...}``; refused callers and invalid requests are counted."""

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
