"""An installed version's first calls: the self-test on the bundle's own sample and the warm-up at each batch
size the batcher will form. Both run before the version takes traffic, each call in its turn on the model's
cores (``turn``: between the batches of the version serving). ``edgefleet verify`` runs the same self-test.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ...engines import Engine
from ...protocol import mqtt as proto
from ..errors import SelfTestFailed
from .store import StagedModel

__all__ = [
    "TUNE_BUDGET_S",
    "TUNE_CALLS",
    "WARMUP_RUNS",
    "RunTogether",
    "Turn",
    "lone_call_ms",
    "measure_batch_sizes",
    "now",
    "self_test",
    "warm_up",
]

WARMUP_RUNS = 3
TUNE_BUDGET_S = 2.0  # seconds of calls, all batch sizes together, when a version measures its batch sizes
TUNE_CALLS = 5  # timed calls per batch size at most (after one untimed call at that size)

_T = TypeVar("_T")
Turn = Callable[..., Any]  # runs fn(*args) in its turn on the model's cores: ComputeTurns.call, bound to a loop


def now(fn: Callable[..., _T], *args: Any) -> _T:
    return fn(*args)


def self_test(backend: Engine, staged: StagedModel, turn: Turn = now) -> proto.SelfTestResult:
    """Run the bundle's own sample; outputs must match what the compiler recorded. Returns the figures
    measured on this device's CPU, for the install report. Each run goes through ``turn`` (while another
    version serves: between its batches)."""
    path = staged.directory / staged.manifest.selftest
    try:
        with np.load(path, allow_pickle=False) as npz:
            feeds = {s.name: npz[f"input:{s.name}"] for s in backend.inputs}
            expected = [npz[f"expected:{s.name}"] for s in backend.outputs]
            labels = npz["labels"] if "labels" in npz.files else None
    except (KeyError, ValueError, OSError) as exc:
        raise SelfTestFailed(f"self-test sample {path.name} is unreadable: {exc}") from exc
    try:
        for _ in range(WARMUP_RUNS):
            got = turn(backend.infer, feeds)
    except Exception as exc:  # the runtime's own error types
        raise SelfTestFailed(f"self-test: the engine failed on its own sample: {exc}") from exc
    drift = 0.0
    for spec, g, e in zip(backend.outputs, got, expected, strict=True):
        if g.shape != e.shape:
            raise SelfTestFailed(f"self-test: output {spec.name!r} has shape {g.shape}, expected {e.shape}")
        if not np.isfinite(g).all():
            raise SelfTestFailed(f"self-test: output {spec.name!r} has NaN or infinite values on this device's CPU")
        tol = 1e-3 + 0.02 * float(np.abs(e).max(initial=0.0))
        diff = float(np.abs(g.astype(np.float64) - e.astype(np.float64)).max(initial=0.0))
        drift = max(drift, diff / tol)
        if not diff <= tol:
            raise SelfTestFailed(f"self-test: output {spec.name!r} differs by {diff:.4g} (tolerance {tol:.4g}) "
                                 "on this device's CPU")
        if e.ndim == 2 and not np.array_equal(g.argmax(1), e.argmax(1)):
            raise SelfTestFailed(f"self-test: output {spec.name!r} ranks classes differently from the build")
    first, want = got[0], expected[0]
    classes = first.ndim == 2 and len(first) > 0 and backend.outputs[0].batch_axis == 0
    axis = backend.inputs[0].batch_axis if backend.inputs else None
    sample = feeds[backend.inputs[0].name] if backend.inputs else first
    return proto.SelfTestResult(
        samples=int(sample.shape[axis]) if axis is not None and sample.ndim > axis else 1,
        top1=float((first.argmax(1) == labels).mean()) if classes and labels is not None
        and labels.shape == (len(first),) else None,
        top1_agreement=float((first.argmax(1) == want.argmax(1)).mean()) if classes else None,
        drift=round(drift, 4))


def warm_up(backends: list[Engine], staged: StagedModel, batch_sizes: tuple[int, ...], turn: Turn = now) -> None:
    """Run every instance once at each batch size the batcher will form that its backend wants warmed
    (``Engine.warm_up_sizes``), on the bundle's own sample, before the version takes traffic: the first
    call at a new shape can be costly (LiteRT tensor resizes, TensorRT shape setup) and would otherwise
    land on a client's request. Each call goes through ``turn``."""
    sample = _sample(staged, "warm-up")
    batchable = staged.manifest.batchable
    for b in backends:
        for n in b.warm_up_sizes(batch_sizes) if batchable else (None,):
            feeds = _fill(staged, sample, n)
            try:
                turn(b.infer, feeds)
            except Exception as exc:  # the runtime's own error types
                raise SelfTestFailed(f"warm-up at batch size {n}: the engine failed: {exc}") from exc


def measure_batch_sizes(backend: Engine | RunTogether, staged: StagedModel, sizes: tuple[int, ...], turn: Turn = now,
                        budget_s: float = TUNE_BUDGET_S, calls: int = TUNE_CALLS) -> tuple[tuple[int, float], ...]:
    """Images per second of ``backend`` at each batch size of ``sizes`` (ascending), on the bundle's own sample
    repeated to fill the batch: one untimed call at the size, then up to ``calls`` timed ones, each in its turn
    (``turn``: only the call itself is timed, not the wait for the cores); the median call counts (the fastest one
    flattered batch 1: on this box it showed MobileNetV2 FP32 at batch 1 as fast per image as at 2 and 4, while
    served it ran 5-7% slower there; the median is what a sustained run sees). Stops after ``budget_s`` of calls:
    the sizes not reached are left out. ``backend`` may be several instances that run each call together
    (:class:`RunTogether`)."""
    copies = len(backend.backends) if isinstance(backend, RunTogether) else 1
    sample = _sample(staged, "batch tuning")
    out: list[tuple[int, float]] = []
    spent = 0.0
    for n in sizes:
        feeds = _fill(staged, sample, n)
        times: list[float] = []
        try:
            spent += turn(_timed, backend.infer, feeds)
            while len(times) < calls and (spent < budget_s or not times):
                times.append(turn(_timed, backend.infer, feeds))
                spent += times[-1]
        except Exception as exc:  # the runtime's own error types
            raise SelfTestFailed(f"batch tuning at batch size {n}: the engine failed: {exc}") from exc
        out.append((n, round(n * copies / max(statistics.median(times), 1e-9), 1)))
        if spent >= budget_s:
            break
    return tuple(out)


class RunTogether:
    """Call ``infer`` of every one of ``backends`` at once on the same feeds, one thread each (a layout of several
    instances, as the batcher runs them under load)."""

    def __init__(self, backends: list[Engine]):
        self.backends = backends

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if len(self.backends) == 1:
            return self.backends[0].infer(feeds)
        import threading

        errors: list[BaseException] = []

        def one(b: Engine) -> None:
            try:
                b.infer(feeds)
            except BaseException as exc:  # re-raised in the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(b,)) for b in self.backends[1:]]
        for t in threads:  # started from the calling thread: on its CPUs
            t.start()
        one(self.backends[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return []


def lone_call_ms(backend: Engine, staged: StagedModel, turn: Turn = now, calls: int = TUNE_CALLS) -> float:
    """The fastest of ``calls`` batch-1 calls of ``backend`` alone (after one untimed): what a lone request costs."""
    feeds = _fill(staged, _sample(staged, "layout tuning"), 1 if staged.manifest.batchable else None)
    try:
        turn(_timed, backend.infer, feeds)
        return round(1000 * min(turn(_timed, backend.infer, feeds) for _ in range(calls)), 3)
    except Exception as exc:  # the runtime's own error types
        raise SelfTestFailed(f"layout tuning: the engine failed: {exc}") from exc


def _timed(fn: Callable[[dict[str, np.ndarray]], Any], feeds: dict[str, np.ndarray]) -> float:
    t0 = time.perf_counter()
    fn(feeds)
    return time.perf_counter() - t0


def _sample(staged: StagedModel, what: str) -> dict[str, np.ndarray]:
    path = staged.directory / staged.manifest.selftest
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {s.name: npz[f"input:{s.name}"] for s in staged.manifest.inputs}
    except (KeyError, ValueError, OSError) as exc:
        raise SelfTestFailed(f"{what}: self-test sample {path.name} is unreadable: {exc}") from exc


def _fill(staged: StagedModel, sample: dict[str, np.ndarray], n: int | None) -> dict[str, np.ndarray]:
    """The sample's rows repeated (or cut) to ``n`` along each input's batch axis (None: as it is)."""
    axes = {s.name: s.batch_axis for s in staged.manifest.inputs}
    return {k: v if (a := axes[k]) is None or n is None else
            np.ascontiguousarray(np.take(v, np.arange(n) % v.shape[a], axis=a)) for k, v in sample.items()}
