"""Mixed releases: what this release sends, a reader of the previous release still accepts."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import ValidationError

from edgefleet.protocol import mqtt as proto
from edgefleet.protocol._strict import StrictModel


class StatusV01(StrictModel):
    """StatusMessage as release 0.1.0 (before CPU features) declared it: unknown keys are refused."""

    v: int
    device_id: str
    ts: float
    kind: Literal["status"]
    state: Literal["online", "offline"]
    agent_version: str | None = None
    inference_url: str | None = None


def test_unset_optional_fields_are_left_out_so_the_previous_fleet_reads_the_message() -> None:
    msg = proto.StatusMessage(device_id="edge-01", ts=1.0, state="offline")
    old = StatusV01.model_validate_json(proto.encode(msg))
    assert (old.device_id, old.state) == ("edge-01", "offline")
    # required-but-nullable fields stay (a reader needs them), and the round trip is exact
    rep = proto.ReportedState(device_id="edge-01", ts=1.0, state="failed", rollout_id=None, model=None,
                              version=None, running_model=None, running_version=None, error="x")
    assert b'"rollout_id":null' in proto.encode(rep)
    assert proto.decode(proto.ReportedState, proto.encode(rep), "t") == rep


def test_a_new_field_that_is_set_is_still_refused_by_the_previous_reader() -> None:
    # upgrade the fleet before the agents: this is what an old fleet does with a new agent's status
    msg = proto.StatusMessage(device_id="edge-01", ts=1.0, state="online", arch="x86_64")
    with pytest.raises(ValidationError, match="arch"):
        StatusV01.model_validate_json(proto.encode(msg))
