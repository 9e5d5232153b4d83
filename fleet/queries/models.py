"""The builds the fleet holds, as rows: one by its name, version and profile, a new one stored, all of them. Each
takes the caller's session; fleet.service.models checks and signs a bundle and answers with schema models."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ...protocol.manifest import Manifest
from ..db import Model

__all__ = ["add_build", "build", "builds"]


def build(s: Session, name: str, version: str, profile: str) -> Model | None:
    return s.scalars(select(Model).where(Model.name == name, Model.version == version,
                                         Model.profile == profile)).first()


def add_build(s: Session, manifest: Manifest, target_path: str, sha256: str, size_bytes: int) -> Model:
    """The build of a checked, signed bundle (the TUF target ``target_path``), flushed: an IntegrityError here is a
    concurrent upload of the same build."""
    m = Model(name=manifest.name, version=manifest.version, profile=manifest.profile, backend=manifest.backend,
              precision=manifest.precision, target_path=target_path, sha256=sha256, size_bytes=size_bytes,
              accuracy=manifest.accuracy.candidate, manifest=manifest.model_dump(mode="json"))
    s.add(m)
    s.flush()
    return m


def builds(s: Session) -> list[Model]:
    return list(s.scalars(select(Model)))
