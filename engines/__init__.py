"""Inference engines: one implementation per runtime, shared by everything that runs a model.

The compiler's accuracy gate and benchmark, the agent's batcher, self-test, warm-up and shadow,
``edgefleet verify`` and the benchmarks in ``bench/`` all load engines through :func:`load`, so the figure
the gate signs is produced by the code that serves. A new runtime is one module here (an :class:`Engine`
subclass) plus one line in ``_REGISTRY``, and its build target in ``compiler/targets/``; the registry's
kinds are the manifest's (``protocol.manifest.Backend``), which a test keeps equal.

A runtime may also load another kind's files: OpenVINO runs the same ONNX/QDQ files as onnxruntime, so a bundle's
backend stays ``onnxruntime`` and the runtime that executes it is a choice on the device (:func:`runtimes_for`
lists them, :func:`runtime_installed` says which are here; the agent times them at install).

Runtimes (onnxruntime, openvino, ai_edge_litert, tensorrt, CUDA bindings) are imported only when an engine of their
kind is loaded, so ``import engines`` works on a box that has only some of them.
"""

from __future__ import annotations

if __name__ != "edgefleet.engines":  # the folder engines/ is installed as edgefleet.engines (pyproject.toml)
    raise ImportError(f"import edgefleet.engines, not {__name__}: edgefleet installs one top-level name")

import importlib
import importlib.util
from pathlib import Path

from edgefleet.engines.base import NP_DTYPES, Engine, EngineSpec
from edgefleet.engines.errors import EngineClosed, EngineError, EngineInputError, EngineLoadError, EngineRunError
from edgefleet.protocol.manifest import Manifest

__all__ = ["EXTRAS", "KINDS", "NP_DTYPES", "RUNTIMES", "Engine", "EngineClosed", "EngineError", "EngineInputError",
           "EngineLoadError", "EngineRunError", "EngineSpec", "load", "load_bundle_engine", "runtime_installed",
           "runtimes_for"]

_GATED = ("fp32", "fp16", "int8")
# runtime -> (module, class, the manifest backend whose engine files it loads, the precisions it runs, the modules
# it needs, any of them). bf16 is OpenVINO's alone: onnxruntime would run a bf16 bundle's ONNX file in fp32
_REGISTRY: dict[str, tuple[str, str, str, tuple[str, ...], tuple[str, ...]]] = {
    "onnxruntime": ("edgefleet.engines.onnxruntime", "OnnxRuntimeEngine", "onnxruntime", _GATED, ("onnxruntime",)),
    "litert": ("edgefleet.engines.litert", "LiteRTEngine", "litert", _GATED, ("ai_edge_litert", "tflite_runtime")),
    "tensorrt": ("edgefleet.engines.tensorrt", "TensorRTEngine", "tensorrt", _GATED, ("tensorrt",)),
    "openvino": ("edgefleet.engines.openvino", "OpenVINOEngine", "onnxruntime", ("fp32", "int8", "bf16"),
                 ("openvino",)),
}
RUNTIMES = tuple(_REGISTRY)  # every runtime this package can drive
KINDS = tuple(k for k, e in _REGISTRY.items() if e[2] == k)  # the manifest's backends: the file formats
# the extra that installs a runtime, for the error a box without it gets
EXTRAS = {"onnxruntime": "edgefleet[onnxruntime]", "litert": "edgefleet[agent]", "tensorrt": "JetPack's tensorrt",
          "openvino": "edgefleet[openvino]"}


def runtimes_for(backend: str, precision: str | None = None) -> tuple[str, ...]:
    """The runtimes that load a ``backend``'s engine files (in ``precision``, if given), the backend's own first."""
    return tuple(sorted((k for k, e in _REGISTRY.items() if e[2] == backend and (precision is None
                                                                                  or precision in e[3])),
                        key=lambda k: k != backend))


def runtime_installed(runtime: str) -> bool:
    """Whether ``runtime``'s module can be imported here (looked up, not imported)."""
    entry = _REGISTRY.get(runtime)
    if entry is None:
        return False
    for module in entry[4]:
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
    entry = _REGISTRY.get(kind)
    if entry is None:
        raise EngineLoadError(f"no {kind!r} engine here (available: {', '.join(sorted(_REGISTRY))})")
    if spec.precision not in entry[3]:
        others = [k for k, e in _REGISTRY.items() if spec.precision in e[3]]
        missing = [EXTRAS[k] for k in others if not runtime_installed(k)]
        raise EngineLoadError(f"{spec.label}: the {kind} runtime does not run {spec.precision} engines"
                              + (f"; {', '.join(others)} {'does' if len(others) == 1 else 'do'}" if others else "")
                              + (f" (install {', '.join(missing)})" if missing else ""))
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    instance: Engine = cls(spec, providers=providers)
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
