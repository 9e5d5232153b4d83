"""Devices: registration (one or a batch), selectors, enrollment and decommission, a device's telemetry and drift,
and the groups."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import Field, StringConstraints

from .. import drift
from .. import schemas as out
from .. import service as svc
from ..auth import Caller
from ..enroll import Enrollment
from ..errors import BadRequest, NotFound
from .context import NAME, Body, Fleet, Offset, Tags

# label keys and values and tags have a length (fleet.service.check_labels says the same for the console and CLI)
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=svc.MAX_LABEL_KEY_CHARS)]
LabelValue = Annotated[str, StringConstraints(max_length=svc.MAX_LABEL_VALUE_CHARS)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=svc.MAX_LABELS)]


class DeviceIn(Body):
    device_id: str = Field(min_length=1, max_length=64)
    labels: Labels | None = None
    group: str | None = Field(default=None, pattern=NAME)
    tags: Tags | None = None
    profile: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")


MAX_BATCH_DEVICES = 5000  # devices per bulk registration (a request body stays well under MAX_BODY_BYTES)


class DeviceBatchIn(Body):
    devices: list[DeviceIn] = Field(min_length=1, max_length=MAX_BATCH_DEVICES)


class DevicePatch(Body):
    group: str | None = Field(default=None, pattern=r"^$|" + NAME)  # "" clears it
    tags: Tags | None = None
    profile: str | None = Field(default=None, pattern=r"^$|^[a-z0-9][a-z0-9._-]{0,63}$")


class EnrollTokenIn(Body):
    ttl_s: float = Field(default=86400.0, gt=0, le=30 * 86400, description="how long the token can be redeemed")


class EnrollIn(Body):
    token: str = Field(min_length=8, max_length=256)


def router(fleet: Fleet) -> APIRouter:
    r = APIRouter()
    service, enrollment, bootstrap = fleet.service, fleet.enrollment, fleet.bootstrap
    devices = service.devices  # this area's service
    caller, viewer, operator = fleet.roles.caller, fleet.roles.viewer, fleet.roles.operator

    @r.get("/api/v1/devices", response_model=list[out.Device])
    def list_devices(response: Response, limit: int | None = Query(default=None, ge=0, le=out.MAX_PAGE),
                     offset: Offset = 0, group: str | None = Query(default=None, max_length=64),
                     state: str | None = Query(default=None, max_length=32),
                     q: str | None = Query(default=None, max_length=64),
                     _: Caller = Depends(viewer)) -> list[out.Device]:
        """Devices by id; ``limit``/``offset`` page them, ``group``/``state``/``q`` filter (fleet.schemas)."""
        page, total = devices.find_devices(limit, offset, group, state, q)
        response.headers["X-Total-Count"] = str(total)
        return page

    @r.post("/api/v1/devices", status_code=201, response_model=out.Device)
    def register_device(body: DeviceIn, c: Caller = Depends(operator)) -> out.Device:
        return devices.register_device(body.device_id, body.labels, body.group, body.tags, body.profile, c.name)

    @r.post("/api/v1/devices/batch", status_code=201, response_model=out.DeviceBatchResult)
    def register_devices(body: DeviceBatchIn, c: Caller = Depends(operator)) -> out.DeviceBatchResult:
        """Register up to MAX_BATCH_DEVICES devices at once (all or none): {"registered": new, "updated": known}."""
        return devices.register_devices([d.model_dump() for d in body.devices], c.name)

    @r.patch("/api/v1/devices/{device_id}", response_model=out.Device)
    def update_device(device_id: str, body: DevicePatch, c: Caller = Depends(operator)) -> out.Device:
        return devices.update_device(device_id, body.group, body.tags, body.profile, c.name)

    @r.get("/api/v1/devices/{device_id}", response_model=out.Device)
    def get_device(device_id: str, _: Caller = Depends(viewer)) -> out.Device:
        return devices.get_device(device_id)

    def _enrollment() -> Enrollment:
        if enrollment is None:
            raise NotFound("this fleet does not enroll devices (no MQTT accounts are managed here)")
        return enrollment

    @r.post("/api/v1/devices/{device_id}/enrollment-token", status_code=201, response_model=out.EnrollmentToken)
    def issue_enrollment_token(device_id: str, body: EnrollTokenIn | None = None,
                               c: Caller = Depends(operator)) -> dict[str, Any]:
        """A one-time token (shown only here; the fleet keeps its hash) that the device trades for its own
        MQTT credentials with POST /api/v1/enroll. Registers the device if it is new."""
        import datetime as dt

        ttl = (body or EnrollTokenIn()).ttl_s
        try:
            doc = devices.get_device(device_id)
        except NotFound:
            devices.register_device(device_id, actor=c.name)
        else:
            if doc.online:  # its new credentials would lock the running agent out: a decommission
                c.require("admin", f"re-enrolling {device_id}, which is online (its agent would be locked out)")
        token = _enrollment().issue_token(device_id, dt.timedelta(seconds=ttl))
        devices.device_audit(device_id, c.name, "enrollment_token_issued", ttl_s=ttl)
        return {"device_id": device_id, "token": token, "expires_in_s": ttl}

    @r.post("/api/v1/enroll", response_model=out.Enrolled)
    def enroll(body: EnrollIn, request: Request) -> dict[str, Any]:
        """For devices: trade a one-time enrollment token (it is the authorization) for this device's MQTT
        username and password, returned once, with what /api/v1/bootstrap says."""
        try:
            creds = _enrollment().redeem(body.token)
        except BadRequest as exc:
            service.rejections.add("enroll_refused", request.client.host if request.client else "?", str(exc))
            raise
        devices.device_enrolled(creds.device_id)
        devices.device_audit(creds.device_id, creds.device_id, "device_enrolled")
        return {"device_id": creds.device_id, "mqtt_username": creds.username, "mqtt_password": creds.password,
                **bootstrap}

    @r.post("/api/v1/devices/{device_id}/decommission", response_model=out.Device)
    def decommission(device_id: str, c: Caller = Depends(caller)) -> out.Device:
        """Revoke the device's MQTT credentials (it can no longer connect) and mark it decommissioned; its
        history stays. Enrolling it again takes a new token. Admin role."""
        c.require("admin", "decommissioning a device")
        doc = devices.decommission_device(device_id, c.name)
        try:
            _enrollment().decommission(device_id)
        except NotFound:
            pass  # never enrolled: nothing to revoke
        return doc

    @r.get("/api/v1/devices/{device_id}/telemetry", response_model=list[out.TelemetryRecord])
    def get_telemetry(device_id: str, limit: int = Query(default=50, ge=1, le=1000),
                      _: Caller = Depends(viewer)) -> list[out.TelemetryRecord]:
        return devices.device_telemetry(device_id, limit)

    @r.get("/api/v1/devices/{device_id}/drift", response_model=list[drift.DriftRecord])
    def get_drift(device_id: str, limit: int = Query(default=200, ge=1, le=drift.MAX_LIST),
                  _: Caller = Depends(viewer)) -> list[dict[str, Any]]:
        """The device's drift score over time, newest first: one per telemetry record with answer counts (fleet.drift:
        PSI against the compile-time reference; 0.1 watch, 0.25 drift; under 200 answers insufficient)."""
        return drift.device_drift(service.sessions, service.driver.drift, device_id, limit)

    @r.get("/api/v1/groups", response_model=list[out.Group])
    def list_groups(_: Caller = Depends(viewer)) -> list[out.Group]:
        return devices.list_groups()

    return r
