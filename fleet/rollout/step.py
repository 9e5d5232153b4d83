"""The rules of a rollout, without a database: ``step`` says what a rollout's current wave does next, as a list of
moves, from the rows (fleet.rollout.queries), the wave's figures and the time; ``next_target_state`` says what a
device's report makes of its target. The driver loads the rows, calls these, and applies the moves (each through
``move_wave``, ``move_targets`` or ``RolloutDriver.transition``, with its audit row).

A wave's life (fleet.states): pending -> [shadowing ->] installing -> soaking -> passed | failed. ``step`` moves the
current wave one step; a move that ``ends`` the step (``Wait``, a failure, ``Finish``) ends the driver's pass over
the rollout, the others let it step again (the next state, or the next wave)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ...protocol import mqtt as proto
from ..states import TARGET_TRANSITIONS, RolloutStatus, TargetState, WaveState
from .gates import (
    GateResult,
    ShadowWaveFigures,
    WaveFigures,
    evaluate_gates,
    evaluate_shadow,
    install_gate_lost,
)
from .queries import ModelInfo, RolloutRow, WaveRow


class Figures(Protocol):
    """A wave's recorded figures, read when a rule asks for them (each at most once per step)."""

    def wave(self) -> WaveFigures: ...

    def shadow(self) -> ShadowWaveFigures: ...

    def outstanding_online(self) -> int: ...

    def downloads(self) -> tuple[int, int]: ...  # (sent and not finished, not sent yet) of the wave's targets


# -- the moves: what a step asks the driver to write (``ends``: the driver's pass over the rollout stops there) ----
@dataclass(frozen=True)
class Wait:  # nothing to do until something changes (a report, a soak's end, telemetry); ``why`` for readers
    why: str
    ends: ClassVar[bool] = True


@dataclass(frozen=True)
class StartWave:  # send the wave its desired states: in shadow (devices keep what they run) or to install
    shadow: bool
    ends: ClassVar[bool] = False


@dataclass(frozen=True)
class Release:  # send ``n`` more of the installing wave's targets their desired state (its download cap has room)
    n: int
    ends: ClassVar[bool] = True


@dataclass(frozen=True)
class SetGates:  # record the wave's gate values
    gates: tuple[dict[str, Any], ...]
    ends: ClassVar[bool] = False


@dataclass(frozen=True)
class PassShadow:  # the candidate agreed in shadow: audited, then a StartWave installs it for real
    ends: ClassVar[bool] = False


@dataclass(frozen=True)
class FailShadow:  # the candidate disagreed in shadow: nothing was installed, the devices drop the shadow
    result: GateResult
    ends: ClassVar[bool] = True


@dataclass(frozen=True)
class Soak:  # every target reported, or ``deferred`` stayed offline past the grace: the wave soaks
    deferred: int = 0
    ends: ClassVar[bool] = False


@dataclass(frozen=True)
class FailWave:  # the wave failed its gates: the rollout pauses or fails, and rolls back if asked
    results: tuple[GateResult, ...]
    ends: ClassVar[bool] = True


@dataclass(frozen=True)
class PassWave:  # the wave passed its gates: on to the next wave
    ends: ClassVar[bool] = False


@dataclass(frozen=True)
class NextWave:  # the current wave ended before (passed, or failed and resumed by an operator): on to the next
    ends: ClassVar[bool] = False


@dataclass(frozen=True)
class Finish:  # no wave is left: the rollout ends in ``status``
    status: RolloutStatus
    ends: ClassVar[bool] = True


Move = Wait | StartWave | Release | SetGates | PassShadow | FailShadow | Soak | FailWave | PassWave | NextWave | Finish


# -- the rules ---------------------------------------------------------------------------------------------------
def step(rollout: RolloutRow, wave: WaveRow | None, figures: Figures, now: dt.datetime) -> list[Move]:
    """What the rollout's current wave does next; the last move says whether the driver steps again."""
    spec = rollout.spec
    if wave is None:
        return [Finish(RolloutStatus.SUCCEEDED)]
    state = wave.state
    if state is WaveState.PENDING:
        return [StartWave(shadow=spec.shadow is not None)]
    if state is WaveState.SHADOWING:
        assert spec.shadow is not None
        result = evaluate_shadow(figures.shadow(), spec.shadow)
        if result is None:
            return [Wait("not enough mirrored requests yet")]
        judged = SetGates((result.as_json(),))
        return [judged, FailShadow(result)] if not result.passed else [judged, PassShadow(), StartWave(shadow=False)]
    if state in (WaveState.PASSED, WaveState.FAILED):
        return [NextWave()]
    if state not in (WaveState.INSTALLING, WaveState.SOAKING):
        return [Wait(f"wave {wave.idx + 1} is {state}")]
    counted = WaveFigures(wave.size, wave.n_installed, wave.n_failed, 0, 0, None, None, 0)
    if install_gate_lost(counted, spec.gates):
        return [FailWave(tuple(evaluate_gates(figures.wave(), spec.gates)))]
    if state is WaveState.INSTALLING:
        cap = spec.max_concurrent_downloads
        if cap is not None:
            in_flight, unsent = figures.downloads()
            if unsent > 0 and in_flight < cap:
                return [Release(min(cap - in_flight, unsent))]
        return [_installed(rollout, wave, figures, now)]
    return _judged(rollout, wave, figures, now)


def _installed(rollout: RolloutRow, wave: WaveRow, figures: Figures, now: dt.datetime) -> Move:
    """An installing wave soaks once every target reported, or once the offline grace ran out with a report in
    and none of the outstanding devices online."""
    if wave.outstanding <= 0:
        return Soak()
    started = wave.started_at or now
    if (now - started).total_seconds() < rollout.spec.offline_grace_s or wave.n_installed + wave.n_failed == 0:
        return Wait("targets still installing")
    if figures.outstanding_online() > 0:
        return Wait("online targets still installing")
    return Soak(deferred=wave.outstanding)


def _judged(rollout: RolloutRow, wave: WaveRow, figures: Figures, now: dt.datetime) -> list[Move]:
    """A soaking wave, judged by its gates once its soak is over."""
    if wave.soak_until is not None and now < wave.soak_until:
        return [Wait("soaking")]
    spec = rollout.spec
    results = evaluate_gates(figures.wave(), spec.gates)
    gates = SetGates(tuple(g for g in wave.gates if g["name"] == "shadow_agreement")
                     + tuple(g.as_json() for g in results))
    if spec.require_telemetry and any(g.value is None for g in results if g.name != "install_success"):
        return [gates, Wait("not judged yet: soaking on until the devices send figures")]
    if not all(g.passed for g in results):
        return [gates, FailWave(tuple(results))]
    return [gates, PassWave()]


def failure_status(rollout: RolloutRow) -> RolloutStatus:
    """Where a failed wave leaves its rollout: paused (an operator may resume) or failed."""
    return RolloutStatus.PAUSED if rollout.spec.on_failure == "pause" else RolloutStatus.FAILED


def gate_failure(wave: int, results: tuple[GateResult, ...]) -> str:
    """The reason a rollout records when wave ``wave`` (0-based) fails its gates."""
    return f"wave {wave + 1} failed its gates: " + "; ".join(
        f"{g.name} {'n/a' if g.value is None else f'{g.value:.4g}'} vs threshold {g.threshold:g} ({g.detail})"
        for g in results if not g.passed)


def shadow_failure(wave: int, result: GateResult) -> str:
    value = "n/a" if result.value is None else f"{result.value:.4g}"
    return (f"wave {wave + 1} failed in shadow, before any install: shadow_agreement {value} vs threshold "
            f"{result.threshold:g} ({result.detail})")


def next_target_state(old: TargetState, msg: proto.ReportedState, model: ModelInfo | None,
                      prev: ModelInfo | None) -> TargetState | None:
    """What a device's report makes of its target: a state ``TARGET_TRANSITIONS`` allows from ``old``,
    ``old`` itself (only its error may change), or None (ignored: late, replayed or about another model)."""
    if old is TargetState.ROLLING_BACK:
        if msg.state == "installed" and prev is not None and msg.running_version == prev.version:
            return TargetState.ROLLED_BACK
        return TargetState.ROLLBACK_FAILED if msg.state == "failed" else None
    new = TargetState.FAILED if msg.state == "rolled_back" else TargetState(msg.state)
    if (new is TargetState.INSTALLED and model is not None and msg.version is not None
            and msg.version != model.version):
        return None  # an install of something else (an older retained report)
    if new is old:
        return old
    if new not in TARGET_TRANSITIONS[old]:
        return None  # a late progress message must not reopen a finished target
    if old is TargetState.INSTALLED and (model is None or msg.running_version == model.version):
        return None  # still running what was installed: a replayed old failure must not flip it
    return new


def previous_bundle(running_model: str, running_version: str, last: ModelInfo | None, profiles: tuple[str, ...],
                    bundles: dict[tuple[str, str, str], int]) -> int | None:
    """The bundle a device runs now (what a rollback sends it back to). A device reports the model's name and
    version, not which profile's bundle: the one it was last sent (``last``) when that is the same name and version,
    else the bundle of its own profile, else its profile's CPU fallback's (``profiles``, in that order; ``bundles``
    by name, version and profile). The new bundle's profile says nothing: a Jetson moving from its arm64-cpu
    fallback to a TensorRT build (or back) changes profile."""
    if last is not None and (last.name, last.version) == (running_model, running_version):
        return last.id
    for p in profiles:
        if (found := bundles.get((running_model, running_version, p))) is not None:
            return found
    return None
