"""The fleet's signed time (protocol/signed_time.py): ``GET /api/v1/time?nonce=N``, for devices whose clock is
wrong. No credentials (a device asks before it has any); signed with the TUF timestamp role's key, at most
``MAX_PER_S`` answers a second for all callers together (one signature each), 503 with Retry-After past that."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from ...protocol.signed_time import NONCE_RE, sign_time
from .. import schemas as out
from .context import Fleet

__all__ = ["MAX_PER_S", "router"]

MAX_PER_S = 200  # signatures a second, all callers together: a fleet's devices ask once per connect and update


class _PerSecond:
    """At most ``limit`` takes in each wall-clock second (monotonic)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._second, self._count = -1, 0

    def take(self) -> bool:
        now = int(time.monotonic())
        with self._lock:
            if now != self._second:
                self._second, self._count = now, 0
            self._count += 1
            return self._count <= self.limit


def router(fleet: Fleet) -> APIRouter:
    r = APIRouter()
    keys, budget = fleet.repo.keys, _PerSecond(MAX_PER_S)

    @r.get("/api/v1/time", response_model=out.SignedTime, responses={503: {"model": out.Error}})
    def signed_time(nonce: str = Query(pattern=NONCE_RE.pattern, description="32-64 lowercase hex digits, "
                                                                               "fresh for each request")) -> Any:
        """The fleet's time, signed with the TUF timestamp role's key for this ``nonce`` (protocol.signed_time):
        what an agent checks TUF metadata's expiry against when its own clock is off."""
        if not budget.take():
            return JSONResponse({"error": "too many signed-time requests this second; retry"}, status_code=503,
                                headers={"Retry-After": "1"})
        return sign_time(keys.signer("timestamp"), dt.datetime.now(dt.UTC), nonce)

    return r
