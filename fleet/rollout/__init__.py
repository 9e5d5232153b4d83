"""Rollouts as a persisted state machine: targets, waves, soak times and health gates.

A rollout sends one model version to the devices a selector picks (a device list, a group, tags, a
hardware profile); each device gets the bundle built for its own profile, or, when the model version has
none, the bundle of the CPU profile its profile names as ``cpu_fallback`` (a Jetson runs the arm64-cpu build
on its CPU cores until a TensorRT build is uploaded). The targets are split into
waves (counts or cumulative percentages, e.g. ``1%,10%,50%,100%``), each with a soak time. A wave
starts by publishing the devices' desired state; it is *installed* when every target reported (or
its device has been offline for ``offline_grace_s``); it then soaks; at the end of the soak the
gates are evaluated against thresholds. A failed gate pauses or fails the rollout and, if asked,
sends the wave's devices back to the model they ran before.

A rollout, each of its waves and each of its targets (one device) is a state machine whose states and
allowed transitions are tables in fleet.states. Each changes only through one function here, which
refuses a transition its table does not list (``Conflict``) and writes the audit row in the same
transaction: ``RolloutDriver.transition`` (a rollout), ``move_wave`` (a wave) and ``move_targets`` (any
number of targets at once, as one UPDATE). A bulk move is audited in rows per wave and new state, each
naming its devices (at most ``AUDIT_DEVICES_PER_ROW``), how many there were, the states they left and
their errors: an operator reading a rollout's audit log sees which devices did what and why, while
100,000 targets moving together cost about 100 audit rows, not 100,000.

Cost per device report is constant: a report updates its target row and adds ±1 to its wave's
counters; nothing is recounted. The driver's tick (``advance``) reads only the wave's counters, and
scans a wave's targets only when its offline grace has run out or when its gates are evaluated.
All state is in the database, so a restarted fleet resumes every rollout where it was.

Lock order (PostgreSQL; SQLite locks the whole database): every transaction takes its row locks in one order,
so two writers never wait on each other in a circle (``lock_rows``): **rollouts** (by id; the driver and an
operator's action FOR UPDATE, report ingest FOR KEY SHARE, so replicas' ingest runs side by side but never while
the driver moves the same rollout), then **devices** (by id), then **targets** (by rollout and device), then
**waves** (the counters). Report ingest, telemetry, statuses, a rollback and a new rollout's supersede all follow
it; tests/test_pg_lock_order.py runs ingest and a rollback at once.

The package, by layer: ``spec`` (what an operator gives: RolloutSpec, Gates, ShadowGate, Selector, plan_waves);
``queries`` (typed rows, a wave's figures, the row locks in the lock order: lock_rows; what fleet.service.rollouts
reads); the pure rules, ``gates`` (functions of a wave's recorded figures) and ``step`` (``step(rollout, wave,
figures, now) -> moves``, and what a report makes of a target); ``moves`` (move_wave, move_targets: the only ways a
wave's or a target's state changes); ``status`` (a rollout as the API's schema models) and ``driver``
(RolloutDriver, the service that loads the rows, asks the rules, applies their moves and publishes). The names
other modules use are re-exported here.
"""

from ..states import TRANSITIONS
from .driver import RolloutDriver
from .gates import GateResult, WaveFigures, evaluate_gates, install_gate_lost
from .moves import (
    AUDIT_DEVICES_PER_ROW,
    WAVE_ACTIONS,
    TargetMove,
    desired_message,
    move_targets,
    move_wave,
)
from .queries import cpu_fallback
from .spec import MAX_GRACE_S, Gates, RolloutSpec, Selector, ShadowGate, plan_waves

__all__ = ["AUDIT_DEVICES_PER_ROW", "MAX_GRACE_S", "TRANSITIONS", "WAVE_ACTIONS", "GateResult", "Gates",
           "RolloutDriver", "RolloutSpec", "Selector", "ShadowGate", "TargetMove", "WaveFigures", "cpu_fallback",
           "desired_message", "evaluate_gates", "install_gate_lost", "move_targets", "move_wave", "plan_waves"]
