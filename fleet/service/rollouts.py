"""Rollouts as the API and the console see them, as the API's schema models (fleet.schemas); the state machine itself
is fleet.rollout's RolloutDriver."""

from __future__ import annotations

import time

from sqlalchemy.orm import sessionmaker

from .. import schemas as out
from ..rollout import RolloutDriver, RolloutSpec, Selector, desired_message
from ..rollout import queries as q
from ..rollout.status import targets_page
from .common import Publisher, check_labels, iso


class RolloutService:
    def __init__(self, sessions: sessionmaker, publisher: Publisher, driver: RolloutDriver):
        self.sessions = sessions
        self.publisher = publisher
        self.driver = driver

    def create_rollout(self, name: str, version: str, devices: list[str] | None = None, profile: str | None = None,
                       group: str | None = None, tags: list[str] | None = None, spec: RolloutSpec | None = None,
                       actor: str = "api") -> out.Rollout:
        check_labels(None, tags)
        sel = Selector(devices=tuple(devices or ()), group=group, tags=tuple(tags or ()), profile=profile)
        rid = self.driver.create(name, version, sel, spec or RolloutSpec(), actor)
        return self.get_rollout(rid)

    def rollout_action(self, rollout_id: int, action: str, actor: str) -> out.Rollout:
        self.driver.act(rollout_id, action, actor)
        return self.get_rollout(rollout_id, with_targets=False)

    def republish_desired(self) -> int:
        """Publish every device's desired state again (retained), e.g. after a broker restart."""
        with self.sessions() as s:
            rows = [(d.id, self.driver.model(s, d.desired_model_id), d.desired_rollout_id) for d in q.with_desired(s)]
        now = time.time()
        for dev_id, model, rid in rows:
            if model is not None:
                self.publisher.publish(*desired_message(dev_id, model, rid, now), retain=True)
        return len(rows)

    def list_rollouts(self, limit: int = 100, summary: bool = False) -> list[out.Rollout]:
        """The newest rollouts, without targets; ``summary``: without their profiles and live gate values either
        (the console's overview shows neither, and each reads every target of a rollout)."""
        with self.sessions() as s:
            ids = q.newest(s, limit)
        return [self.get_rollout(i, with_targets=False, profiles=not summary, live_gates=not summary) for i in ids]

    def get_rollout(self, rollout_id: int, with_targets: bool = True, profiles: bool = True,
                    live_gates: bool = True) -> out.Rollout:
        """A rollout as the API shows it; the fields left out (``with_targets``...) are unset, so the API leaves them
        out (its routes answer with ``response_model_exclude_unset``)."""
        return self.driver.status(rollout_id, with_targets, profiles, live_gates)

    def rollout_targets(self, rollout_id: int, limit: int, offset: int = 0,
                        state: str | None = None) -> tuple[list[out.RolloutTarget], int]:
        """One page of a rollout's targets by device id (``state`` filters), and how many match in all."""
        with self.sessions() as s:
            total = q.target_count(s, rollout_id, state)
            return targets_page(s, rollout_id, state, offset, limit), total

    def audit_log(self, rollout_id: int | None = None, limit: int = 200) -> list[out.AuditEntry]:
        with self.sessions() as s:
            return [out.AuditEntry(id=a.id, ts=iso(a.ts), actor=a.actor, action=a.action, rollout_id=a.rollout_id,
                                   device_id=a.device_id, detail=a.detail) for a in q.audit_rows(s, rollout_id, limit)]
