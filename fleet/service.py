"""The fleet's operations, independent of HTTP and MQTT: registry, uploads, rollouts, ingest."""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Table, bindparam, case, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from edgefleet.fleet.audit import Rejections, audit
from edgefleet.fleet.db import AuditRow, Device, Model, Rollout, RolloutTarget, TelemetryRow, utcnow
from edgefleet.fleet.errors import BadRequest, Conflict, NotFound, RepositoryError
from edgefleet.fleet.ingest import NotStored
from edgefleet.fleet.keys import bundle_target
from edgefleet.fleet.rollout import RolloutEngine, RolloutSpec, Selector, desired_message, lock_rows, target_json
from edgefleet.fleet.tuf_repo import Repository
from edgefleet.protocol import mqtt as proto
from edgefleet.protocol.bundle import check_bundle
from edgefleet.protocol.errors import ContractError
from edgefleet.protocol.manifest import version_key
from edgefleet.protocol.profile import list_profiles

__all__ = ["MAX_LABELS", "MAX_LABEL_KEY_CHARS", "MAX_LABEL_VALUE_CHARS", "MAX_TAGS", "MAX_TAG_CHARS",
           "REPORT_CLOCK_AHEAD_S", "FleetService", "Publisher", "check_labels"]

log = logging.getLogger("edgefleet.fleet")
DECOMMISSIONED = "decommissioned"  # a device's last_state once decommissioned, until it enrolls again
# a device's labels and tags are shown in every listing: bounded in number and length
MAX_LABELS = 32
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_TAGS = 32
MAX_TAG_CHARS = 64
# reports are ordered by their ``ts`` (the device's clock): one older than the newest stored is dropped. A ts
# further ahead of the fleet's clock than this orders as if it were this far ahead, so a device whose clock ran
# ahead and was set back is heard again after at most this long, not after its clock catches up
REPORT_CLOCK_AHEAD_S = 300.0


def check_labels(labels: dict[str, str] | None = None, tags: list[str] | None = None) -> None:
    """Labels and tags within their bounds, else BadRequest (422) naming the first that is not."""
    if labels is not None:
        if len(labels) > MAX_LABELS:
            raise BadRequest(f"{len(labels)} labels: a device has at most {MAX_LABELS}", 422)
        for k, v in labels.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise BadRequest("labels map names to strings", 422)
            if not 1 <= len(k) <= MAX_LABEL_KEY_CHARS:
                raise BadRequest(f"label name {k[:40]!r}{'...' if len(k) > 40 else ''} has {len(k)} characters: "
                                 f"1 to {MAX_LABEL_KEY_CHARS}", 422)
            if len(v) > MAX_LABEL_VALUE_CHARS:
                raise BadRequest(f"label {k!r} has a value of {len(v)} characters: at most {MAX_LABEL_VALUE_CHARS}",
                                 422)
    if tags is not None:
        if len(tags) > MAX_TAGS:
            raise BadRequest(f"{len(tags)} tags: at most {MAX_TAGS}", 422)
        for t in tags:
            if not isinstance(t, str) or not 1 <= len(t) <= MAX_TAG_CHARS:
                shown = f"{t[:40]!r}{'...' if len(t) > 40 else ''} has {len(t)} characters" if isinstance(t, str) \
                    else "is not a string"
                raise BadRequest(f"tag {shown}: 1 to {MAX_TAG_CHARS} characters", 422)


class Publisher(Protocol):
    def publish(self, topic: str, payload: bytes, retain: bool) -> None: ...


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=dt.UTC).isoformat()


class FleetService:
    def __init__(self, sessions: sessionmaker, repo: Repository, publisher: Publisher,
                 accept_unknown_devices: bool = True, owner: str | None = None):
        self.sessions = sessions
        self.repo = repo
        self.publisher = publisher
        # True: a device seen on MQTT before registration is added (registered_via "mqtt"). Enrollment
        # (fleet/enroll.py) turns it off: then only enrolled devices are heard, the rest counted and dropped.
        self.accept_unknown_devices = accept_unknown_devices
        self.rejections = Rejections()
        self.rollouts = RolloutEngine(sessions, publisher, owner)
        self._known: set[str] = set()

    # -- devices ------------------------------------------------------------------------------
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

    def register_devices(self, items: list[dict[str, Any]], actor: str = "api") -> dict[str, int]:
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
        return {"registered": len(new), "updated": len(items) - len(new)}

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

    def list_groups(self) -> list[dict[str, Any]]:
        with self.sessions() as s:
            rows = s.execute(select(Device.group_name, func.count(), func.sum(case((Device.online.is_(True), 1),
                                                                                 else_=0)))
                             .where(Device.group_name.is_not(None)).group_by(Device.group_name)
                             .order_by(Device.group_name))
            return [{"group": g, "devices": int(n), "online": int(o or 0)} for g, n, o in rows]

    def _device_json(self, s: Session, d: Device) -> dict[str, Any]:
        desired = s.get(Model, d.desired_model_id) if d.desired_model_id else None
        return {
            "device_id": d.id, "labels": d.labels, "registered_via": d.registered_via, "online": d.online,
            "last_seen": _iso(d.last_seen), "agent_version": d.agent_version, "inference_url": d.inference_url,
            "running_model": d.running_model, "running_version": d.running_version,
            "last_state": d.last_state, "last_error": d.last_error,
            "desired": None if desired is None else {"model": desired.name, "version": desired.version,
                                                     "rollout_id": d.desired_rollout_id},
            "telemetry": d.last_telemetry, "hardware": d.hardware, "selftest": d.selftest,
            "group": d.group_name, "tags": d.tags or [], "profile": d.profile,
        }

    def list_devices(self) -> list[dict[str, Any]]:
        with self.sessions() as s:
            return [self._device_json(s, d) for d in s.scalars(select(Device).order_by(Device.id))]

    def find_devices(self, limit: int | None = None, offset: int = 0, group: str | None = None,
                     state: str | None = None, q: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """One page of devices by id, filtered on the server: ``group`` exactly, ``state`` a last report's
        state or ``online``/``offline`` (the connection), ``q`` a substring of the id. Returns the page and
        how many devices match in all. ``limit`` None: every match (the API's answer when no limit is asked)."""
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
            total = int(s.scalar(select(func.count()).select_from(Device).where(*where)) or 0)
            query = select(Device).where(*where).order_by(Device.id).offset(max(0, offset))
            if limit is not None:
                query = query.limit(max(0, limit))
            return [self._device_json(s, d) for d in s.scalars(query)], total

    def device_counts(self) -> dict[str, int]:
        """The whole fleet's figures for the console's summary, counted in the database."""
        with self.sessions() as s:
            total, online, failing = s.execute(select(
                func.count(), func.sum(case((Device.online.is_(True), 1), else_=0)),
                func.sum(case((Device.last_state.in_(("failed", "rolled_back")), 1), else_=0)))).one()
            return {"devices": int(total or 0), "online": int(online or 0), "failing": int(failing or 0)}

    def devices_by_id(self, device_ids: list[str]) -> dict[str, dict[str, Any]]:
        with self.sessions() as s:
            return {d.id: self._device_json(s, d)
                    for d in s.scalars(select(Device).where(Device.id.in_(device_ids)))} if device_ids else {}

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

    # -- models -------------------------------------------------------------------------------
    def upload_bundle(self, path: Path) -> dict[str, Any]:
        """Check the whole archive with the agent's own reader (protocol.bundle.check_bundle: plain regular
        files only, exactly the ones the manifest lists with their sizes and sha256, a profile this fleet
        knows) before anything is signed or stored; a bad one is a 422 naming the problem (never ``path``,
        the server's temporary file). The delegated layout too: CI's signature says who built it, not that
        the archive is sound."""
        try:
            manifest = check_bundle(path, profiles=list_profiles(), label="upload")
        except ContractError as exc:  # BundleError, SchemaError, UnsupportedVersionError
            raise BadRequest(f"not a valid bundle: {exc}", 422) from exc
        if not manifest.accuracy.passed:
            raise BadRequest(f"{manifest.name} {manifest.version} failed its accuracy gate at compile time "
                             f"(drop {manifest.accuracy.drop:.4f} > {manifest.accuracy.max_drop:.4f}); "
                             "the fleet does not publish it", 422)
        target_path, custom = bundle_target(manifest)
        if self.repo.delegated() and not self.repo.is_signed(target_path):
            raise BadRequest(f"this fleet does not sign bundles (the CI key does): upload with 'edgefleet fleet "
                             f"upload BUNDLE --sign-key ci/bundles.key', which signs {target_path} first", 422)
        with self.sessions() as s:
            existing = s.scalars(select(Model).where(Model.name == manifest.name, Model.version == manifest.version,
                                                     Model.profile == manifest.profile)).first()
            if existing is not None:
                raise Conflict(f"{manifest.name} {manifest.version} for {manifest.profile} is already uploaded; "
                               "bump the version to publish a new build")
        try:
            info = self.repo.add_target(target_path, path, custom.signed_fields())
            with self.sessions.begin() as s:
                m = Model(name=manifest.name, version=manifest.version, profile=manifest.profile,
                          backend=manifest.backend, precision=manifest.precision, target_path=target_path,
                          sha256=info["sha256"], size_bytes=info["length"], accuracy=manifest.accuracy.candidate,
                          manifest=manifest.model_dump(mode="json"))
                s.add(m)
                s.flush()
                return self._model_json(m)
        except (RepositoryError, IntegrityError) as exc:  # a concurrent upload of the same version won
            raise Conflict(f"{manifest.name} {manifest.version} for {manifest.profile} was uploaded concurrently "
                           f"with other content or is already registered: {exc}") from exc

    @staticmethod
    def _model_json(m: Model) -> dict[str, Any]:
        return {"id": m.id, "name": m.name, "version": m.version, "profile": m.profile, "backend": m.backend,
                "precision": m.precision, "target": m.target_path, "sha256": m.sha256, "size_bytes": m.size_bytes,
                "accuracy": m.manifest["accuracy"], "uploaded_at": _iso(m.uploaded_at),
                "cpu_features": m.manifest.get("cpu_features", []), "quantization": m.manifest.get("quantization"),
                "precision_choice": m.manifest.get("precision_choice"),
                "selftest_summary": m.manifest.get("selftest_summary")}

    def list_models(self) -> list[dict[str, Any]]:
        with self.sessions() as s:
            models = list(s.scalars(select(Model)))
        models.sort(key=lambda m: (m.name, version_key(m.version), m.profile))
        return [self._model_json(m) for m in models]

    def _find_model(self, s: Session, name: str, version: str, profile: str | None) -> Model:
        q = select(Model).where(Model.name == name, Model.version == version)
        if profile:
            q = q.where(Model.profile == profile)
        found = list(s.scalars(q))
        if not found:
            raise NotFound(f"no model {name} {version}" + (f" for {profile}" if profile else "") + "; upload it first")
        if len(found) > 1:
            raise BadRequest(f"{name} {version} exists for several profiles "
                             f"({', '.join(m.profile for m in found)}); say which with 'profile'")
        return found[0]

    # -- rollouts (the state machine lives in fleet.rollout) --------------------------------------
    def create_rollout(self, name: str, version: str, devices: list[str] | None = None, profile: str | None = None,
                       group: str | None = None, tags: list[str] | None = None, spec: RolloutSpec | None = None,
                       actor: str = "api") -> dict[str, Any]:
        check_labels(None, tags)
        sel = Selector(devices=tuple(devices or ()), group=group, tags=tuple(tags or ()), profile=profile)
        rid = self.rollouts.create(name, version, sel, spec or RolloutSpec(), actor)
        return self.get_rollout(rid)

    def rollout_action(self, rollout_id: int, action: str, actor: str) -> dict[str, Any]:
        self.rollouts.act(rollout_id, action, actor)
        return self.get_rollout(rollout_id, with_targets=False)

    def republish_desired(self) -> int:
        """Publish every device's desired state again (retained), e.g. after a broker restart."""
        with self.sessions() as s:
            rows = [(d.id, self.rollouts.model(s, d.desired_model_id), d.desired_rollout_id)
                    for d in s.scalars(select(Device).where(Device.desired_model_id.is_not(None)))]
        now = time.time()
        for dev_id, model, rid in rows:
            if model is not None:
                self.publisher.publish(*desired_message(dev_id, model, rid, now), retain=True)
        return len(rows)

    def list_rollouts(self, limit: int = 100) -> list[dict[str, Any]]:
        with self.sessions() as s:
            ids = list(s.scalars(select(Rollout.id).order_by(Rollout.id.desc()).limit(max(1, min(limit, 1000)))))
        return [self.get_rollout(i, with_targets=False) for i in ids]

    def get_rollout(self, rollout_id: int, with_targets: bool = True) -> dict[str, Any]:
        return self.rollouts.status(rollout_id, with_targets)

    def rollout_targets(self, rollout_id: int, limit: int, offset: int = 0,
                        state: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """One page of a rollout's targets by device id (``state`` filters), and how many match in all."""
        where = [RolloutTarget.rollout_id == rollout_id]
        if state:
            where.append(RolloutTarget.state == state)
        with self.sessions() as s:
            total = int(s.scalar(select(func.count()).select_from(RolloutTarget).where(*where)) or 0)
            rows = s.execute(select(RolloutTarget, Model.profile).outerjoin(Model, Model.id == RolloutTarget.model_id)
                             .where(*where).order_by(RolloutTarget.device_id).offset(max(0, offset))
                             .limit(max(0, limit)))
            return [target_json(t, p) for t, p in rows], total

    def audit_log(self, rollout_id: int | None = None, limit: int = 200) -> list[dict[str, Any]]:
        with self.sessions() as s:
            q = select(AuditRow).order_by(AuditRow.id.desc()).limit(max(1, min(limit, 5000)))
            if rollout_id is not None:
                q = q.where(AuditRow.rollout_id == rollout_id)
            return [{"id": a.id, "ts": _iso(a.ts), "actor": a.actor, "action": a.action, "rollout_id": a.rollout_id,
                     "device_id": a.device_id, "detail": a.detail} for a in s.scalars(q)]

    # -- ingest (called from the MQTT bridge) ---------------------------------------------------
    def _ensure_device(self, device_id: str) -> bool:
        """A device seen on MQTT before anyone registered it is kept visible, not lost (unless the fleet
        accepts only known devices: then False, counted and logged once). Several replicas may see its
        first message at once: the losers of the insert race just use the winner's row."""
        if device_id in self._known:
            return True
        with self.sessions() as s:
            if s.get(Device, device_id) is not None:
                self._known.add(device_id)
                return True
        if not self.accept_unknown_devices:
            self.rejections.add("unknown_device", device_id, f"device {device_id} is not registered: its "
                                "messages are dropped until it is")
            return False
        try:
            with self.sessions.begin() as s:
                s.add(Device(id=device_id, labels={}, registered_via="mqtt"))
        except IntegrityError:
            pass
        self._known.add(device_id)
        return True

    def _known_devices(self, msgs: list[Any]) -> list[Any]:
        """``msgs`` of devices the fleet knows, or adds (``_ensure_device`` for a whole batch: one SELECT of the
        ids not yet seen by this replica and one INSERT .. ON CONFLICT DO NOTHING of the new ones, whatever the batch's
        size; a connect burst of 10,000 devices cost two transactions per device before)."""
        unseen = {m.device_id for m in msgs} - self._known
        if unseen:
            dev: Table = Device.__table__  # type: ignore[assignment]
            with self.sessions.begin() as s:
                found = set(s.scalars(select(dev.c.id).where(dev.c.id.in_(unseen))))
                new = sorted(unseen - found)
                if new and self.accept_unknown_devices:
                    ins = sqlite_insert(dev) if s.get_bind().dialect.name == "sqlite" else pg_insert(dev)
                    s.execute(ins.on_conflict_do_nothing(index_elements=["id"]),  # a replica that won the race
                              [{"id": d, "labels": {}, "registered_via": "mqtt"} for d in new])
                    found.update(new)
            self._known.update(found)
            for d in sorted(unseen - found):
                self.rejections.add("unknown_device", d, f"device {d} is not registered: its messages are dropped "
                                    "until it is")
        return [m for m in msgs if m.device_id in self._known]

    def _without_decommissioned(self, s: Session, msgs: list[Any]) -> list[Any]:
        """Drop (count, log once) the messages of decommissioned devices. A broker the fleet does not manage (an
        open lab broker), or a managed one in the moment before it drops the revoked session (Mosquitto does on
        the SIGHUP that reloads its password file), lets such a device go on publishing; nothing it says then
        is stored. One query per batch, against the database, so every replica agrees."""
        ids = {m.device_id for m in msgs}
        gone = set(s.scalars(select(Device.id).where(Device.id.in_(ids), Device.last_state == DECOMMISSIONED)))
        if not gone:
            return msgs
        for m in msgs:
            if m.device_id in gone:
                self.rejections.add("decommissioned_device", m.device_id, f"device {m.device_id} is decommissioned: "
                                    "its messages are dropped (enroll it again to take it back)")
        return [m for m in msgs if m.device_id not in gone]

    def _device_for_message(self, s: Session, device_id: str) -> Device:
        dev = s.get(Device, device_id)
        assert dev is not None, "call _ensure_device first"
        return dev

    # Each handler takes a batch (the MQTT bridge hands over whatever queued up, in arrival order) and
    # costs a fixed number of statements per batch: executemany updates by primary key, no recount.
    def handle_status(self, msg: proto.StatusMessage) -> None:
        self.handle_statuses([msg])

    def handle_statuses(self, msgs: list[proto.StatusMessage]) -> None:
        last: dict[str, proto.StatusMessage] = {}
        for m in self._known_devices(msgs):
            last[m.device_id] = m  # the newest status of a device wins
        if not last:
            return
        now = utcnow()
        dev: Table = Device.__table__  # type: ignore[assignment]
        with self.sessions.begin() as s:
            last = {m.device_id: m for m in self._without_decommissioned(s, list(last.values()))}
            if not last:
                return
            last = dict(sorted(last.items()))  # devices by id: the lock order (fleet.rollout.lock_rows)
            rows = [{"b_id": m.device_id, "online": m.state == "online", "last_seen": now} for m in last.values()]
            s.connection().execute(update(dev).where(dev.c.id == bindparam("b_id")), rows)
            details = [m for m in last.values() if m.agent_version or m.inference_url or m.cpu_features is not None
                       or m.profile is not None]
            by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}  # one executemany per set of columns
            for m in details:
                values: dict[str, Any] = {}
                if m.agent_version:
                    values["agent_version"] = m.agent_version
                if m.inference_url:
                    values["inference_url"] = m.inference_url
                if m.cpu_features is not None:
                    values["hardware"] = {"arch": m.arch, "cpu_features": list(m.cpu_features)}
                if m.profile is not None:
                    values["profile"] = m.profile
                by_columns.setdefault(tuple(sorted(values)), []).append({"b_id": m.device_id, **values})
            for group in by_columns.values():
                s.connection().execute(update(dev).where(dev.c.id == bindparam("b_id")), group)

    def handle_reported(self, msg: proto.ReportedState) -> bool:
        """Store one report; False if it was dropped as older than the one stored."""
        return not isinstance(self.handle_reports([msg]), NotStored)

    def _in_order(self, s: Session, msgs: list[proto.ReportedState]) -> tuple[list[proto.ReportedState],
                                                                          list[proto.ReportedState], dict[str, float]]:
        """(reports to apply, in arrival order; reports older than the newest stored or seen before them; each
        device's new ordering ts). Locks the devices' rows, so replicas order one device's reports alike."""
        dev: Table = Device.__table__  # type: ignore[assignment]
        # the lock order (fleet.rollout.lock_rows): the rollouts reported on (shared: the engine's moves wait), then
        # the devices by id
        lock_rows(s, rollouts=[m.rollout_id for m in msgs if m.rollout_id is not None], rollouts_shared=True)
        newest: dict[str, float | None] = {i: ts for i, ts in s.execute(
            select(dev.c.id, dev.c.last_report_ts).where(dev.c.id.in_({m.device_id for m in msgs}))
            .order_by(dev.c.id).with_for_update())}
        ahead = time.time() + REPORT_CLOCK_AHEAD_S
        kept, stale, order = [], [], {}
        for m in msgs:
            seen = newest.get(m.device_id)
            if seen is not None and m.ts < seen:
                stale.append(m)
                self.rejections.add("stale_report", m.device_id, f"dropped a report of {m.device_id} (state {m.state}, "
                                    f"ts {m.ts:.3f}) older than the one stored (ts {seen:.3f}); not acked")
                continue
            newest[m.device_id] = order[m.device_id] = max(seen or 0.0, min(m.ts, ahead))
            kept.append(m)
        return kept, stale, order

    def handle_reports(self, msgs: list[proto.ReportedState]) -> NotStored | None:
        """Store a batch of reports in arrival order; one older (by ``ts``) than the newest stored for its device is
        dropped and returned as NotStored: not applied (it would roll the device's recorded state back) and not
        acked as stored."""
        msgs = self._known_devices(msgs)
        if not msgs:
            return None
        now = utcnow()
        dev: Table = Device.__table__  # type: ignore[assignment]
        with self.sessions.begin() as s:
            msgs = self._without_decommissioned(s, msgs)
            if not msgs:
                return None
            msgs, stale, order = self._in_order(s, msgs)
            if not msgs:
                return NotStored(tuple(stale))
            rows = {m.device_id: {"b_id": m.device_id, "last_seen": now, "last_state": m.state, "last_error": m.error,
                                  "running_model": m.running_model, "running_version": m.running_version,
                                  "last_report_ts": order[m.device_id]}
                    for m in msgs}  # the newest report of a device wins
            s.connection().execute(update(dev).where(dev.c.id == bindparam("b_id")), [rows[d] for d in sorted(rows)])
            rejected = self.rollouts.on_reports(s, [m for m in msgs if m.rollout_id is not None])
            for m in msgs:
                if m.state == "installed" and m.selftest is not None:
                    s.connection().execute(update(dev).where(dev.c.id == m.device_id).values(
                        selftest=self._selftest_json(s, m)))
        for exc, m in rejected:
            self.rejections.add(exc.kind, m.device_id, str(exc))
        return NotStored(tuple(stale)) if stale else None

    @staticmethod
    def _selftest_json(s: Session, msg: proto.ReportedState) -> dict[str, Any]:
        """The device's self-test next to what the compiler measured for the same build."""
        out: dict[str, Any] = {"model": msg.running_model, "version": msg.running_version,
                               **(msg.selftest.model_dump(mode="json") if msg.selftest else {})}
        if msg.serving is not None:  # the precision, batch sizes and layout it chose on its own CPU
            out["serving"] = msg.serving.model_dump(mode="json")
        t = s.get(RolloutTarget, (msg.rollout_id, msg.device_id)) if msg.rollout_id is not None else None
        m = s.get(Model, t.model_id) if t is not None and t.model_id is not None else None
        if m is not None and (m.name, m.version) == (msg.running_model, msg.running_version):
            summary = m.manifest.get("selftest_summary") or {}
            out["build"] = {"profile": m.profile, "precision": m.precision, "top1": summary.get("top1"),
                            "accuracy": m.manifest["accuracy"]["candidate"],
                            "metric": m.manifest["accuracy"].get("metric", "top1"),
                            "eval_samples": m.manifest["accuracy"]["eval_samples"]}
        return out

    def handle_telemetry(self, msg: proto.Telemetry) -> bool:
        """Store one telemetry record; False if it was a duplicate (QoS 1 may deliver twice)."""
        return self.store_telemetry([msg]) == 1

    def store_telemetry(self, msgs: list[proto.Telemetry]) -> int:
        """Store a batch of records, each (device, stream, seq) once; returns how many were new. A record
        another replica stores at the same moment is skipped by the insert (ON CONFLICT DO NOTHING)."""
        msgs = self._known_devices(msgs)
        if not msgs:
            return 0
        tel: Table = TelemetryRow.__table__  # type: ignore[assignment]
        dev: Table = Device.__table__  # type: ignore[assignment]
        now = utcnow()
        with self.sessions.begin() as s:
            msgs = self._without_decommissioned(s, msgs)
            if not msgs:
                return 0
            batch: dict[tuple[str, str, int], proto.Telemetry] = {}
            for m in msgs:
                batch.setdefault((m.device_id, m.stream, m.seq), m)
            payloads = {k: m.model_dump(mode="json") for k, m in batch.items()}
            ins = sqlite_insert(tel) if s.get_bind().dialect.name == "sqlite" else pg_insert(tel)
            # records stored before (a resend, or another replica's) are skipped by the insert; RETURNING says
            # which rows are new (multi-row INSERTs: one statement per few hundred records)
            stmt = ins.on_conflict_do_nothing(index_elements=["device_id", "stream", "seq"]).returning(
                tel.c.device_id, tel.c.stream, tel.c.seq)
            new = {tuple(r) for r in s.connection().execute(stmt, [
                {"device_id": k[0], "stream": k[1], "seq": k[2], "ts": m.ts, "received_at": now,
                 "payload": payloads[k]} for k, m in batch.items()])}
            fresh = {k: m for k, m in batch.items() if k in new}
            if not fresh:
                return 0
            devices = {k[0] for k in fresh}
            # only the stream and seq of each device's last record (not its whole JSON): is this one newer?
            last_tel = dev.c.last_telemetry
            current = {i: ((st, sq), r) for i, st, sq, r in s.execute(
                select(dev.c.id, last_tel["stream"].as_string(), last_tel["seq"].as_integer(),
                       dev.c.desired_rollout_id).where(dev.c.id.in_(devices)))}
            newest: dict[str, dict[str, Any]] = {}
            for k in fresh:
                p = payloads[k]
                last = (newest[k[0]]["stream"], newest[k[0]]["seq"]) if k[0] in newest \
                    else (current.get(k[0]) or ((None, None), None))[0]
                if last[0] is None or last[0] != p["stream"] or (last[1] if last[1] is not None else -1) < p["seq"]:
                    newest[k[0]] = p
            rows = [{"b_id": d, "last_seen": now, **({"last_telemetry": newest[d]} if d in newest else {})}
                    for d in sorted(devices)]  # by id: the lock order (fleet.rollout.lock_rows)
            with_tel = [r for r in rows if "last_telemetry" in r]
            without = [r for r in rows if "last_telemetry" not in r]
            for group in (with_tel, without):
                if group:
                    s.connection().execute(update(dev).where(dev.c.id == bindparam("b_id")), group)
            self.rollouts.on_telemetry_batch(s, {d: r for d, (_, r) in current.items()}, list(fresh.values()))
            self.rollouts.on_shadow_batch(s, list(fresh.values()))
            for device_id, why in self.rollouts.drift.on_telemetry(s, list(fresh.values())):  # fleet.drift
                self.rejections.add("drift_counts_refused", device_id, why)
            return len(fresh)

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
