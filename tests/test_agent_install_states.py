"""The install's state machine as a table (agent/install/states.py): every walk ends, and ends in a state the fleet
knows or in ``ignored``; a move the table does not have is refused. The walks themselves run through a real agent and
broker in tests/test_agent_lifecycle.py, tests/test_report_ack.py and tests/test_e2e.py."""

from __future__ import annotations

import typing

import pytest

from edgefleet.agent.install.states import FINAL, REPORTED, TRANSITIONS, InstallEvent, InstallState, next_state
from edgefleet.protocol import mqtt as proto


def _walks(state: InstallState, seen: tuple[InstallState, ...] = ()) -> list[tuple[InstallState, ...]]:
    assert state not in seen, f"a cycle: {[*seen, state]}"
    if state in FINAL:
        return [(*seen, state)]
    return [w for new in TRANSITIONS[state].values() for w in _walks(new, (*seen, state))]


def test_every_walk_from_received_ends_in_a_final_state_without_passing_a_state_twice():
    walks = _walks(InstallState.RECEIVED)
    assert {w[-1] for w in walks} == set(FINAL) == {InstallState.INSTALLED, InstallState.SHADOWING,
                                                    InstallState.FAILED, InstallState.IGNORED}
    assert max(len(w) for w in walks) <= len(TRANSITIONS)  # the walk's loop bound holds
    reached = {s for w in walks for s in w}
    assert reached == set(InstallState), set(InstallState) - reached  # no state is unreachable


def test_the_fleet_is_told_only_states_its_report_has_and_as_their_values():
    fleet_states = set(typing.get_args(proto.ReportedState.model_fields["state"].annotation))
    assert {s.value for s in REPORTED} <= fleet_states
    assert InstallState.RECEIVED not in REPORTED and InstallState.IGNORED not in REPORTED
    report = proto.ReportedState(device_id="d", ts=1.0, state=InstallState.FAILED, rollout_id=None, model=None,
                                 version=None, running_model=None, running_version=None)
    assert report.model_dump()["state"] == "failed" and type(report.model_dump()["state"]) is str


def test_a_move_the_table_lacks_is_refused():
    assert next_state(InstallState.DOWNLOADING, InstallEvent.FETCHED) is InstallState.INSTALLING
    with pytest.raises(ValueError, match="'installed' has no move on 'swapped'"):
        next_state(InstallState.INSTALLED, InstallEvent.SWAPPED)
    with pytest.raises(ValueError, match="'received' has no move on 'swapped'"):
        next_state(InstallState.RECEIVED, InstallEvent.SWAPPED)
