"""Device enrollment: a one-time token becomes the device's own MQTT credentials.

    operator:  token = enroll.issue_token("cam-7")        (shown once; only its sha256 is stored)
    device:    creds = enroll.redeem(token)                (once; the password is shown only here)
    operator:  enroll.decommission("cam-7")                (the device can no longer connect)

The tables live in their own metadata (``enroll_tokens``, ``device_credentials``) beside the fleet's
registry, so they are created on any fleet database without touching its migrations. Whenever the
set of active credentials changes, ``on_change`` is called (the fleet rewrites Mosquitto's password
and ACL files and sends SIGHUP: see ``fleet.acl``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from ..protocol import mqtt as proto
from .acl import FLEET_USER, Account, hash_password
from .errors import BadRequest, NotFound

__all__ = ["DeviceCredentials", "Enrollment"]

TOKEN_TTL = dt.timedelta(hours=24)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def _sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class _Base(DeclarativeBase):
    pass


class EnrollToken(_Base):
    __tablename__ = "enroll_tokens"
    token_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    device_id: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    expires_at: Mapped[dt.datetime] = mapped_column()
    used_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class DeviceCredential(_Base):
    __tablename__ = "device_credentials"
    username: Mapped[str] = mapped_column(String(64), primary_key=True)  # the device id (or the fleet's user)
    password_hash: Mapped[str] = mapped_column(String(256))  # fleet.acl.hash_password
    state: Mapped[str] = mapped_column(String(16), default="active")  # active | decommissioned
    issued_at: Mapped[dt.datetime] = mapped_column(default=_now)


@dataclass(frozen=True)
class DeviceCredentials:
    device_id: str
    username: str
    password: str  # shown once, never stored


class Enrollment:
    def __init__(self, engine: Engine, on_change: Callable[[list[Account]], object] | None = None):
        _Base.metadata.create_all(engine)
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self.on_change = on_change

    def issue_token(self, device_id: str, ttl: dt.timedelta = TOKEN_TTL) -> str:
        problem = proto.device_id_problem(device_id)
        if problem is not None:
            raise BadRequest(problem)
        token = "eft_" + secrets.token_urlsafe(32)
        with self.sessions.begin() as s:
            s.add(EnrollToken(token_sha256=_sha256(token), device_id=device_id, expires_at=_now() + ttl))
        return token

    def redeem(self, token: str) -> DeviceCredentials:
        """Trade a token (once, before it expires) for the device's MQTT credentials; a device that
        enrolls again gets a new password and the old one stops working."""
        digest = _sha256(token)
        password = secrets.token_urlsafe(32)
        with self.sessions.begin() as s:
            row = s.get(EnrollToken, digest, with_for_update=True)
            if row is None or not hmac.compare_digest(row.token_sha256, digest):
                raise BadRequest("unknown enrollment token", 401)
            if row.used_at is not None:
                raise BadRequest("this enrollment token was already used; issue a new one", 401)
            if row.expires_at < _now():
                raise BadRequest("this enrollment token has expired; issue a new one", 401)
            problem = proto.device_id_problem(row.device_id)
            if problem is not None:  # a token from before names were reserved: never the fleet's own account
                raise BadRequest(f"this enrollment token cannot be redeemed: {problem}", 403)
            row.used_at = _now()
            cred = s.get(DeviceCredential, row.device_id)
            if cred is None:
                s.add(DeviceCredential(username=row.device_id, password_hash=hash_password(password)))
            else:
                cred.password_hash, cred.state, cred.issued_at = hash_password(password), "active", _now()
            device_id = row.device_id
        self._changed()
        return DeviceCredentials(device_id, device_id, password)

    def set_fleet_password(self, password: str) -> None:
        """The fleet's own broker account (read and write everything under the device topics)."""
        with self.sessions.begin() as s:
            cred = s.get(DeviceCredential, FLEET_USER)
            if cred is None:
                s.add(DeviceCredential(username=FLEET_USER, password_hash=hash_password(password)))
            else:
                cred.password_hash, cred.state = hash_password(password), "active"
        self._changed()

    def decommission(self, device_id: str) -> None:
        with self.sessions.begin() as s:
            cred = s.get(DeviceCredential, device_id)
            if cred is None or device_id == FLEET_USER:
                raise NotFound(f"device {device_id!r} has no credentials")
            cred.state = "decommissioned"
            for t in s.scalars(select(EnrollToken).where(EnrollToken.device_id == device_id,
                                                         EnrollToken.used_at.is_(None))):
                t.used_at = _now()  # unused tokens die with the device
        self._changed()

    def accounts(self) -> list[Account]:
        with self.sessions() as s:
            rows = s.scalars(select(DeviceCredential).where(DeviceCredential.state == "active")
                             .order_by(DeviceCredential.username))
            return [Account(r.username, r.password_hash) for r in rows]

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.accounts())
