"""Inference engines: one implementation per runtime, shared by everything that runs a model.

The compiler's accuracy gate and benchmark, the agent's batcher, self-test, warm-up and shadow,
``edgefleet verify`` and the benchmarks in ``bench/`` all load engines through :func:`load`, so the figure
the gate signs is produced by the code that serves. A new runtime is one module here: an :class:`Engine` subclass
and its record, ``RUNTIME = Runtime(...)`` (:class:`engines.base.Runtime`: the backend whose files it loads, its
precisions, the modules that provide it, its file suffix and its build target in ``compiler/targets/``), found by
this package at import; plus its run of tests/test_engines_conformance.py. The registry's kinds are the manifest's
(``protocol.manifest.Backend``) and the compiler's targets, which tests/test_runtime_records.py keeps equal.

A runtime may also load another kind's files: OpenVINO runs the same ONNX/QDQ files as onnxruntime, so a bundle's
backend stays ``onnxruntime`` and the runtime that executes it is a choice on the device (:func:`runtimes_for`
lists them, :func:`runtime_installed` says which are here; the agent times them at install).

Runtimes (onnxruntime, openvino, ai_edge_litert, tensorrt, CUDA bindings) are imported only when an engine of their
kind is loaded, so ``import engines`` works on a box that has only some of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path

from ..protocol.manifest import Manifest
from .base import NP_DTYPES, Engine, EngineSpec, Runtime
from .errors import EngineClosed, EngineError, EngineInputError, EngineLoadError, EngineRunError

__all__ = ["EXTRAS", "KINDS", "NP_DTYPES", "RUNTIMES", "Engine", "EngineClosed", "EngineError", "EngineInputError",
           "EngineLoadError", "EngineRunError", "EngineSpec", "Runtime", "load", "load_bundle_engine", "record",
           "runtime_installed", "runtimes_for"]


def _records() -> dict[str, Runtime]:
    """Every runtime, by name, in the records' order: the ``RUNTIME`` record of each module of this package that
    declares one (the modules import their runtimes lazily, so this imports none)."""
    found: dict[str, Runtime] = {}
    for info in pkgutil.iter_modules(__path__):
        entry = getattr(importlib.import_module(f"{__name__}.{info.name}"), "RUNTIME", None)
        if isinstance(entry, Runtime):
            if entry.name in found:
                raise ImportError(f"two engine modules declare the runtime {entry.name!r}")
            found[entry.name] = entry
    return dict(sorted(found.items(), key=lambda item: (item[1].order, item[0])))


_REGISTRY = _records()
RUNTIMES = tuple(_REGISTRY)  # every runtime this package can drive
KINDS = tuple(k for k, e in _REGISTRY.items() if e.backend == k)  # the manifest's backends: the file formats
EXTRAS = {k: e.extra for k, e in _REGISTRY.items()}  # what installs a runtime, for the error a box without it gets


def record(runtime: str) -> Runtime:
    """The record of ``runtime`` (a manifest backend is the runtime of its own name); EngineLoadError if none."""
    entry = _REGISTRY.get(runtime)
    if entry is None:
        raise EngineLoadError(f"no {runtime!r} engine here (available: {', '.join(sorted(_REGISTRY))})")
    return entry


def runtimes_for(backend: str, precision: str | None = None) -> tuple[str, ...]:
    """The runtimes that load a ``backend``'s engine files (in ``precision``, if given), the backend's own first."""
    return tuple(sorted((k for k, e in _REGISTRY.items() if e.backend == backend and (precision is None
                                                                                       or precision in e.precisions)),
                        key=lambda k: k != backend))


def runtime_installed(runtime: str) -> bool:
    """Whether ``runtime``'s module can be imported here (looked up, not imported)."""
    entry = _REGISTRY.get(runtime)
    if entry is None:
        return False
    for module in entry.modules:
        try:
            if importlib.util.find_spec(module) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def load(kind: str, engine: Path, spec: EngineSpec, threads: int,
         providers: tuple[str, ...] | None = None) -> Engine:
    """A loaded engine of ``kind`` from the file ``engine``, with ``threads`` CPU threads. ``providers``: the
    execution providers to ask for, best first, for a runtime that has them (onnxruntime; default: from the
    spec's profile); the others run where their engine was built for."""
    entry = record(kind)
    if spec.precision not in entry.precisions:
        others = [k for k, e in _REGISTRY.items() if spec.precision in e.precisions]
        missing = [EXTRAS[k] for k in others if not runtime_installed(k)]
        raise EngineLoadError(f"{spec.label}: the {kind} runtime does not run {spec.precision} engines"
                              + (f"; {', '.join(others)} {'does' if len(others) == 1 else 'do'}" if others else "")
                              + (f" (install {', '.join(missing)})" if missing else ""))
    instance: Engine = entry.engine(spec, providers=providers)
    try:
        instance.load(engine, threads)
    except BaseException:
        instance.close()
        raise
    return instance


def load_bundle_engine(manifest: Manifest, engine: Path, threads: int,
                       providers: tuple[str, ...] | None = None, runtime: str | None = None) -> Engine:
    """The engine of an installed bundle, as its manifest describes it, run by ``runtime`` (default: the
    manifest's backend, or the first runtime that runs its precision; another must load that backend's files,
    see :func:`runtimes_for`)."""
    runtime = runtime or (runtimes_for(manifest.backend, manifest.precision) or (manifest.backend,))[0]
    if runtime not in runtimes_for(manifest.backend) and runtime in _REGISTRY:
        raise EngineLoadError(f"the {runtime} runtime cannot run a {manifest.backend} bundle (its runtimes: "
                              f"{', '.join(runtimes_for(manifest.backend))})")
    return load(runtime, engine, EngineSpec.from_manifest(manifest), threads, providers)
