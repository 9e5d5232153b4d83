"""The registry of devices: registration (one or a batch), selectors, decommission and enrollment, listings
and counts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, case, func, select
from sqlalchemy.orm import Session, sessionmaker

from ...protocol import mqtt as proto
from .. import schemas as out
from ..audit import audit
from ..db import Device, Model, TelemetryRow
from ..errors import BadRequest, NotFound
from .common import DECOMMISSIONED, check_labels, iso


class DeviceService:
    def __init__(self, sessions: sessionmaker, known: set[str]):
        self.sessions = sessions
        self._known = known  # device ids this replica knows are in the database (shared with the ingest)

    def register_device(self, device_id: str, labels: dict[str, str] | None = None, group: str | None = None,
                        tags: list[str] | None = None, profile: str | None = None,
                        actor: str = "api") -> dict[str, Any]:
        problem = proto.device_id_problem(device_id)
        if problem is not None:
            raise BadRequest(problem)
        check_labels(labels, tags)
        with self.sessions.begin() as s:
            dev = s.get(Device, device_id)
            if dev is None:
                dev = Device(id=device_id, labels=labels or {}, registered_via="api")
                s.add(dev)
            else:
                dev.registered_via = "api"
                if labels is not None:
                    dev.labels = labels
            self._set_selectors(dev, group, tags, profile)
            audit(s, actor, "device_registered", device_id=device_id, group=group, tags=tags, profile=profile)
            s.flush()
            self._known.add(device_id)
            return self._device_json(s, dev)

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
        dev: Table = Device.__table__  # type: ignore[assignment]
        with self.sessions.begin() as s:
            existing = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(seen)))} if seen else {}
            new = []
            for it in items:
                d = existing.get(it["device_id"])
                if d is None:
                    new.append({"id": it["device_id"], "labels": it.get("labels") or {}, "registered_via": "api",
                                "group_name": it.get("group") or None, "tags": sorted(set(it.get("tags") or ())),
                                "profile": it.get("profile") or None})
                    continue
                d.registered_via = "api"
                if it.get("labels") is not None:
                    d.labels = it["labels"]
                self._set_selectors(d, it.get("group"), it.get("tags"), it.get("profile"))
            if new:
                s.execute(dev.insert(), new)
            ids = [it["device_id"] for it in items]
            audit(s, actor, "devices_registered", count=len(ids), new=len(new), devices=ids[:self.AUDIT_IDS])
        self._known.update(seen)
        return out.DeviceBatchResult(registered=len(new), updated=len(items) - len(new))

    AUDIT_IDS = 1000  # device ids named in a bulk registration's audit row

    def device_audit(self, device_id: str, actor: str, action: str, **detail: Any) -> None:
        """An audit row for a device event that happens outside this service (enrollment)."""
        with self.sessions.begin() as s:
            audit(s, actor, action, device_id=device_id, **detail)

    def decommission_device(self, device_id: str, actor: str) -> dict[str, Any]:
        """The device is kept (its history stays readable) but marked decommissioned and offline; its
        broker credentials are revoked by the caller (fleet.enroll)."""
        with self.sessions.begin() as s:
            dev = s.get(Device, device_id)
            if dev is None:
                raise NotFound(f"no device {device_id!r}")
            dev.online = False
            dev.last_state = DECOMMISSIONED  # sticky: its messages are dropped until it enrolls again
            audit(s, actor, "device_decommissioned", device_id=device_id)
            s.flush()
            return self._device_json(s, dev)

    def device_enrolled(self, device_id: str) -> None:
        """A device traded an enrollment token for credentials: if it was decommissioned, it is back."""
        with self.sessions.begin() as s:
            dev = s.get(Device, device_id)
            if dev is not None and dev.last_state == DECOMMISSIONED:
                dev.last_state = None

    @staticmethod
    def _set_selectors(dev: Device, group: str | None, tags: list[str] | None, profile: str | None) -> None:
        if group is not None:
            dev.group_name = group or None
        if tags is not None:
            dev.tags = sorted(set(tags))
        if profile is not None:
            dev.profile = profile or None

    def update_device(self, device_id: str, group: str | None = None, tags: list[str] | None = None,
                      profile: str | None = None, actor: str = "api") -> dict[str, Any]:
        check_labels(None, tags)
        with self.sessions.begin() as s:
            dev = s.get(Device, device_id)
            if dev is None:
                raise NotFound(f"no device {device_id!r}; register it with POST /api/v1/devices")
            self._set_selectors(dev, group, tags, profile)
            audit(s, actor, "device_updated", device_id=device_id, group=group, tags=tags, profile=profile)
            s.flush()
            return self._device_json(s, dev)

    def list_groups(self) -> list[out.Group]:
        with self.sessions() as s:
            rows = s.execute(select(Device.group_name, func.count(), func.sum(case((Device.online.is_(True), 1),
                                                                                 else_=0)))
                             .where(Device.group_name.is_not(None)).group_by(Device.group_name)
                             .order_by(Device.group_name))
            return [out.Group(group=g, devices=int(n), online=int(o or 0)) for g, n, o in rows]

    def _device_json(self, s: Session, d: Device, models: dict[int, Model] | None = None) -> dict[str, Any]:
        """A device as the API shows it; ``models``: the desired models by id, read beforehand for a page of devices
        (``_devices_json``), so that a page costs one query for them, not one per device."""
        if models is not None:
            desired = models.get(d.desired_model_id) if d.desired_model_id else None
        else:
            desired = s.get(Model, d.desired_model_id) if d.desired_model_id else None
        return {
            "device_id": d.id, "labels": d.labels, "registered_via": d.registered_via, "online": d.online,
            "last_seen": iso(d.last_seen), "agent_version": d.agent_version, "inference_url": d.inference_url,
            "running_model": d.running_model, "running_version": d.running_version,
            "last_state": d.last_state, "last_error": d.last_error,
            "desired": None if desired is None else {"model": desired.name, "version": desired.version,
                                                     "rollout_id": d.desired_rollout_id},
            "telemetry": d.last_telemetry, "hardware": d.hardware, "selftest": d.selftest,
            "group": d.group_name, "tags": d.tags or [], "profile": d.profile,
        }

    def _devices_json(self, s: Session, devices: list[Device]) -> list[dict[str, Any]]:
        """Devices as the API shows them, their desired models read in one query (the session's identity map holds
        its objects weakly: ``s.get`` per device went to the database for each of them, 50 queries a console page)."""
        ids = {d.desired_model_id for d in devices if d.desired_model_id}
        models = {m.id: m for m in s.scalars(select(Model).where(Model.id.in_(ids)))} if ids else {}
        return [self._device_json(s, d, models) for d in devices]

    def list_devices(self) -> list[dict[str, Any]]:
        with self.sessions() as s:
            return self._devices_json(s, list(s.scalars(select(Device).order_by(Device.id))))

    def find_devices(self, limit: int | None = None, offset: int = 0, group: str | None = None,
                     state: str | None = None, q: str | None = None,
                     total: int | None = None) -> tuple[list[dict[str, Any]], int]:
        """One page of devices by id, filtered on the server: ``group`` exactly, ``state`` a last report's
        state or ``online``/``offline`` (the connection), ``q`` a substring of the id. Returns the page and
        how many devices match in all. ``limit`` None: every match (the API's answer when no limit is asked).
        ``total``: how many match, when the caller has just counted them (the console's unfiltered overview)."""
        where = []
        if group:
            where.append(Device.group_name == group)
        if state in ("online", "offline"):
            where.append(Device.online.is_(state == "online"))
        elif state:
            where.append(Device.last_state == state)
        if q:
            pattern = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append(Device.id.like(f"%{pattern}%", escape="\\"))
        with self.sessions() as s:
            if total is None and where and limit is not None:
                # a filtered page: its ids and how many match from one pass over the matching devices (a count and
                # then the page scanned them twice, and the page's walk by id could read most of the table to find
                # a rare match); the page's rows are then read by id
                # (OFFSET 0 keeps the matching ids a subquery of their own: unfenced, PostgreSQL walked the whole
                # primary key in id order to filter it, several times slower than the group index and a sort)
                matching = select(Device.id).where(*where).offset(0).subquery()
                rows = s.execute(select(matching.c.id, func.count().over()).order_by(matching.c.id)
                                 .offset(max(0, offset)).limit(max(0, limit))).all()
                if rows:
                    found = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_([r[0] for r in rows])))}
                    return self._devices_json(s, [found[r[0]] for r in rows if r[0] in found]), int(rows[0][1])
            if total is None:
                total = int(s.scalar(select(func.count()).select_from(Device).where(*where)) or 0)
            query = select(Device).where(*where).order_by(Device.id).offset(max(0, offset))
            if limit is not None:
                query = query.limit(max(0, limit))
            return self._devices_json(s, list(s.scalars(query))), total

    def device_counts(self) -> dict[str, int]:
        """The whole fleet's figures for the console's summary, counted in the database."""
        with self.sessions() as s:
            total, online, failing = s.execute(select(
                func.count(), func.sum(case((Device.online.is_(True), 1), else_=0)),
                func.sum(case((Device.last_state.in_(("failed", "rolled_back")), 1), else_=0)))).one()
            return {"devices": int(total or 0), "online": int(online or 0), "failing": int(failing or 0)}

    def devices_by_id(self, device_ids: list[str]) -> dict[str, dict[str, Any]]:
        with self.sessions() as s:
            if not device_ids:
                return {}
            return {d["device_id"]: d for d in self._devices_json(
                s, list(s.scalars(select(Device).where(Device.id.in_(device_ids)))))}

    def get_device(self, device_id: str) -> dict[str, Any]:
        with self.sessions() as s:
            d = s.get(Device, device_id)
            if d is None:
                raise NotFound(f"no device {device_id!r}; register it with POST /api/v1/devices")
            return self._device_json(s, d)

    def device_telemetry(self, device_id: str, limit: int = 50) -> list[dict[str, Any]]:
        with self.sessions() as s:
            if s.get(Device, device_id) is None:
                raise NotFound(f"no device {device_id!r}")
            rows = s.scalars(select(TelemetryRow).where(TelemetryRow.device_id == device_id)
                             .order_by(TelemetryRow.id.desc()).limit(max(1, min(limit, 1000))))
            return [r.payload for r in rows]

    def counts(self) -> dict[str, int]:
        with self.sessions() as s:
            devices, online = s.execute(select(func.count(), func.sum(case((Device.online.is_(True), 1), else_=0)))
                                        .select_from(Device)).one()
            return {"devices": int(devices or 0), "online": int(online or 0),
                    "telemetry_rows": int(s.scalar(select(func.count()).select_from(TelemetryRow)) or 0)}

    def telemetry_count(self, device_id: str | None = None) -> int:
        with self.sessions() as s:
            q = select(func.count(TelemetryRow.id))
            if device_id:
                q = q.where(TelemetryRow.device_id == device_id)
            return int(s.scalar(q) or 0)
