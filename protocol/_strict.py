"""Strict parsing: pydantic models that forbid unknown keys, with errors that name file and key."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import SchemaError

__all__ = ["StrictModel", "parse_document", "problems_from"]

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Frozen, no unknown keys, no silent coercion of strings to numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, protected_namespaces=(),
                              allow_inf_nan=False)


def problems_from(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(document)"
        kind = err["type"]
        if kind == "extra_forbidden":
            out.append(f"unknown key '{loc}'")
        elif kind == "missing":
            out.append(f"missing key '{loc}'")
        else:
            out.append(f"key '{loc}': {err['msg']}")
    return out


def parse_document(model: type[M], data: Any, source: str) -> M:
    """Validate ``data`` (already decoded) against ``model``; raise SchemaError naming ``source``."""
    if not isinstance(data, dict):
        raise SchemaError(source, [f"expected a mapping at the top level, got {type(data).__name__}"])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise SchemaError(source, problems_from(exc)) from exc
