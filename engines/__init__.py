"""Inference engines: one implementation per runtime, shared by everything that runs a model.

The compiler's accuracy gate and benchmark, the agent's batcher, self-test, warm-up and shadow,
``edgefleet verify`` and the benchmarks in ``bench/`` all load engines through :func:`load`, so the figure
the gate signs is produced by the code that serves. A new runtime is one module here (an :class:`Engine`
subclass) plus one line in ``_REGISTRY``, and its build target in ``compiler/targets/``; the registry's
kinds are the manifest's (``protocol.manifest.Backend``), which a test keeps equal.

Runtimes (onnxruntime, ai_edge_litert, tensorrt, CUDA bindings) are imported only when an engine of their
kind is loaded, so ``import engines`` works on a box that has only some of them.
"""

from __future__ import annotations

if __name__ != "edgefleet.engines":  # the folder engines/ is installed as edgefleet.engines (pyproject.toml)
    raise ImportError(f"import edgefleet.engines, not {__name__}: edgefleet installs one top-level name")

import importlib
from pathlib import Path

from edgefleet.engines.base import NP_DTYPES, Engine, EngineSpec
from edgefleet.engines.errors import EngineClosed, EngineError, EngineInputError, EngineLoadError, EngineRunError
from edgefleet.protocol.manifest import Manifest

__all__ = ["KINDS", "NP_DTYPES", "Engine", "EngineClosed", "EngineError", "EngineInputError", "EngineLoadError",
           "EngineRunError", "EngineSpec", "load", "load_bundle_engine"]

_REGISTRY = {
    "onnxruntime": ("edgefleet.engines.onnxruntime", "OnnxRuntimeEngine"),
    "litert": ("edgefleet.engines.litert", "LiteRTEngine"),
    "tensorrt": ("edgefleet.engines.tensorrt", "TensorRTEngine"),
}
KINDS = tuple(_REGISTRY)


def load(kind: str, engine: Path, spec: EngineSpec, threads: int,
         providers: tuple[str, ...] | None = None) -> Engine:
    """A loaded engine of ``kind`` from the file ``engine``, with ``threads`` CPU threads. ``providers``: the
    execution providers to ask for, best first, for a runtime that has them (onnxruntime; default: from the
    spec's profile); the others run where their engine was built for."""
    entry = _REGISTRY.get(kind)
    if entry is None:
        raise EngineLoadError(f"no {kind!r} engine here (available: {', '.join(sorted(_REGISTRY))})")
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    instance: Engine = cls(spec, providers=providers)
    try:
        instance.load(engine, threads)
    except BaseException:
        instance.close()
        raise
    return instance


def load_bundle_engine(manifest: Manifest, engine: Path, threads: int,
                       providers: tuple[str, ...] | None = None) -> Engine:
    """The engine of an installed bundle, as its manifest describes it."""
    return load(manifest.backend, engine, EngineSpec.from_manifest(manifest), threads, providers)
