"""What devices send over MQTT, stored in batches: statuses, reports (ordered by their ts) and telemetry; the SQL
is fleet.queries.ingest."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ...protocol import mqtt as proto
from .. import series
from ..audit import Rejections
from ..db import utcnow
from ..ingest import NotStored
from ..presence import bound_s
from ..queries import ingest as queries
from ..rollout import RolloutDriver

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
            with self.sessions.begin() as s:
                found = queries.existing(s, unseen)
                new = sorted(unseen - found)
                if new and self.accept_unknown_devices:
                    queries.add_heard(s, new)
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
        gone = queries.decommissioned(s, ids)
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
        with self.sessions.begin() as s:
            last = {m.device_id: m for m in self._without_decommissioned(s, list(last.values()))}
            if not last:
                return
            last = dict(sorted(last.items()))  # devices by id: the lock order (fleet.rollout.lock_rows)
            ups = [{"b_id": d} for d, m in last.items() if m.state == "online"]
            downs = [{"b_id": d} for d, m in last.items() if m.state != "online"]
            queries.set_presence(s, ups, downs, retained, now)
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
            queries.set_details(s, by_columns.values())

    def handle_retained_statuses(self, msgs: list[proto.StatusMessage]) -> None:
        self.handle_statuses(msgs, retained=True)

    def handle_reported(self, msg: proto.ReportedState) -> bool:
        """Store one report; False if it was dropped as older than the one stored."""
        return not isinstance(self.handle_reports([msg]), NotStored)

    def _in_order(self, s: Session, msgs: list[proto.ReportedState]) -> tuple[list[proto.ReportedState],
                                                                          list[proto.ReportedState], dict[str, float]]:
        """(reports to apply, in arrival order; reports older than the newest stored or seen before them; each
        device's new ordering ts). Locks the devices' rows, so replicas order one device's reports alike."""
        newest = queries.lock_report_ts(s, {m.device_id for m in msgs},
                                        [m.rollout_id for m in msgs if m.rollout_id is not None])
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
            queries.set_reports(s, [rows[d] for d in sorted(rows)])
            rejected = self.driver.on_reports(s, [m for m in msgs if m.rollout_id is not None])
            for m in msgs:
                if m.state == "installed" and m.selftest is not None:
                    queries.set_selftest(s, m.device_id, self._selftest_json(s, m))
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
        m = queries.build_sent(s, msg.rollout_id, msg.device_id)
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
        now = utcnow()
        with self.sessions.begin() as s:
            msgs = self._without_decommissioned(s, msgs)
            if not msgs:
                return 0
            batch: dict[tuple[str, str, int], proto.Telemetry] = {}
            for m in msgs:
                batch.setdefault((m.device_id, m.stream, m.seq), m)
            payloads = {k: m.model_dump(mode="json") for k, m in batch.items()}
            new = queries.insert_telemetry(s, [{"device_id": k[0], "stream": k[1], "seq": k[2], "ts": m.ts,
                                                "received_at": now, "payload": payloads[k]} for k, m in batch.items()])
            fresh = {k: m for k, m in batch.items() if k in new}
            if not fresh:
                return 0
            devices = {k[0] for k in fresh}
            # each device's last record: is this one newer? And the wave of its target in its desired rollout
            read = queries.last_records(s, devices)
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
            if self.presence_min_s > 0:  # fleet.presence: heard from now, for its bound
                intervals = {k[0]: m.interval_s for k, m in fresh.items()}  # the device's newest record in the batch
                t = time.time()
                for r in rows:
                    bound = bound_s(intervals[str(r["b_id"])], self.presence_min_s, self.presence_intervals)
                    r["b_ps"], r["b_pu"] = bound, t + bound
            queries.touch(s, rows, presence=self.presence_min_s > 0)
            self.driver.on_telemetry_batch(s, {d: r for d, (_, r) in current.items()}, list(fresh.values()))
            self.driver.on_shadow_batch(s, list(fresh.values()))
            for device_id, why in self.driver.drift.on_telemetry(s, list(fresh.values())):  # fleet.drift
                self.rejections.add("drift_counts_refused", device_id, why)
            # each rollout wave's rows of the minute (fleet.series): last, its upserts take their rows in key order
            series.on_telemetry(s, waves, list(fresh.values()), self.driver.drift)
            return len(fresh)
