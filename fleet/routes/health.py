"""Liveness, an agent's bootstrap (and the signed time, fleet/routes/clock.py) and the fleet's counters."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from .. import schemas as out
from ..auth import Caller
from . import clock
from .context import Fleet


def router(fleet: Fleet) -> APIRouter:
    r = APIRouter()
    service, health, bootstrap, replica_stats = fleet.service, fleet.health, fleet.bootstrap, fleet.replica_stats
    viewer = fleet.roles.viewer

    @r.get("/api/v1/health", response_model=out.Health)
    def get_health() -> dict[str, Any]:
        """Liveness (always 200 while the server answers) and whether device messages reach the database:
        ``status`` is "ok" only then, "degraded" with ``problems`` otherwise."""
        return health()

    @r.get("/api/v1/bootstrap", response_model=out.Bootstrap)
    def get_bootstrap() -> dict[str, Any]:
        """What an agent needs to find the broker and the TUF repository."""
        return bootstrap

    @r.get("/api/v1/stats", response_model=out.Stats, response_model_exclude_unset=True)
    def stats(_: Caller = Depends(viewer)) -> out.Stats:
        """Device and telemetry counts (the database's), counters of rejected input by kind, and what this
        replica handled from MQTT (with several replicas, each answers for itself)."""
        c = service.devices.counts()
        return out.Stats(rejected=service.rejections.snapshot(), devices=c.devices, online=c.online,
                         telemetry_rows=c.telemetry_rows,
                         **({"replica": replica_stats()} if replica_stats is not None else {}))

    r.include_router(clock.router(fleet))  # the signed time: what an agent needs beside its bootstrap
    return r
