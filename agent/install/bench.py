"""The agent's benchmarks on its own box.

``edgefleet bench BUNDLE`` (:func:`bench_bundle`): the compiler's benchmark, run again on the box the bundle is
for. The compiler measured the engine on the build host (latency p50/p99 per batch size, in the manifest). This
runs the same engine through the agent's own backend, on the bundle's self-test inputs repeated to each batch size,
a fixed number of times, and prints both side by side. Only the agent's dependencies are needed.

The layout trial at install (:func:`drive_together`, :func:`measure_layout`): what ``bench/serve.py`` calls the
runtime's limit, measured the same way. Every instance of a layout runs in its own thread, on the CPUs the serving
inference threads run on (``cpus``), all at once, each calling back to back for a time slice after a common
start; the figure is the sum of each thread's images/s (calls x batch / its own time in the runtime). A lock-step
trial (every instance starts a call together and the next round waits for the slowest) put 8 one-thread sessions
of MobileNetV2 FP32 on a 16-core Xeon at 618 images/s where the limit measured 845, and the agent chose 1x8.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...engines import Engine, load_bundle_engine
from ...protocol.bundle import extract_bundle
from ...protocol.cpu import cpu_features
from ...protocol.manifest import Manifest
from ..core.batching.dispatch import pin_thread
from ..core.batching.tuning import LayoutFigures, in_the_running
from ..errors import SelfTestFailed
from .selftest import Turn, now
from .store import StagedModel
from .timed_choice import child_answer, child_reply, layout_doc, layout_figures, run_child

__all__ = ["LAYOUT_BUDGET_S", "BenchPoint", "Driven", "bench_bundle", "drive_together", "layout_trial",
           "layout_trial_in_child", "lone_call_ms", "measure_layout", "release_memory", "slice_seconds", "trial_feeds"]

log = logging.getLogger("edgefleet.agent.bench")

LAYOUT_BUDGET_S = 1.5  # seconds of timed calls for every layout and batch size together (issue 41: an install's
# trials within 3 s for digits, 10 s for MobileNetV2 on 2 cores; 4.0 before)
SLICE_S = (0.05, 0.5)  # the time slice of one layout at one batch size: at least, at most
TRIAL_TIMEOUT_S = 120.0  # a layout trial in its child process is killed after this
LADDER_STOP = 0.85  # a layout's ladder stops at a batch size this much below its best so far (bigger is slower)


@dataclass(frozen=True)
class Driven:
    """One time slice of :func:`drive_together`: the summed images/s, and each instance's timed calls."""

    images_per_s: float
    calls: tuple[int, ...]


def slice_seconds(layouts: int, sizes: int, budget_s: float | None = None) -> float:
    """The time slice of one layout at one batch size when ``layouts`` x ``sizes`` share ``budget_s`` (default:
    :data:`LAYOUT_BUDGET_S`)."""
    budget = LAYOUT_BUDGET_S if budget_s is None else budget_s
    return min(SLICE_S[1], max(SLICE_S[0], budget / max(1, layouts * sizes)))


def drive_together(engines: Sequence[Engine], feeds: dict[str, np.ndarray], batch: int, seconds: float,
                   cpus: Collection[int] | None = None, turn: Turn = now, min_calls: int = 2,
                   start_timeout_s: float = 60.0) -> Driven:
    """Every engine in its own thread (on ``cpus``, as the serving threads are pinned; None: where the scheduler
    puts them), all at once: one untimed call each, a common start, then calls back to back on ``feeds`` (``batch``
    samples) until ``seconds`` have passed and each made ``min_calls``. -> the sum of each thread's ``batch`` x calls
    / its time in the runtime (each call in ``turn``: the wait for a turn is not timed). A failing call fails the
    whole trial (SelfTestFailed)."""
    n = len(engines)
    start = threading.Barrier(n)
    times: list[list[float]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def timed(engine: Engine) -> float:
        t0 = time.perf_counter()
        engine.infer(feeds)
        return time.perf_counter() - t0

    def run(i: int) -> None:
        try:
            pin_thread(cpus)
            turn(timed, engines[i])
            start.wait(start_timeout_s)
            end = time.perf_counter() + seconds
            mine = times[i]
            while len(mine) < min_calls or time.perf_counter() < end:
                mine.append(turn(timed, engines[i]))
                if errors:
                    return
        except threading.BrokenBarrierError:
            return  # another thread failed (its error is the one raised)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"layout-trial-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SelfTestFailed(f"layout trial at batch size {batch}: the engine failed: {errors[0]}") from errors[0]
    if any(not t for t in times):
        raise SelfTestFailed(f"layout trial at batch size {batch}: the instances did not start together")
    return Driven(round(sum(batch * len(t) / max(sum(t), 1e-9) for t in times), 1), tuple(len(t) for t in times))


def lone_call_ms(engine: Engine, feeds: dict[str, np.ndarray], cpus: Collection[int] | None = None,
                 turn: Turn = now, calls: int = 5) -> float:
    """The fastest of ``calls`` calls of ``engine`` alone on ``feeds`` (after one untimed), on a thread on ``cpus``
    as a serving instance's: what a lone request costs."""
    got: list[float] = []
    errors: list[BaseException] = []

    def timed() -> float:
        t0 = time.perf_counter()
        engine.infer(feeds)
        return time.perf_counter() - t0

    def run() -> None:
        try:
            pin_thread(cpus)
            turn(timed)
            got.extend(turn(timed) for _ in range(calls))
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    t = threading.Thread(target=run, name="layout-trial-lone", daemon=True)
    t.start()
    t.join()
    if errors:
        raise SelfTestFailed(f"layout trial, a lone call: the engine failed: {errors[0]}") from errors[0]
    return round(1000 * min(got), 3)


def measure_layout(engines: Sequence[Engine], fill: Callable[[int], dict[str, np.ndarray]],
                   sizes: tuple[int, ...], seconds: float, cpus: Collection[int] | None = None,
                   turn: Turn = now) -> tuple[tuple[int, float], ...]:
    """Images/s of a layout (``engines``, all driven at once: :func:`drive_together`) at each batch size of
    ``sizes`` (ascending; ``fill(n)``: the feeds of a batch of ``n``). The
    ladder stops at a size that serves :data:`LADDER_STOP` of this layout's best so far or less: larger batches are
    then slower per image too (the sizes not reached are left out)."""
    out: list[tuple[int, float]] = []
    for n in sizes:
        got = drive_together(engines, fill(n), n, seconds, cpus, turn)
        out.append((n, got.images_per_s))
        if got.images_per_s <= LADDER_STOP * max(v for _, v in out):
            break
    return tuple(out)


@dataclass(frozen=True)
class BenchPoint:
    batch_size: int
    ms_p50: float
    ms_p99: float
    items_per_s: float
    build_ms_p50: float | None  # what the compiler recorded on the build host, if it benchmarked this size

    def to_json(self) -> dict[str, float | int | None]:
        return {"batch_size": self.batch_size, "ms_p50": self.ms_p50, "ms_p99": self.ms_p99,
                "items_per_s": self.items_per_s, "build_ms_p50": self.build_ms_p50,
                "vs_build": None if not self.build_ms_p50 else round(self.build_ms_p50 / self.ms_p50, 3)}


def trial_feeds(staged: StagedModel) -> Callable[[int], dict[str, np.ndarray]]:
    """-> ``fill(n)``: the bundle's self-test sample repeated to a batch of ``n`` along each input's batch axis (as it
    is for a model without one)."""
    path = staged.directory / staged.manifest.selftest
    try:
        with np.load(path, allow_pickle=False) as npz:
            sample = {s.name: npz[f"input:{s.name}"] for s in staged.manifest.inputs}
    except (KeyError, ValueError, OSError) as exc:
        raise SelfTestFailed(f"layout trial: self-test sample {path.name} is unreadable: {exc}") from exc
    axes = {s.name: s.batch_axis if staged.manifest.batchable else None for s in staged.manifest.inputs}
    return lambda n: {k: _repeat(v, axes[k], n) for k, v in sample.items()}


def release_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): closed trial sessions free their
    arenas into the allocator, which keeps them mapped otherwise. -> whether it could (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return False
    if trim is None:
        return False
    trim(0)
    return True


def layout_trial(manifest: Manifest, directory: Path, candidates: Sequence[tuple[int, int]], sizes: tuple[int, ...],
                 seconds: float, cpus: Collection[int] | None = None, providers: tuple[str, ...] | None = None,
                 turn: Turn = now, load: Callable[[int, int], list[Engine]] | None = None,
                 runtime: str | None = None) -> list[LayoutFigures]:
    """Each of ``candidates`` ((instances, threads)) loaded (``load``; default: the bundle's engine with
    ``providers`` on ``runtime``, the one that will serve it; None: the bundle's own), measured
    (:func:`measure_layout`, ``seconds`` a slice, and :func:`lone_call_ms`) and closed as soon as it is out of the
    running (agent.core.batching.tuning.in_the_running: at most the layouts still in the running are loaded at
    once); every one is closed at the end. -> their figures, in the order measured."""
    staged = StagedModel(manifest, directory, "")
    fill = trial_feeds(staged)

    def default_load(instances: int, threads: int) -> list[Engine]:
        out: list[Engine] = []
        try:
            for _ in range(instances):
                out.append(load_bundle_engine(manifest, directory / manifest.engine, threads, providers, runtime))
        except BaseException:
            for b in out:
                b.close()
            raise
        return out

    figures: list[LayoutFigures] = []
    kept: dict[tuple[int, int], list[Engine]] = {}
    try:
        for i, t in candidates:
            engines = kept[(i, t)] = (load or default_load)(i, t)
            figures.append(LayoutFigures(i, t, measure_layout(engines, fill, sizes, seconds, cpus, turn),
                                         lone_call_ms(engines[0], fill(1), cpus, turn)))
            top = max(f.best for f in figures)
            for f in figures:
                if (f.instances, f.threads) in kept and not in_the_running(f, top):
                    for b in kept.pop((f.instances, f.threads)):
                        b.close()
    finally:
        for engines in kept.values():
            for b in engines:
                b.close()
    return figures


def layout_trial_in_child(manifest: Manifest, directory: Path, candidates: Sequence[tuple[int, int]],
                          sizes: tuple[int, ...], seconds: float, cpus: Collection[int] | None = None,
                          providers: tuple[str, ...] | None = None,
                          timeout_s: float = TRIAL_TIMEOUT_S, runtime: str | None = None) -> list[LayoutFigures]:
    """:func:`layout_trial` in a child process (``python -m edgefleet.agent.install.bench --layout-trial``, started from
    the calling thread: on its CPUs): the trial sessions' arenas, grown to the largest batch timed, die with it, and
    the agent's own memory (its peak included) holds only the sessions it serves (measured, MobileNetV2 FP32 on 2
    cores: in-process trials left the agent's peak at 3.4x that of the served sessions alone). An engine that fails
    in the trial is a SelfTestFailed as in-process; a trial that outlives ``timeout_s`` is killed and is one too."""
    doc = {"manifest": manifest.model_dump(mode="json"), "directory": str(directory),
           "candidates": [list(c) for c in candidates], "sizes": list(sizes), "seconds": seconds,
           "cpus": sorted(cpus) if cpus else None, "providers": list(providers) if providers else None,
           "runtime": runtime}
    done = run_child("edgefleet.agent.install.bench", "--layout-trial", doc, timeout_s, "layout trial", log)
    if done is None:
        return layout_trial(manifest, directory, candidates, sizes, seconds, cpus, providers, runtime=runtime)
    return layout_figures(child_answer(done, "layout trial")["figures"])


def _layout_trial_main() -> int:
    """The child of :func:`layout_trial_in_child`: a trial described on stdin -> its figures on stdout (JSON)."""
    import json
    import sys

    from ...protocol.manifest import parse_manifest

    doc = json.loads(sys.stdin.buffer.read(1 << 22))
    return child_reply(lambda: {"figures": layout_doc(layout_trial(
        parse_manifest(doc["manifest"]), Path(doc["directory"]), [(int(i), int(t)) for i, t in doc["candidates"]],
        tuple(doc["sizes"]), float(doc["seconds"]), doc["cpus"], tuple(doc["providers"]) if doc["providers"] else None,
        runtime=doc.get("runtime")))})


def _recorded_p50(manifest: Manifest) -> dict[int, float]:
    """The build host's p50 per batch size for the precision that was shipped (with --precision auto
    the compiler benchmarks both and may ship the reference)."""
    b = manifest.benchmark
    if b is None:
        return {}
    shipped_is_candidate = (b.candidate_precision or manifest.precision) == manifest.precision
    return {p.batch_size: p.candidate_ms_p50 if shipped_is_candidate else p.reference_ms_p50 for p in b.points}


def _repeat(arr: np.ndarray, axis: int | None, n: int) -> np.ndarray:
    """``arr``'s samples repeated to a batch of ``n`` along its batch axis (as-is without one)."""
    if axis is None or arr.ndim <= axis or arr.shape[axis] == 0:
        return np.array(arr, order="C")  # (not ascontiguousarray: it makes a scalar input of shape [] one of [1])
    return np.ascontiguousarray(np.take(arr, np.arange(n) % arr.shape[axis], axis=axis))


def bench_bundle(bundle: Path, batch_sizes: tuple[int, ...] | None = None, iterations: int = 30, warmup: int = 5,
                 threads: int = 2) -> tuple[Manifest, list[BenchPoint], tuple[str, ...]]:
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-") as tmp:
        manifest = extract_bundle(bundle, Path(tmp))
        recorded = _recorded_p50(manifest)
        batchable = manifest.batchable
        sizes = (batch_sizes or tuple(recorded) or (1,)) if batchable else (1,)
        backend = load_bundle_engine(manifest, Path(tmp) / manifest.engine, threads)
        try:
            with np.load(Path(tmp) / manifest.selftest, allow_pickle=False) as npz:
                sample = {s.name: npz[f"input:{s.name}"] for s in manifest.inputs}
            points = []
            for bs in sizes:
                feed = {s.name: _repeat(sample[s.name], s.batch_axis, bs) for s in manifest.inputs}
                for _ in range(warmup):
                    backend.infer(feed)
                times = []
                for _ in range(iterations):
                    t0 = time.perf_counter()
                    backend.infer(feed)
                    times.append((time.perf_counter() - t0) * 1000)
                p50 = float(np.median(times))
                points.append(BenchPoint(bs, round(p50, 4), round(float(np.percentile(times, 99)), 4),
                                         round(bs * 1000 / p50, 1) if p50 > 0 else 0.0, recorded.get(bs)))
        finally:
            backend.close()
    return manifest, points, tuple(sorted(cpu_features()))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--layout-trial"]:
        sys.exit("usage: python -m edgefleet.agent.install.bench --layout-trial < trial.json "
                 "(the agent runs it at install)")
    sys.exit(_layout_trial_main())
