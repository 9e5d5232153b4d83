"""Rollouts as a persisted state machine: targets, waves, soak times and health gates.

A rollout sends one model version to the devices a selector picks (a device list, a group, tags, a
hardware profile); each device gets the bundle built for its own profile. The targets are split into
waves (counts or cumulative percentages, e.g. ``1%,10%,50%,100%``), each with a soak time. A wave
starts by publishing the devices' desired state; it is *installed* when every target reported (or
its device has been offline for ``offline_grace_s``); it then soaks; at the end of the soak the
gates are evaluated against thresholds. A failed gate pauses or fails the rollout and, if asked,
sends the wave's devices back to the model they ran before.

Rollout states and the only transitions allowed (every one through ``transition``, which writes
the audit row in the same transaction)::

    in_progress ──► paused ──► in_progress          (pause / resume, by hand or by a gate)
    in_progress | paused ──► aborted                (abort, by hand)
    in_progress | paused ──► failed                 (a gate failed with on_failure=abort)
    in_progress ──► succeeded                       (the last wave passed its gates)
    any but rolled_back ──► rolled_back             (rollback, by hand; or a gate with rollback)

Wave states: pending → installing → soaking → passed | failed.

Cost per device report is constant: a report updates its target row and adds ±1 to its wave's
counters; nothing is recounted. The engine's tick (``advance``) reads only the wave's counters, and
scans a wave's targets only when its offline grace has run out or when its gates are evaluated.
All state is in the database, so a restarted fleet resumes every rollout where it was.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Float, Table, and_, bindparam, case, func, insert, or_, select, tuple_, update
from sqlalchemy.orm import Session, sessionmaker

from fleet.audit import ENGINE_ACTOR, audit
from fleet.db import Device, Model, Rollout, RolloutShadow, RolloutTarget, RolloutWave, utcnow
from fleet.errors import BadRequest, Conflict, DeviceInputRejected, NotFound
from protocol import mqtt as proto

__all__ = ["TRANSITIONS", "GateResult", "Gates", "RolloutEngine", "RolloutSpec", "WaveFigures", "evaluate_gates",
           "plan_waves"]

log = logging.getLogger("edgefleet.fleet.rollout")

TRANSITIONS: dict[str, frozenset[str]] = {
    "in_progress": frozenset({"paused", "aborted", "failed", "succeeded", "rolled_back"}),
    "paused": frozenset({"in_progress", "aborted", "failed", "rolled_back"}),
    "failed": frozenset({"rolled_back"}),
    "aborted": frozenset({"rolled_back"}),
    "succeeded": frozenset({"rolled_back"}),
    "rolled_back": frozenset(),
}
TARGET_TERMINAL = frozenset({"installed", "failed"})
_WAVE_RE = re.compile(r"^(\d+(?:\.\d+)?)%$|^(\d+)$")


class Publisher(Protocol):
    def publish(self, topic: str, payload: bytes, retain: bool) -> None: ...


# -- the spec an operator gives ------------------------------------------------------------------
class Gates(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    install_success_min: float | None = Field(default=1.0, ge=0.0, le=1.0)  # installed / (installed + failed)
    error_rate_max: float | None = Field(default=None, ge=0.0, le=1.0)  # errors / requests on the new model
    p99_ratio_max: float | None = Field(default=None, gt=0.0)  # p99 new / p99 previous, same devices


class ShadowGate(BaseModel):
    """Run each wave's candidate in shadow first: devices keep serving their model, mirror a sample of live
    requests to the candidate and report agreement; the wave installs only once enough samples agree."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    agreement_min: float = Field(default=0.99, ge=0.0, le=1.0)  # top-1 agreement over the wave's samples
    min_samples: int = Field(default=100, ge=1, le=10_000_000)  # mirrored requests, summed over the wave
    max_abs_error: float | None = Field(default=None, ge=0.0)  # optional: the worst difference allowed


class RolloutSpec(BaseModel):
    """How a rollout proceeds; stored with it. Defaults: one wave, no soak, every install must succeed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    waves: tuple[str, ...] = Field(default=("100%",), min_length=1, max_length=20)  # cumulative: "1%", "10", "100%"
    soak_s: tuple[float, ...] = Field(default=(0.0,), min_length=1, max_length=20)  # per wave; the last repeats
    gates: Gates = Gates()
    shadow: ShadowGate | None = None  # None: no shadow phase
    on_failure: Literal["pause", "abort"] = "abort"
    rollback_on_failure: bool = False
    offline_grace_s: float = Field(default=300.0, ge=0.0)  # then a wave stops waiting for offline devices
    # True: a wave whose telemetry gates have no figures yet keeps soaking until they do
    require_telemetry: bool = False

    @field_validator("waves")
    @classmethod
    def _waves(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for w in v:
            m = _WAVE_RE.match(w.strip())
            if m is None:
                raise ValueError(f"wave {w!r} must be a device count like '5' or a percentage like '10%'")
            if m.group(1) is not None and not 0 < float(m.group(1)) <= 100:
                raise ValueError(f"wave {w!r}: a percentage must be in (0, 100]")
            if m.group(2) is not None and int(m.group(2)) < 1:
                raise ValueError(f"wave {w!r}: a count must be at least 1")
        return tuple(w.strip() for w in v)

    @field_validator("soak_s")
    @classmethod
    def _soak(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 <= s <= 7 * 86400 for s in v):
            raise ValueError("soak times must be between 0 and 604800 s")
        return v

    def soak_for(self, idx: int) -> float:
        return self.soak_s[min(idx, len(self.soak_s) - 1)]


def plan_waves(n: int, waves: tuple[str, ...]) -> list[int]:
    """Sizes of the waves for ``n`` targets. Each entry is a cumulative end (count or percentage,
    rounded up); ends that add nobody are dropped, and the last wave always reaches every target."""
    sizes, done = [], 0
    for w in waves:
        w = w.strip()
        end = math.ceil(n * float(w[:-1]) / 100 - 1e-9) if w.endswith("%") else int(w)
        end = min(max(end, 1), n)
        if end > done:
            sizes.append(end - done)
            done = end
    if done < n:
        sizes.append(n - done)
    return sizes


# -- gates: pure functions of recorded figures ---------------------------------------------------
@dataclass(frozen=True)
class WaveFigures:
    size: int
    installed: int
    failed: int
    requests: int  # on the new model, summed over the wave's devices
    errors: int
    p99_before_ms: float | None  # mean over the devices that have both figures
    p99_after_ms: float | None
    p99_devices: int


@dataclass(frozen=True)
class GateResult:
    name: str
    value: float | None
    threshold: float
    passed: bool
    detail: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShadowWaveFigures:
    devices: int  # devices of the wave that reported shadow figures
    samples: int
    agreement: float | None  # sample-weighted top-1 agreement
    max_abs_error: float | None


def evaluate_shadow(f: ShadowWaveFigures, gate: ShadowGate) -> GateResult | None:
    """None until the wave has mirrored enough requests; then the agreement against the threshold."""
    if f.samples < gate.min_samples:
        return None
    ok = f.agreement is not None and f.agreement >= gate.agreement_min
    detail = (f"{f.samples} live requests mirrored on {f.devices} devices; top-1 agreement with the active model "
              f"{'n/a' if f.agreement is None else f'{f.agreement:.4f}'}")
    if gate.max_abs_error is not None:
        ok = ok and f.max_abs_error is not None and f.max_abs_error <= gate.max_abs_error
        detail += f"; max abs error {f.max_abs_error}"
    return GateResult("shadow_agreement", f.agreement, gate.agreement_min, ok, detail)


def install_gate_lost(f: WaveFigures, gates: Gates) -> bool:
    """True once the failures alone make the install-success threshold unreachable."""
    if gates.install_success_min is None:
        return False
    allowed = math.floor((1.0 - gates.install_success_min) * f.size + 1e-9)
    return f.failed > allowed


def evaluate_gates(f: WaveFigures, gates: Gates) -> list[GateResult]:
    """Each configured gate against its threshold. A telemetry gate without data passes, saying so."""
    out = []
    if gates.install_success_min is not None:
        done = f.installed + f.failed
        ratio = f.installed / done if done else None
        ok = ratio is not None and ratio >= gates.install_success_min and not install_gate_lost(f, gates)
        out.append(GateResult("install_success", ratio, gates.install_success_min, ok,
                              f"{f.installed} of {done} reported installs succeeded ({f.size} in the wave)"))
    if gates.error_rate_max is not None:
        rate = f.errors / f.requests if f.requests else None
        out.append(GateResult("error_rate", rate, gates.error_rate_max, rate is None or rate <= gates.error_rate_max,
                              f"{f.errors} errors in {f.requests} requests on the new model"
                              if f.requests else "no requests on the new model yet: not judged"))
    if gates.p99_ratio_max is not None:
        if f.p99_before_ms and f.p99_after_ms is not None:
            ratio = f.p99_after_ms / f.p99_before_ms
            out.append(GateResult("p99_latency_ratio", ratio, gates.p99_ratio_max, ratio <= gates.p99_ratio_max,
                                  f"p99 {f.p99_after_ms:.2f} ms vs {f.p99_before_ms:.2f} ms on the previous model "
                                  f"(mean over {f.p99_devices} devices)"))
        else:
            out.append(GateResult("p99_latency_ratio", None, gates.p99_ratio_max, True,
                                  "no device has p99 figures on both models yet: not judged"))
    return out


# -- the engine -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    id: int
    name: str
    version: str
    profile: str
    target_path: str
    sha256: str
    size_bytes: int


def desired_message(device_id: str, m: ModelInfo, rollout_id: int | None, now: float,
                    mode: str | None = None) -> tuple[str, bytes]:
    msg = proto.DesiredState(device_id=device_id, ts=now, rollout_id=rollout_id, model=m.name, version=m.version,
                             target=m.target_path, sha256=m.sha256, size_bytes=m.size_bytes,
                             mode=mode)  # type: ignore[arg-type]
    return proto.topic(device_id, "desired"), proto.encode(msg)


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=dt.UTC).isoformat()


@dataclass(frozen=True)
class Selector:
    devices: tuple[str, ...] = ()
    group: str | None = None
    tags: tuple[str, ...] = ()
    profile: str | None = None


class RolloutEngine:
    LEASE_S = 15.0  # a replica that stops renewing loses its rollouts to another after this

    def __init__(self, sessions: sessionmaker, publisher: Publisher, owner: str | None = None):
        self.sessions = sessions
        self.publisher = publisher
        self.owner = owner or f"fleet-{uuid.uuid4().hex[:12]}"
        self._models: dict[int, ModelInfo] = {}
        self._lock = threading.Lock()

    # -- models (immutable rows, cached) ---------------------------------------------------------
    def model(self, s: Session, model_id: int | None) -> ModelInfo | None:
        if model_id is None:
            return None
        m = self._models.get(model_id)
        if m is None:
            row = s.get(Model, model_id)
            if row is None:
                return None
            m = ModelInfo(row.id, row.name, row.version, row.profile, row.target_path, row.sha256, row.size_bytes)
            with self._lock:
                self._models[model_id] = m
        return m

    # -- transitions -----------------------------------------------------------------------------
    @staticmethod
    def transition(s: Session, r: Rollout, new: str, actor: str, reason: str | None = None, **detail: Any) -> None:
        if new not in TRANSITIONS[r.status]:
            raise Conflict(f"rollout {r.id} is {r.status}; it cannot become {new}")
        old = r.status
        r.status = new
        r.reason = reason
        if new in ("succeeded", "failed", "aborted", "rolled_back"):
            r.finished_at = utcnow()
        audit(s, actor, f"rollout_{new}", r.id, from_state=old, reason=reason, **detail)

    # -- create ----------------------------------------------------------------------------------
    def create(self, name: str, version: str, sel: Selector, spec: RolloutSpec, actor: str) -> int:
        if not (sel.devices or sel.group or sel.tags or sel.profile):
            raise BadRequest("a rollout needs devices, a group, tags or a profile to target")
        if len(set(sel.devices)) != len(sel.devices):
            raise BadRequest("the device list names a device twice")
        with self.sessions.begin() as s:
            builds = {m.profile: m for m in s.scalars(select(Model).where(Model.name == name,
                                                                         Model.version == version))}
            if not builds:
                raise NotFound(f"no model {name} {version}" + (f" for {sel.profile}" if sel.profile else "")
                               + "; upload it first")
            if sel.profile and sel.profile not in builds:
                raise BadRequest(f"profile {sel.profile!r} has no bundle of {name} {version} (built for "
                                 f"{', '.join(sorted(builds))})", 422)
            devices = self._select(s, sel)
            chosen: list[tuple[Device, Model]] = []
            no_bundle: dict[str, list[str]] = {}
            unknown_profile: list[str] = []
            for d in devices:
                prof = d.profile or sel.profile or (next(iter(builds)) if len(builds) == 1 else None)
                if prof is None:
                    unknown_profile.append(d.id)
                elif prof not in builds:
                    no_bundle.setdefault(prof, []).append(d.id)
                else:
                    chosen.append((d, builds[prof]))
            if unknown_profile:
                raise BadRequest(f"{name} {version} exists for several profiles ({', '.join(sorted(builds))}) and "
                                 f"these devices have no known hardware profile: {_names(unknown_profile)}; set "
                                 "their profile or say which build with 'profile'", 422)
            if no_bundle:
                raise BadRequest("no bundle of " + f"{name} {version} for " + "; ".join(
                    f"profile {p} (devices {_names(ids)})" for p, ids in sorted(no_bundle.items()))
                    + f"; it is built for {', '.join(sorted(builds))}", 422)
            # online devices first, so an early wave is not spent waiting for boxes that are off
            chosen.sort(key=lambda dm: (not dm[0].online, dm[0].id))
            sizes = plan_waves(len(chosen), spec.waves)
            first = chosen[0][1]
            r = Rollout(model_id=first.id, model_name=name, model_version=version, spec=spec.model_dump(mode="json"),
                        current_wave=0, created_by=actor, status="in_progress")
            s.add(r)
            s.flush()
            rid = r.id
            self._supersede(s, {d.id for d, _ in chosen}, rid, actor)
            rows, i = [], 0
            for w, size in enumerate(sizes):
                s.add(RolloutWave(rollout_id=rid, idx=w, size=size, soak_s=spec.soak_for(w), state="pending"))
                for d, m in chosen[i:i + size]:
                    rows.append({"rollout_id": rid, "device_id": d.id, "state": "pending", "wave": w,
                                 "model_id": m.id, "updated_at": utcnow()})
                i += size
            s.flush()
            s.execute(insert(RolloutTarget), rows)
            audit(s, actor, "rollout_created", rid, model=name, version=version, targets=len(chosen), waves=sizes,
                  selector={k: v for k, v in asdict(sel).items() if v and k != "devices"} or None,
                  devices=len(sel.devices) or None, spec=spec.model_dump(mode="json"))
        self.advance(rid)  # the first wave goes out now, not at the next tick
        return rid

    @staticmethod
    def _select(s: Session, sel: Selector) -> list[Device]:
        if sel.devices:
            found = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(sel.devices)))}
            missing = [d for d in sel.devices if d not in found]
            if missing:
                raise NotFound(f"unknown devices: {', '.join(missing)}; register them first")
            devs = [found[d] for d in sel.devices]
            wrong = [d.id for d in devs if sel.profile and d.profile and d.profile != sel.profile]
            if wrong:
                raise BadRequest(f"devices {_names(wrong)} are not {sel.profile} devices", 422)
        else:
            q = select(Device)
            if sel.group:
                if s.scalar(select(Device.id).where(Device.group_name == sel.group).limit(1)) is None:
                    groups = sorted(g for g in s.scalars(select(Device.group_name).distinct()) if g)
                    raise NotFound(f"unknown group {sel.group!r}: no device is in it (groups: "
                                   f"{', '.join(groups) or 'none yet'})")
                q = q.where(Device.group_name == sel.group)
            if sel.profile:
                q = q.where(Device.profile == sel.profile)
            devs = list(s.scalars(q))
        if sel.tags:
            want = set(sel.tags)
            devs = [d for d in devs if want <= set(d.tags or [])]
        if sel.group and sel.devices:
            devs = [d for d in devs if d.group_name == sel.group]
        if not devs:
            raise BadRequest("the selector picks no device (" + ", ".join(
                f"{k}={v}" for k, v in asdict(sel).items() if v) + ")", 422)
        return devs

    def _supersede(self, s: Session, devices: set[str], new_rollout: int, actor: str) -> None:
        """A device has one desired state: its unfinished targets in older rollouts fail as superseded."""
        stale = [t for t in s.scalars(select(RolloutTarget).where(
            RolloutTarget.rollout_id != new_rollout, RolloutTarget.state.not_in(TARGET_TERMINAL),
            RolloutTarget.state.not_in(("rolled_back", "rollback_failed")))) if t.device_id in devices]
        for t in stale:
            self._set_target(s, t, "failed", f"superseded by rollout {new_rollout}")
        for rid in sorted({t.rollout_id for t in stale}):
            audit(s, actor, "targets_superseded", rid, by_rollout=new_rollout,
                  devices=sum(1 for t in stale if t.rollout_id == rid))
        s.flush()
        for rid in sorted({t.rollout_id for t in stale}):
            self._advance_in(s, rid, [])

    @staticmethod
    def _set_target(s: Session, t: RolloutTarget, new: str, error: str | None) -> None:
        """Move one target and its wave's counters by ±1 (never a recount)."""
        old = t.state
        t.state = new
        t.error = error
        t.updated_at = utcnow()
        d_ok = (new == "installed") - (old == "installed")
        d_bad = (new == "failed") - (old == "failed")
        if d_ok or d_bad:
            s.execute(update(RolloutWave).where(RolloutWave.rollout_id == t.rollout_id, RolloutWave.idx == t.wave)
                      .values(n_installed=RolloutWave.n_installed + d_ok, n_failed=RolloutWave.n_failed + d_bad))

    # -- ingest ----------------------------------------------------------------------------------
    def on_report(self, s: Session, msg: proto.ReportedState) -> None:
        for exc, _ in self.on_reports(s, [msg]):
            raise exc

    def on_reports(self, s: Session, msgs: list[proto.ReportedState]) -> list[tuple[DeviceInputRejected,
                                                                                   proto.ReportedState]]:
        """Reports on rollouts, in arrival order: one SELECT of their targets, one executemany UPDATE, and
        one counter UPDATE per wave touched, whatever the size of the rollout or of the fleet."""
        if not msgs:
            return []
        t: Table = RolloutTarget.__table__  # type: ignore[assignment]
        keys = list({(m.rollout_id, m.device_id) for m in msgs})
        cur = {(r.rollout_id, r.device_id): [r.state, r.error, r.model_id, r.previous_model_id, r.wave]
               for r in s.execute(select(t.c.rollout_id, t.c.device_id, t.c.state, t.c.error, t.c.model_id,
                                         t.c.previous_model_id, t.c.wave)
                                  .where(tuple_(t.c.rollout_id, t.c.device_id).in_(keys))
                                  .with_for_update())}  # replicas that both got a report serialize here
        rejected: list[tuple[DeviceInputRejected, proto.ReportedState]] = []
        changed: dict[tuple[int, str], dict[str, Any]] = {}
        deltas: dict[tuple[int, int], list[int]] = {}
        now = utcnow()
        for m in msgs:
            key = (m.rollout_id or 0, m.device_id)
            row = cur.get(key)
            if row is None:
                rejected.append((DeviceInputRejected("report_not_a_target", f"device {m.device_id} reported on "
                                                     f"rollout {m.rollout_id}, which does not target it"), m))
                continue
            old, err, model_id, prev_id, wave = row
            new = self._next_state(old, m, self.model(s, model_id), self.model(s, prev_id))
            if new is None or (new == old and m.error == err):
                continue
            row[0], row[1] = new, m.error
            changed[key] = {"b_r": key[0], "b_d": key[1], "state": new, "error": m.error, "updated_at": now}
            d = deltas.setdefault((key[0], wave), [0, 0])
            d[0] += (new == "installed") - (old == "installed")
            d[1] += (new == "failed") - (old == "failed")
        if changed:
            s.connection().execute(update(t).where(t.c.rollout_id == bindparam("b_r"),
                                                   t.c.device_id == bindparam("b_d")), list(changed.values()))
        for (rid, wave), (d_ok, d_bad) in deltas.items():
            if d_ok or d_bad:
                s.execute(update(RolloutWave).where(RolloutWave.rollout_id == rid, RolloutWave.idx == wave)
                          .values(n_installed=RolloutWave.n_installed + d_ok, n_failed=RolloutWave.n_failed + d_bad))
        return rejected

    @staticmethod
    def _next_state(old: str, msg: proto.ReportedState, model: ModelInfo | None,
                    prev: ModelInfo | None) -> str | None:
        if old == "rolling_back":
            if msg.state == "installed" and prev is not None and msg.running_version == prev.version:
                return "rolled_back"
            return "rollback_failed" if msg.state == "failed" else None
        if old in ("rolled_back", "rollback_failed"):
            return None
        state = "failed" if msg.state == "rolled_back" else msg.state
        if old in TARGET_TERMINAL and state not in TARGET_TERMINAL:
            return None  # a late progress message must not reopen a finished target
        if old == "installed" and state != "installed" and (model is None or msg.running_version == model.version):
            return None  # still running what was installed: a replayed old failure must not flip it
        if state == "installed" and model is not None and msg.version is not None and msg.version != model.version:
            return None  # an install of something else (an older retained report)
        return state

    def on_shadow_batch(self, s: Session, msgs: list[proto.Telemetry]) -> None:
        """Shadow figures of devices whose target is shadowing a candidate: the newest per device is kept."""
        newest = {m.device_id: m.shadow for m in msgs if m.shadow is not None}
        if not newest:
            return
        t = RolloutTarget
        rows = s.execute(select(t.rollout_id, t.device_id, t.model_id).where(
            t.device_id.in_(list(newest)), t.state == "shadowing")).all()
        now = utcnow()
        for rid, dev, model_id in rows:
            fig = newest[dev]
            info = self.model(s, model_id)
            if fig is None or info is None or (info.name, info.version) != (fig.model, fig.version):
                continue
            row = s.get(RolloutShadow, (rid, dev))
            if row is None:
                row = RolloutShadow(rollout_id=rid, device_id=dev)
                s.add(row)
            row.samples, row.agreement = fig.samples, fig.top1_agreement
            row.max_abs_error, row.p99_ms, row.updated_at = fig.max_abs_error, fig.p99_ms, now

    def on_telemetry_batch(self, s: Session, rollout_of: dict[str, int | None], msgs: list[proto.Telemetry]) -> None:
        """Figures for the gates: requests, errors and newest p99 on the rollout's model, per target."""
        t: Table = RolloutTarget.__table__  # type: ignore[assignment]
        keys = list({(rollout_of[m.device_id], m.device_id) for m in msgs
                     if rollout_of.get(m.device_id) is not None and m.version is not None})
        if not keys:
            return
        models = {(r.rollout_id, r.device_id): r.model_id for r in s.execute(
            select(t.c.rollout_id, t.c.device_id, t.c.model_id).where(tuple_(t.c.rollout_id, t.c.device_id).in_(keys)))}
        acc: dict[tuple[int, str], dict[str, Any]] = {}
        for m in msgs:
            key = (rollout_of.get(m.device_id) or 0, m.device_id)
            info = self.model(s, models.get(key))
            if info is None or (info.name, info.version) != (m.model, m.version):
                continue
            a = acc.setdefault(key, {"b_r": key[0], "b_d": key[1], "dr": 0, "de": 0, "p99": None})
            a["dr"] += m.requests
            a["de"] += m.errors
            if m.latency.p99_ms is not None:
                a["p99"] = m.latency.p99_ms
        if acc:
            s.connection().execute(
                update(t).where(t.c.rollout_id == bindparam("b_r"), t.c.device_id == bindparam("b_d")).values(
                    tele_requests=t.c.tele_requests + bindparam("dr"), tele_errors=t.c.tele_errors + bindparam("de"),
                    p99_after=func.coalesce(bindparam("p99", type_=Float), t.c.p99_after)), list(acc.values()))

    # -- the tick ----------------------------------------------------------------------------------
    def tick(self) -> int:
        """Advance every in-progress rollout this replica holds the lease of; returns how many."""
        now = utcnow()
        with self.sessions() as s:
            ids = list(s.scalars(select(Rollout.id).where(Rollout.status == "in_progress")))
        n = 0
        for rid in ids:
            with self.sessions.begin() as s:
                got = s.execute(update(Rollout).where(
                    Rollout.id == rid, Rollout.status == "in_progress",
                    or_(Rollout.lease_owner.is_(None), Rollout.lease_owner == self.owner, Rollout.lease_until < now))
                    .values(lease_owner=self.owner, lease_until=now + dt.timedelta(seconds=self.LEASE_S)))
            if got.rowcount == 1:  # type: ignore[attr-defined]
                self.advance(rid)
                n += 1
        return n

    def release_leases(self) -> None:
        with self.sessions.begin() as s:
            s.execute(update(Rollout).where(Rollout.lease_owner == self.owner).values(lease_owner=None,
                                                                                       lease_until=None))

    def advance(self, rollout_id: int) -> None:
        msgs: list[tuple[str, bytes]] = []
        with self.sessions.begin() as s:
            self._advance_in(s, rollout_id, msgs)
        self._publish(msgs)

    def _publish(self, msgs: list[tuple[str, bytes]]) -> None:
        for topic, payload in msgs:  # after commit: a device that answers at once finds its target row
            self.publisher.publish(topic, payload, retain=True)

    def _advance_in(self, s: Session, rollout_id: int, msgs: list[tuple[str, bytes]]) -> None:
        r = s.get(Rollout, rollout_id, with_for_update=True)
        if r is None or r.status != "in_progress":
            return
        spec = RolloutSpec.model_validate(r.spec or {})
        for _ in range(64):  # bounded: each pass moves one wave one step or returns
            w = s.get(RolloutWave, (r.id, r.current_wave))
            if w is None:
                self.transition(s, r, "succeeded", ENGINE_ACTOR, None)
                return
            now = utcnow()
            if w.state == "pending":
                self._start_wave(s, r, w, msgs, shadow=spec.shadow is not None)
                continue
            if w.state == "shadowing":
                assert spec.shadow is not None
                result = evaluate_shadow(self._shadow_figures(s, w), spec.shadow)
                if result is None:
                    return  # not enough mirrored requests yet
                w.gates = [result.as_json()]
                if not result.passed:
                    self._fail_shadow(s, r, w, spec, result, msgs)
                    return
                audit(s, ENGINE_ACTOR, "wave_shadow_passed", r.id, wave=w.idx, gates=w.gates)
                self._start_wave(s, r, w, msgs, shadow=False)  # promote: the real install
                continue
            if w.state in ("installing", "soaking"):
                f = WaveFigures(w.size, w.n_installed, w.n_failed, 0, 0, None, None, 0)
                if install_gate_lost(f, spec.gates):
                    self._fail_wave(s, r, w, spec, self._figures(s, w), msgs)
                    return
            if w.state == "installing":
                outstanding = w.size - w.n_installed - w.n_failed
                if outstanding > 0:
                    started = w.started_at or now
                    if (now - started).total_seconds() < spec.offline_grace_s or w.n_installed + w.n_failed == 0:
                        return
                    if self._outstanding_online(s, w) > 0:
                        return
                    audit(s, ENGINE_ACTOR, "wave_offline_deferred", r.id, wave=w.idx, devices=outstanding)
                w.state = "soaking"
                w.soak_until = now + dt.timedelta(seconds=w.soak_s)
                audit(s, ENGINE_ACTOR, "wave_soaking", r.id, wave=w.idx, installed=w.n_installed, failed=w.n_failed,
                      soak_s=w.soak_s)
            if w.state == "soaking":
                if w.soak_until is not None and now < w.soak_until:
                    return
                results = evaluate_gates(self._figures(s, w), spec.gates)
                w.gates = [g for g in (w.gates or []) if g["name"] == "shadow_agreement"] + [
                    g.as_json() for g in results]
                if spec.require_telemetry and any(g.value is None for g in results if g.name != "install_success"):
                    return  # not judged yet: soak on until the devices send figures
                if not all(g.passed for g in results):
                    self._fail_wave(s, r, w, spec, self._figures(s, w), msgs, results)
                    return
                w.state = "passed"
                w.finished_at = now
                audit(s, ENGINE_ACTOR, "wave_passed", r.id, wave=w.idx, gates=w.gates)
                r.current_wave += 1
                continue
            if w.state in ("passed", "failed"):
                r.current_wave += 1
                continue
            return

    def _start_wave(self, s: Session, r: Rollout, w: RolloutWave, msgs: list[tuple[str, bytes]],
                    shadow: bool = False) -> None:
        """Send the wave its desired states: in shadow (the devices keep what they run) or to install."""
        pairs = list(s.execute(select(RolloutTarget, Device).join(Device, Device.id == RolloutTarget.device_id)
                               .where(RolloutTarget.rollout_id == r.id, RolloutTarget.wave == w.idx)))
        if shadow:
            now_ts = time.time()
            n = 0
            for t, d in pairs:
                if t.state != "pending":
                    continue
                m = self.model(s, t.model_id)
                assert m is not None
                msgs.append(desired_message(d.id, m, r.id, now_ts, mode="shadow"))
                n += 1
            w.state = "shadowing"
            w.started_at = utcnow()
            audit(s, ENGINE_ACTOR, "wave_shadow_started", r.id, wave=w.idx, devices=n)
            return
        running = {(m.name, m.version, m.profile): m.id for m in s.scalars(
            select(Model).where(Model.name.in_({d.running_model for _, d in pairs if d.running_model})))}
        now = time.time()
        sent = 0
        for t, d in pairs:
            if t.state not in ("pending", "shadowing"):
                continue  # superseded meanwhile
            m = self.model(s, t.model_id)
            assert m is not None
            t.previous_model_id = running.get((d.running_model or "", d.running_version or "", m.profile))
            tel = d.last_telemetry or {}
            if (tel.get("model"), tel.get("version")) == (d.running_model, d.running_version) and d.running_model:
                t.p99_before = (tel.get("latency") or {}).get("p99_ms")
            d.desired_model_id = m.id
            d.desired_rollout_id = r.id
            msgs.append(desired_message(d.id, m, r.id, now))
            sent += 1
        w.state = "installing"
        w.started_at = utcnow()
        audit(s, ENGINE_ACTOR, "wave_started", r.id, wave=w.idx, devices=sent)

    @staticmethod
    def _outstanding_online(s: Session, w: RolloutWave) -> int:
        return int(s.scalar(select(func.count()).select_from(RolloutTarget).join(
            Device, Device.id == RolloutTarget.device_id).where(
            RolloutTarget.rollout_id == w.rollout_id, RolloutTarget.wave == w.idx,
            RolloutTarget.state.not_in(TARGET_TERMINAL), Device.online.is_(True))) or 0)

    @staticmethod
    def _shadow_figures(s: Session, w: RolloutWave) -> ShadowWaveFigures:
        sh, t = RolloutShadow, RolloutTarget
        row = s.execute(select(
            func.count(), func.coalesce(func.sum(sh.samples), 0),
            func.sum(case((sh.agreement.is_not(None), sh.samples * sh.agreement))),
            func.sum(case((sh.agreement.is_not(None), sh.samples))), func.max(sh.max_abs_error))
            .join(t, and_(t.rollout_id == sh.rollout_id, t.device_id == sh.device_id))
            .where(sh.rollout_id == w.rollout_id, t.wave == w.idx)).one()
        judged = float(row[3] or 0)
        return ShadowWaveFigures(int(row[0] or 0), int(row[1] or 0),
                                 float(row[2]) / judged if judged else None,
                                 None if row[4] is None else float(row[4]))

    def _fail_shadow(self, s: Session, r: Rollout, w: RolloutWave, spec: RolloutSpec, result: GateResult,
                     msgs: list[tuple[str, bytes]]) -> None:
        """The candidate disagreed in shadow: nothing was installed; the devices drop the shadow (their
        desired state goes back to what they run)."""
        w.state = "failed"
        w.finished_at = utcnow()
        audit(s, ENGINE_ACTOR, "wave_failed", r.id, wave=w.idx, gates=w.gates)
        now = time.time()
        for t, d in s.execute(select(RolloutTarget, Device).join(Device, Device.id == RolloutTarget.device_id)
                              .where(RolloutTarget.rollout_id == r.id, RolloutTarget.wave == w.idx)):
            if t.state == "shadowing":
                t.state = "pending"
            cur = self.model(s, d.desired_model_id) if d.desired_model_id else None
            if cur is not None:
                msgs.append(desired_message(d.id, cur, d.desired_rollout_id, now))
        value = "n/a" if result.value is None else f"{result.value:.4g}"
        reason = (f"wave {w.idx + 1} failed in shadow, before any install: shadow_agreement {value} vs threshold "
                  f"{result.threshold:g} ({result.detail})")
        self.transition(s, r, "paused" if spec.on_failure == "pause" else "failed", ENGINE_ACTOR, reason)

    @staticmethod
    def _figures(s: Session, w: RolloutWave) -> WaveFigures:
        both = and_(RolloutTarget.p99_before.is_not(None), RolloutTarget.p99_after.is_not(None),
                    RolloutTarget.p99_before > 0)
        row = s.execute(select(
            func.coalesce(func.sum(RolloutTarget.tele_requests), 0),
            func.coalesce(func.sum(RolloutTarget.tele_errors), 0),
            func.sum(case((both, RolloutTarget.p99_before))), func.sum(case((both, RolloutTarget.p99_after))),
            func.sum(case((both, 1), else_=0))).where(RolloutTarget.rollout_id == w.rollout_id,
                                                      RolloutTarget.wave == w.idx)).one()
        n = int(row[4] or 0)
        return WaveFigures(w.size, w.n_installed, w.n_failed, int(row[0]), int(row[1]),
                           float(row[2]) / n if n else None, float(row[3]) / n if n else None, n)

    def _fail_wave(self, s: Session, r: Rollout, w: RolloutWave, spec: RolloutSpec, f: WaveFigures,
                   msgs: list[tuple[str, bytes]], results: list[GateResult] | None = None) -> None:
        results = results or evaluate_gates(f, spec.gates)
        w.gates = [g.as_json() for g in results]
        w.state = "failed"
        w.finished_at = utcnow()
        bad = [g for g in results if not g.passed]
        reason = f"wave {w.idx + 1} failed its gates: " + "; ".join(
            f"{g.name} {'n/a' if g.value is None else f'{g.value:.4g}'} vs threshold {g.threshold:g} ({g.detail})"
            for g in bad)
        audit(s, ENGINE_ACTOR, "wave_failed", r.id, wave=w.idx, gates=w.gates)
        if spec.rollback_on_failure:
            self._rollback_targets(s, r, ENGINE_ACTOR, msgs, wave=w.idx)
        self.transition(s, r, "paused" if spec.on_failure == "pause" else "failed", ENGINE_ACTOR, reason)

    def _rollback_targets(self, s: Session, r: Rollout, actor: str, msgs: list[tuple[str, bytes]],
                          wave: int | None = None) -> tuple[int, int]:
        """Send the started targets back to their previous model; returns (sent back, without a previous)."""
        q = select(RolloutTarget, Device).join(Device, Device.id == RolloutTarget.device_id).where(
            RolloutTarget.rollout_id == r.id, RolloutTarget.state.in_(
                ("installed", "downloading", "installing", "failed", "pending")))
        q = q.where(RolloutTarget.wave == wave) if wave is not None else q.where(RolloutTarget.wave <= r.current_wave)
        now = time.time()
        back = stuck = 0
        for t, d in s.execute(q):
            if t.state == "pending" and d.desired_rollout_id != r.id:
                continue  # never sent
            prev = self.model(s, t.previous_model_id)
            if prev is None:
                stuck += 1
                continue
            self._set_target(s, t, "rolling_back", None)
            if d.desired_rollout_id == r.id:
                d.desired_model_id = prev.id
                msgs.append(desired_message(d.id, prev, r.id, now))
            back += 1
        audit(s, actor, "rollback_sent", r.id, wave=wave, devices=back, without_previous_model=stuck)
        return back, stuck

    # -- operator actions ----------------------------------------------------------------------------
    def act(self, rollout_id: int, action: str, actor: str) -> None:
        msgs: list[tuple[str, bytes]] = []
        with self.sessions.begin() as s:
            r = s.get(Rollout, rollout_id, with_for_update=True)
            if r is None:
                raise NotFound(f"no rollout {rollout_id}")
            if action == "pause":
                self.transition(s, r, "paused", actor, f"paused by {actor}")
            elif action == "resume":
                w = s.get(RolloutWave, (r.id, r.current_wave))
                skipped = w is not None and w.state == "failed"
                self.transition(s, r, "in_progress", actor, None,
                                overriding_failed_wave=(w.idx if w is not None and skipped else None))
            elif action == "abort":
                self.transition(s, r, "aborted", actor, f"aborted by {actor}")
            elif action == "rollback":
                if r.status == "rolled_back":
                    raise Conflict(f"rollout {rollout_id} is already rolled back")
                back, stuck = self._rollback_targets(s, r, actor, msgs)
                self.transition(s, r, "rolled_back", actor, f"rolled back by {actor}: {back} devices sent to their "
                                f"previous model" + (f", {stuck} had none" if stuck else ""))
            else:
                raise BadRequest(f"unknown action {action!r}: pause, resume, abort or rollback")
        self._publish(msgs)
        if action == "resume":
            self.advance(rollout_id)

    # -- reading ---------------------------------------------------------------------------------
    def status(self, rollout_id: int, with_targets: bool = True) -> dict[str, Any]:
        with self.sessions() as s:
            r = s.get(Rollout, rollout_id)
            if r is None:
                raise NotFound(f"no rollout {rollout_id}")
            first = self.model(s, r.model_id)
            assert first is not None
            counts = {st: int(n) for st, n in s.execute(
                select(RolloutTarget.state, func.count()).where(RolloutTarget.rollout_id == r.id)
                .group_by(RolloutTarget.state))}
            waves = list(s.scalars(select(RolloutWave).where(RolloutWave.rollout_id == r.id)
                                   .order_by(RolloutWave.idx)))
            profiles = sorted({p for (p,) in s.execute(
                select(Model.profile).join(RolloutTarget, RolloutTarget.model_id == Model.id)
                .where(RolloutTarget.rollout_id == r.id).distinct())})
            out: dict[str, Any] = {
                "id": r.id, "model": r.model_name or first.name, "version": r.model_version or first.version,
                "profile": first.profile, "profiles": profiles, "status": r.status, "reason": r.reason,
                "created_by": r.created_by, "created_at": _iso(r.created_at), "finished_at": _iso(r.finished_at),
                "current_wave": r.current_wave, "spec": r.spec, "counts": counts,
                "waves": [{"index": w.idx, "size": w.size, "soak_s": w.soak_s, "state": w.state,
                           "installed": w.n_installed, "failed": w.n_failed, "started_at": _iso(w.started_at),
                           "soak_until": _iso(w.soak_until), "gates": w.gates} for w in waves],
            }
            spec = RolloutSpec.model_validate(r.spec or {})
            for wj, w in zip(out["waves"], waves, strict=True):  # gates not judged yet: their values so far
                if w.state == "shadowing" and spec.shadow is not None:
                    f = self._shadow_figures(s, w)
                    g = evaluate_shadow(f, spec.shadow) or GateResult(
                        "shadow_agreement", f.agreement, spec.shadow.agreement_min, False,
                        f"{f.samples} of {spec.shadow.min_samples} mirrored requests so far")
                    wj["gates_live"] = [g.as_json()]
                elif w.state in ("installing", "soaking") and not any(
                        g["name"] != "shadow_agreement" for g in (w.gates or [])):
                    wj["gates_live"] = [g.as_json() for g in evaluate_gates(self._figures(s, w), spec.gates)]
            if with_targets:
                out["targets"] = [{"device_id": t.device_id, "state": t.state, "error": t.error, "wave": t.wave,
                                   "updated_at": _iso(t.updated_at)}
                                  for t in s.scalars(select(RolloutTarget).where(RolloutTarget.rollout_id == r.id)
                                                     .order_by(RolloutTarget.device_id))]
            return out


def _names(ids: list[str], limit: int = 10) -> str:
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")
