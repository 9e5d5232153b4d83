"""Inference backends. A new runtime is one new module plus one line in ``_REGISTRY``.

The manifest's ``backend`` (what the compiler built: onnxruntime, litert or tensorrt) picks the module.
Runtimes (ai_edge_litert, tensorrt, CUDA bindings) are imported only when a bundle asks for them, so
``import agent`` works on a box that has only some of them.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from agent.backends.base import Backend
from agent.errors import BackendError
from protocol.manifest import Manifest

__all__ = ["BACKENDS", "Backend", "load_backend"]

_REGISTRY = {
    "onnxruntime": ("agent.backends.onnxruntime", "OnnxRuntimeBackend"),
    "litert": ("agent.backends.litert", "LiteRTBackend"),
    "tensorrt": ("agent.backends.tensorrt", "TensorRTBackend"),
}
BACKENDS = tuple(_REGISTRY)


def load_backend(manifest: Manifest, engine: Path, threads: int, *,
                 onnxruntime_providers: tuple[str, ...] | None = None) -> Backend:
    """A loaded backend for ``manifest``'s engine. ``onnxruntime_providers`` overrides the execution providers
    an onnxruntime bundle's profile asks for (ignored by other backends)."""
    entry = _REGISTRY.get(manifest.backend)
    if entry is None:
        raise BackendError(f"this agent has no {manifest.backend!r} backend "
                           f"(available: {', '.join(sorted(_REGISTRY))})")
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    kwargs: dict[str, Any] = {}
    if manifest.backend == "onnxruntime" and onnxruntime_providers is not None:
        kwargs["providers"] = onnxruntime_providers
    backend: Backend = cls(manifest, **kwargs)
    try:
        backend.load(engine, threads)
    except BaseException:
        backend.close()
        raise
    return backend
