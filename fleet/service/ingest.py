"""What devices send over MQTT, stored in batches: statuses, reports (ordered by their ts) and telemetry."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Float, Table, and_, bindparam, case, or_, select, true, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from ...protocol import mqtt as proto
from .. import series
from ..audit import Rejections
from ..db import Device, Model, RolloutTarget, TelemetryRow, utcnow
from ..ingest import NotStored
from ..presence import bound_s
from ..queries.devices import DECOMMISSIONED
from ..rollout import RolloutDriver
from ..rollout.queries import lock_rows

# reports are ordered by their ``ts`` (the device's clock): one older than the newest stored is dropped. A ts
# further ahead of the fleet's clock than this orders as if it were this far ahead, so a device whose clock ran
# ahead and was set back is heard again after at most this long, not after its clock catches up
REPORT_CLOCK_AHEAD_S = 300.0


class IngestService:
    def __init__(self, sessions: sessionmaker, driver: RolloutDriver, rejections: Rejections, known: set[str],
                 accept_unknown_devices: bool = True):
        self.sessions = sessions
        self.driver = driver
        self.rejections = rejections
        self._known = known  # device ids this replica knows are in the database (shared with the registry)
        # True: a device seen on MQTT before registration is added (registered_via "mqtt"). Enrollment
        # (fleet/enroll.py) turns it off: then only enrolled devices are heard, the rest counted and dropped.
        self.accept_unknown_devices = accept_unknown_devices
        # fleet.presence: a device's staleness bound from its telemetry interval (presence_min_s 0: no bound, the
        # will alone takes a device offline)
        self.presence_min_s = 0.0
        self.presence_intervals = 3.0

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

    # Each handler takes a batch (the MQTT bridge hands over whatever queued up, in arrival order) and
    # costs a fixed number of statements per batch: executemany updates by primary key, no recount.
    def handle_status(self, msg: proto.StatusMessage) -> None:
        self.handle_statuses([msg])

    def handle_statuses(self, msgs: list[proto.StatusMessage], retained: bool = False) -> None:
        """Store a batch of status messages; the newest of a device wins. ``retained``: copies the broker sent because
        the fleet subscribed (fleet.presence): not signs of life. A retained ``online`` counts only while the device's
        presence bound has not passed (or it has none) and extends nothing; ``offline``, live or retained, takes the
        device offline and ends its bound (telemetry from before it revives nothing)."""
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
            by_id = update(dev).where(dev.c.id == bindparam("b_id"))
            ups = [{"b_id": d} for d, m in last.items() if m.state == "online"]
            downs = [{"b_id": d} for d, m in last.items() if m.state != "online"]
            lock_rows(s, devices=list(last))  # one statement per state below: the rows are taken in id order first
            if retained:
                if ups:
                    fresh = or_(dev.c.presence_until.is_(None), dev.c.presence_until >= time.time())
                    s.connection().execute(by_id.where(fresh).values(online=True), ups)
                if downs:
                    s.connection().execute(by_id.values(online=False, presence_until=None), downs)
            else:
                if ups:  # heard from now: online for its bound (none known: until its will)
                    t = time.time()
                    s.connection().execute(by_id.values(online=True, last_seen=now, presence_until=bindparam(
                        "b_t", type_=Float) + dev.c.presence_s), [{**u, "b_t": t} for u in ups])
                if downs:
                    s.connection().execute(by_id.values(online=False, last_seen=now, presence_until=None), downs)
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

    def handle_retained_statuses(self, msgs: list[proto.StatusMessage]) -> None:
        self.handle_statuses(msgs, retained=True)

    def handle_reported(self, msg: proto.ReportedState) -> bool:
        """Store one report; False if it was dropped as older than the one stored."""
        return not isinstance(self.handle_reports([msg]), NotStored)

    def _in_order(self, s: Session, msgs: list[proto.ReportedState]) -> tuple[list[proto.ReportedState],
                                                                          list[proto.ReportedState], dict[str, float]]:
        """(reports to apply, in arrival order; reports older than the newest stored or seen before them; each
        device's new ordering ts). Locks the devices' rows, so replicas order one device's reports alike."""
        dev: Table = Device.__table__  # type: ignore[assignment]
        # the lock order (fleet.rollout.lock_rows): the rollouts reported on (shared: the driver's moves wait), then
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
            rejected = self.driver.on_reports(s, [m for m in msgs if m.rollout_id is not None])
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
            # only the stream and seq of each device's last record (not its whole JSON): is this one newer? And the
            # wave of its target in its desired rollout (fleet.series), from the same read
            last_tel = dev.c.last_telemetry
            tgt: Table = RolloutTarget.__table__  # type: ignore[assignment]
            read = s.execute(select(dev.c.id, last_tel["stream"].as_string(), last_tel["seq"].as_integer(),
                                    dev.c.desired_rollout_id, tgt.c.wave)
                             .select_from(dev.outerjoin(tgt, and_(tgt.c.rollout_id == dev.c.desired_rollout_id,
                                                                  tgt.c.device_id == dev.c.id)))
                             .where(dev.c.id.in_(devices))).all()
            current = {i: ((st, sq), r) for i, st, sq, r, _ in read}
            waves = {i: (r, w) for i, _, _, r, w in read if r is not None and w is not None}
            newest: dict[str, dict[str, Any]] = {}
            for k in fresh:
                p = payloads[k]
                last = (newest[k[0]]["stream"], newest[k[0]]["seq"]) if k[0] in newest \
                    else (current.get(k[0]) or ((None, None), None))[0]
                if last[0] is None or last[0] != p["stream"] or (last[1] if last[1] is not None else -1) < p["seq"]:
                    newest[k[0]] = p
            rows = [{"b_id": d, "last_seen": now, **({"last_telemetry": newest[d]} if d in newest else {})}
                    for d in sorted(devices)]  # by id: the lock order (fleet.rollout.lock_rows)
            by_id = update(dev).where(dev.c.id == bindparam("b_id"))
            if self.presence_min_s > 0:  # fleet.presence: heard from now, for its bound
                intervals = {k[0]: m.interval_s for k, m in fresh.items()}  # the device's newest record in the batch
                t = time.time()
                for r in rows:
                    bound = bound_s(intervals[str(r["b_id"])], self.presence_min_s, self.presence_intervals)
                    r["b_ps"], r["b_pu"] = bound, t + bound
                # a device a status said was offline stays so (its presence ended): a record still queued from before
                # its will revives nothing; one taken offline by its bound is back
                revive = or_(dev.c.online.is_(True), dev.c.presence_until.is_not(None))
                by_id = by_id.values(presence_s=bindparam("b_ps", type_=Float),
                                     presence_until=case((revive, bindparam("b_pu", type_=Float)),
                                                         else_=dev.c.presence_until),
                                     online=case((revive, true()), else_=dev.c.online))
            with_tel = [r for r in rows if "last_telemetry" in r]
            without = [r for r in rows if "last_telemetry" not in r]
            for group in (with_tel, without):
                if group:
                    s.connection().execute(by_id, group)
            self.driver.on_telemetry_batch(s, {d: r for d, (_, r) in current.items()}, list(fresh.values()))
            self.driver.on_shadow_batch(s, list(fresh.values()))
            for device_id, why in self.driver.drift.on_telemetry(s, list(fresh.values())):  # fleet.drift
                self.rejections.add("drift_counts_refused", device_id, why)
            # each rollout wave's rows of the minute (fleet.series): last, its upserts take their rows in key order
            series.on_telemetry(s, waves, list(fresh.values()), self.driver.drift)
            return len(fresh)
