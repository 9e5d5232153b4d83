"""The engine interface: load, describe, infer, close; one runtime per module, each implementing only this.

Like Polygraphy's runners, the public :meth:`Engine.infer` checks state and validates a feed against the
engine's input specs (names, dtypes, ranks, fixed dimensions, one batch size) before the runtime sees it,
then calls the runtime's :meth:`Engine._infer_impl`, and checks that what comes back is what the output
specs promise (as many outputs, each with the batch it was given). The compiler's accuracy gate, the agent's
batcher, self-test, warm-up and shadow, ``edgefleet verify`` and the benchmarks all call this one method.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..protocol.manifest import Manifest, TensorSpec
from .errors import EngineClosed, EngineInputError, EngineRunError

__all__ = ["NP_DTYPES", "Engine", "EngineSpec", "Runtime"]

NP_DTYPES: dict[str, type] = {"FP32": np.float32, "FP16": np.float16, "INT8": np.int8, "UINT8": np.uint8,
                              "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_}


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is asked to be: its tensors, its precision and the hardware profile it was built for.
    The agent makes it from a bundle's manifest; the compiler from the source graph before a manifest exists."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    precision: str = "fp32"  # fp32 | fp16 | int8
    profile: str | None = None  # hardware profile name; None: a CPU profile
    label: str = "engine"  # for messages: "digits 1.0.0", "the int8 candidate"
    # what the engine file is tied to beyond the CPU (TensorRT: version, GPU compute capability), checked at load
    engine_compatibility: dict[str, str] = field(default_factory=dict)
    model: str = "?"  # the bundle's name and version, where there is a bundle (metrics are labelled by them)
    version: str = "?"
    # the engine file runs exactly this batch (manifest fixed_batch): infer pads up to it and runs in pieces of it
    fixed_batch: int | None = None

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> EngineSpec:
        return cls(manifest.inputs, manifest.outputs, manifest.precision, manifest.profile,
                   f"{manifest.name} {manifest.version}", dict(manifest.engine_compatibility), manifest.name,
                   manifest.version, manifest.fixed_batch)


class Engine(ABC):
    """A loaded engine. ``infer`` may be called from one thread at a time per instance; several instances may
    be loaded at once (one per batcher instance) and share nothing."""

    kind: str = "?"  # the registry's name for this runtime (a manifest's ``backend``)

    def __init__(self, spec: EngineSpec, providers: tuple[str, ...] | None = None):
        """``providers``: execution providers to ask for, for a runtime that has them (see engines.load)."""
        self.spec = spec
        # what actually runs the engine once loaded, e.g. "CPUExecutionProvider", "CUDAExecutionProvider",
        # "ai-edge-litert CPU (4 threads)", "TensorRT 10.3.0 on sm87": reported in model metadata and logs
        self.device: str = "?"
        self._closed = threading.Event()
        self._dtypes = {s.name: np.dtype(NP_DTYPES[s.datatype]) for s in spec.inputs}

    @classmethod
    def cpu_runs(cls, precision: str) -> bool:
        """Whether this runtime can run ``precision`` on this host's CPU as it is (a runtime whose answers in a
        precision depend on CPU instructions, e.g. OpenVINO's bf16, asks its plugin); True unless it says not."""
        return True

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.spec.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.spec.outputs

    @abstractmethod
    def load(self, engine: Path, threads: int) -> None: ...

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Outputs in the order of ``outputs``, each with the batch size of the inputs. Raises EngineInputError
        for a feed that breaks the input specs, EngineClosed after close(), EngineRunError if the runtime fails
        or answers outside the output specs."""
        if self._closed.is_set():
            raise EngineClosed(f"{self.spec.label}: the {self.kind} engine is closed")
        batch = self.check_feeds(feeds)
        try:
            outs = self._infer_impl(feeds) if self.spec.fixed_batch is None or batch is None \
                else self._infer_fixed(feeds, batch, self.spec.fixed_batch)
        except (EngineClosed, EngineInputError, EngineRunError):
            raise
        except Exception as exc:
            if self._closed.is_set():
                raise EngineClosed(f"{self.spec.label}: the {self.kind} engine was closed during a batch") from exc
            raise EngineRunError(f"{self.spec.label}: {self.kind} failed on a batch of {batch}: "
                                 f"{' '.join(str(exc).split())[:500]}") from exc
        self._check_outputs(outs, batch)
        return outs

    def check_feeds(self, feeds: dict[str, np.ndarray]) -> int | None:
        """Validate ``feeds`` against the input specs; the batch size (None if no input has a batch axis)."""
        if not isinstance(feeds, dict):
            raise EngineInputError(f"{self.spec.label}: feeds must be a dict of input name -> array")
        names = [s.name for s in self.inputs]
        unknown = [k for k in feeds if k not in self._dtypes]
        missing = [n for n in names if n not in feeds]
        if unknown or missing:
            raise EngineInputError(f"{self.spec.label}: inputs are {names}; "
                                   + (f"missing {missing}" if missing else f"unknown {unknown}"))
        batch: int | None = None
        for spec in self.inputs:
            x = feeds[spec.name]
            if not isinstance(x, np.ndarray):
                raise EngineInputError(f"{self.spec.label}: input {spec.name!r} is a {type(x).__name__}, "
                                       "not a numpy array")
            if x.dtype != self._dtypes[spec.name]:
                raise EngineInputError(f"{self.spec.label}: input {spec.name!r} is {x.dtype}, the engine takes "
                                       f"{self._dtypes[spec.name]} ({spec.datatype})")
            if x.ndim != len(spec.shape) or any(d != -1 and d != n for d, n in zip(spec.shape, x.shape, strict=True)):
                raise EngineInputError(f"{self.spec.label}: input {spec.name!r} has shape {list(x.shape)}, the "
                                       f"engine takes {list(spec.shape)} (-1: any size)")
            if spec.batch_axis is not None:
                n = int(x.shape[spec.batch_axis])
                if n < 1:
                    raise EngineInputError(f"{self.spec.label}: input {spec.name!r} holds an empty batch")
                if batch is not None and n != batch:
                    raise EngineInputError(f"{self.spec.label}: inputs hold different batch sizes ({batch} and {n} "
                                           f"in {spec.name!r})")
                batch = n
        return batch

    def _check_outputs(self, outs: list[np.ndarray], batch: int | None) -> None:
        if len(outs) != len(self.outputs):
            raise EngineRunError(f"{self.spec.label}: the {self.kind} engine returned {len(outs)} outputs, the spec "
                                 f"names {len(self.outputs)}")
        if batch is None:
            return
        for spec, o in zip(self.outputs, outs, strict=True):
            if spec.batch_axis is None:
                continue
            got = o.shape[spec.batch_axis] if o.ndim > spec.batch_axis else None
            if got != batch:
                raise EngineRunError(f"{self.spec.label}: output {spec.name!r} has shape {list(o.shape)} for a batch "
                                     f"of {batch} (batch axis {spec.batch_axis}): the engine does not keep the batch")

    def _infer_fixed(self, feeds: dict[str, np.ndarray], batch: int, fixed: int) -> list[np.ndarray]:
        """A batch of any size on an engine that runs exactly ``fixed``: in pieces of ``fixed``, the last padded with
        copies of its last sample (values the model has seen, so no padding value can overflow anything), and each
        output sliced back to the samples given."""
        axes = {s.name: s.batch_axis for s in self.inputs}
        pieces: list[list[np.ndarray]] = []
        for start in range(0, batch, fixed):
            n = min(fixed, batch - start)
            chunk = {}
            for k, v in feeds.items():
                a = axes[k]
                if a is None:
                    chunk[k] = v
                    continue
                part = np.take(v, np.arange(start, start + n), axis=a)
                if n < fixed:
                    part = np.concatenate([part, np.repeat(np.take(part, [n - 1], axis=a), fixed - n, axis=a)], axis=a)
                chunk[k] = np.ascontiguousarray(part)
            outs = self._infer_impl(chunk)
            pieces.append([o if s.batch_axis is None else np.take(o, np.arange(n), axis=s.batch_axis)
                           for s, o in zip(self.outputs, outs, strict=True)])
        if len(pieces) == 1:
            return pieces[0]
        return [parts[0] if s.batch_axis is None else np.concatenate(parts, axis=s.batch_axis)
                for s, parts in zip(self.outputs, zip(*pieces, strict=True), strict=True)]

    @abstractmethod
    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run a validated batch: outputs in the order of ``outputs``."""

    def warm_up_sizes(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Of the batch sizes the batcher will form (ascending), those to run once before the version takes
        traffic: every one by default (a runtime that sets up per shape pays that on the first call)."""
        return sizes

    def close(self) -> None:
        """Release the engine (idempotent, safe from any thread)."""
        self._closed.set()
        self._close_impl()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @abstractmethod
    def _close_impl(self) -> None:
        """Release the runtime's resources (called once or more; must be idempotent)."""


@dataclass(frozen=True)
class Runtime:
    """A runtime, declared once, by its own module of this package (``RUNTIME = Runtime(...)``). The registry
    (:mod:`engines`), the compiler's build targets and its pipeline all read this record, so a new runtime is one
    module here (its :class:`Engine` and this record), its build target in the compiler (named by ``target``), and
    its run of tests/test_engines_conformance.py."""

    engine: type[Engine]  # the engine class; the runtime's name is its ``kind``
    backend: str  # the manifest backend whose engine files it loads: its own name when it builds them
    precisions: tuple[str, ...]  # the precisions it runs
    modules: tuple[str, ...]  # the Python modules that provide it (any one of them), looked up, not imported
    extra: str  # what installs it, for the error a box without it gets
    accelerators: tuple[str, ...] = ("cpu",)  # the hardware profiles' accelerators it serves
    suffix: str = ""  # its engine files' suffix ("" when it runs another backend's files)
    target: str = ""  # its build target in the compiler, "module:Class" ("" when it runs another backend's files)
    order: int = 100  # where it stands when runtimes are listed (messages, a choice's candidates): lower first

    @property
    def name(self) -> str:
        return self.engine.kind
