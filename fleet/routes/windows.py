"""Maintenance windows (fleet.windows): ``PUT /api/v1/windows/{group|device}/{name}`` sets a group's or a device's
window (protocol.window.MaintenanceWindow: days, start, duration_min, tz), ``DELETE`` removes it (404 when it has
none), ``GET /api/v1/windows`` lists them (``edgefleet windows list|set|delete``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path

from ...protocol.window import MaintenanceWindow
from .. import schemas as out
from .. import windows
from ..auth import Caller
from .context import Fleet

__all__ = ["router"]

Name = Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


def router(fleet: Fleet) -> APIRouter:
    r = APIRouter()
    sessions = fleet.service.sessions
    viewer, operator = fleet.roles.viewer, fleet.roles.operator

    @r.get("/api/v1/windows", response_model=list[out.Window])
    def list_windows(_: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        with sessions() as s:
            return windows.list_windows(s)

    @r.put("/api/v1/windows/{scope}/{name}", response_model=out.Window)
    def set_window(scope: windows.Scope, body: MaintenanceWindow, name: str = Name,
                   c: Caller = Depends(operator)) -> dict[str, Any]:
        with sessions.begin() as s:
            windows.set_window(s, scope, name, body, c.name)
        return {"scope": scope, "name": name, "window": body.model_dump(mode="json")}

    @r.delete("/api/v1/windows/{scope}/{name}", status_code=204)
    def remove_window(scope: windows.Scope, name: str = Name, c: Caller = Depends(operator)) -> None:
        with sessions.begin() as s:
            windows.set_window(s, scope, name, None, c.name)

    return r
