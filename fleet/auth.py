"""Operator tokens: bearer tokens with a role (viewer < operator < admin), stored as SHA-256 only.

A token is 256 random bits, so a fast hash is enough to make a stolen database useless (no
dictionary to try). The first start of a fleet with no token writes an admin token to
``<data_dir>/admin-token`` (mode 0600), the way Jenkins hands out its first password; that admin
makes the others over the API (``POST /api/v1/tokens``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from .audit import audit
from .db import ApiToken, utcnow
from .errors import BadRequest, Conflict, Forbidden, NotFound, Unauthorized

__all__ = ["ROLES", "Caller", "TokenStore"]

ROLES = ("viewer", "operator", "admin")
TOKEN_PREFIX = "eft_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
log = logging.getLogger("edgefleet.fleet.auth")


@dataclass(frozen=True)
class Caller:
    name: str
    role: str

    def require(self, role: str, what: str) -> None:
        if ROLES.index(self.role) < ROLES.index(role):
            raise Forbidden(f"token {self.name!r} has role {self.role}; {what} needs {role}")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenStore:
    CACHE_S = 2.0  # a revoked token stops working within this

    def __init__(self, sessions: sessionmaker):
        self.sessions = sessions
        self._cache: dict[str, tuple[float, Caller | None]] = {}
        self._lock = threading.Lock()

    def bootstrap_admin(self, path: Path) -> Path | None:
        """With no token at all, make an admin token and write it to ``path``; else do nothing."""
        with self.sessions() as s:
            if (s.scalar(select(func.count()).select_from(ApiToken)) or 0) > 0:
                return None
        try:
            token = self.create("admin", "admin", actor="fleet (first start)")["token"]
        except Conflict:
            return None  # another replica made it
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        log.warning("no API token existed: wrote an admin token to %s", path)
        return path

    def create(self, name: str, role: str, actor: str) -> dict[str, str]:
        if role not in ROLES:
            raise BadRequest(f"role {role!r} is not one of {', '.join(ROLES)}", 422)
        if not NAME_RE.match(name):
            raise BadRequest(f"token name {name!r} must be 1-64 of [A-Za-z0-9_.@-]", 422)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        try:
            with self.sessions.begin() as s:
                s.add(ApiToken(name=name, role=role, token_sha256=_digest(token), created_by=actor))
                audit(s, actor, "token_created", token_name=name, role=role)
        except IntegrityError as exc:
            raise Conflict(f"a token named {name!r} exists; revoke it first or pick another name") from exc
        return {"name": name, "role": role, "token": token}

    def revoke(self, name: str, actor: str) -> None:
        with self.sessions.begin() as s:
            t = s.scalar(select(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None)))
            if t is None:
                raise NotFound(f"no active token named {name!r}")
            t.revoked_at = utcnow()
            audit(s, actor, "token_revoked", token_name=name)
        with self._lock:
            self._cache.clear()

    def list(self) -> list[dict[str, object]]:
        with self.sessions() as s:
            return [{"name": t.name, "role": t.role, "created_by": t.created_by,
                     "created_at": t.created_at.isoformat(), "revoked": t.revoked_at is not None}
                    for t in s.scalars(select(ApiToken).order_by(ApiToken.id))]

    def check(self, authorization: str | None) -> Caller:
        """The caller behind an ``Authorization: Bearer ...`` header, or Unauthorized naming why."""
        if not authorization:
            raise Unauthorized("no API token: send 'Authorization: Bearer <token>' (an admin makes tokens with "
                               "POST /api/v1/tokens; the first one is in the fleet's data dir, admin-token)")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("the Authorization header must be 'Bearer <token>'")
        if len(token) > 200:
            raise Unauthorized("that is not an edgefleet API token (too long)")
        digest = _digest(token)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is None or now - hit[0] > self.CACHE_S:
            with self.sessions() as s:
                row = s.scalar(select(ApiToken).where(ApiToken.token_sha256 == digest))
                caller = None if row is None or row.revoked_at is not None else Caller(row.name, row.role)
                if row is not None and not hmac.compare_digest(row.token_sha256, digest):
                    caller = None
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[digest] = (now, caller)
        else:
            caller = hit[1]
        if caller is None:
            raise Unauthorized("unknown or revoked API token")
        return caller
