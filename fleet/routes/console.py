"""The web console's wiring: its pages (``/``, ``/rollouts/{id}``, ``/devices/{id}``), its forms and the sign-in.
Pages are drawn by fleet.console; a form takes the same checks as the API and shows its error on the page. None of
these routes is in the OpenAPI document."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from .. import console, drift, series, windows
from ..auth import ROLES, Caller, TokenStore
from ..db import Device, utcnow
from ..errors import BadRequest, FleetError, Forbidden, Unauthorized
from ..rollout import Gates, RolloutSpec, ShadowGate
from ..rollout.status import wave_waits
from ..service import FleetService
from .context import Fleet, RolloutId

__all__ = ["COOKIE", "router"]

COOKIE = "edgefleet_token"


def console_caller(store: TokenStore, request: Request) -> Caller | None:
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


def render_index(service: FleetService, request: Request, operate: bool, message: str | None = None) -> str:
    """The overview with one page of devices, filtered and paged in the database (?group=&state=&q=&offset=)."""
    filters = {k: _str_param(request, k) for k in ("group", "state", "q")}
    offset = _int_param(request, "offset")
    fleet = service.devices.device_counts()
    page, matching = service.devices.find_devices(console.PAGE_SIZE, offset, filters["group"] or None,
                                          filters["state"] or None, filters["q"] or None,
                                          total=None if any(filters.values()) else fleet.devices)
    # the console renders JSON: the records as the API's models dump them (a rollout's fields left out stay out)
    rollouts = [r.model_dump(exclude_unset=True) for r in service.rollouts.list_rollouts(20, summary=True)]
    models = [m.model_dump(mode="json") for m in service.models.list_models()]
    return console.render([d.model_dump(mode="json") for d in page], models, rollouts, operate, message,
                          fleet=fleet.model_dump(include={"devices", "online", "failing"}), matching=matching,
                          filters=filters, offset=offset)


def render_rollout(service: FleetService, rollout_id: int, request: Request, operate: bool,
                   message: str | None = None) -> str:
    """A rollout with its wave counters and one page of its targets (?state=&offset=), never all of them."""
    state, offset = _str_param(request, "state"), _int_param(request, "offset")
    r = service.rollouts.get_rollout(rollout_id, with_targets=False, profiles=False)  # the page does not show them
    page, total = service.rollouts.rollout_targets(rollout_id, console.PAGE_SIZE, offset, state or None)
    devices = {i: d.model_dump(mode="json")
               for i, d in service.devices.devices_by_id([t.device_id for t in page]).items()}
    # each wave over time: grouped in SQL from the rows the ingest summed per wave and time step (fleet.series)
    waves = series.rollout_series(service.sessions, service.driver.drift, rollout_id)
    with service.sessions() as s:  # where each installing wave waits: maintenance windows, the download cap
        now = utcnow()
        waits = {w.index: wave_waits(s, rollout_id, w.index, now) for w in r.waves if w.state == "installing"}
    view = {**r.model_dump(exclude_unset=True), "targets": [t.model_dump() for t in page],  # the console renders JSON
            "targets_total": total}
    return console.rollout_page(view, devices, operate, message, state=state, offset=offset, series=waves,
                                waits=waits)


def _same_origin(service: FleetService, request: Request) -> None:
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


def _console_operator(fleet: Fleet, request: Request) -> Caller:
    _same_origin(fleet.service, request)
    c = console_caller(fleet.store, request)
    if c is None:
        raise Unauthorized("sign in to the console first")
    c.require("operator", "this change")
    return c


def _split(f: dict[str, str], key: str) -> list[str]:
    return [x.strip() for x in f.get(key, "").split(",") if x.strip()]


def _rollout_form(f: dict[str, str]) -> tuple[str, str, RolloutSpec]:
    """The new-rollout form's model, version and spec (``ValueError``/``OverflowError`` on a bad field)."""

    def num(key: str) -> float | None:
        return float(f[key]) if f.get(key) else None

    name, _, version = f.get("model_version", "").partition(" ")
    gates = Gates(install_success_min=num("install_success_min"), error_rate_max=num("error_rate_max"),
                  p99_ratio_max=num("p99_ratio_max"))
    shadow = ShadowGate(agreement_min=num("shadow_agreement") or 0.99,
                        min_samples=int(num("shadow_samples") or 100)) if f.get("shadow") == "1" else None
    spec = RolloutSpec(waves=tuple(_split(f, "waves") or ["100%"]), shadow=shadow,
                       soak_s=tuple(float(x) for x in _split(f, "soak_s") or ["0"]), gates=gates,
                       on_failure="abort" if f.get("on_failure") == "abort" else "pause",
                       rollback_on_failure=f.get("rollback_on_failure") == "1")
    return name, version, spec


def router(fleet: Fleet) -> APIRouter:
    web = APIRouter()
    service, store = fleet.service, fleet.store

    @web.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request) -> Any:
        c = console_caller(store, request)
        if c is None:
            return HTMLResponse(console.login_page(), status_code=401)
        return render_index(service, request, can_operate(c))

    @web.get("/rollouts/{rollout_id}", response_class=HTMLResponse, include_in_schema=False)
    def console_rollout(rollout_id: RolloutId, request: Request) -> Any:
        c = console_caller(store, request)
        if c is None:
            return HTMLResponse(console.login_page(), status_code=401)
        return render_rollout(service, rollout_id, request, can_operate(c))

    @web.get("/devices/{device_id}", response_class=HTMLResponse, include_in_schema=False)
    def console_device(device_id: str, request: Request) -> Any:
        c = console_caller(store, request)
        if c is None:
            return HTMLResponse(console.login_page(), status_code=401)
        devices = service.devices
        d = devices.get_device(device_id).model_dump(mode="json")
        with service.sessions() as s:  # its maintenance window (its own or its group's) and when it next opens
            dev = s.get(Device, device_id)
            window = windows.effective(s, [dev]).get(device_id) if dev is not None else None
        return console.device_page(d, [t.model_dump(mode="json") for t in devices.device_telemetry(device_id, 200)],
                                   drift.device_drift(service.sessions, service.driver.drift, device_id, 200),
                                   window=window)

    @web.post("/console/rollouts", include_in_schema=False)
    async def console_create_rollout(request: Request) -> Any:
        """The console's new-rollout form: the same checks as POST /api/v1/rollouts, errors shown on the page."""
        c = _console_operator(fleet, request)
        f = await _form(request)
        try:
            name, version, spec = _rollout_form(f)
            r = service.rollouts.create_rollout(name, version, _split(f, "devices") or None, f.get("profile") or None,
                                       f.get("group") or None, _split(f, "tags") or None, spec, c.name)
        except (ValueError, OverflowError, FleetError) as exc:  # a number past its range too (int of 1e400)
            return HTMLResponse(render_index(service, request, True, f"rollout not started: {exc}"),
                                status_code=400)
        return RedirectResponse(f"/rollouts/{r.id}", status_code=303)

    @web.post("/console/rollouts/{rollout_id}/{action}", include_in_schema=False)
    async def console_rollout_action(rollout_id: RolloutId, action: str, request: Request) -> Any:
        c = _console_operator(fleet, request)
        if action not in ("pause", "resume", "abort", "rollback"):
            raise BadRequest(f"unknown action {action!r}", 404)
        try:
            service.rollouts.rollout_action(rollout_id, action, c.name)
        except FleetError as exc:
            return HTMLResponse(render_rollout(service, rollout_id, request, True, str(exc)),
                                status_code=exc.status_code)
        return RedirectResponse(f"/rollouts/{rollout_id}", status_code=303)

    @web.post("/login", include_in_schema=False)
    async def login(request: Request) -> Any:
        from urllib.parse import parse_qs

        _same_origin(service, request)
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

    return web
