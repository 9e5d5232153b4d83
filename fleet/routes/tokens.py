"""API tokens: listed, created (shown once) and revoked by an admin."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import Field

from .. import schemas as out
from ..auth import Caller
from .context import Body, Fleet


class TokenIn(Body):
    name: str = Field(min_length=1, max_length=64)
    role: str = Field(pattern="^(viewer|operator|admin)$")


def router(fleet: Fleet) -> APIRouter:
    r = APIRouter()
    store, admin = fleet.store, fleet.roles.admin

    @r.get("/api/v1/tokens", response_model=list[out.Token])
    def list_tokens(_: Caller = Depends(admin)) -> list[dict[str, Any]]:
        return store.list()

    @r.post("/api/v1/tokens", status_code=201, response_model=out.TokenCreated)
    def create_token(body: TokenIn, c: Caller = Depends(admin)) -> dict[str, str]:
        """The token is in this answer only; the fleet keeps its SHA-256."""
        return store.create(body.name, body.role, c.name)

    @r.delete("/api/v1/tokens/{name}", status_code=204)
    def revoke_token(name: str, c: Caller = Depends(admin)) -> None:
        store.revoke(name, c.name)

    return r
