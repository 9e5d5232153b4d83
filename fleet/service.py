"""The fleet's operations, independent of HTTP and MQTT: registry, uploads, rollouts, ingest."""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from fleet.db import Device, Model, Rollout, RolloutTarget, TelemetryRow, utcnow
from fleet.errors import BadRequest, Conflict, NotFound, RepositoryError
from fleet.tuf_repo import Repository
from protocol import mqtt as proto
from protocol.bundle import BundleError, read_manifest
from protocol.errors import ContractError
from protocol.manifest import version_key

__all__ = ["FleetService", "Publisher", "rollout_status"]

log = logging.getLogger("edgefleet.fleet")
TERMINAL = {"installed", "failed"}


class Publisher(Protocol):
    def publish(self, topic: str, payload: bytes, retain: bool) -> None: ...


def rollout_status(states: list[str]) -> str:
    """in_progress until every target is installed or failed; then succeeded only if all installed."""
    if not states or any(s not in TERMINAL for s in states):
        return "in_progress"
    return "succeeded" if all(s == "installed" for s in states) else "failed"


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=dt.UTC).isoformat()


class FleetService:
    def __init__(self, sessions: sessionmaker, repo: Repository, publisher: Publisher):
        self.sessions = sessions
        self.repo = repo
        self.publisher = publisher

    # -- devices ------------------------------------------------------------------------------
    def register_device(self, device_id: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        if not proto.device_id_ok(device_id):
            raise BadRequest(f"device id {device_id!r} must be 1-64 of [A-Za-z0-9_.-], starting with a letter or digit")
        with self.sessions.begin() as s:
            dev = s.get(Device, device_id)
            if dev is None:
                dev = Device(id=device_id, labels=labels or {}, registered_via="api")
                s.add(dev)
            else:
                dev.registered_via = "api"
                if labels is not None:
                    dev.labels = labels
            s.flush()
            return self._device_json(s, dev)

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
        }

    def list_devices(self) -> list[dict[str, Any]]:
        with self.sessions() as s:
            return [self._device_json(s, d) for d in s.scalars(select(Device).order_by(Device.id))]

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
        try:
            manifest = read_manifest(path)
        except (BundleError, ContractError) as exc:
            raise BadRequest(f"not a valid bundle: {exc}", 422) from exc
        if not manifest.accuracy.passed:
            raise BadRequest(f"{manifest.name} {manifest.version} failed its accuracy gate at compile time "
                             f"(drop {manifest.accuracy.drop:.4f} > {manifest.accuracy.max_drop:.4f}); "
                             "the fleet does not publish it", 422)
        target_path = f"{manifest.name}/{manifest.version}/{manifest.profile}.tar"
        with self.sessions() as s:
            existing = s.scalars(select(Model).where(Model.name == manifest.name, Model.version == manifest.version,
                                                     Model.profile == manifest.profile)).first()
            if existing is not None:
                raise Conflict(f"{manifest.name} {manifest.version} for {manifest.profile} is already uploaded; "
                               "bump the version to publish a new build")
        # signed with the target: agents refuse a bundle their CPU cannot run before downloading it
        custom = {"name": manifest.name, "version": manifest.version, "profile": manifest.profile,
                  "backend": manifest.backend, "precision": manifest.precision,
                  "cpu_features": list(manifest.cpu_features)}
        try:
            info = self.repo.add_target(target_path, path, custom)
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

    # -- rollouts -----------------------------------------------------------------------------
    def create_rollout(self, name: str, version: str, devices: list[str], profile: str | None = None) -> dict[str, Any]:
        if not devices:
            raise BadRequest("a rollout needs at least one device")
        if len(set(devices)) != len(devices):
            raise BadRequest("the device list names a device twice")
        msgs = []
        with self.sessions.begin() as s:
            model = self._find_model(s, name, version, profile)
            missing = [d for d in devices if s.get(Device, d) is None]
            if missing:
                raise NotFound(f"unknown devices: {', '.join(missing)}; register them first")
            r = Rollout(model_id=model.id)
            s.add(r)
            s.flush()
            self._supersede(s, devices, r.id)
            now = time.time()
            for dev_id in devices:
                s.add(RolloutTarget(rollout_id=r.id, device_id=dev_id))
                dev = s.get(Device, dev_id)
                assert dev is not None
                dev.desired_model_id = model.id
                dev.desired_rollout_id = r.id
                msgs.append(self._desired_message(dev_id, model, r.id, now))
            rollout_id = r.id
        for t, payload in msgs:  # after commit: a device that answers at once finds its target row
            self.publisher.publish(t, payload, retain=True)
        return self.get_rollout(rollout_id)

    def _supersede(self, s: Session, devices: list[str], new_rollout: int) -> None:
        """A device gets one desired state: its unfinished targets in older rollouts fail as superseded."""
        stale = list(s.scalars(select(RolloutTarget).where(
            RolloutTarget.device_id.in_(devices), RolloutTarget.rollout_id != new_rollout,
            RolloutTarget.state.not_in(TERMINAL))))
        for t in stale:
            t.state = "failed"
            t.error = f"superseded by rollout {new_rollout}"
            t.updated_at = utcnow()
        for rid in {t.rollout_id for t in stale}:
            self._recompute(s, rid)

    @staticmethod
    def _recompute(s: Session, rollout_id: int) -> None:
        r = s.get(Rollout, rollout_id)
        assert r is not None
        s.flush()
        states = list(s.scalars(select(RolloutTarget.state).where(RolloutTarget.rollout_id == rollout_id)))
        new = rollout_status(states)
        if new != r.status:
            r.status = new
            r.finished_at = utcnow() if new != "in_progress" else None

    @staticmethod
    def _desired_message(device_id: str, model: Model, rollout_id: int | None, now: float) -> tuple[str, bytes]:
        msg = proto.DesiredState(device_id=device_id, ts=now, rollout_id=rollout_id, model=model.name,
                                 version=model.version, target=model.target_path, sha256=model.sha256,
                                 size_bytes=model.size_bytes)
        return proto.topic(device_id, "desired"), proto.encode(msg)

    def republish_desired(self) -> int:
        """Publish every device's desired state again (retained), e.g. after a broker restart."""
        with self.sessions() as s:
            rows = [(d.id, s.get(Model, d.desired_model_id), d.desired_rollout_id)
                    for d in s.scalars(select(Device).where(Device.desired_model_id.is_not(None)))]
        now = time.time()
        for dev_id, model, rid in rows:
            if model is not None:
                self.publisher.publish(*self._desired_message(dev_id, model, rid, now), retain=True)
        return len(rows)

    def list_rollouts(self, limit: int = 100) -> list[dict[str, Any]]:
        with self.sessions() as s:
            ids = list(s.scalars(select(Rollout.id).order_by(Rollout.id.desc()).limit(max(1, min(limit, 1000)))))
        return [self.get_rollout(i) for i in ids]

    def get_rollout(self, rollout_id: int) -> dict[str, Any]:
        with self.sessions() as s:
            r = s.get(Rollout, rollout_id)
            if r is None:
                raise NotFound(f"no rollout {rollout_id}")
            m = s.get(Model, r.model_id)
            assert m is not None
            targets = list(s.scalars(select(RolloutTarget).where(RolloutTarget.rollout_id == r.id)
                                     .order_by(RolloutTarget.device_id)))
            counts: dict[str, int] = {}
            for t in targets:
                counts[t.state] = counts.get(t.state, 0) + 1
            return {"id": r.id, "model": m.name, "version": m.version, "profile": m.profile, "status": r.status,
                    "created_at": _iso(r.created_at), "finished_at": _iso(r.finished_at), "counts": counts,
                    "targets": [{"device_id": t.device_id, "state": t.state, "error": t.error,
                                 "updated_at": _iso(t.updated_at)} for t in targets]}

    # -- ingest (called from the MQTT bridge) ---------------------------------------------------
    def _ensure_device(self, device_id: str) -> None:
        """A device seen on MQTT before anyone registered it is kept visible, not lost. Several replicas
        may see its first message at once: the losers of the insert race just use the winner's row."""
        with self.sessions() as s:
            if s.get(Device, device_id) is not None:
                return
        try:
            with self.sessions.begin() as s:
                s.add(Device(id=device_id, labels={}, registered_via="mqtt"))
        except IntegrityError:
            pass

    def _device_for_message(self, s: Session, device_id: str) -> Device:
        dev = s.get(Device, device_id)
        assert dev is not None, "call _ensure_device first"
        return dev

    def handle_status(self, msg: proto.StatusMessage) -> None:
        self._ensure_device(msg.device_id)
        with self.sessions.begin() as s:
            dev = self._device_for_message(s, msg.device_id)
            dev.online = msg.state == "online"
            dev.last_seen = utcnow()
            if msg.agent_version:
                dev.agent_version = msg.agent_version
            if msg.inference_url:
                dev.inference_url = msg.inference_url
            if msg.cpu_features is not None:
                dev.hardware = {"arch": msg.arch, "cpu_features": list(msg.cpu_features)}

    def handle_reported(self, msg: proto.ReportedState) -> None:
        self._ensure_device(msg.device_id)
        with self.sessions.begin() as s:
            dev = self._device_for_message(s, msg.device_id)
            dev.last_seen = utcnow()
            dev.last_state = msg.state
            dev.last_error = msg.error
            dev.running_model = msg.running_model
            dev.running_version = msg.running_version
            if msg.state == "installed" and msg.selftest is not None:
                dev.selftest = self._selftest_json(s, msg)
            if msg.rollout_id is None:
                return
            target = s.get(RolloutTarget, (msg.rollout_id, msg.device_id))
            if target is None:
                log.warning("device %s reported on rollout %s it is not part of", msg.device_id, msg.rollout_id)
                return
            state = "failed" if msg.state == "rolled_back" else msg.state
            if target.state in TERMINAL and state not in TERMINAL:
                return  # a late progress message must not reopen a finished target
            if target.state == "installed" and state != "installed":
                r = s.get(Rollout, msg.rollout_id)
                m = s.get(Model, r.model_id) if r else None
                if m is None or msg.running_version == m.version:
                    return  # still running what was installed: a replayed old failure must not flip it
            target.state = state
            target.error = msg.error
            target.updated_at = utcnow()
            self._recompute(s, msg.rollout_id)

    @staticmethod
    def _selftest_json(s: Session, msg: proto.ReportedState) -> dict[str, Any]:
        """The device's self-test next to what the compiler measured for the same build."""
        out: dict[str, Any] = {"model": msg.running_model, "version": msg.running_version,
                               **(msg.selftest.model_dump(mode="json") if msg.selftest else {})}
        r = s.get(Rollout, msg.rollout_id) if msg.rollout_id is not None else None
        m = s.get(Model, r.model_id) if r is not None else None
        if m is not None and (m.name, m.version) == (msg.running_model, msg.running_version):
            summary = m.manifest.get("selftest_summary") or {}
            out["build"] = {"profile": m.profile, "precision": m.precision, "top1": summary.get("top1"),
                            "accuracy": m.manifest["accuracy"]["candidate"],
                            "metric": m.manifest["accuracy"].get("metric", "top1"),
                            "eval_samples": m.manifest["accuracy"]["eval_samples"]}
        return out

    def handle_telemetry(self, msg: proto.Telemetry) -> bool:
        """Store one telemetry record; False if it was a duplicate (QoS 1 may deliver twice)."""
        self._ensure_device(msg.device_id)
        try:
            with self.sessions.begin() as s:
                dev = self._device_for_message(s, msg.device_id)
                dev.last_seen = utcnow()
                payload = msg.model_dump(mode="json")
                s.add(TelemetryRow(device_id=msg.device_id, stream=msg.stream, seq=msg.seq, ts=msg.ts,
                                   payload=payload))
                last = dev.last_telemetry
                if last is None or last.get("stream") != msg.stream or last.get("seq", -1) < msg.seq:
                    dev.last_telemetry = payload
        except IntegrityError:
            with self.sessions() as s:  # a duplicate (QoS 1 redelivery, or another replica stored it)?
                if s.scalar(select(TelemetryRow.id).where(
                        TelemetryRow.device_id == msg.device_id, TelemetryRow.stream == msg.stream,
                        TelemetryRow.seq == msg.seq)) is not None:
                    return False
            raise
        return True

    def telemetry_count(self, device_id: str | None = None) -> int:
        with self.sessions() as s:
            q = select(func.count(TelemetryRow.id))
            if device_id:
                q = q.where(TelemetryRow.device_id == device_id)
            return int(s.scalar(q) or 0)
