"""What every router is built from: the fleet's parts (``Fleet``), the role dependencies and shared field types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

from fastapi import Depends, Header, Query
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from .. import schemas as out
from .. import service as svc
from ..auth import Caller, TokenStore
from ..enroll import Enrollment
from ..service import FleetService
from ..tuf_repo import Repository

__all__ = ["NAME", "Body", "Fleet", "Offset", "Roles", "RolloutId", "Tags", "roles"]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite (1e400 is refused)


NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# rollouts.id is an INTEGER (32-bit on PostgreSQL: a larger id in a query answered 500)
RolloutId = Annotated[int, PathParam(ge=1, lt=2**31, description="a rollout's id")]
Tag = Annotated[str, StringConstraints(min_length=1, max_length=svc.MAX_TAG_CHARS)]
Tags = Annotated[list[Tag], Field(max_length=svc.MAX_TAGS)]
# a query's offset: a row count no table reaches, far below a database's 64-bit limit
Offset = Annotated[int, Query(ge=0, le=out.MAX_OFFSET)]


class Roles(NamedTuple):
    """FastAPI dependencies: the caller of a bearer token, and the same caller required to hold a role."""

    caller: Callable[..., Caller]
    viewer: Callable[..., Caller]
    operator: Callable[..., Caller]
    admin: Callable[..., Caller]


def roles(store: TokenStore) -> Roles:
    def caller(authorization: str | None = Header(default=None)) -> Caller:
        return store.check(authorization)

    def viewer(c: Caller = Depends(caller)) -> Caller:
        return c

    def operator(c: Caller = Depends(caller)) -> Caller:
        c.require("operator", "this change")
        return c

    def admin(c: Caller = Depends(caller)) -> Caller:
        c.require("admin", "managing tokens")
        return c

    return Roles(caller, viewer, operator, admin)


@dataclass(frozen=True)
class Fleet:
    """The parts a fleet server's routes answer from (``fleet.api.create_app`` builds it once)."""

    service: FleetService
    repo: Repository
    store: TokenStore
    roles: Roles
    bootstrap: dict[str, Any]
    health: Callable[[], dict[str, Any]]
    max_upload_bytes: int
    enrollment: Enrollment | None = None
    replica_stats: Callable[[], dict[str, Any]] | None = None
