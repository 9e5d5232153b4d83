"""onnxruntime engine: x86 and the universal CPU fallback; CUDA and TensorRT execution providers on a GPU.

Which providers to ask for comes from the bundle's hardware profile (``accelerator: gpu``) or the agent's
config; which one *runs* is read back from the session (``get_providers()``): a GPU build of onnxruntime
lists CUDA as available even where the CUDA libraries or the driver are missing, and then quietly runs on
the CPU. ``device`` says what the session actually uses, and a fallback is logged.

:func:`session_options` is the one place onnxruntime's session options are set: the agent, the compiler's
gate and reference runs, and the benchmarks all take them from here.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .base import Engine, EngineSpec, Runtime
from .errors import EngineLoadError, EngineRunError

__all__ = ["CPU", "CUDA", "RUNTIME", "TENSORRT", "OnnxRuntimeEngine", "providers_for", "session_options"]

log = logging.getLogger("edgefleet.engines.onnxruntime")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
KNOWN_PROVIDERS = (TENSORRT, CUDA, CPU)


def providers_for(profile: str | None) -> tuple[str, ...]:
    """The providers an engine built for ``profile`` asks for, best first: the profile's accelerator decides
    (gpu: TensorRT, then CUDA, then CPU). None, or a profile this box does not know, is a CPU one."""
    from ..protocol.errors import EdgefleetError
    from ..protocol.profile import load_profile

    try:
        accelerator = load_profile(profile).accelerator if profile else "cpu"
    except (EdgefleetError, OSError):
        accelerator = "cpu"
    return (TENSORRT, CUDA, CPU) if accelerator == "gpu" else (CPU,)


def session_options(ort: Any, threads: int) -> Any:
    """onnxruntime's session options for serving and for measuring what is served: ``threads`` intra-op
    threads, one inter-op thread, every graph optimization, and no spinning (idle spinning threads steal CPU
    from the HTTP front end, measured here at 20-50% at 32 clients, and from the other session of an
    alternating benchmark)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


class OnnxRuntimeEngine(Engine):
    kind = "onnxruntime"

    def __init__(self, spec: EngineSpec, providers: tuple[str, ...] | None = None):
        """``providers``: execution providers to ask for, best first (default: from the spec's profile)."""
        super().__init__(spec, providers)
        if providers is not None:
            unknown = [p for p in providers if p not in KNOWN_PROVIDERS]
            if unknown or not providers:
                raise EngineLoadError(f"unknown onnxruntime execution provider "
                                      f"{unknown[0] if unknown else '(none)'!r}; known: {', '.join(KNOWN_PROVIDERS)}")
        self.requested: tuple[str, ...] = providers if providers is not None else providers_for(spec.profile)
        self.providers: tuple[str, ...] = ()  # what the session runs on, best first
        self._sess: Any = None

    def _provider_options(self, name: str, engine: Path) -> dict[str, str]:
        if name == TENSORRT:
            # TensorRT builds its engine on first load (minutes on a Jetson): keep it beside the bundle
            return {"trt_fp16_enable": str(self.spec.precision == "fp16"),
                    "trt_int8_enable": str(self.spec.precision == "int8"),
                    "trt_engine_cache_enable": "True",
                    "trt_engine_cache_path": str(engine.parent / ".ort-tensorrt-cache")}
        return {}

    def load(self, engine: Path, threads: int) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise EngineLoadError("this bundle's engine is onnxruntime, which is not installed: "
                                  "pip install 'edgefleet[onnxruntime]'") from exc
        so = session_options(ort, threads)
        asked = [*self.requested, *([] if CPU in self.requested else [CPU])]
        options = [self._provider_options(p, engine) for p in asked]
        try:
            with warnings.catch_warnings(record=True) as caught:  # "not in available provider names"
                warnings.simplefilter("always")
                self._sess = ort.InferenceSession(str(engine), so, providers=asked, provider_options=options)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise EngineLoadError(f"onnxruntime could not load {engine.name}: {' '.join(str(exc).split())}") from exc
        for w in caught:
            log.debug("onnxruntime: %s", w.message)
        self.providers = tuple(self._sess.get_providers())
        self.device = self.providers[0] if self.providers else "?"
        if self.device != asked[0]:
            log.warning("%s asked for %s; onnxruntime runs it on %s", self.spec.label, asked[0], self.device)
        have = {i.name for i in self._sess.get_inputs()}
        want = {s.name for s in self.inputs}
        if have != want:
            raise EngineLoadError(f"engine inputs {sorted(have)} differ from the spec's {sorted(want)}")
        outs = {o.name for o in self._sess.get_outputs()}
        missing = [o.name for o in self.outputs if o.name not in outs]
        if missing:
            raise EngineLoadError(f"the engine has no output {missing[0]!r} (it has {sorted(outs)})")
        self._out_names = [o.name for o in self.outputs]

    def warm_up_sizes(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """On the CPU provider only the smallest: a CPU session plans no kernels per shape, and its first
        call at a larger batch only grows the arena (measured: MobileNetV2 FP32 at batch 16, about 15% over
        a steady call), while warming at the largest size costs a whole batch of compute that competes with
        the version being served. CUDA and TensorRT build per shape: every size."""
        if self.providers[:1] == (CPU,) and sizes:
            return sizes[:1]
        return sizes

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        sess = self._sess
        if sess is None:
            raise EngineRunError(f"{self.spec.label}: the onnxruntime session is gone")
        return list(sess.run(self._out_names, feeds))

    def _close_impl(self) -> None:
        self._sess = None


RUNTIME = Runtime(OnnxRuntimeEngine, backend="onnxruntime", precisions=("fp32", "fp16", "int8"),
                  modules=("onnxruntime",), extra="edgefleet[onnxruntime]", accelerators=("cpu", "gpu"), suffix=".onnx",
                  target="edgefleet.compiler.targets.onnxruntime:OnnxRuntimeTarget", order=0)
