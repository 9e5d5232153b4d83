"""A sketch of each served model's answers, for the fleet's drift score (protocol/drift.py).

After a request is answered, :meth:`DriftRecorder.offer` puts a reference to the answer's output array on a
bounded queue (a lookup and a deque append: nothing is computed on the request path, no input is kept); one
background thread counts the answers into the model's fixed bins (:class:`protocol.drift.DriftAccumulator`), and the
telemetry loop :meth:`take`-s the counts of each interval. When the thread falls behind (``max_pending`` answers
waiting), new answers are skipped and counted as such, so a burst never grows memory or slows the device.
A model whose manifest carries no reference (bundles from before version 6) is not sketched.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from edgefleet.protocol.drift import DriftAccumulator, DriftCounts
from edgefleet.protocol.manifest import Manifest

__all__ = ["DriftRecorder"]

log = logging.getLogger("edgefleet.agent.drift")


class _Tracked:
    __slots__ = ("acc", "axis", "index", "version")

    def __init__(self, manifest: Manifest, index: int):
        assert manifest.drift is not None
        self.version = manifest.version
        self.index = index
        self.axis = manifest.outputs[index].batch_axis
        self.acc = DriftAccumulator(manifest.drift, manifest.name, manifest.version)


class DriftRecorder:
    def __init__(self, max_pending: int = 256):
        self.max_pending = max_pending  # answers waiting for the sketch thread, at most
        self.errors = 0  # answers the sketch could not read (logged once per model version)
        self._tracked: dict[str, _Tracked] = {}  # model name -> its served version's sketch
        self._q: deque[tuple[str, str, np.ndarray]] = deque()
        self._lock = threading.Lock()  # the accumulators and the queue
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warned: set[tuple[str, str]] = set()

    # -- the request path --------------------------------------------------------------------------------
    def offer(self, manifest: Manifest, outputs: Sequence[np.ndarray]) -> None:
        """Called after ``manifest``'s model answered with ``outputs``: cheap, never raises."""
        t = self._tracked.get(manifest.name)
        if t is None or t.version != manifest.version or t.index >= len(outputs):
            return
        if len(self._q) >= self.max_pending:
            with self._lock:
                t.acc.skipped += 1
            return
        self._q.append((manifest.name, manifest.version, outputs[t.index]))
        self._wake.set()

    # -- the served models -----------------------------------------------------------------------------------
    def track(self, manifest: Manifest) -> None:
        """Sketch ``manifest``'s answers from now on (in place of its name's previous version)."""
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
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)

    # -- the sketch thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(1.0)
            self._wake.clear()
            while self._q and not self._stop:
                name, version, out = self._q.popleft()
                try:
                    self._count(name, version, out)
                except Exception as exc:  # an answer the sketch cannot read is a finding, never a crash
                    self.errors += 1
                    if (name, version) not in self._warned:
                        self._warned.add((name, version))
                        log.warning("drift sketch of %s %s cannot read an answer: %r", name, version, exc)

    def _count(self, name: str, version: str, out: np.ndarray) -> None:
        with self._lock:
            t = self._tracked.get(name)
            if t is None or t.version != version:
                return  # answered by a version swapped out meanwhile
            arr = np.asarray(out)
            if t.axis is None:
                batch: np.ndarray | list[np.ndarray] = [arr]
            else:
                batch = np.moveaxis(arr, t.axis, 0) if t.axis else arr
            t.acc.add(batch)

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """True once every queued answer is counted (for tests and the bench)."""
        import time

        deadline = time.monotonic() + timeout_s
        while self._q and time.monotonic() < deadline:
            time.sleep(0.001)
        with self._lock:  # the last popped answer is counted under the lock
            return not self._q
