"""Rollouts: their spec in, their state out, the operator's actions, each wave's drift, and the audit trail."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import Field, StringConstraints

from .. import drift, series
from .. import schemas as out
from ..auth import Caller
from ..errors import BadRequest
from ..rollout import MAX_GRACE_S, Gates, RolloutSpec, ShadowGate
from ..rollout.spec import MAX_CONCURRENT_DOWNLOADS
from .context import Body, Fleet, Offset, RolloutId, Tags


class RolloutIn(Body):
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
    download_max_bytes_per_s: int | None = Field(default=None, ge=4096, le=10_000_000_000,
                                                 description="each device's bundle download rate cap, bytes/s")
    max_concurrent_downloads: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT_DOWNLOADS,
                                                 description="devices of a wave sent their update at once")
    urgent: bool = Field(default=False, description="install at once, not waiting for devices' maintenance windows")


def router(fleet: Fleet) -> APIRouter:
    r = APIRouter()
    service = fleet.service
    rollouts = service.rollouts  # this area's service
    viewer, operator = fleet.roles.viewer, fleet.roles.operator

    @r.get("/api/v1/rollouts", response_model=list[out.Rollout], response_model_exclude_unset=True)
    def list_rollouts(limit: int = Query(default=100, ge=1, le=1000),
                      _: Caller = Depends(viewer)) -> list[out.Rollout]:
        """Newest first, at most ``limit`` (up to 1000), without their target lists."""
        return rollouts.list_rollouts(limit)

    @r.post("/api/v1/rollouts", status_code=201, response_model=out.Rollout, response_model_exclude_unset=True)
    def create_rollout(body: RolloutIn, c: Caller = Depends(operator)) -> out.Rollout:
        try:
            spec = RolloutSpec(waves=tuple(body.waves), soak_s=tuple(body.soak_s), gates=body.gates, shadow=body.shadow,
                               on_failure=body.on_failure, rollback_on_failure=body.rollback_on_failure,
                               offline_grace_s=body.offline_grace_s, require_telemetry=body.require_telemetry,
                               download_max_bytes_per_s=body.download_max_bytes_per_s,
                               max_concurrent_downloads=body.max_concurrent_downloads, urgent=body.urgent)
        except ValueError as exc:
            raise BadRequest(f"bad rollout spec: {exc}", 422) from exc
        return rollouts.create_rollout(body.model, body.version, body.devices, body.profile, body.group, body.tags,
                                      spec, c.name)

    @r.get("/api/v1/rollouts/{rollout_id}", response_model=out.Rollout, response_model_exclude_unset=True)
    def get_rollout(rollout_id: RolloutId, targets: bool = True,
                    targets_limit: int | None = Query(default=None, ge=0, le=out.MAX_PAGE),
                    targets_offset: Offset = 0,
                    targets_state: str | None = Query(default=None, max_length=32),
                    _: Caller = Depends(viewer)) -> out.Rollout:
        """With ``targets_limit`` (or ``targets_state``/``targets_offset``): one page of targets and their total."""
        paged = targets and (targets_limit is not None or targets_state or targets_offset)
        r = rollouts.get_rollout(rollout_id, with_targets=targets and not paged)
        if paged:
            limit = out.MAX_PAGE if targets_limit is None else targets_limit
            page, total = rollouts.rollout_targets(rollout_id, limit, targets_offset, targets_state)
            r = r.model_copy(update={"targets": page, "targets_total": total})  # both set: the API shows them
        return r

    @r.post("/api/v1/rollouts/{rollout_id}/{action}", response_model=out.Rollout,
            response_model_exclude_unset=True)
    def rollout_action(rollout_id: RolloutId, action: str, c: Caller = Depends(operator)) -> out.Rollout:
        """``action``: pause, resume, abort or rollback."""
        if action not in ("pause", "resume", "abort", "rollback"):
            raise BadRequest(f"unknown action {action!r}: pause, resume, abort or rollback", 404)
        return rollouts.rollout_action(rollout_id, action, c.name)

    @r.get("/api/v1/rollouts/{rollout_id}/drift", response_model=drift.RolloutDrift)
    def get_rollout_drift(rollout_id: RolloutId, _: Caller = Depends(viewer)) -> dict[str, Any]:
        """Each wave's new version against its compile-time reference and against the version its devices ran before
        (what the max_drift_psi gate judges)."""
        return drift.rollout_drift(service.sessions, service.driver.drift, rollout_id)

    @r.get("/api/v1/rollouts/{rollout_id}/series", response_model=series.RolloutSeries)
    def get_rollout_series(rollout_id: RolloutId, _: Caller = Depends(viewer)) -> dict[str, Any]:
        """Each wave's latency p99, throughput, error rate and drift (PSI against the compile-time reference) over
        the rollout's life, in at most 60 buckets, per model version its devices ran (fleet.series: summed by the
        ingest per wave and minute, ten minutes and hour, never read from the devices' records)."""
        return series.rollout_series(service.sessions, service.driver.drift, rollout_id)

    @r.get("/api/v1/rollouts/{rollout_id}/audit", response_model=list[out.AuditEntry])
    def rollout_audit(rollout_id: RolloutId, _: Caller = Depends(viewer)) -> list[out.AuditEntry]:
        rollouts.get_rollout(rollout_id, with_targets=False)
        return rollouts.audit_log(rollout_id)

    @r.get("/api/v1/audit", response_model=list[out.AuditEntry])
    def audit_log(limit: int = Query(default=200, ge=1, le=5000),
                  _: Caller = Depends(viewer)) -> list[out.AuditEntry]:
        return rollouts.audit_log(None, limit)

    return r
