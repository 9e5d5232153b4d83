"""A candidate model in shadow: it sees a sample of the live requests, never answers them.

After the active model answered a request, ``offer`` hands the same inputs and the active model's
outputs to the shadow with probability ``sample_rate``; one background thread runs the candidate and
compares. Nothing here is on the request path beyond a random draw and a queue put: when the shadow
falls behind (more than ``max_pending`` requests waiting), new ones are skipped and counted, so a slow
candidate cannot slow the device down. The figures (``ShadowFigures``) travel in telemetry; the fleet
promotes the candidate only if they agree well enough.

Agreement: for each output of class scores (``[N, C]`` with the batch on axis 0), the share of samples
whose argmax is the same; the worst absolute difference over every output; the candidate's p99.

A pipeline (manifest version 7) shadows a pipeline (:class:`PipelineShadow`): the mirrored images run through the
candidate's two engines and the steps between them (judge.pipeline.Chain, one image batch at a time on the shadow's
thread), and its END answers are compared with the serving pipeline's on the same images, as the compiler's end gate
compares a pipeline with FP32 (judge.pipeline.compare_image): boxes matched one to one at IoU 0.5, and on each of the
serving pipeline's boxes the string read (ctc, byte for byte) or the top class (top-k). ``top1_agreement`` is then
the share of the serving pipeline's end answers the candidate keeps: each of its boxes is one answer, kept when the
candidate has a box there that reads the same (a lost box is a changed answer); an image where it found nothing is
one answer too ("no text here"), kept when the candidate finds nothing either. Boxes the candidate adds beside the
serving pipeline's are not counted against it. ``samples`` counts images; ``max_abs_error`` is the largest box or
answer score difference on matched boxes. A pipeline never shadows a single model nor a single model a pipeline
(the installer refuses both: their answers are not comparable); an offer from a served version of the other kind
(a swap after the shadow started) is ignored.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...engines import Engine
from ...protocol import mqtt as proto
from ...protocol.manifest import Manifest

if TYPE_CHECKING:
    from .pipeline import PipelineStages

__all__ = ["PipelineShadow", "ShadowMirror"]

log = logging.getLogger("edgefleet.agent.shadow")


@dataclass(frozen=True)
class _Tally:
    """One mirrored request compared: its samples (batch rows, images), those judged, those agreeing, the worst
    absolute difference (None: nothing comparable; inf: the answers' shapes differ)."""

    samples: int
    compared: int
    agreed: int
    worst: float | None


class ShadowMirror:
    pipeline = False  # the kind of served version whose requests it takes (a single model)

    def __init__(self, manifest: Manifest, backend: Engine, sample_rate: float, staged: Any = None,
                 max_pending: int = 2, seed: int | None = None):
        self.manifest = manifest
        self.backend = backend
        self.staged = staged  # the candidate's files, until the shadow is dropped
        self.sample_rate = sample_rate
        self.max_pending = max_pending
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._pending = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow")
        self.samples = 0  # mirrored samples (batch rows) compared
        self.compared = 0  # samples with class scores, for top-1 agreement
        self.agreed = 0
        self.max_abs_error: float | None = None
        self.skipped = 0  # sampled, but the shadow was behind
        self.errors = 0
        self._latencies: deque[float] = deque(maxlen=2000)
        self._top1 = [i for i, t in enumerate(manifest.outputs) if len(t.shape) == 2 and t.batch_axis == 0]

    def offer(self, model: str, feeds: dict[str, np.ndarray], outputs: list[np.ndarray], pipeline: bool = False
              ) -> None:
        """Called after the active model of ``model`` answered (``pipeline``: a pipeline answered, its end outputs);
        cheap unless this request is sampled."""
        if model != self.manifest.name or pipeline != self.pipeline or self._rng.random() >= self.sample_rate:
            return
        with self._lock:
            if self._pending >= self.max_pending:
                self.skipped += 1
                return
            self._pending += 1
        self._executor.submit(self._run, feeds, outputs)

    def _run(self, feeds: dict[str, np.ndarray], outputs: list[np.ndarray]) -> None:
        try:
            t0 = time.perf_counter()
            got = self._infer(feeds)
            self._latencies.append((time.perf_counter() - t0) * 1000.0)
            tally = self._compare(feeds, outputs, got)
            with self._lock:
                self.samples += tally.samples
                self.agreed += tally.agreed
                self.compared += tally.compared
                if tally.worst is not None and np.isfinite(tally.worst):
                    self.max_abs_error = tally.worst if self.max_abs_error is None else max(self.max_abs_error,
                                                                                            tally.worst)
        except Exception as exc:  # a failing candidate is a finding, not a crash
            with self._lock:
                self.errors += 1
            log.warning("shadow %s %s failed on a mirrored request: %r", self.manifest.name, self.manifest.version,
                        exc)
        finally:
            with self._lock:
                self._pending -= 1

    def _infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The candidate's answer to a mirrored request (on the shadow's thread)."""
        return list(self.backend.infer(feeds))

    def _compare(self, feeds: dict[str, np.ndarray], outputs: list[np.ndarray], got: list[np.ndarray]) -> _Tally:
        """Each output of class scores: top-1 per sample; every output: the worst absolute difference."""
        n = next((int(v.shape[0]) for v in feeds.values() if v.ndim > 0), 1)
        worst = 0.0
        agreed = compared = 0
        for i, (a, b) in enumerate(zip(outputs, got, strict=False)):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape:
                worst = float("inf")
                continue
            if a.size:
                worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
            if i in self._top1 and a.ndim == 2:
                agreed += int(np.sum(np.argmax(a, axis=1) == np.argmax(b, axis=1)))
                compared += a.shape[0]
        if not np.isfinite(worst):  # shapes differ: that is a disagreement on every sample with class scores
            compared += n if self._top1 else 0
        return _Tally(n, compared, agreed, worst)

    def figures(self) -> proto.ShadowFigures:
        with self._lock:
            lat = sorted(self._latencies)
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
            return proto.ShadowFigures(
                model=self.manifest.name, version=self.manifest.version, samples=self.samples,
                top1_agreement=self.agreed / self.compared if self.compared else None,
                max_abs_error=self.max_abs_error, p99_ms=None if p99 is None else round(p99, 3))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.backend.close()


class PipelineShadow(ShadowMirror):
    """A candidate pipeline in shadow of the serving pipeline of its name (see the module docstring): the mirrored
    images through its two engines (the first instance of each stage) and the steps between them; its end answers
    against the serving pipeline's, image by image."""

    pipeline = True

    def __init__(self, manifest: Manifest, stages: PipelineStages, sample_rate: float, staged: Any = None,
                 max_pending: int = 2, seed: int | None = None):
        from ...judge.pipeline import Chain

        p = manifest.pipeline
        assert p is not None
        super().__init__(manifest, stages.detector.backends[0], sample_rate, staged, max_pending, seed)
        self.stages = stages
        self.spec = p.spec
        det_m, rec_m = stages.detector.manifest, stages.reader.manifest
        self.reader = stages.reader.backends[0]
        self.det_input, self.rec_input = det_m.inputs[0].name, rec_m.inputs[0].name
        self.chain = Chain(p.spec, stages.size, [o.name for o in det_m.outputs], [o.name for o in rec_m.outputs])
        self.rec_batch = stages.reader.settings.max_batch_size

    def _infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = next(iter(feeds.values()))  # a pipeline takes one input: the image batch
        return self.chain.run(x, lambda b: self.backend.infer({self.det_input: b}),
                              lambda b: self.reader.infer({self.rec_input: np.ascontiguousarray(b)}), self.rec_batch)

    def _compare(self, feeds: dict[str, np.ndarray], outputs: list[np.ndarray], got: list[np.ndarray]) -> _Tally:
        from ...judge.pipeline import compare_image

        n = int(np.asarray(outputs[2]).shape[0])
        answers = kept = 0
        worst: float | None = None
        for i in range(n):
            one = compare_image(self.spec, outputs, got, i)
            if one.answers == 0:  # "nothing to read here" is an answer too
                answers += 1
                kept += int(one.found == 0)
            else:
                answers += one.answers
                kept += one.kept
            if one.score_diff is not None:
                worst = one.score_diff if worst is None else max(worst, one.score_diff)
        return _Tally(n, answers, kept, worst)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for e in {id(e): e for e in (self.backend, self.reader)}.values():
            e.close()
