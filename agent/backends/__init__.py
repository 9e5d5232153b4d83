"""Inference backends. A new runtime is one new module plus one line in ``_REGISTRY``.

Heavy runtimes (tensorrt) are imported only when a bundle asks for them.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from agent.backends.base import Backend
from agent.errors import BackendError
from protocol.manifest import Manifest

__all__ = ["Backend", "load_backend"]

_REGISTRY = {
    "onnxruntime": ("agent.backends.onnxruntime", "OnnxRuntimeBackend"),
}


def load_backend(manifest: Manifest, engine: Path, threads: int) -> Backend:
    entry = _REGISTRY.get(manifest.backend)
    if entry is None:
        raise BackendError(f"this agent has no {manifest.backend!r} backend "
                           f"(available: {', '.join(sorted(_REGISTRY))})")
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    backend: Backend = cls(manifest)
    backend.load(engine, threads)
    return backend
