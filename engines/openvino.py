"""OpenVINO engine: Intel's CPU runtime, running the same ONNX and QDQ INT8 files the onnxruntime engine runs.

A second runtime for an ``onnxruntime`` bundle's engine file (the manifest's backend stays ``onnxruntime``; the
registry says which runtimes load which backend's files, and the agent chooses among those installed). Measured
on a 2-core AVX-512 EPYC (issue 35): 1.1-1.9x onnxruntime's throughput on the compiler's QDQ INT8 models, equal
on FP32.

Precision is always set, never left to OpenVINO: its CPU plugin's default on a CPU with avx512_bf16 or AMX runs
an FP32 model in bf16 (faster, but answers no gate judged). :func:`precision_hint` maps the bundle's precision
to ``INFERENCE_PRECISION_HINT``: ``f32`` for fp32 and int8 bundles (the QDQ nodes decide what runs in int8), and
``bf16`` only for a bf16 bundle, whose gate judged bf16 answers; the compiled model's own hint is read back and
a difference is a load error. A bf16 bundle on a CPU that OpenVINO says cannot run bf16 does not load (OpenVINO
would quietly run f32 and the engine would claim bf16).

Threads: one engine instance is one stream of ``threads`` threads (the agent's layout picks instances x threads,
as for onnxruntime), latency hint, no pinning of its own (the agent pins its inference CPUs itself, and several
instances pinned by OpenVINO would pile onto the same cores).

``openvino`` is imported only in :meth:`OpenVINOEngine.load`: it is the optional extra ``edgefleet[openvino]``.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .base import NP_DTYPES, Engine, EngineSpec, Runtime
from .errors import EngineLoadError, EngineRunError

__all__ = ["EXTRA", "HINTS", "RUNTIME", "OpenVINOEngine", "bf16_capable", "compile_config", "core", "installed",
           "precision_hint"]

log = logging.getLogger("edgefleet.engines.openvino")

EXTRA = "edgefleet[openvino]"
# the bundle's precision -> OpenVINO's INFERENCE_PRECISION_HINT (and the element type's name it reads back as)
HINTS: dict[str, tuple[str, str]] = {"fp32": ("f32", "f32"), "int8": ("f32", "f32"), "bf16": ("bf16", "bf16")}
_core_lock = threading.Lock()
_core: Any = None  # one ov.Core per process: it holds the plugins, and creating it costs ~100 ms


def installed() -> bool:
    """Whether ``openvino`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("openvino") is not None
    except (ImportError, ValueError):
        return False


def precision_hint(precision: str) -> str:
    """The INFERENCE_PRECISION_HINT for a bundle of ``precision``: never OpenVINO's own default."""
    hint = HINTS.get(precision)
    if hint is None:
        raise EngineLoadError(f"OpenVINO serves fp32, int8 and bf16 CPU bundles, not {precision}")
    return hint[0]


def _ov() -> Any:
    try:
        import openvino as ov
    except ImportError as exc:
        raise EngineLoadError(f"OpenVINO is not installed; install {EXTRA}") from exc
    return ov


def _get_core() -> Any:
    global _core
    ov = _ov()
    with _core_lock:
        if _core is None:
            _core = ov.Core()
        return _core


def bf16_capable() -> bool:
    """Whether OpenVINO's CPU plugin can run bf16 on this CPU (its OPTIMIZATION_CAPABILITIES, from CPUID)."""
    try:
        caps = _get_core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except EngineLoadError:
        return False
    return "BF16" in {str(c) for c in caps}


def compile_config(hint: str, threads: int) -> dict[str, Any]:
    """The CPU plugin's properties an engine of ``threads`` threads compiles with (bench/serve.py times raw OpenVINO
    with the same): the precision hint, one stream, latency hint, no pinning of its own."""
    return {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": int(threads), "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}


def core() -> Any:
    """The process's ov.Core (EngineLoadError naming the extra where OpenVINO is not installed)."""
    return _get_core()


def _type_name(t: Any) -> str:
    """An ov.Type's short name (f32, bf16, ...) across OpenVINO versions."""
    name = getattr(t, "get_type_name", None)
    return str(name() if callable(name) else t)


class OpenVINOEngine(Engine):
    kind = "openvino"

    def __init__(self, spec: EngineSpec, providers: tuple[str, ...] | None = None):
        """``providers`` are onnxruntime's: OpenVINO runs on the CPU and takes none."""
        super().__init__(spec, providers)
        self.hint = precision_hint(spec.precision)  # refuses fp16 (a GPU precision) before anything loads
        self._compiled: Any = None
        self._request: Any = None
        self._ports: list[Any] = []
        self._out_dtypes = [np.dtype(NP_DTYPES[o.datatype]) for o in spec.outputs]
        self._run_lock = threading.Lock()  # close() from another thread waits for the batch in flight

    @classmethod
    def cpu_runs(cls, precision: str) -> bool:
        """bf16 only where OpenVINO's CPU plugin lists BF16 (:func:`bf16_capable`); f32 (fp32, int8) anywhere."""
        return bf16_capable() if HINTS.get(precision, ("", ""))[0] == "bf16" else precision in HINTS

    def load(self, engine: Path, threads: int) -> None:
        ov = _ov()
        core = _get_core()
        if self.hint == "bf16" and not bf16_capable():
            raise EngineLoadError(f"{self.spec.label} is a bf16 bundle and OpenVINO cannot run bf16 on this CPU "
                                  "(it needs avx512_bf16 or AMX); it would run f32 while claiming bf16")
        try:
            model = core.read_model(str(engine))
        except Exception as exc:  # OpenVINO raises RuntimeError/its own types for a file it cannot read
            raise EngineLoadError(f"OpenVINO could not read {engine.name}: {' '.join(str(exc).split())[:500]}") \
                from exc
        have = [set(p.get_names()) for p in model.inputs]
        want = {s.name for s in self.inputs}
        if len(have) != len(want) or not all(any(n in names for names in have) for n in want):
            raise EngineLoadError(f"engine inputs {sorted(n for names in have for n in names)} differ from the "
                                  f"spec's {sorted(want)}")
        outs = {n for p in model.outputs for n in p.get_names()}
        missing = [o.name for o in self.outputs if o.name not in outs]
        if missing:
            raise EngineLoadError(f"the engine has no output {missing[0]!r} (it has {sorted(outs)})")
        config = compile_config(self.hint, threads)
        try:
            compiled = core.compile_model(model, "CPU", config)
        except Exception as exc:
            raise EngineLoadError(f"OpenVINO could not compile {engine.name} for the CPU: "
                                  f"{' '.join(str(exc).split())[:500]}") from exc
        got = _type_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
        if got != HINTS[self.spec.precision][1]:
            raise EngineLoadError(f"OpenVINO compiled {self.spec.label} with inference precision {got}, not the "
                                  f"{self.hint} its {self.spec.precision} bundle was gated for")
        self._ports = [compiled.output(o.name) for o in self.outputs]
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        self.device = f"OpenVINO {ov.__version__.split('-')[0]} CPU ({self.hint}, {threads} threads)"

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self._run_lock:
            request = self._request
            if request is None:
                raise EngineRunError(f"{self.spec.label}: the OpenVINO request is gone")
            results = request.infer({k: np.ascontiguousarray(v) for k, v in feeds.items()},
                                    share_inputs=True, share_outputs=False)
            outs = [results[p] for p in self._ports]
        # OpenVINO may hand back a narrower integer type than the ONNX graph's (i64 -> i32): the spec's dtype
        return [o if o.dtype == d else o.astype(d) for o, d in zip(outs, self._out_dtypes, strict=True)]

    def _close_impl(self) -> None:
        with self._run_lock:
            self._request = None
            self._compiled = None


# runs onnxruntime bundles' ONNX/QDQ files (a choice on the device); bf16 is OpenVINO's alone: onnxruntime would run a
# bf16 bundle's ONNX file in fp32
RUNTIME = Runtime(OpenVINOEngine, backend="onnxruntime", precisions=("fp32", "int8", "bf16"), modules=("openvino",),
                  extra=EXTRA, order=30)
