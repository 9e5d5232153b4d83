"""The rollout's three state machines as tables (fleet.states), and the only functions that move them
(fleet.rollout): every pair of states allowed or refused as the table says, every move audited (bulk
moves in rows per wave), wave counters that never drift, and a restart that resumes from the database.
A real SQLite database, no broker."""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

from edgefleet.fleet import console
from edgefleet.fleet.audit import ENGINE_ACTOR
from edgefleet.fleet.db import AuditRow, Device, Model, Rollout, RolloutShadow, RolloutTarget, RolloutWave, make_engine
from edgefleet.fleet.errors import Conflict
from edgefleet.fleet.rollout import (
    WAVE_ACTIONS,
    RolloutDriver,
    RolloutSpec,
    Selector,
    TargetMove,
    move_targets,
    move_wave,
)
from edgefleet.fleet.rollout import moves as rollout
from edgefleet.fleet.states import (
    TARGET_FINAL,
    TARGET_TRANSITIONS,
    TRANSITIONS,
    WAVE_TRANSITIONS,
    RolloutStatus,
    State,
    TargetState,
    WaveState,
)
from edgefleet.protocol import mqtt as proto
from tests.fleet_harness import RecordingPublisher

N_DEVICES = 5000



def seed(sessions, n_devices: int) -> None:
    """Two builds of model m (0.9.0 is what the devices ran before) and ``n_devices`` devices."""
    with sessions.begin() as s:
        for mid, version in ((1, "1.0.0"), (2, "0.9.0")):
            s.add(Model(id=mid, name="m", version=version, profile="x86-cpu", backend="onnxruntime", precision="int8",
                        target_path=f"m/{version}/x86-cpu.tar", sha256=str(mid) * 64, size_bytes=1, accuracy=1.0,
                        manifest={}))
        s.add_all(Device(id=f"d{i:05d}", labels={}, registered_via="api", profile="x86-cpu", running_model="m",
                         running_version="0.9.0") for i in range(n_devices))


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """Rollouts written directly (make_rollout), for the functions that move states."""
    engine, sessions = make_engine(f"sqlite:///{tmp_path_factory.mktemp('states') / 'fleet.db'}")
    seed(sessions, N_DEVICES)
    yield engine, sessions
    engine.dispose()


@pytest.fixture
def fresh(tmp_path):
    """A database of its own, for the driver (its rollouts supersede whatever else targets their devices)."""
    engine, sessions = make_engine(f"sqlite:///{tmp_path / 'fleet.db'}")
    seed(sessions, 20)
    yield sessions
    engine.dispose()


def make_rollout(sessions, waves: list[tuple[WaveState, list[TargetState]]]) -> int:
    """A rollout whose waves and targets are in the given states (counters to match), written directly."""
    with sessions.begin() as s:
        r = Rollout(model_id=1, status="in_progress", spec={}, current_wave=0)
        s.add(r)
        s.flush()
        dev = 0
        for idx, (ws, targets) in enumerate(waves):
            s.add(RolloutWave(rollout_id=r.id, idx=idx, size=len(targets), state=ws.value,
                              n_installed=targets.count(TargetState.INSTALLED),
                              n_failed=targets.count(TargetState.FAILED)))
            for ts in targets:
                s.add(RolloutTarget(rollout_id=r.id, device_id=f"d{dev:05d}", state=ts.value, wave=idx, model_id=1,
                                    previous_model_id=2))
                dev += 1
        return r.id


def audit_rows(sessions, rid: int) -> list[AuditRow]:
    with sessions() as s:
        return list(s.scalars(select(AuditRow).where(AuditRow.rollout_id == rid).order_by(AuditRow.id)))


def attempt(sessions, move: Callable[[Session], object], old: State, new: State, legal: bool, refusal: str) -> None:
    """``move`` (``old`` -> ``new``) in one transaction: allowed if the table lists it (``legal``), else refused with a
    Conflict that says ``refusal``."""
    try:
        with sessions.begin() as s:
            move(s)
    except Conflict as exc:
        assert not legal, exc
        assert refusal in str(exc)
    else:
        assert legal, f"{old} -> {new} is not in the table but was allowed"


def assert_counters_match(sessions, rid: int) -> None:
    with sessions() as s:
        for w in s.scalars(select(RolloutWave).where(RolloutWave.rollout_id == rid)):
            got = Counter(s.scalars(select(RolloutTarget.state).where(RolloutTarget.rollout_id == rid,
                                                                     RolloutTarget.wave == w.idx)))
            assert (w.n_installed, w.n_failed) == (got["installed"], got["failed"]), (w.idx, got)


# -- the tables themselves ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("enum", "table"), [(RolloutStatus, TRANSITIONS), (WaveState, WAVE_TRANSITIONS),
                                             (TargetState, TARGET_TRANSITIONS)])
def test_each_table_names_every_state_and_only_its_states(enum, table):
    assert set(table) == set(enum)
    assert set().union(*table.values()) <= set(enum)
    assert all(old not in new for old, new in table.items())  # staying put is not a transition


@pytest.mark.parametrize(("table", "start"), [(TRANSITIONS, RolloutStatus.IN_PROGRESS),
                                              (WAVE_TRANSITIONS, WaveState.PENDING),
                                              (TARGET_TRANSITIONS, TargetState.PENDING)])
def test_every_state_is_reachable_from_the_first_one(table, start):
    seen, todo = {start}, [start]
    while todo:
        for nxt in table[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(table)


def test_the_final_states_are_the_ones_a_rollout_ends_in():
    assert {s for s, n in WAVE_TRANSITIONS.items() if not n} == {WaveState.PASSED, WaveState.FAILED}
    assert TARGET_FINAL == {TargetState.ROLLED_BACK, TargetState.ROLLBACK_FAILED}
    assert {s for s, n in TRANSITIONS.items() if not n} == {RolloutStatus.ROLLED_BACK}
    assert set(WAVE_ACTIONS) == set(WaveState) - {WaveState.PENDING}  # every state a wave can enter has its action


def test_states_are_stored_and_printed_as_their_value():
    assert f"{TargetState.ROLLBACK_FAILED}" == str(TargetState.ROLLBACK_FAILED) == "rollback_failed"
    assert TargetState("shadowing") is TargetState.SHADOWING and WaveState.SOAKING == "soaking"
    assert max(len(s.value) for s in [*RolloutStatus, *WaveState, *TargetState]) <= 16  # the columns' width


# -- every pair, through the one function that moves each ---------------------------------------------------
@pytest.mark.parametrize(("old", "new"), list(itertools.product(RolloutStatus, RolloutStatus)),
                         ids=lambda s: s.value)
def test_a_rollout_moves_only_as_its_table_says_and_each_move_is_audited(db, old, new):
    _, sessions = db
    rid = make_rollout(sessions, [(WaveState.PENDING, [TargetState.PENDING])])
    with sessions.begin() as s:
        s.get(Rollout, rid).status = old.value
    legal = new in TRANSITIONS[old]
    attempt(sessions, lambda s: RolloutDriver.transition(s, s.get(Rollout, rid), new, "tester", "why"), old, new,
            legal, f"rollout {rid} is {old.value}; it cannot become {new.value}")
    with sessions() as s:
        assert s.get(Rollout, rid).status == (new if legal else old).value
    assert [(a.action, a.detail) for a in audit_rows(sessions, rid)] == (
        [(f"rollout_{new.value}", {"from_state": old.value, "reason": "why"})] if legal else [])


@pytest.mark.parametrize(("old", "new"), list(itertools.product(WaveState, WaveState)), ids=lambda s: s.value)
def test_a_wave_moves_only_as_its_table_says_and_each_move_is_audited(db, old, new):
    _, sessions = db
    rid = make_rollout(sessions, [(old, [TargetState.PENDING])])
    legal = new in WAVE_TRANSITIONS[old]
    attempt(sessions, lambda s: move_wave(s, s.get(RolloutWave, (rid, 0)), new, "tester", why="test"), old, new,
            legal, f"wave 1 of rollout {rid} is {old.value}; it cannot become {new.value}")
    with sessions() as s:
        w = s.get(RolloutWave, (rid, 0))
        assert w.state == (new if legal else old).value
    rows = audit_rows(sessions, rid)
    if not legal:
        assert rows == []
        return
    assert [(a.actor, a.action) for a in rows] == [("tester", WAVE_ACTIONS[new])]
    assert rows[0].detail == {"wave": 0, "from_state": old.value, "why": "test"}
    if new in (WaveState.SHADOWING, WaveState.INSTALLING):
        assert w.started_at is not None
    elif new is WaveState.SOAKING:
        assert w.soak_until is not None
    else:
        assert w.finished_at is not None


@pytest.mark.parametrize(("old", "new"), list(itertools.product(TargetState, TargetState)), ids=lambda s: s.value)
def test_a_target_moves_only_as_its_table_says_and_each_move_is_audited(db, old, new):
    _, sessions = db
    rid = make_rollout(sessions, [(WaveState.INSTALLING, [old, TargetState.PENDING])])
    legal = new in TARGET_TRANSITIONS[old]
    move = TargetMove(rid, "d00000", 0, old, new, "boom" if new is TargetState.FAILED else None)
    attempt(sessions, lambda s: move_targets(s, [move], "tester", "test"), old, new, legal,
            f"d00000 in rollout {rid} is {old.value}; it cannot become {new.value}")
    with sessions() as s:
        assert s.get(RolloutTarget, (rid, "d00000")).state == (new if legal else old).value
    assert_counters_match(sessions, rid)
    rows = audit_rows(sessions, rid)
    if not legal:
        assert rows == []
        return
    assert len(rows) == 1
    a = rows[0]
    assert (a.actor, a.action, a.device_id) == ("tester", f"targets_{new.value}", "d00000")
    expect = {"wave": 0, "cause": "test", "count": 1, "devices": ["d00000"], "from": {old.value: 1}}
    if new is TargetState.FAILED:
        expect["error"] = "boom"
    assert a.detail == expect


def test_a_refused_move_in_a_batch_writes_nothing_of_the_batch(db):
    _, sessions = db
    rid = make_rollout(sessions, [(WaveState.INSTALLING, [TargetState.PENDING, TargetState.ROLLED_BACK])])
    with pytest.raises(Conflict, match=r"d00001 .* is rolled_back; it cannot become installed"), sessions.begin() as s:
        move_targets(s, [TargetMove(rid, "d00000", 0, TargetState.PENDING, TargetState.INSTALLED, None),
                         TargetMove(rid, "d00001", 0, TargetState.ROLLED_BACK, TargetState.INSTALLED, None)],
                     "tester", "test")
    with sessions() as s:
        assert [t.state for t in s.scalars(select(RolloutTarget).where(RolloutTarget.rollout_id == rid)
                                           .order_by(RolloutTarget.device_id))] == ["pending", "rolled_back"]
    assert audit_rows(sessions, rid) == []
    assert_counters_match(sessions, rid)


def test_a_move_whose_old_state_is_not_the_stored_one_is_refused(db):
    _, sessions = db
    rid = make_rollout(sessions, [(WaveState.INSTALLING, [TargetState.INSTALLED])])
    with pytest.raises(Conflict, match=f"rollout {rid}: 1 of 1 targets were not in the state"), \
            sessions.begin() as s:
        move_targets(s, [TargetMove(rid, "d00000", 0, TargetState.PENDING, TargetState.DOWNLOADING, None)],
                     "tester", "test")


# -- any sequence of moves keeps the counters right and audits each move -------------------------------------
_STATES = st.sampled_from(list(TargetState))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.tuples(st.integers(0, 5), _STATES), min_size=1, max_size=6),
                        min_size=1, max_size=8))
def test_any_sequence_of_bulk_moves_keeps_counters_and_audits_every_move(db, monkeypatch, batches):
    """Six targets in two waves; each batch asks for moves (target, new state). Legal ones are applied in
    one call; an illegal one makes the whole call raise and write nothing. Audit rows name at most 2
    devices each (the chunk size is lowered to see chunking), and their counts add up to the moves."""
    _, sessions = db
    monkeypatch.setattr(rollout, "AUDIT_DEVICES_PER_ROW", 2)
    rid = make_rollout(sessions, [(WaveState.INSTALLING, [TargetState.PENDING] * 3),
                                  (WaveState.PENDING, [TargetState.PENDING] * 3)])
    model = {f"d{i:05d}": TargetState.PENDING for i in range(6)}
    applied = Counter[tuple[str, str]]()
    for batch in batches:
        moves, cur, legal = [], dict(model), True
        for i, new in batch:
            dev = f"d{i:05d}"
            legal &= new in TARGET_TRANSITIONS[cur[dev]]
            moves.append(TargetMove(rid, dev, i // 3, cur[dev], new, None))
            cur[dev] = new
        try:
            with sessions.begin() as s:
                move_targets(s, moves, "tester", "test")
        except Conflict:
            assert not legal
        else:
            assert legal
            model = cur
            applied.update((m.new.value, str(m.wave)) for m in moves)
        with sessions() as s:
            stored = dict(s.execute(select(RolloutTarget.device_id, RolloutTarget.state)
                                    .where(RolloutTarget.rollout_id == rid)).all())
        assert stored == {d: v.value for d, v in model.items()}
        assert_counters_match(sessions, rid)
    rows = audit_rows(sessions, rid)
    assert all(len(a.detail["devices"]) <= 2 and a.detail["count"] == len(a.detail["devices"]) for a in rows)
    audited = Counter[tuple[str, str]]()
    for a in rows:
        audited[(a.action.removeprefix("targets_"), str(a.detail["wave"]))] += a.detail["count"]
    assert audited == applied


# -- bulk cost ----------------------------------------------------------------------------------------------
def test_a_bulk_move_of_thousands_costs_a_few_statements_and_one_audit_row_per_thousand_devices(db):
    _, sessions = db
    engine, _ = db
    rid = make_rollout(sessions, [(WaveState.SOAKING, [TargetState.INSTALLED] * 1500),
                                  (WaveState.SOAKING, [TargetState.INSTALLED] * 3500)])
    with sessions() as s:
        moves = [TargetMove(rid, d, w, TargetState.INSTALLED, TargetState.ROLLING_BACK, None)
                 for d, w in s.execute(select(RolloutTarget.device_id, RolloutTarget.wave)
                                       .where(RolloutTarget.rollout_id == rid))]
    statements: list[str] = []

    def count(*a):
        statements.append(a[2])

    event.listen(engine, "before_cursor_execute", count)
    try:
        with sessions.begin() as s:
            move_targets(s, moves, ENGINE_ACTOR, "rollback")
    finally:
        event.remove(engine, "before_cursor_execute", count)
    updates = [q for q in statements if q.lstrip().upper().startswith("UPDATE")]
    assert len(updates) == 1 + 2, statements  # one executemany for the targets, one counter update per wave
    rows = audit_rows(sessions, rid)
    assert [(a.action, a.detail["wave"], a.detail["count"]) for a in rows] == [
        ("targets_rolling_back", 0, 1000), ("targets_rolling_back", 0, 500)] + [
        ("targets_rolling_back", 1, 1000)] * 3 + [("targets_rolling_back", 1, 500)]
    assert sum(len(a.detail["devices"]) for a in rows) == 5000 == len({d for a in rows for d in a.detail["devices"]})
    assert len(rows) == math.ceil(1500 / 1000) + math.ceil(3500 / 1000)
    assert_counters_match(sessions, rid)


# -- through the driver ---------------------------------------------------------------------------------------
def _report(rid: int, dev: str, state: str, version: str = "1.0.0", error: str | None = None) -> proto.ReportedState:
    return proto.ReportedState(device_id=dev, ts=time.time(), state=state, rollout_id=rid,  # type: ignore[arg-type]
                               model="m", version="1.0.0", running_model="m", running_version=version, error=error)


def test_reports_move_targets_in_bulk_with_one_audit_row_per_wave_and_state(fresh):
    sessions = fresh
    driver = RolloutDriver(sessions, RecordingPublisher())
    rid = make_rollout(sessions, [(WaveState.INSTALLING, [TargetState.PENDING] * 4)])
    with sessions.begin() as s:
        rejected = driver.on_reports(s, [_report(rid, "d00000", "downloading"), _report(rid, "d00000", "installed"),
                                      _report(rid, "d00001", "installed"), _report(rid, "d00002", "installed"),
                                      _report(rid, "d00003", "failed", "0.9.0", error="no space left")])
    assert rejected == []
    rows = [(a.actor, a.action, a.detail) for a in audit_rows(sessions, rid)]
    assert rows == [
        ("devices", "targets_downloading", {"wave": 0, "cause": "report", "count": 1, "devices": ["d00000"],
                                            "from": {"pending": 1}}),
        ("devices", "targets_installed", {"wave": 0, "cause": "report", "count": 3,
                                          "devices": ["d00000", "d00001", "d00002"],
                                          "from": {"downloading": 1, "pending": 2}}),
        ("devices", "targets_failed", {"wave": 0, "cause": "report", "count": 1, "devices": ["d00003"],
                                       "from": {"pending": 1}, "error": "no space left"}),
    ]
    with sessions() as s:
        w = s.get(RolloutWave, (rid, 0))
        assert (w.n_installed, w.n_failed) == (3, 1)
    # a late progress report and a replay change nothing and write nothing
    with sessions.begin() as s:
        driver.on_reports(s, [_report(rid, "d00001", "downloading"), _report(rid, "d00002", "installed")])
    assert len(audit_rows(sessions, rid)) == 3
    assert_counters_match(sessions, rid)


def test_a_failed_shadow_wave_and_a_rollback_audit_their_targets(fresh):
    sessions = fresh
    driver = RolloutDriver(sessions, RecordingPublisher())
    spec = RolloutSpec(waves=("2", "100%"), shadow={"agreement_min": 0.9, "min_samples": 1},  # type: ignore[arg-type]
                       on_failure="pause", rollback_on_failure=True)
    rid = driver.create("m", "1.0.0", Selector(devices=tuple(f"d{i:05d}" for i in range(4))), spec, "tester")

    def shadow(devs: list[str], agreement: float) -> None:
        with sessions.begin() as s:
            driver.on_reports(s, [_report(rid, d, "shadowing", "0.9.0") for d in devs])
            s.add_all(RolloutShadow(rollout_id=rid, device_id=d, samples=10, agreement=agreement) for d in devs)
        driver.advance(rid)

    shadow(["d00000", "d00001"], 0.5)
    r = driver.status(rid)
    assert r.status == "paused" and [w.state for w in r.waves] == ["failed", "pending"]
    assert {t.state for t in r.targets} == {"pending"}
    acts = [(a.action, (a.detail or {}).get("cause")) for a in audit_rows(sessions, rid)]
    assert acts == [("rollout_created", None), ("wave_shadow_started", None), ("targets_shadowing", "report"),
                    ("wave_failed", None), ("targets_pending", "shadow_failed"), ("rollout_paused", None)]
    # an operator resumes past the failed wave; wave 2 agrees in shadow and installs; then a rollback
    driver.act(rid, "resume", "tester")
    shadow(["d00002", "d00003"], 1.0)
    assert [w.state for w in driver.status(rid).waves] == ["failed", "installing"]
    with sessions.begin() as s:
        driver.on_reports(s, [_report(rid, "d00002", "installed"), _report(rid, "d00003", "installed")])
    driver.advance(rid)
    assert driver.status(rid).status == "succeeded"
    driver.act(rid, "rollback", "tester")
    rows = audit_rows(sessions, rid)
    assert [a.action for a in rows][6:] == [
        "rollout_in_progress", "wave_shadow_started", "targets_shadowing", "wave_shadow_passed", "wave_started",
        "targets_installed", "wave_soaking", "wave_passed", "rollout_succeeded", "targets_rolling_back",
        "rollback_sent", "rollout_rolled_back"]
    back = [a for a in rows if a.action == "targets_rolling_back"]
    assert [(a.actor, a.detail["wave"], a.detail["devices"], a.detail["from"]) for a in back] == [
        ("tester", 1, ["d00002", "d00003"], {"installed": 2})]
    with sessions() as s:
        assert s.get(RolloutWave, (rid, 1)).n_installed == 0  # the counters follow the rollback too


def test_a_newer_rollout_supersedes_unfinished_targets_with_an_audit_row_on_the_older_one(fresh):
    sessions = fresh
    driver = RolloutDriver(sessions, RecordingPublisher())
    devs = tuple(f"d{i:05d}" for i in range(10, 13))
    old = driver.create("m", "1.0.0", Selector(devices=devs), RolloutSpec(), "tester")
    with sessions.begin() as s:
        driver.on_reports(s, [_report(old, "d00010", "installed")])
    new = driver.create("m", "0.9.0", Selector(devices=devs[1:]), RolloutSpec(), "tester")
    sup = [a for a in audit_rows(sessions, old) if a.action == "targets_failed"]
    assert [(a.detail["cause"], a.detail["by_rollout"], a.detail["devices"], a.detail["error"]) for a in sup] == [
        ("superseded", new, ["d00011", "d00012"], f"superseded by rollout {new}")]
    assert driver.status(old).status == "failed"  # its only wave lost its install gate
    assert_counters_match(sessions, old)


def test_a_restart_resumes_every_state_from_the_database(tmp_path):
    """A second driver (a restarted fleet) on the same file reads the stored states and carries on: wave 1
    is not started again, wave 2 is, and every stored value is a member of its enum."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    engine, sessions = make_engine(url)
    seed(sessions, 4)
    driver = RolloutDriver(sessions, RecordingPublisher())
    rid = driver.create("m", "1.0.0", Selector(devices=tuple(f"d{i:05d}" for i in range(4))),
                     RolloutSpec(waves=("2", "100%"), soak_s=(3600.0,)), "tester")
    with sessions.begin() as s:
        driver.on_reports(s, [_report(rid, "d00000", "installed"), _report(rid, "d00001", "installed")])
    driver.advance(rid)
    assert [w.state for w in driver.status(rid).waves] == ["soaking", "pending"]
    engine.dispose()

    engine, sessions = make_engine(url)
    driver = RolloutDriver(sessions, RecordingPublisher())
    with sessions.begin() as s:  # the soak is over (as if the fleet had been down for an hour)
        s.get(RolloutWave, (rid, 0)).soak_until = rollout.utcnow()
    driver.advance(rid)
    assert [w.state for w in driver.status(rid).waves] == ["passed", "installing"]
    with sessions() as s:
        assert {RolloutStatus(x) for x in s.scalars(select(Rollout.status))} == {RolloutStatus.IN_PROGRESS}
        assert {WaveState(x) for x in s.scalars(select(RolloutWave.state))} == {WaveState.PASSED,
                                                                                 WaveState.INSTALLING}
        assert {TargetState(x) for x in s.scalars(select(RolloutTarget.state))} == {TargetState.INSTALLED,
                                                                                     TargetState.PENDING}
        starts = s.scalar(select(func.count()).where(AuditRow.rollout_id == rid, AuditRow.action == "wave_started"))
    assert starts == 2
    engine.dispose()


# -- the console shows every state -----------------------------------------------------------------------------
def _every_state_shown() -> list[str]:
    device = [*get_args(proto.ReportedState.model_fields["state"].annotation), "online", "offline", "decommissioned"]
    return sorted({*(s.value for s in [*RolloutStatus, *WaveState, *TargetState]), *device})


@pytest.mark.parametrize("state", _every_state_shown())
def test_the_console_has_a_style_for_every_state(state):
    cls = console.STATE_STYLES[state]
    assert f".{cls}{{" in console.CSS
    assert console._pill(state) == f'<span class="pill {cls}">{state}</span>'
