"""The audit log (who did what, in the same transaction as the change) and counted rejections."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from sqlalchemy.orm import Session

from .db import AuditRow

__all__ = ["ENGINE_ACTOR", "Rejections", "audit"]

ENGINE_ACTOR = "fleet"  # the rollout driver's own actions (waves, gates)
log = logging.getLogger("edgefleet.fleet.audit")


def audit(s: Session, actor: str, action: str, rollout_id: int | None = None, device_id: str | None = None,
          **detail: Any) -> None:
    s.add(AuditRow(actor=actor, action=action, rollout_id=rollout_id, device_id=device_id, detail=detail or None))


class Rejections:
    """Bad input from devices or API callers: counted by kind, logged once per (kind, subject)."""

    MAX_LOGGED = 10_000  # distinct (kind, subject) pairs remembered for log-once; then counted only

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def add(self, kind: str, subject: str, message: str) -> None:
        with self._lock:
            self.counts[kind] += 1
            key = (kind, subject)
            first = key not in self._logged and len(self._logged) < self.MAX_LOGGED
            if first:
                self._logged.add(key)
        if first:
            log.warning("rejected (%s): %s", kind, message)

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
