"""A rollout as the API and the console show it, built as the API's own schema models (fleet.schemas): its waves
with the gates judged (and, while a wave runs, the values so far), its targets, the counts by state."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ...protocol import mqtt as proto
from .. import schemas as out
from ..db import WAITING_STATES, Device, Model, Rollout, RolloutTarget, RolloutWave
from ..errors import NotFound
from ..states import RolloutStatus, TargetState, WaveState
from ..windows import effective as effective_windows
from ..windows import next_opening
from .gates import GateResult, WaveFigures, evaluate_gates, evaluate_shadow
from .queries import ModelInfo, downloads, shadow_figures
from .spec import RolloutSpec

log = logging.getLogger("edgefleet.fleet.rollout")


def iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=dt.UTC).isoformat()


def failure(exc: BaseException) -> str:
    """An exception as one line an operator can read (a database error without its SQL)."""
    orig = getattr(exc, "orig", None)  # SQLAlchemy's DBAPIError wraps the driver's
    text = f"{type(orig).__name__}: {orig}" if orig is not None else f"{type(exc).__name__}: {exc}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(
        ("For further information", "[SQL:", "[parameters:", "(Background on"))]
    return "; ".join(lines or [type(exc).__name__])[:500]


def target_model(t: RolloutTarget, bundle_profile: str | None, bundle_target: str | None = None,
                 download: Any = None) -> out.RolloutTarget:
    """A target as the API shows it; ``bundle_profile`` is the profile of the bundle it was sent (its device's
    own, or that profile's CPU fallback); ``download``: its newest telemetry's download in progress, shown when it
    is of the bundle it was sent (``bundle_target``), readable, and the target not yet past its install (a record
    made during the download outlives it until the device's next one)."""
    got = None
    if (t.state in (TargetState.PENDING, TargetState.DOWNLOADING, TargetState.INSTALLING)
            and isinstance(download, dict) and bundle_target is not None and download.get("target") == bundle_target):
        with contextlib.suppress(ValueError):
            got = proto.DownloadFigures.model_validate(download)
    return out.RolloutTarget(device_id=t.device_id, state=t.state, error=t.error, wave=t.wave,
                             updated_at=iso(t.updated_at), bundle_profile=bundle_profile, download=got)


def targets_page(s: Session, rollout_id: int, state: str | None = None, offset: int = 0,
                 limit: int | None = None) -> list[out.RolloutTarget]:
    """A rollout's targets by device id (those in ``state``), with the profile of the bundle each was sent."""
    where = [RolloutTarget.state == state] if state else []
    q = (select(RolloutTarget, Model.profile, Model.target_path, Device.last_telemetry["download"])
         .outerjoin(Model, Model.id == RolloutTarget.model_id).outerjoin(Device, Device.id == RolloutTarget.device_id)
         .where(RolloutTarget.rollout_id == rollout_id, *where).order_by(RolloutTarget.device_id))
    if offset or limit is not None:
        q = q.offset(max(0, offset)).limit(None if limit is None else max(0, limit))
    return [target_model(t, p, bt, dl) for t, p, bt, dl in s.execute(q)]


def rollout_status(s: Session, rollout_id: int, model: Callable[[Session, int | None], ModelInfo | None],
                   wave_figures: Callable[[Session, RolloutWave], WaveFigures], with_targets: bool = True,
                   profiles: bool = True, live_gates: bool = True) -> out.Rollout:
    """A rollout as the API shows it. Each part that reads all of a large rollout's targets can be left out where
    it is not shown (the console): ``profiles`` (the bundles' profiles sent: empty when left out) and
    ``live_gates`` (the running wave's gate values so far). Fields left out are unset (the API leaves them out)."""
    r = s.get(Rollout, rollout_id)
    if r is None:
        raise NotFound(f"no rollout {rollout_id}")
    first = model(s, r.model_id)
    assert first is not None
    counts = {st: int(n) for st, n in s.execute(
        select(RolloutTarget.state, func.count()).where(RolloutTarget.rollout_id == r.id)
        .group_by(RolloutTarget.state))}
    waves = list(s.scalars(select(RolloutWave).where(RolloutWave.rollout_id == r.id).order_by(RolloutWave.idx)))
    sent = sorted({p for (p,) in s.execute(
        select(Model.profile).join(RolloutTarget, RolloutTarget.model_id == Model.id)
        .where(RolloutTarget.rollout_id == r.id).distinct())}) if profiles else []
    extra: dict[str, object] = {}
    if with_targets:
        extra["targets"] = targets_page(s, r.id)
    live: dict[int, list[GateResult]] = {}
    engine_error = r.engine_error
    try:  # last: a failure here leaves the rest of the answer (and the listing) standing
        if live_gates:
            _live_gates(s, r, waves, wave_figures, live)
    except Exception as exc:  # shown (while it runs) as the driver's own failure would be
        log.debug("rollout %d: its live gate figures could not be read: %s", r.id, failure(exc))
        if r.status == RolloutStatus.IN_PROGRESS:
            engine_error = engine_error or failure(exc)
    return out.Rollout(
        id=r.id, model=r.model_name or first.name, version=r.model_version or first.version, profile=first.profile,
        profiles=sent, status=r.status, reason=r.reason, created_by=r.created_by, created_at=iso(r.created_at),
        finished_at=iso(r.finished_at), current_wave=r.current_wave, spec=r.spec if isinstance(r.spec, dict) else {},
        counts=counts, engine_error=engine_error, engine_error_at=iso(r.engine_error_at),
        waves=[_wave(w, live.get(w.idx)) for w in waves], **extra)  # type: ignore[arg-type]


def _wave(w: RolloutWave, live: list[GateResult] | None) -> out.Wave:
    extra = {} if live is None else {"gates_live": [out.Gate(**g.as_json()) for g in live]}
    return out.Wave(index=w.idx, size=w.size, soak_s=w.soak_s, state=w.state, installed=w.n_installed,
                    failed=w.n_failed, started_at=iso(w.started_at), soak_until=iso(w.soak_until),
                    gates=w.gates, **extra)  # type: ignore[arg-type]


def _live_gates(s: Session, r: Rollout, waves: list[RolloutWave],
                wave_figures: Callable[[Session, RolloutWave], WaveFigures], live: dict[int, list[GateResult]]) -> None:
    """Gates not judged yet: their values so far, into ``live`` by wave (those read before a failure stay)."""
    spec = RolloutSpec.model_validate(r.spec or {})
    for w in waves:
        if w.state == WaveState.SHADOWING and spec.shadow is not None:
            f = shadow_figures(s, w.rollout_id, w.idx)
            live[w.idx] = [evaluate_shadow(f, spec.shadow) or GateResult(
                "shadow_agreement", f.agreement, spec.shadow.agreement_min, False,
                f"{f.samples} of {spec.shadow.min_samples} mirrored requests so far")]
        elif w.state in (WaveState.INSTALLING, WaveState.SOAKING) and not any(
                g["name"] != "shadow_agreement" for g in (w.gates or [])):
            live[w.idx] = evaluate_gates(wave_figures(s, w), spec.gates)


def wave_waits(s: Session, rollout_id: int, wave: int, now: dt.datetime) -> str | None:
    """Where an installing wave waits, in words (the console): its devices outside their maintenance window now
    (fleet.windows, on the fleet's clock) and when the first of those opens, and its devices not sent their update
    yet because of the rollout's download cap. None when it waits on neither."""
    r = s.get(Rollout, rollout_id)
    if r is None:
        return None
    spec = RolloutSpec.model_validate(r.spec or {})
    said = []
    if not spec.urgent:
        devs = list(s.scalars(select(Device).join(RolloutTarget, RolloutTarget.device_id == Device.id).where(
            RolloutTarget.rollout_id == rollout_id, RolloutTarget.wave == wave,
            RolloutTarget.state.in_(WAITING_STATES))))
        now = now.replace(tzinfo=dt.UTC) if now.tzinfo is None else now
        opens = [o for w in effective_windows(s, devs).values() if (o := next_opening(w, now)[1]) is not None]
        if opens:
            said.append(f"{len(opens)} device{'s' if len(opens) != 1 else ''} outside their maintenance window "
                        f"(the first opens {min(opens).isoformat(timespec='minutes')})")
    if spec.max_concurrent_downloads is not None:
        in_flight, unsent = downloads(s, rollout_id, wave)
        if unsent:
            said.append(f"{unsent} not sent yet: {in_flight} of at most {spec.max_concurrent_downloads} downloading")
    return "; ".join(said) or None
