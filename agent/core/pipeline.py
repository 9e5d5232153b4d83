"""A pipeline bundle (manifest version 7) installed and served as one model.

A detect-then-read pipeline (protocol/pipeline.py) is two engines and the steps between them (judge/pipeline.py's
:class:`~edgefleet.judge.pipeline.Chain`, the same code the compiler gated the pipeline with). To its clients it is
one model: one request in (KServe v2 over HTTP or gRPC, the local socket, ``/infer/image``), the end outputs out;
the detector's map, the boxes and the crops never leave the process.

**Serving** (:class:`PipelineRunner`). Each stage has its own
:class:`~edgefleet.agent.core.batching.batcher.Batcher`, both on the model's ComputeTurns (a stage's batch holds a
permit while it runs: the detector and the reader take turns on the cores, as two versions of one model do). A request's
images go to the detector's batcher (images of concurrent requests stacked in one batch); its boxes and crops are cut on
a small thread pool (off the event loop); its crops go to the reader's batcher in pieces of at most the reader's
``max_batch_size`` (crops of many images and requests stacked in one batch, a request's crops split across batches when
they are more); the answers are put together on the same pool. :meth:`~edgefleet.judge.pipeline.Chain.check` refuses a
request whose images could need more than ``max_crops`` crops before any work (400), as does an image of another size
than the pipeline's (the size it was gated and self-tested at: the top-level input's fixed dimensions, else its image
preprocessing, else its self-test sample's). Images waiting anywhere in the pipeline are bounded by the agent's
``max_queue_size`` (429 beyond it).

**Hot swap**: a new version is a new runner (its own batchers and engines). A request resolves the served version
once and runs both stages of it; the old runner takes no new request once replaced and closes its batchers only
after its last request is answered, so no request sees a detector of one version and a reader of another.

**Metrics**: the pipeline is the model (requests, errors, end-to-end latency: the telemetry's p99); each stage has
metrics of its own labelled ``<model>/<stage>`` (agent.core.metrics.Metrics.for_stage), sent per interval in the
telemetry's ``stages``.

**Drift**: the pipeline's end answers are the model's answers: the host offers each request's end outputs to its
drift recorder as it offers a single model's (agent.core.host.ModelHost.offer_shadow), which counts them into the
manifest's reference when it is read as task ``pipeline`` (agent.core.drift: boxes per image, each string's length and
score) and the telemetry's ``drift`` carries the interval's counts, as a single model's does.


How a version is loaded and checked before it serves (the install's part) is agent/install/pipeline.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...engines import Engine
from ...judge.errors import InputError
from ...judge.pipeline import Chain
from ...protocol import mqtt as proto
from ...protocol.manifest import Manifest
from ..errors import AgentError, InferenceFailed, QueueFull, RequestError, Unavailable
from .batching.batcher import Batcher
from .batching.dispatch import Outputs
from .batching.request_queue import HIGH, NORMAL
from .batching.settings import BatchSettings
from .batching.tuning import BatchTuning
from .batching.turns import ComputeTurns
from .metrics import Metrics, ModelMetrics
from .request import InferRequest
from .runtime_pick import RuntimePick

__all__ = ["PipelineRunner", "PipelineStages", "Stage", "image_answer"]

log = logging.getLogger("edgefleet.agent.pipeline")

STEP_THREADS = 2  # threads that cut boxes and crops and decode answers (OpenCV and numpy release the GIL)


@dataclass(frozen=True)
class Stage:
    """One stage as served: its own manifest, its loaded engines and its batch settings."""

    manifest: Manifest
    backends: tuple[Engine, ...]
    settings: BatchSettings
    runtime: RuntimePick | None = None
    tuning: BatchTuning | None = None  # how its largest batch was chosen


@dataclass(frozen=True)
class PipelineStages:
    """A pipeline version loaded and checked, ready to swap in (agent.install.pipeline.prepare)."""

    detector: Stage
    reader: Stage
    size: tuple[int, int]  # the images it reads (height, width)
    selftest: proto.SelfTestResult  # the end-to-end self-test's figures (for the install report)

    @property
    def engines(self) -> list[Engine]:
        return [*self.detector.backends, *self.reader.backends]

    @property
    def permits(self) -> int:
        """Turns on the model's cores at once: one per instance of its larger stage."""
        return max(len(self.detector.backends), len(self.reader.backends))


# -- serving -------------------------------------------------------------------------------------------------------
class PipelineRunner:
    """Serves one pipeline version: its two stages' batchers on the model's turns, and the steps between them."""

    def __init__(self, manifest: Manifest, stages: PipelineStages, metrics: Metrics, turns: ComputeTurns,
                 cpus: Collection[int] | None = None):
        p = manifest.pipeline
        assert p is not None
        self.manifest = manifest
        self.stages = stages
        self.spec = p.spec
        det_m, rec_m = stages.detector.manifest, stages.reader.manifest
        self.input = manifest.inputs[0].name
        self.det_input, self.rec_input = det_m.inputs[0].name, rec_m.inputs[0].name
        self.size = stages.size
        self.chain = Chain(p.spec, stages.size, [o.name for o in det_m.outputs], [o.name for o in rec_m.outputs])
        self.rec_axes = [o.batch_axis or 0 for o in rec_m.outputs]
        self.det_metrics: ModelMetrics = metrics.for_stage(manifest.name, p.spec.detector, manifest.version,
                                                           entry=True)
        self.rec_metrics: ModelMetrics = metrics.for_stage(manifest.name, p.spec.reader, manifest.version)
        self.detector = Batcher(list(stages.detector.backends), stages.detector.settings, self.det_metrics, turns, cpus)
        self.reader = Batcher(list(stages.reader.backends), stages.reader.settings, self.rec_metrics, turns, cpus)
        self.rec_batch = stages.reader.settings.max_batch_size
        self.max_images = stages.detector.settings.max_queue_size  # images in the pipeline at once
        self._steps = ThreadPoolExecutor(max_workers=STEP_THREADS, thread_name_prefix="pipeline-steps")
        self._images = 0  # images of the requests in the pipeline now
        self._inflight = 0
        self._closing = False
        self._drained: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def engines(self) -> list[Engine]:
        return self.stages.engines

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()
        self.detector.start()
        self.reader.start()

    def stage_figures(self) -> dict[str, proto.StageFigures]:
        """Each stage's figures since the last call (the telemetry's ``stages``)."""
        return {self.spec.detector: proto.StageFigures.model_validate(self.det_metrics.take_interval()),
                self.spec.reader: proto.StageFigures.model_validate(self.rec_metrics.take_interval())}

    async def infer(self, req: InferRequest) -> Outputs:
        """One request's images through both stages -> the end outputs. RequestError (400) for a request the
        pipeline cannot take, QueueFull (429) when too many images are in the pipeline, a stage's own error
        otherwise."""
        if self._closing:
            raise Unavailable("the pipeline is being replaced; retry")
        x = req.feeds[self.input]
        n = int(x.shape[0])
        if n < 1:
            raise RequestError(f"input {self.input!r} holds no image")
        try:
            self.chain.check(n)
        except InputError as exc:
            raise RequestError(str(exc)) from None
        if (int(x.shape[2]), int(x.shape[3])) != self.size:
            raise RequestError(f"input {self.input!r} holds {x.shape[2]}x{x.shape[3]} images; this pipeline reads "
                               f"{self.size[0]}x{self.size[1]} (height x width, the size it was gated at): resize "
                               "them first, or send each image to /infer/image")
        if self._images + n > self.max_images:
            raise QueueFull(f"{self._images} images are in the pipeline (limit {self.max_images}, max_queue_size); "
                            "retry later")
        self._images += n
        self._inflight += 1
        try:
            return await self._run(x, req)
        finally:
            self._images -= n
            self._inflight -= 1
            if self._inflight == 0 and self._drained is not None:
                self._drained.set()

    async def _run(self, x: np.ndarray, req: InferRequest) -> Outputs:
        loop = self._loop or asyncio.get_running_loop()
        priority = HIGH if req.priority == 1 else NORMAL
        timeout = None if req.timeout_us is None else req.timeout_us / 1e6
        det_out = await _timed_stage(self.det_metrics, self.detector.submit({self.det_input: x}, priority, timeout))
        found, crops, owners = await loop.run_in_executor(self._steps, self._cut, x, det_out)
        reader_out: list[np.ndarray] = []
        if owners:
            b = self.rec_batch
            reader_out = await _timed_stage(self.rec_metrics, self._read(crops, b, priority, timeout))
        try:
            ends = await loop.run_in_executor(self._steps, self.chain.answers, found, owners, reader_out)
        except Exception as exc:  # the reader's answer is not what read.op decodes: the bundle's fault
            raise InferenceFailed(f"pipeline step 'read' failed: {exc}") from exc
        return Outputs(ends)

    def _cut(self, x: np.ndarray, det_out: Sequence[np.ndarray]) -> tuple[Any, np.ndarray, list[int]]:
        """(on a step thread) the detector's answer -> each image's boxes, the crops and each crop's image."""
        try:
            found = self.chain.boxes(det_out)
        except Exception as exc:  # the detector's answer is not what boxes.format decodes: the bundle's fault
            raise InferenceFailed(f"pipeline step 'boxes' failed: {exc}") from exc
        try:
            crops, owners = self.chain.crops(x, found)
        except InputError as exc:  # max_crops (check() keeps it unreachable)
            raise RequestError(str(exc)) from None
        except Exception as exc:
            raise InferenceFailed(f"pipeline step 'crop' failed: {exc}") from exc
        return found, crops, owners

    async def _read(self, crops: np.ndarray, b: int, priority: int, timeout: float | None) -> list[np.ndarray]:
        """The crops through the reader's batcher in pieces of at most ``b`` (each may share a batch with other
        requests' crops) -> the reader's outputs for all of them, in order."""
        parts = await asyncio.gather(*(self.reader.submit({self.rec_input: crops[i:i + b]}, priority, timeout)
                                       for i in range(0, len(crops), b)), return_exceptions=True)
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        if len(parts) == 1:
            return list(parts[0])  # type: ignore[arg-type]
        return [np.concatenate([pt[j] for pt in parts], axis=a)  # type: ignore[index]
                for j, a in enumerate(self.rec_axes)]

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Take no new request, answer those in the pipeline (both stages stay up for them), then close both
        batchers (the caller closes the engines)."""
        self._closing = True
        if self._inflight and self._drained is not None:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), drain_timeout_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                log.error("%s %s: %d requests still in the pipeline after %.0fs; closing it", self.manifest.name,
                          self.manifest.version, self._inflight, drain_timeout_s)
        await self.detector.close()
        await self.reader.close()
        self._steps.shutdown(wait=False)


async def _timed_stage(metrics: ModelMetrics, work: Any) -> Any:
    """Await a stage's work, counted on the stage's metrics (its time and outcome)."""
    t0 = time.perf_counter()
    status = 500
    try:
        out = await work
        status = 200
        return out
    except AgentError as exc:
        status = getattr(exc, "status_code", 500)
        raise
    except asyncio.CancelledError:
        status = 499
        raise
    finally:
        metrics.request(time.perf_counter() - t0, status)


def image_answer(manifest: Manifest, outs: Sequence[np.ndarray]) -> dict[str, Any]:
    """``/infer/image``'s answer for a pipeline (one image): its boxes (x0, y0, x1, y1 in the pipeline input's
    pixels, in reading order) and their scores, and what was read in each: ``texts`` (decoded UTF-8) and
    ``text_scores`` (ctc), or ``classes`` and ``class_scores`` (top-k)."""
    p = manifest.pipeline
    assert p is not None
    k = int(outs[2][0])
    doc: dict[str, Any] = {"model_name": manifest.name, "model_version": manifest.version, "count": k,
                           "boxes": np.round(outs[0][0, :k].astype(np.float64), 2).tolist(),
                           "scores": np.round(outs[1][0, :k].astype(np.float64), 5).tolist()}
    if p.spec.read.op == "ctc":
        doc["texts"] = [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in outs[3][0, :k]]
        doc["text_scores"] = np.round(outs[4][0, :k].astype(np.float64), 5).tolist()
    else:
        doc["classes"] = outs[3][0, :k].tolist()
        doc["class_scores"] = np.round(outs[4][0, :k].astype(np.float64), 5).tolist()
    return doc
