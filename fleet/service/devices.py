"""The registry of devices: registration (one or a batch), selectors, decommission and enrollment, listings
and counts, answered as the API's schema models (fleet.schemas); their SQL is fleet.queries.devices."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker

from ...protocol import mqtt as proto
from .. import schemas as out
from ..audit import audit
from ..db import Device, Model
from ..errors import BadRequest, NotFound
from ..queries import devices as queries
from .common import check_labels, iso


class DeviceService:
    def __init__(self, sessions: sessionmaker, known: set[str]):
        self.sessions = sessions
        self._known = known  # device ids this replica knows are in the database (shared with the ingest)

    def register_device(self, device_id: str, labels: dict[str, str] | None = None, group: str | None = None,
                        tags: list[str] | None = None, profile: str | None = None,
                        actor: str = "api") -> out.Device:
        problem = proto.device_id_problem(device_id)
        if problem is not None:
            raise BadRequest(problem)
        check_labels(labels, tags)
        with self.sessions.begin() as s:
            dev = queries.register(s, device_id, labels)
            queries.set_selectors(dev, group, tags, profile)
            audit(s, actor, "device_registered", device_id=device_id, group=group, tags=tags, profile=profile)
            s.flush()
            self._known.add(device_id)
            return self._device(s, dev)

    def register_devices(self, items: list[dict[str, Any]], actor: str = "api") -> out.DeviceBatchResult:
        """Register many devices in one transaction (``items``: device_id, and optionally labels, group, tags,
        profile, as ``register_device`` takes them): every item is checked first, and one bad item refuses the
        whole batch (400/422 naming it); a device named twice is refused too. Costs a few statements whatever the
        batch's size, and one audit row naming at most ``AUDIT_IDS`` of the devices."""
        seen: set[str] = set()
        for i, it in enumerate(items):
            device_id = it["device_id"]
            problem = proto.device_id_problem(device_id)
            if problem is not None:
                raise BadRequest(f"device {i}: {problem}")
            if device_id in seen:
                raise BadRequest(f"device {i}: {device_id!r} is named twice in the batch")
            seen.add(device_id)
            try:
                check_labels(it.get("labels"), it.get("tags"))
            except BadRequest as exc:
                raise BadRequest(f"device {i} ({device_id}): {exc}", 422) from exc
        with self.sessions.begin() as s:
            new = queries.insert_new(s, items)
            ids = [it["device_id"] for it in items]
            audit(s, actor, "devices_registered", count=len(ids), new=new, devices=ids[:self.AUDIT_IDS])
        self._known.update(seen)
        return out.DeviceBatchResult(registered=new, updated=len(items) - new)

    AUDIT_IDS = 1000  # device ids named in a bulk registration's audit row

    def device_audit(self, device_id: str, actor: str, action: str, **detail: Any) -> None:
        """An audit row for a device event that happens outside this service (enrollment)."""
        with self.sessions.begin() as s:
            audit(s, actor, action, device_id=device_id, **detail)

    def decommission_device(self, device_id: str, actor: str) -> out.Device:
        """The device is kept (its history stays readable) but marked decommissioned and offline; its
        broker credentials are revoked by the caller (fleet.enroll)."""
        with self.sessions.begin() as s:
            dev = queries.decommission(s, device_id)
            if dev is None:
                raise NotFound(f"no device {device_id!r}")
            audit(s, actor, "device_decommissioned", device_id=device_id)
            s.flush()
            return self._device(s, dev)

    def device_enrolled(self, device_id: str) -> None:
        """A device traded an enrollment token for credentials: if it was decommissioned, it is back."""
        with self.sessions.begin() as s:
            queries.enrolled(s, device_id)

    def update_device(self, device_id: str, group: str | None = None, tags: list[str] | None = None,
                      profile: str | None = None, actor: str = "api") -> out.Device:
        check_labels(None, tags)
        with self.sessions.begin() as s:
            dev = queries.device(s, device_id)
            if dev is None:
                raise NotFound(f"no device {device_id!r}; register it with POST /api/v1/devices")
            queries.set_selectors(dev, group, tags, profile)
            audit(s, actor, "device_updated", device_id=device_id, group=group, tags=tags, profile=profile)
            s.flush()
            return self._device(s, dev)

    def list_groups(self) -> list[out.Group]:
        with self.sessions() as s:
            return [out.Group(group=g.name, devices=g.devices, online=g.online) for g in queries.group_rows(s)]

    @staticmethod
    def _device(s: Session, d: Device, models: dict[int, Model] | None = None) -> out.Device:
        """A device as the API shows it; ``models``: the desired models by id, read beforehand for a page of devices
        (``_devices``), so that a page costs one query for them, not one per device. Its newest telemetry, hardware
        and self-test are stored as the device sent them and read here into their schema models."""
        if models is not None:
            desired = models.get(d.desired_model_id) if d.desired_model_id else None
        else:
            desired = s.get(Model, d.desired_model_id) if d.desired_model_id else None
        return out.Device(
            device_id=d.id, labels=d.labels, registered_via=d.registered_via, online=d.online,
            last_seen=iso(d.last_seen), agent_version=d.agent_version, inference_url=d.inference_url,
            running_model=d.running_model, running_version=d.running_version,
            last_state=d.last_state, last_error=d.last_error,
            desired=None if desired is None else out.DesiredModel(model=desired.name, version=desired.version,
                                                                  rollout_id=d.desired_rollout_id),
            telemetry=_parsed(out.TelemetryRecord, d.last_telemetry), hardware=_parsed(out.Hardware, d.hardware),
            selftest=_parsed(out.DeviceSelfTest, d.selftest), group=d.group_name, tags=d.tags or [],
            profile=d.profile)

    def _devices(self, s: Session, devices: list[Device]) -> list[out.Device]:
        """Devices as the API shows them, the models they are sent read in one query."""
        models = queries.desired_models(s, devices)
        return [self._device(s, d, models) for d in devices]

    def list_devices(self) -> list[out.Device]:
        with self.sessions() as s:
            return self._devices(s, queries.in_order(s))

    def find_devices(self, limit: int | None = None, offset: int = 0, group: str | None = None,
                     state: str | None = None, q: str | None = None,
                     total: int | None = None) -> tuple[list[out.Device], int]:
        """One page of devices by id, filtered on the server: ``group`` exactly, ``state`` a last report's
        state or ``online``/``offline`` (the connection), ``q`` a substring of the id. Returns the page and
        how many devices match in all. ``limit`` None: every match (the API's answer when no limit is asked).
        ``total``: how many match, when the caller has just counted them (the console's unfiltered overview)."""
        with self.sessions() as s:
            devices, matching = queries.page(s, queries.filters(group, state, q), limit, offset, total)
            return self._devices(s, devices), matching

    def device_counts(self) -> out.DeviceCounts:
        """The whole fleet's figures for the console's summary, counted in the database."""
        with self.sessions() as s:
            c = queries.counts(s, failing=True)
        return out.DeviceCounts(devices=c.devices, online=c.online, failing=c.failing)

    def devices_by_id(self, device_ids: list[str]) -> dict[str, out.Device]:
        if not device_ids:
            return {}
        with self.sessions() as s:
            return {d.device_id: d for d in self._devices(s, queries.in_order(s, device_ids))}

    def get_device(self, device_id: str) -> out.Device:
        with self.sessions() as s:
            d = queries.device(s, device_id)
            if d is None:
                raise NotFound(f"no device {device_id!r}; register it with POST /api/v1/devices")
            return self._device(s, d)

    def device_telemetry(self, device_id: str, limit: int = 50) -> list[out.TelemetryRecord]:
        """Its newest telemetry records, newest first."""
        with self.sessions() as s:
            if queries.device(s, device_id) is None:
                raise NotFound(f"no device {device_id!r}")
            return [out.TelemetryRecord.model_validate(r) for r in queries.telemetry(s, device_id, limit)]

    def counts(self) -> out.DeviceCounts:
        """Devices, those online and the telemetry records stored (/api/v1/stats)."""
        with self.sessions() as s:
            c = queries.counts(s, telemetry_rows=True)
        return out.DeviceCounts(devices=c.devices, online=c.online, telemetry_rows=c.telemetry_rows)

    def telemetry_count(self, device_id: str | None = None) -> int:
        with self.sessions() as s:
            return queries.telemetry_count(s, device_id)


M = TypeVar("M", bound=BaseModel)


def _parsed(model: type[M], stored: dict[str, Any] | None) -> M | None:
    return None if stored is None else model.model_validate(stored)
