"""The agent's core: the models it serves and how a request reaches them, apart from every transport.

:class:`ModelHost` owns the served model versions (:class:`Served`: loaded engine instances, their batcher,
settings and metrics), swaps a new version in without dropping requests, runs a decoded request through a
model's batcher, mirrors it to a shadow candidate, and lists the repository index. The transports (HTTP in
:mod:`agent.transports.http`, gRPC in :mod:`agent.transports.grpc`, the local socket in :mod:`agent.transports.local`)
only decode a request, call the host and encode its answer; the installer (:mod:`agent.install.job`) asks it by verbs
(``swap``, ``remove``, ``start_shadow``, ``end_shadow``, ``set_index``). This module imports no web framework
(tests/test_agent_core.py checks): a new transport needs nothing from another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...engines import Engine
from ...protocol import mqtt as proto
from ...protocol.drift import DriftCounts
from ...protocol.manifest import Manifest
from ..errors import ModelNotFound, RequestError, Unavailable
from .batching.batcher import Batcher
from .batching.request_queue import HIGH, NORMAL
from .batching.settings import BatchSettings
from .batching.tuning import BATCH_TOLERANCE, BatchTuning
from .batching.turns import ComputeTurns
from .drift import DriftRecorder
from .metrics import Metrics, ModelMetrics
from .request import InferRequest
from .versions import VersionNumbers

if TYPE_CHECKING:
    from .pipeline import PipelineRunner, PipelineStages
    from .shadow import ShadowMirror

__all__ = ["EXTENSIONS", "LARGE_BODY", "IndexEntry", "ModelHost", "Served", "model_config"]

log = logging.getLogger("edgefleet.agent.host")

TRITON_TYPES = {"FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "INT8": "TYPE_INT8", "UINT8": "TYPE_UINT8",
                "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL"}
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "model_repository_index", "image_infer",
              "system_shared_memory"]  # what the server metadata lists, on HTTP and gRPC
LARGE_BODY = 256 * 1024  # bytes: a transport decodes JSON bodies above this off the event loop (HTTP, local socket)


@dataclass
class Served:
    manifest: Manifest
    backends: tuple[Engine, ...]
    batcher: Batcher
    settings: BatchSettings
    metrics: ModelMetrics
    loaded_at: float = field(default_factory=time.time)
    tuning: BatchTuning | None = None  # how its batch sizes were chosen (None: the host's defaults, untold)
    serving: proto.ServingChoice | None = None  # precision, batch sizes and layout as chosen here (install report)
    # a pipeline (manifest version 7, agent/core/pipeline.py): its stages and steps; ``backends``, ``batcher`` and
    # ``settings`` are then its detector's (its entry stage), and a request goes through ``pipeline.infer``
    pipeline: PipelineRunner | None = None

    @property
    def backend(self) -> Engine:
        """The first instance (every instance describes the same model)."""
        return self.backends[0]

    @property
    def engines(self) -> list[Engine]:
        """Every engine this version holds (a pipeline's: both stages')."""
        return self.pipeline.engines if self.pipeline is not None else list(self.backends)


@dataclass(frozen=True)
class IndexEntry:
    """A model the agent knows of, for ``/v2/repository/index`` (state: READY, UNAVAILABLE, LOADING)."""

    name: str
    version: str
    state: str
    reason: str = ""


class ModelHost:
    """The models being served, one version each; swaps a new version in without dropping requests.

    ``swap`` starts serving a model version (with one or more backend instances, one inference thread
    each) and retires the version of the same name it replaces once its queue is empty; other models
    keep serving. The index source given to ``set_index`` lists the versions on disk for the repository
    index (served versions are always listed as READY). ``start_shadow`` / ``end_shadow`` mirror live
    requests to a candidate and stop. Every version of a model shares one :class:`ComputeTurns` (``turns``):
    the old version's last batch, the new one's self-test and warm-up calls and its first batch take turns
    on the cores. Other parts read ``models``, ``current``, ``shadow``, ``settings`` and ``metrics`` and change
    them only through these verbs.
    """

    def __init__(self, settings: BatchSettings, metrics: Metrics, inference_cpus: Collection[int] | None = None,
                 versions: VersionNumbers | None = None):
        self.settings = settings  # the default for models swapped in without their own
        # each served version's integer number, for Triton's tools (agent/core/versions.py; None: in memory)
        self.versions = versions or VersionNumbers()
        self.metrics = metrics
        self.inference_cpus = inference_cpus  # where every batcher's inference threads run (None: anywhere)
        self.models: dict[str, Served] = {}
        self._current: Served | None = None  # the version swapped in last
        self._index: Callable[[], Sequence[IndexEntry]] | None = None
        self._shadow: ShadowMirror | None = None  # a candidate in shadow, if any
        self._swap_lock = asyncio.Lock()
        self._turns: dict[str, ComputeTurns] = {}
        self._drift = DriftRecorder()  # each served version's answers, sketched for the fleet's drift score

    @property
    def current(self) -> Served | None:
        """The version swapped in last (what the fleet is told this device serves)."""
        return self._current

    @property
    def shadow(self) -> ShadowMirror | None:
        """The candidate live requests are mirrored to, if any."""
        return self._shadow

    def set_index(self, index: Callable[[], Sequence[IndexEntry]] | None) -> None:
        """Where the repository index learns of versions not serving (on disk, failed): ``index()`` -> entries."""
        self._index = index

    def start_shadow(self, mirror: ShadowMirror) -> None:
        """Mirror live requests to ``mirror`` (a candidate loaded beside the served version; it serves nothing).
        One at a time: a running shadow is ended first (:meth:`end_shadow`), never replaced unseen."""
        if self._shadow is not None:
            raise RuntimeError(f"already shadowing {self._shadow.manifest.name} {self._shadow.manifest.version}; "
                               "end_shadow() first")
        self._shadow = mirror

    def end_shadow(self) -> ShadowMirror | None:
        """Stop mirroring -> the candidate that was mirrored to (the caller closes it and discards its files)."""
        old, self._shadow = self._shadow, None
        return old

    def ready(self) -> bool:
        """At least one model is serving."""
        return bool(self.models)

    def record(self, served: Served | None, name: str | None, duration_s: float, status: int) -> None:
        """Count one answered request: on ``served``'s metrics, or, answered before any model took it, as rejected,
        labelled with ``name`` (the client's) only when it names a served model, so the label sets stay bounded."""
        if served is not None:
            served.metrics.request(duration_s, status)
        else:
            self.metrics.rejected(duration_s, status, name if name is not None and name in self.models else None)

    def turns(self, name: str, permits: int) -> ComputeTurns:
        """Model ``name``'s turns on its compute (``permits``: its instance count; a new count starts new turns)."""
        t = self._turns.get(name)
        if t is None or t.permits != permits:
            t = self._turns[name] = ComputeTurns(permits)
        return t

    async def swap(self, manifest: Manifest, backends: Engine | Sequence[Engine],
                   settings: BatchSettings | None = None, tuning: BatchTuning | None = None,
                   serving: proto.ServingChoice | None = None, stages: PipelineStages | None = None) -> None:
        """Start serving ``backends`` (loaded instances of one model version) with ``settings`` (default: the
        host's), chosen as ``tuning`` says; the version it replaces finishes its queue, then closes. Runs on the
        server loop. A pipeline (``manifest.pipeline``) comes as ``stages`` (agent.install.pipeline.prepare;
        ``backends`` is ignored): both stages swap in as one unit."""
        if manifest.pipeline is not None:
            if stages is None:
                raise ValueError(f"{manifest.name} {manifest.version} is a pipeline: swap it in with its stages")
            await self._swap_pipeline(manifest, stages, serving)
            return
        instances = (backends,) if isinstance(backends, Engine) else tuple(backends)
        s = settings or self.settings
        if not manifest.batchable and s.request_limit != 1:  # an unbatched input: one request at a time
            s = BatchSettings(**{**s.__dict__, "max_batch_size": 1, "preferred_batch_sizes": (),
                                 "max_request_batch_size": None})
            tuning = None
        self.versions.number(manifest.name, manifest.version)
        async with self._swap_lock:
            mm = self.metrics.for_model(manifest.name, manifest.version)
            batcher = Batcher(instances, s, mm, self.turns(manifest.name, len(instances)), self.inference_cpus)
            batcher.start()
            served = Served(manifest, instances, batcher, s, mm, tuning=tuning, serving=serving)
            await self._put(served)
        log.info("now serving %s %s (%d instance%s)", manifest.name, manifest.version, len(instances),
                 "" if len(instances) == 1 else "s")

    async def _put(self, served: Served) -> None:
        """``served`` takes its model's place (the caller holds the swap lock); the one it replaces is retired."""
        name, version = served.manifest.name, served.manifest.version
        old = self.models.get(name)
        self.models[name] = served
        self._current = served
        self.metrics.model_event(name, version, "swap" if old is not None else "load")
        if old is not None:
            await self._retire(old)

    async def _swap_pipeline(self, manifest: Manifest, stages: PipelineStages,
                             serving: proto.ServingChoice | None) -> None:
        from .pipeline import PipelineRunner

        self.versions.number(manifest.name, manifest.version)
        async with self._swap_lock:
            mm = self.metrics.for_model(manifest.name, manifest.version)
            runner = PipelineRunner(manifest, stages, self.metrics, self.turns(manifest.name, stages.permits),
                                    self.inference_cpus)
            runner.start()
            det = stages.detector
            served = Served(manifest, det.backends, runner.detector, det.settings, mm, serving=serving,
                            pipeline=runner)
            await self._put(served)
        log.info("now serving the pipeline %s %s (%s then %s)", manifest.name, manifest.version,
                 stages.detector.manifest.name, stages.reader.manifest.name)

    async def remove(self, name: str) -> None:
        """Stop serving model ``name`` (its queued requests are answered first)."""
        async with self._swap_lock:
            old = self.models.pop(name, None)
            if old is None:
                return
            if self._current is old:
                self._current = next(reversed(self.models.values()), None)
            await self._retire(old)

    async def _retire(self, old: Served) -> None:
        now = self.models.get(old.manifest.name)
        if now is None or now.manifest.version != old.manifest.version:
            self.metrics.model_event(old.manifest.name, old.manifest.version, "unload")
        try:  # best effort: whatever serves now already does, whatever happens here
            if old.pipeline is not None:  # its requests finish on both of its stages first
                await old.pipeline.close()
            else:
                await old.batcher.close()
            loop = asyncio.get_running_loop()
            for b in old.engines:
                await loop.run_in_executor(None, b.close)
        except Exception:
            log.exception("retiring %s %s failed", old.manifest.name, old.manifest.version)

    async def close(self) -> None:
        async with self._swap_lock:  # an install racing shutdown finishes its swap first
            for served in list(self.models.values()):
                if served.pipeline is not None:
                    await served.pipeline.close()
                else:
                    await served.batcher.close()
                for b in served.engines:
                    b.close()
            self.models.clear()
            self._current = None
        self._drift.close()

    def get(self, name: str, version: str | None = None) -> Served:
        served = self.models.get(name)
        if served is None:
            if not self.models:
                raise Unavailable("no model is loaded yet; the agent is waiting for its first install")
            raise ModelNotFound(f"unknown model {name!r}; this agent serves {_names(self.models)}")
        m = served.manifest
        if version is not None and not self.versions.matches(name, m.version, version):
            raise ModelNotFound(f"model {name!r} version {version!r} is not loaded; serving {m.version} (number "
                                f"{self.version_number(served)})")
        return served

    def version_number(self, served: Served) -> str:
        """``served``'s integer version, as Triton's tools read one (agent/core/versions.py)."""
        return str(self.versions.number(served.manifest.name, served.manifest.version))

    def model_stats(self, served: Served) -> dict[str, Any]:
        """Triton's statistics of ``served``, its version the integer (perf_analyzer looks them up by it)."""
        return {**served.metrics.stats(), "version": self.version_number(served)}

    async def infer(self, served: Served, req: InferRequest) -> list[np.ndarray]:
        """Queue a decoded request in ``served``'s batcher and wait for its outputs (and offer it to a shadow
        candidate): what every transport does with a request once decoded (HTTP, gRPC, the local socket)."""
        if served.pipeline is not None:  # both stages, as one model
            outs: list[np.ndarray] = await served.pipeline.infer(req)
            self.offer_shadow(served, req, outs)
            return outs
        pending = self.enqueue(served, req)
        try:
            outs = await pending.future
        finally:
            served.batcher.settle(pending)
        self.offer_shadow(served, req, outs)
        return outs

    @staticmethod
    def enqueue(served: Served, req: InferRequest) -> Any:
        """``infer`` without a coroutine (the local socket's fast path): queue ``req`` -> its batcher entry, whose
        ``future`` gets the outputs; then ``served.batcher.settle(entry)`` and ``offer_shadow`` are the caller's.
        A pipeline has no one queue: RequestError, and the caller takes its slow path (``infer``)."""
        if served.pipeline is not None:
            raise RequestError(f"{served.manifest.name} is a pipeline: it runs through ModelHost.infer")
        return served.batcher.enqueue(req.feeds, HIGH if req.priority == 1 else NORMAL,
                                      None if req.timeout_us is None else req.timeout_us / 1e6)

    def stage_figures(self, name: str, version: str) -> dict[str, proto.StageFigures] | None:
        """Each stage's figures since the last call when ``name`` ``version`` is a pipeline serving here (the
        interval's telemetry ``stages``); None for a single model."""
        served = self.models.get(name)
        if served is None or served.pipeline is None or served.manifest.version != version:
            return None
        return served.pipeline.stage_figures()

    def drift_counts(self, name: str, version: str) -> DriftCounts | None:
        """The answers of ``name`` ``version`` since the last call, counted in its manifest's drift bins
        (agent.core.drift), for the interval's telemetry record; None when the version has no drift reference or
        answered nothing."""
        return self._drift.take(name, version)

    def offer_shadow(self, served: Served, req: InferRequest, outs: list[np.ndarray]) -> None:
        self._drift.offer(served.manifest, outs)  # a deque append; counted off the request path
        if self._shadow is not None:  # a pipeline's answers go to a pipeline's shadow only (agent/core/shadow.py)
            self._shadow.offer(served.manifest.name, req.feeds, outs, served.pipeline is not None)

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        entries: dict[tuple[str, str], IndexEntry] = {}
        if self._index is not None:
            for e in self._index():
                entries[(e.name, e.version)] = e
        for s in self.models.values():
            entries[(s.manifest.name, s.manifest.version)] = IndexEntry(s.manifest.name, s.manifest.version, "READY")
        return [{"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
                for _, e in sorted(entries.items()) if not ready_only or e.state == "READY"]


def _names(models: dict[str, Served]) -> str:
    return ", ".join(repr(n) for n in sorted(models))


def model_config(served: Served, number: str) -> dict[str, Any]:
    """Triton's model configuration layout (what ``tritonclient`` get_model_config returns). ``max_batch_size``
    is the largest request accepted; ``batch_tuning`` (edgefleet's) says how the batches formed were sized;
    ``number``: the version's integer (``version_policy``), the semantic one in ``version`` and ``parameters``."""
    m, s, t = served.manifest, served.settings, served.tuning
    batched = m.batchable and s.request_limit > 1

    def dims(spec: Any) -> list[int]:
        shape = list(spec.shape)
        if batched and spec.batch_axis == 0:
            return shape[1:]
        return shape

    return {
        "name": m.name, "version": m.version, "platform": m.backend, "backend": m.backend,
        "max_batch_size": s.request_limit if batched else 0,
        "input": [{"name": t.name, "data_type": TRITON_TYPES.get(t.datatype, t.datatype), "dims": dims(t)}
                  for t in m.inputs],
        "output": [{"name": t.name, "data_type": TRITON_TYPES.get(t.datatype, t.datatype), "dims": dims(t)}
                   for t in m.outputs],
        "dynamic_batching": {
            "preferred_batch_size": list(s.preferred_batch_sizes),
            "max_queue_delay_microseconds": s.max_queue_delay_us,
            "priority_levels": 2, "default_priority_level": 2,
            "default_queue_policy": {"timeout_action": "REJECT",
                                     "default_timeout_microseconds": int(s.queue_timeout_s * 1e6),
                                     "allow_timeout_override": True, "max_queue_size": s.max_queue_size},
        },
        "instance_group": [{"name": f"{m.name}_0", "kind": "KIND_GPU" if any(
            "CUDA" in b.device or "TensorRT" in b.device for b in served.backends if hasattr(b, "device"))
            else "KIND_CPU", "count": len(served.backends)}],
        "version_policy": {"specific": {"versions": [number]}},
        "parameters": {"precision": {"string_value": m.precision}, "profile": {"string_value": m.profile},
                       "semantic_version": {"string_value": m.version}},
        "image_preprocessing": m.preprocessing.model_dump() if m.preprocessing else None,
        "batch_tuning": None if t is None else {
            "mode": t.mode, "max_formed_batch_size": s.max_batch_size,
            # whether batches wait for a larger size though an instance is free, and what was measured (gathering.py)
            "gathering": served.batcher.gathering_report(),
            "images_per_second": {str(n): v for n, v in t.images_per_s},
            "tolerance": BATCH_TOLERANCE if t.mode == "measured" else None,
            # instances x intra-op threads each: measured here (each candidate's best images/s and lone batch-1
            # call), set by the operator, or the default
            "layout": None if t.layout is None else {
                "instances": t.layout[0], "threads": t.layout[1], "source": t.layout_source,
                "measured": {f.name: {"images_per_second": f.best, "lone_call_ms": f.lone_ms} for f in t.layouts}}},
        # edgefleet's: the precisions this bundle carries and how this device chose among them (timed here, or not)
        "precision_choice": {
            "precision": m.precision, "available": list(m.precisions),
            "source": served.serving.precision_source if served.serving else "bundle",
            "items_per_second": {pt.precision: pt.items_per_s for pt in served.serving.precisions}
            if served.serving else {}},
        # the runtime serving the bundle's file (onnxruntime, OpenVINO) and how this device chose it (issue 35)
        "runtime_choice": None if served.serving is None or served.serving.runtime is None else {
            "runtime": served.serving.runtime.runtime, "source": served.serving.runtime.source,
            "items_per_second": {rt.runtime: rt.items_per_s for rt in served.serving.runtime.runtimes}},
        # edgefleet's: a pipeline's stages as they serve here (each its own precision, runtime and batches)
        **({"pipeline": _pipeline_config(served.pipeline)} if served.pipeline is not None else {}),
    }


def _pipeline_config(runner: PipelineRunner) -> dict[str, Any]:
    spec = runner.spec
    stages = []
    for role, st in (("detector", runner.stages.detector), ("reader", runner.stages.reader)):
        stages.append({"name": st.manifest.name, "role": role, "precision": st.manifest.precision,
                       "backend": st.manifest.backend, "runtime": st.runtime.runtime if st.runtime else None,
                       "runtime_source": st.runtime.source if st.runtime else None,
                       "max_batch_size": st.settings.max_batch_size, "instances": len(st.backends),
                       "batch_tuning": None if st.tuning is None else {
                           "mode": st.tuning.mode, "items_per_second": {str(n): v for n, v in st.tuning.images_per_s}},
                       "devices": [getattr(b, "device", "?") for b in st.backends]})
    return {"kind": spec.kind, "stages": stages, "image_size": list(runner.size), "max_crops": spec.max_crops,
            "max_boxes_per_image": spec.boxes.max_boxes, "max_images_per_request": runner.chain.max_images}

