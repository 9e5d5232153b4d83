"""The install of one desired state as a state machine: its states, the events that move it, one table.

Plain data, no I/O, like the fleet's rollout tables (fleet/states.py). An install (agent.install.steps,
``InstallRun.walk``) runs the step of the state it is in; each step ends in an event, and the one function that
moves the install (``InstallRun.move``) checks the move against :data:`TRANSITIONS` and reports the new state to
the fleet when the fleet has a name for it (:data:`REPORTED`, the ``state`` of protocol.mqtt's ReportedState)::

    received ──► downloading ──► installing ──► installed        (accepted, fetched, swapped in)
    received ──► installed                                       (kept: it is serving already)
    received ──► shadowing                                       (already mirroring it: a re-sent desired state)
    received ──► failed                                          (refused: trust, profile, failed here before)
    received ──► ignored                                         (an older rollout's desired state: a stale replay)
    downloading ──► ignored                                      (superseded by a newer desired state, or stopping)
    downloading | installing ──► failed                          (the download, the bundle or the swap failed)
    installing ──► shadowing                                     (loaded beside the serving model, mirrored to)

``ignored`` reports nothing (the fleet sees no state for a stale or superseded desired state).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ...protocol import mqtt as proto

__all__ = ["FINAL", "REPORTED", "TRANSITIONS", "Event", "InstallEvent", "InstallState", "next_state"]


class InstallState(str, Enum):  # str: compared, hashed and sent as its value (no StrEnum on Python 3.10)
    RECEIVED = "received"  # a desired state taken from the queue, nothing decided yet
    DOWNLOADING = "downloading"
    INSTALLING = "installing"  # the signed bundle is here: staged, loaded, self-tested, warmed up, swapped in
    SHADOWING = "shadowing"  # loaded beside the serving model; live requests mirrored to it
    INSTALLED = "installed"
    FAILED = "failed"
    IGNORED = "ignored"  # a stale or superseded desired state: nothing to report

    __hash__ = str.__hash__  # the same key as its value in a dict or a set


class InstallEvent(Enum):
    ACCEPTED = "accepted"  # decided: install (or shadow) it
    KEPT = "kept"  # decided: it is the version serving
    REFUSED = "refused"  # decided: refuse it (Event.error says why)
    SHADOW_HELD = "shadow_held"  # it is the shadow running now
    STALE = "stale"  # its rollout is older than the newest seen
    FETCHED = "fetched"  # the signed bundle is here and names what the desired state names
    SUPERSEDED = "superseded"  # the download gave up for a newer desired state, or the agent is stopping
    SHADOW_STARTED = "shadow_started"  # checked and mirrored to
    SWAPPED = "swapped"  # committed and serving
    BROKE = "broke"  # an error on the way (Event.error); what was loaded is closed, what was staged discarded


@dataclass(frozen=True)
class Event:
    """What a step ended in, with what the report of the state it leads to carries."""

    kind: InstallEvent
    error: str | None = None
    install_s: float | None = None
    selftest: proto.SelfTestResult | None = None
    serving: proto.ServingChoice | None = None


_S, _E = InstallState, InstallEvent

TRANSITIONS: dict[InstallState, dict[InstallEvent, InstallState]] = {
    _S.RECEIVED: {_E.ACCEPTED: _S.DOWNLOADING, _E.KEPT: _S.INSTALLED, _E.REFUSED: _S.FAILED,
                  _E.SHADOW_HELD: _S.SHADOWING, _E.STALE: _S.IGNORED},
    _S.DOWNLOADING: {_E.FETCHED: _S.INSTALLING, _E.SUPERSEDED: _S.IGNORED, _E.BROKE: _S.FAILED},
    _S.INSTALLING: {_E.SHADOW_STARTED: _S.SHADOWING, _E.SWAPPED: _S.INSTALLED, _E.BROKE: _S.FAILED},
    _S.SHADOWING: {},
    _S.INSTALLED: {},
    _S.FAILED: {},
    _S.IGNORED: {},
}
FINAL = frozenset(s for s, moves in TRANSITIONS.items() if not moves)
REPORTED = frozenset(TRANSITIONS) - {_S.RECEIVED, _S.IGNORED}  # the states the fleet is told


def next_state(state: InstallState, event: InstallEvent) -> InstallState:
    """The state ``event`` moves an install in ``state`` to; ValueError for a move the table does not have."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise ValueError(f"an install in state {state.value!r} has no move on {event.value!r}") from None
