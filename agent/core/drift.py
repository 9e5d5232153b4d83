"""A sketch of each served model's answers, for the fleet's drift score (protocol/drift.py).

After a request is answered, :meth:`DriftRecorder.offer` puts a reference to the answer's output array on a
bounded queue (a lookup and a deque append: nothing is computed on the request path, no input is kept); one
background thread counts what queued up every ``drain_every_s`` (50 ms) into the model's fixed bins, one numpy pass
per model version (:class:`protocol.drift.DriftAccumulator`; numpy's per-call overhead, not the answers, is most of
the cost of counting one small answer alone), and the telemetry loop :meth:`take`-s the counts of each interval.
When the thread falls behind (``max_pending`` answers or ``max_pending_bytes`` of them waiting), new answers are
skipped and counted as such, so a burst never grows memory or slows the device.
A model whose manifest carries no reference (bundles from before version 6) is not sketched.

A pipeline (manifest version 7, agent/core/pipeline.py) is sketched as one model: the host offers its end answers as it
offers a single model's outputs, and a reference read as task ``pipeline`` takes all of them at once (``count``,
the strings and their scores: protocol.drift's features), referenced, not copied, until counted; its samples are
the requests' images. Its stages' own references are not counted (their answers never leave the pipeline).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from ...protocol.drift import DriftAccumulator, DriftCounts
from ...protocol.manifest import Manifest

__all__ = ["DriftRecorder"]

log = logging.getLogger("edgefleet.agent.drift")


Answer = np.ndarray | tuple[np.ndarray, ...]  # the reference's output, or a pipeline's end outputs


def _nbytes(out: Answer) -> int:
    return sum(int(getattr(o, "nbytes", 0)) for o in out) if isinstance(out, tuple) else int(getattr(out, "nbytes", 0))


class _Tracked:
    __slots__ = ("acc", "axis", "index", "version", "whole")

    def __init__(self, manifest: Manifest, index: int):
        assert manifest.drift is not None
        self.version = manifest.version
        self.index = index
        self.whole = manifest.drift.read_as == "pipeline"  # every output is read (a pipeline's end answers)
        self.axis = manifest.outputs[index].batch_axis
        self.acc = DriftAccumulator(manifest.drift, manifest.name, manifest.version)


class DriftRecorder:
    def __init__(self, max_pending: int = 1024, max_pending_bytes: int = 32 * 2**20, drain_every_s: float = 0.05):
        self.max_pending = max_pending  # answers waiting for the sketch thread, at most
        self.max_pending_bytes = max_pending_bytes  # and their outputs' bytes (a segmentation map is large)
        self.drain_every_s = drain_every_s  # the thread counts what queued up this often: one numpy pass per group
        self._pending_bytes = 0
        self.errors = 0  # answers the sketch could not read (logged once per model version)
        self._tracked: dict[str, _Tracked] = {}  # model name -> its served version's sketch
        self._q: deque[tuple[str, str, Answer]] = deque()
        self._lock = threading.Lock()  # the accumulators and the queue
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warned: set[tuple[str, str]] = set()

    # -- the request path --------------------------------------------------------------------------------
    def offer(self, manifest: Manifest, outputs: Sequence[np.ndarray]) -> None:
        """Called after ``manifest``'s model answered with ``outputs``: cheap, never raises."""
        t = self._tracked.get(manifest.name)
        if t is None or t.version != manifest.version:
            if manifest.drift is None:
                return
            self.track(manifest)  # the first answer of a version swapped in: sketch it from now on
            t = self._tracked.get(manifest.name)
            if t is None:
                return
        if t.index >= len(outputs):
            return
        out: Answer = tuple(outputs) if t.whole else outputs[t.index]
        size = _nbytes(out)
        if len(self._q) >= self.max_pending or self._pending_bytes + size > self.max_pending_bytes:
            with self._lock:
                t.acc.skipped += 1
            return
        self._pending_bytes += size  # approximate under races (the GIL orders the += and -=); only a bound
        self._q.append((manifest.name, manifest.version, out))

    # -- the served models -----------------------------------------------------------------------------------
    def track(self, manifest: Manifest) -> None:
        """Sketch ``manifest``'s answers from now on (in place of its name's previous version; ``offer`` does it at a
        version's first answer)."""
        with self._lock:
            if manifest.drift is None:
                self._tracked.pop(manifest.name, None)
                return
            names = [o.name for o in manifest.outputs]
            if manifest.drift.output not in names:  # the manifest's validation forbids it; never crash on it
                self._tracked.pop(manifest.name, None)
                return
            self._tracked[manifest.name] = _Tracked(manifest, names.index(manifest.drift.output))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="drift-sketch", daemon=True)
                self._thread.start()

    def take(self, name: str, version: str) -> DriftCounts | None:
        """The counts of ``name`` ``version`` since the last take (None if it is not sketched or saw nothing)."""
        with self._lock:
            t = self._tracked.get(name)
            if t is None or t.version != version:
                return None
            return t.acc.take()

    def close(self) -> None:
        self._stop = True
        self._wake.set()  # ends the thread's wait at once
        if self._thread is not None:
            self._thread.join(5)

    # -- the sketch thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.drain_every_s)
            while self._q and not self._stop:
                # everything queued at once, grouped by version: one count per group, not per answer (the per-call
                # overhead of numpy dominates a small answer's cost)
                groups: dict[tuple[str, str], list[Answer]] = {}
                for _ in range(min(len(self._q), self.max_pending)):
                    name, version, out = self._q.popleft()
                    self._pending_bytes -= _nbytes(out)
                    groups.setdefault((name, version), []).append(out)
                for (name, version), outs in groups.items():
                    try:
                        self._count(name, version, outs)
                    except Exception as exc:  # an answer the sketch cannot read is a finding, never a crash
                        self.errors += len(outs)
                        if (name, version) not in self._warned:
                            self._warned.add((name, version))
                            log.warning("drift sketch of %s %s cannot read an answer: %r", name, version, exc)

    def _count(self, name: str, version: str, outs: list[Answer]) -> None:
        with self._lock:
            t = self._tracked.get(name)
            if t is None or t.version != version:
                return  # answered by a version swapped out meanwhile
            if t.whole:  # a pipeline's end outputs, images on axis 0 of each: stacked output by output
                per = [[np.asarray(o[j]) for o in outs] for j in range(len(outs[0]))]
                if all(len({a.shape[1:] for a in arrays}) == 1 for arrays in per):
                    t.acc.add([np.concatenate(arrays) if len(arrays) > 1 else arrays[0] for arrays in per])
                else:
                    for o in outs:
                        t.acc.add(list(o))
                return
            if t.axis is None:  # no batch axis: each output is one answer
                t.acc.add([np.asarray(o) for o in outs])
                return
            rows = [np.moveaxis(np.asarray(o), t.axis, 0) if t.axis else np.asarray(o) for o in outs]
            if len({r.shape[1:] for r in rows}) == 1:
                t.acc.add(np.concatenate(rows) if len(rows) > 1 else rows[0])
            else:  # answers of other shapes (a dynamic axis): one by one
                for r in rows:
                    t.acc.add(r)

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """True once every queued answer is counted (for tests and the bench)."""
        import time

        deadline = time.monotonic() + timeout_s
        while self._q and time.monotonic() < deadline:
            time.sleep(0.001)
        with self._lock:  # the last popped answer is counted under the lock
            return not self._q
