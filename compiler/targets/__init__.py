"""Build targets: one module per runtime, each implementing :class:`compiler.targets.base.BuildTarget` (building
only; the engines it builds run through :mod:`engines`). Which class builds a backend's engines is that runtime's
record (``engines.record(backend).target``), declared once by its engine module."""

from __future__ import annotations

import importlib

from ... import engines
from ..errors import ToolchainError
from .base import BuildTarget

__all__ = ["BuildTarget", "get_target"]


def get_target(backend: str) -> BuildTarget:
    """A build target for ``backend``'s engine files, as its runtime's record names it."""
    entry = engines.record(backend) if backend in engines.RUNTIMES else None
    if entry is None or not entry.target:
        raise ToolchainError(f"no build target for backend {backend!r} (backends with one: {', '.join(engines.KINDS)})")
    module, _, name = entry.target.partition(":")
    target: BuildTarget = getattr(importlib.import_module(module), name)()
    return target
