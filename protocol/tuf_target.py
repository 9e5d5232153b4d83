"""The custom fields signed with a bundle's TUF target: what the fleet (or the compiler's CI key) vouches for
about a bundle, which an agent reads before it downloads a byte of it.

Written by ``fleet.keys.bundle_target`` into ``targets[path].custom``; read by the agent's TUF client
(``agent.link.updater``), which refuses a target whose fields it cannot read. Strict like every message of the
protocol: a field this agent does not know (from a newer fleet) is refused with its name, never ignored,
since an ignored field could be a requirement the agent does not meet. Optional fields left unset are not
written, so a fleet that adds one keeps older agents working until it uses it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from ._strict import StrictModel, parse_document
from .manifest import NAME_RE, VERSION_RE, Backend, Manifest, Precision

__all__ = ["TargetCustom", "target_path"]

MAX_CPU_FEATURES = 64  # a profile names a handful (avx2, avx512_vnni, neon...)


def target_path(manifest: Manifest) -> str:
    """Where a bundle lives in the TUF repository: one target per model, version and profile."""
    return f"{manifest.name}/{manifest.version}/{manifest.profile}.tar"


class TargetCustom(StrictModel):
    name: str = Field(pattern=f"^{NAME_RE.pattern}$")  # the manifest's rules
    version: str = Field(pattern=f"^{VERSION_RE.pattern}$")
    profile: str = Field(pattern=f"^{NAME_RE.pattern}$")
    # None: not recorded (repositories and CI signers from before they were); the agent reads neither
    backend: Backend | None = None
    precision: Precision | None = None
    # the instruction sets the engine needs; None in repositories from before they were recorded (the agent
    # then checks what the profile promises)
    cpu_features: tuple[Annotated[str, Field(min_length=1, max_length=32)], ...] | None = Field(
        default=None, max_length=MAX_CPU_FEATURES)

    @classmethod
    def of(cls, manifest: Manifest) -> TargetCustom:
        return cls(name=manifest.name, version=manifest.version, profile=manifest.profile,
                   backend=manifest.backend, precision=manifest.precision, cpu_features=tuple(manifest.cpu_features))

    @classmethod
    def parse(cls, data: Any, source: str) -> TargetCustom:
        """Validate what a target's metadata says (``source`` names it in the error)."""
        return parse_document(cls, data, source)

    def signed_fields(self) -> dict[str, Any]:
        """As written into the TUF metadata: JSON data, unset optional fields left out."""
        return self.model_dump(mode="json", exclude_none=True)
