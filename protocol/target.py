"""The custom fields signed with a bundle's TUF target: what the fleet (or the compiler's CI key) vouches for
about a bundle, which an agent reads before it downloads a byte of it.

Written by ``fleet.keys.bundle_target`` into ``targets[path].custom``; read by the agent's TUF client
(``agent.updater``), which refuses a target whose fields it cannot read. Strict like every message of the
protocol: a field this agent does not know (from a newer fleet) is refused with its name, never ignored,
since an ignored field could be a requirement the agent does not meet. Optional fields left unset are not
written, so a fleet that adds one keeps older agents working until it uses it.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator

from protocol._strict import StrictModel, problems_from
from protocol.errors import SchemaError
from protocol.manifest import NAME_RE, Backend, Manifest, Precision, version_key

__all__ = ["TargetCustom", "target_path"]

MAX_CPU_FEATURES = 64  # a profile names a handful (avx2, avx512_vnni, neon...)


def target_path(manifest: Manifest) -> str:
    """Where a bundle lives in the TUF repository: one target per model, version and profile."""
    return f"{manifest.name}/{manifest.version}/{manifest.profile}.tar"


class TargetCustom(StrictModel):
    name: str = Field(max_length=63)
    version: str = Field(max_length=32)
    profile: str = Field(max_length=63)
    # None: not recorded (repositories and CI signers from before they were); the agent reads neither
    backend: Backend | None = None
    precision: Precision | None = None
    # the instruction sets the engine needs; None in repositories from before they were recorded (the agent
    # then checks what the profile promises)
    cpu_features: tuple[str, ...] | None = Field(default=None, max_length=MAX_CPU_FEATURES)

    @field_validator("name", "profile")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError("names are 1-63 of [a-z0-9._-], starting with a letter or digit")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        version_key(v)
        return v

    @field_validator("cpu_features")
    @classmethod
    def _features(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and any(not f or len(f) > 32 for f in v):
            raise ValueError("CPU feature names are 1-32 characters")
        return v

    @classmethod
    def of(cls, manifest: Manifest) -> TargetCustom:
        return cls(name=manifest.name, version=manifest.version, profile=manifest.profile,
                   backend=manifest.backend, precision=manifest.precision, cpu_features=tuple(manifest.cpu_features))

    @classmethod
    def parse(cls, data: Any, source: str) -> TargetCustom:
        """Validate what a target's metadata says (``source`` names it in the error)."""
        if not isinstance(data, dict):
            raise SchemaError(source, [f"custom fields: expected a mapping, got {type(data).__name__}"])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SchemaError(source, problems_from(exc)) from exc

    def signed_fields(self) -> dict[str, Any]:
        """As written into the TUF metadata: JSON data, unset optional fields left out."""
        return self.model_dump(mode="json", exclude_none=True)
