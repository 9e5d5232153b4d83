"""The three state machines of a rollout, as tables: the rollout's status, each wave's state, each target's.

Plain data, no I/O. A state is stored in the database as its value (a short string, as before these
enums existed); the only functions that change one are in fleet.rollout (``RolloutDriver.transition``,
``move_wave``, ``move_targets``), each checks its table here and writes the audit row in the same
transaction.

Rollout status::

    in_progress ──► paused ──► in_progress          (pause / resume, by hand or by a gate)
    in_progress | paused ──► aborted                (abort, by hand)
    in_progress | paused ──► failed                 (a gate failed with on_failure=abort)
    in_progress ──► succeeded                       (the last wave passed its gates)
    any but rolled_back ──► rolled_back             (rollback, by hand)

Wave state (the driver's tick moves it; audit action in brackets)::

    pending ──► shadowing [wave_shadow_started] ──► installing [wave_started] ──► soaking [wave_soaking]
    pending ──────────────────────────────────────► installing                      │
    shadowing | installing | soaking ──► failed [wave_failed]        soaking ──► passed [wave_passed]

Target state (one device in one rollout; audit action ``targets_<new state>``). Device reports move
it through pending → downloading ⇄ installing → installed ⇄ failed (or → shadowing, when its wave runs
the candidate in shadow first); the driver moves it back to pending when the wave fails in shadow, to
failed when a newer rollout supersedes an unfinished one, and to rolling_back on a rollback, after which
reports end it as rolled_back or rollback_failed. ``TARGET_TRANSITIONS`` below is the whole list.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["TARGET_DONE", "TARGET_FINAL", "TARGET_TRANSITIONS", "TRANSITIONS", "WAVE_TRANSITIONS", "RolloutStatus",
           "State", "TargetState", "WaveState"]


class State(StrEnum):
    """A state: stored, compared and printed as its value."""


class RolloutStatus(State):
    IN_PROGRESS = "in_progress"
    PAUSED = "paused"
    FAILED = "failed"
    ABORTED = "aborted"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"


class WaveState(State):
    PENDING = "pending"
    SHADOWING = "shadowing"  # devices run the candidate beside their model and report agreement
    INSTALLING = "installing"  # desired states sent; waiting for every target (or the offline grace)
    SOAKING = "soaking"  # installed; the gates are judged when the soak time is over
    PASSED = "passed"
    FAILED = "failed"


class TargetState(State):
    PENDING = "pending"  # nothing sent yet (or sent and not answered)
    DOWNLOADING = "downloading"
    INSTALLING = "installing"
    SHADOWING = "shadowing"  # the device mirrors live requests to the candidate, still serving its model
    INSTALLED = "installed"
    FAILED = "failed"  # the install failed, the device rolled itself back, or a newer rollout superseded it
    ROLLING_BACK = "rolling_back"  # sent back to the model it ran before
    ROLLED_BACK = "rolled_back"
    ROLLBACK_FAILED = "rollback_failed"


_R, _W, _T = RolloutStatus, WaveState, TargetState

TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    _R.IN_PROGRESS: frozenset({_R.PAUSED, _R.ABORTED, _R.FAILED, _R.SUCCEEDED, _R.ROLLED_BACK}),
    _R.PAUSED: frozenset({_R.IN_PROGRESS, _R.ABORTED, _R.FAILED, _R.ROLLED_BACK}),
    _R.FAILED: frozenset({_R.ROLLED_BACK}),
    _R.ABORTED: frozenset({_R.ROLLED_BACK}),
    _R.SUCCEEDED: frozenset({_R.ROLLED_BACK}),
    _R.ROLLED_BACK: frozenset(),
}

WAVE_TRANSITIONS: dict[WaveState, frozenset[WaveState]] = {
    _W.PENDING: frozenset({_W.SHADOWING, _W.INSTALLING}),
    _W.SHADOWING: frozenset({_W.INSTALLING, _W.FAILED}),  # promoted after agreeing, or failed in shadow
    _W.INSTALLING: frozenset({_W.SOAKING, _W.FAILED}),  # failed: the install gate is already lost
    _W.SOAKING: frozenset({_W.PASSED, _W.FAILED}),
    _W.PASSED: frozenset(),
    _W.FAILED: frozenset(),  # a resumed rollout skips it; it stays failed
}

TARGET_TRANSITIONS: dict[TargetState, frozenset[TargetState]] = {
    _T.PENDING: frozenset({_T.DOWNLOADING, _T.INSTALLING, _T.SHADOWING, _T.INSTALLED, _T.FAILED, _T.ROLLING_BACK}),
    _T.DOWNLOADING: frozenset({_T.INSTALLING, _T.SHADOWING, _T.INSTALLED, _T.FAILED, _T.ROLLING_BACK}),
    _T.INSTALLING: frozenset({_T.DOWNLOADING, _T.SHADOWING, _T.INSTALLED, _T.FAILED, _T.ROLLING_BACK}),
    # pending: its wave failed in shadow and the device dropped the candidate
    _T.SHADOWING: frozenset({_T.PENDING, _T.DOWNLOADING, _T.INSTALLING, _T.INSTALLED, _T.FAILED}),
    _T.INSTALLED: frozenset({_T.FAILED, _T.ROLLING_BACK}),  # failed: only once it no longer runs the model
    _T.FAILED: frozenset({_T.INSTALLED, _T.ROLLING_BACK}),  # installed: a later attempt succeeded
    _T.ROLLING_BACK: frozenset({_T.ROLLED_BACK, _T.ROLLBACK_FAILED, _T.FAILED}),  # failed: superseded
    _T.ROLLED_BACK: frozenset(),
    _T.ROLLBACK_FAILED: frozenset(),
}

TARGET_DONE = frozenset({_T.INSTALLED, _T.FAILED})  # a wave stops waiting for a target in one of these
TARGET_FINAL = frozenset(s for s, nxt in TARGET_TRANSITIONS.items() if not nxt)
