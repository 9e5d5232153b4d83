"""Dynamic batching: the loop, not user code, enforces the contract.

Requests queue on the server's event loop, in two priority levels (high first, then normal; first in,
first out within a level). One loop task forms batches and hands each to a free *instance*: a backend
object with its own inference thread, so several batches run at once when a model has several
instances. Inference never runs on the event loop.

Forming a batch: take the oldest request of the highest level, then keep taking queued requests while
the batch stays within ``max_batch_size`` samples. If the batch is not full (or not of a preferred size)
it waits for more, until the oldest request has waited ``max_queue_delay_us`` -- but only when there is
evidence of concurrent clients (the batch already holds two requests, or requests arrived while a
batch ran): a lone client is never made to wait for company that is not coming. With
``preferred_batch_sizes``, a batch larger than a preferred size gives its newest requests back to the
queue to run at the largest preferred size it can fill (the runtime's fastest sizes per sample).

While an instance runs a batch and a full batch is already queued, that batch is formed at once (its inputs
copied into one array on the event loop) and queued on the instance's thread, which starts it the moment the
running batch ends: the runtime never waits for the event loop between two batches under load. At most one
batch waits on a thread this way, and only when nothing else waits for a turn on the cores.

Several versions of one model share a :class:`ComputeGate`: every batch holds one of its permits while it
runs, and so does each self-test or warm-up call of a version being installed (``ComputeGate.call``). The
cores are not shared between a serving batch and the next version's warm-up, nor between the old
version's last batch and the new version's first: each waits its turn, first come first served, so a
swap adds at most one such call to the time between two answers instead of slowing every batch it
overlaps.

The contract: every request gets exactly one answer. A request whose timeout passes while it is still
queued gets 503 at its deadline (running requests are not interrupted); a full queue answers 429
(:class:`QueueFull`) at once; a batch whose outputs do not match its inputs, or that raises, fails every
request in it with the same error.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from edgefleet.agent.errors import InferenceFailed, QueueFull, RequestError, Unavailable
from edgefleet.agent.core.metrics import Metrics, ModelMetrics
from edgefleet.engines import Engine

__all__ = ["BATCH_TOLERANCE", "DEAD_MAX", "HIGH", "LAYOUT_TIE", "NORMAL", "BatchSettings",
           "BatchTuning", "Batcher", "ComputeGate", "LayoutFigures", "Outputs", "batch_ladder", "choose_batch_size",
           "choose_layout", "in_the_running", "layout_candidates", "pin_thread"]

log = logging.getLogger("edgefleet.agent.batcher")

HIGH, NORMAL = 0, 1  # priority levels: the index of their queue
DEAD_MAX = 64  # cancelled requests left in the queues before they are compacted (when they are half of them)
_T = TypeVar("_T")


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int = 16  # samples
    max_queue_delay_us: int = 0  # longest the oldest request waits for a fuller batch (only under concurrency)
    preferred_batch_sizes: tuple[int, ...] = ()  # sizes the runtime runs best at, e.g. (4, 8)
    queue_timeout_s: float = 5.0  # a request's default timeout in the queue; a request may ask for less
    max_queue_size: int = 1024  # samples waiting, both levels together; beyond it: 429
    # the largest request accepted, in samples (None: max_batch_size). A request larger than max_batch_size (the
    # largest batch formed) runs alone: a device that tuned its batches smaller still takes what any device takes
    max_request_batch_size: int | None = None
    # a lone request (nothing else queued or running) of a CPU model whose lone calls take less than this runs on
    # the event loop itself: handing it to the inference thread and its answer back costs more (about 0.2 ms of
    # thread wake-ups, measured). 0: always on the inference thread
    inline_max_us: int = 100

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_request_batch_size is not None and self.max_request_batch_size < self.max_batch_size:
            raise ValueError("max_request_batch_size must be at least max_batch_size")
        if self.max_queue_delay_us < 0 or self.queue_timeout_s <= 0 or self.max_queue_size < 1:
            raise ValueError("max_queue_delay_us must be >= 0, queue_timeout_s > 0, max_queue_size >= 1")
        bad = [p for p in self.preferred_batch_sizes if not 1 <= p <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes {bad} are outside 1..max_batch_size ({self.max_batch_size})")


    @property
    def request_limit(self) -> int:
        """The largest request accepted, in samples."""
        return self.max_request_batch_size or self.max_batch_size


# a smaller batch within this fraction of the best images/s is chosen: less latency. Under load the agent serves at
# the chosen size's rate, so this is also what it may give up against the runtime's best (measured: 5% chose batch 1
# for MobileNetV2 FP32 and 2 for INT8, 4-6% under their best sizes, 2 and 4, when served pinned)
BATCH_TOLERANCE = 0.02


@dataclass(frozen=True)
class BatchTuning:
    """How a served version's batch sizes were chosen: ``measured`` on this device at install (``images_per_s``
    per batch size, ``chosen`` from them), set by the ``operator`` (max_batch_size in the agent's config), or
    ``off`` (batch_tuning: off)."""

    mode: str  # measured | operator | off
    images_per_s: tuple[tuple[int, float], ...] = ()  # (batch size, images/s), ascending sizes
    chosen: int | None = None
    # the layout served: (instances, intra-op threads each), ``measured`` here (``layouts``: the figures of each
    # candidate), set by the ``operator`` (instances / intra_op_threads in the config), or the ``default``
    layout: tuple[int, int] | None = None
    layout_source: str = "default"  # measured | operator | default
    layouts: tuple[LayoutFigures, ...] = ()


@dataclass(frozen=True)
class LayoutFigures:
    """One candidate layout as measured at install: ``instances`` sessions of ``threads`` intra-op threads each,
    all running at once; images/s by batch size, and a lone batch-1 call's time on one of its sessions."""

    instances: int
    threads: int
    images_per_s: tuple[tuple[int, float], ...]
    lone_ms: float

    @property
    def name(self) -> str:
        return f"{self.instances}x{self.threads}"

    @property
    def best(self) -> float:
        return max((v for _, v in self.images_per_s), default=0.0)


# layouts within this fraction of the most images/s are equals: of those, the one whose lone batch-1 call is fastest
# serves (a lone request waits less; what is given up under load is at most this)
LAYOUT_TIE = 0.03


def layout_candidates(cores: int) -> tuple[tuple[int, int], ...]:
    """(instances, threads) that use ``cores`` inference CPUs exactly: one session of every core, one session per
    core, and the splits between (1x1 alone on one core)."""
    return tuple((i, cores // i) for i in range(1, cores + 1) if cores % i == 0 and i <= 16)


def in_the_running(f: LayoutFigures, top: float) -> bool:
    """``f`` may still be chosen when the most images/s measured so far is ``top``: it is within ``LAYOUT_TIE``
    of it (a layout out of the running stays out whatever is measured next: the top only rises)."""
    return f.best >= (1 - LAYOUT_TIE) * top


def choose_layout(measured: Sequence[LayoutFigures]) -> LayoutFigures:
    """The layout to serve with: the one that serves the most images/s at its best batch size with all its
    instances driven at once (the figure ``bench/serve.py`` calls the runtime's limit, measured the same way:
    agent.install.bench.drive_together); of the layouts within ``LAYOUT_TIE`` of it, the one whose lone batch-1 call is
    fastest."""
    if not measured:
        raise ValueError("no layout was measured")
    top = max(f.best for f in measured)
    return min((f for f in measured if in_the_running(f, top)), key=lambda f: (f.lone_ms, -f.best))


def batch_ladder(limit: int) -> tuple[int, ...]:
    """The batch sizes a device measures: 1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != limit:
        sizes.append(limit)
    return tuple(sizes)


def choose_batch_size(images_per_s: Sequence[tuple[int, float]], tolerance: float = BATCH_TOLERANCE) -> int:
    """The largest batch to form: the smallest size whose images/s is within ``tolerance`` of the best measured
    (a larger batch that is barely faster only makes each request wait longer)."""
    if not images_per_s:
        raise ValueError("no batch size was measured")
    best = max(v for _, v in images_per_s)
    return min(n for n, v in images_per_s if v >= (1 - tolerance) * best)


class ComputeGate:
    """Turns on one model's compute, first come first served: ``permits`` runs at a time (one per
    instance), shared by every version of the model. Acquired on the event loop; ``call`` runs a function
    in its turn from another thread (an install's self-test and warm-up)."""

    def __init__(self, permits: int = 1):
        if permits < 1:
            raise ValueError("a compute gate needs at least one permit")
        self.permits = permits
        self._free = permits
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # called (on the loop) when someone starts to wait: a batcher takes back a batch queued on a busy thread
        self.on_wait: list[Callable[[], None]] = []

    @property
    def busy(self) -> int:
        return self.permits - self._free

    @property
    def waiting(self) -> bool:
        """Someone waits for a turn (a batch of another version, an install's call)."""
        return any(not f.done() for f in self._waiters)

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        for hook in list(self.on_wait):
            hook()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a permit just as it was cancelled: pass it on
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the permit passes straight to the oldest waiter
                return
        self._free += 1

    def call(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., _T], *args: object,
             wait_s: float = 30.0) -> _T:
        """Run ``fn(*args)`` in this (non-loop) thread in its turn. If no turn comes within ``wait_s`` (a
        loop that has stopped, a batch stuck in the runtime), it runs anyway: a turn is a courtesy to
        the requests being served, not a condition of installing. A turn that arrives after this thread
        gave up is handed straight back."""
        lock = threading.Lock()
        state = {"taken": False, "gave_up": False}

        async def turn() -> None:
            try:
                await asyncio.wait_for(self.acquire(), wait_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                return
            with lock:
                if state["gave_up"]:
                    self.release()
                    return
                state["taken"] = True

        try:
            fut = asyncio.run_coroutine_threadsafe(turn(), loop)
            fut.result(wait_s + 5.0)  # the loop's own timeout comes first; this one is for a loop that stopped
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            pass
        with lock:
            state["gave_up"] = True
            held = state["taken"]
        if not held:
            log.warning("no compute turn within %.0fs; running without one", wait_s)
            return fn(*args)
        try:
            return fn(*args)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to hand on to
                loop.call_soon_threadsafe(self.release)


class Outputs(list):  # type: ignore[type-arg]
    """One request's outputs (a list of arrays, one per model output), and whether the whole batch they came from was
    checked to hold no NaN or infinity (``finite``: then no check of each request's rows is needed)."""

    def __init__(self, arrays: list[np.ndarray], finite: bool = False):
        super().__init__(arrays)
        self.finite = finite


@dataclass(eq=False)
class _Pending:
    feeds: dict[str, np.ndarray]
    n: int
    future: asyncio.Future
    priority: int
    enqueued: float = field(default_factory=time.monotonic)
    counted: bool = True  # its samples are still in the queue's count
    dispatched: bool = False
    waiting_on_thread: bool = False  # in a batch queued behind the running one on an inference thread
    timer: asyncio.TimerHandle | None = None  # a request with a timeout of its own; else the batcher's one timer
    settled: bool = False  # Batcher.settle ran: its answer is out, nothing of it is needed any more

    def stackable_with(self, other: _Pending, axes: dict[str, int | None]) -> bool:
        """Every input has a batch axis, and the same other dimensions (dynamic dims may differ between
        requests). A model with an unbatched input (a shared parameter) runs one request at a time."""
        for k, v in self.feeds.items():
            a = axes.get(k, 0)
            if a is None:
                return False
            o = other.feeds[k].shape
            if v.shape[:a] + v.shape[a + 1:] != o[:a] + o[a + 1:]:
                return False
        return True


def _gone(ref: weakref.ref[_Pending]) -> bool:
    """A request in the timeout queue that needs no watching any more: answered (settled) or freed."""
    p = ref()
    return p is None or p.settled


def pin_thread(cpus: Collection[int] | None) -> None:
    """Run the calling thread (only it: Linux's affinity is per thread; threads it starts inherit it) on ``cpus``."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cpus))


class _Instance:
    """One backend object and the one thread that runs it (on ``cpus``, if given)."""

    def __init__(self, backend: Engine, index: int, cpus: Collection[int] | None = None):
        self.backend = backend
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infer-{index}",
                                           initializer=pin_thread, initargs=(cpus,))
        self.inflight = 0  # batches handed to its thread and not finished: at most 2 (one runs, one waits)
        self.slot: _Staged | None = None  # the batch its thread starts next; taken under ``lock``
        self.lock = threading.Lock()
        self.buffers: list[dict[str, np.ndarray]] = []  # batch buffers not in use (two at most: one runs, one fills)


@dataclass(eq=False)
class _Staged:
    batch: list[_Pending]
    feeds: dict[str, np.ndarray]
    n: int  # samples
    behind: bool = False  # queued behind a running batch: in its instance's slot until its thread takes it
    staged: bool = False  # counted in the queue's limit (_staged_samples) until it ends or is taken back
    # an open batch: its requests' inputs copied into rows of these (one per input, max_batch_size rows), and
    # requests arriving while it waits in the slot join it (copied into the next rows) until its thread takes it
    buffers: dict[str, np.ndarray] | None = None


class Batcher:
    def __init__(self, backends: Engine | Sequence[Engine], settings: BatchSettings,
                 metrics: ModelMetrics | Metrics | None = None, gate: ComputeGate | None = None,
                 cpus: Collection[int] | None = None, open_batches: bool = True):
        """``gate``: shared with the model's other versions (default: one of its own, a permit per instance).
        ``cpus``: the CPUs the inference threads run on (None: wherever the scheduler puts them).
        ``open_batches``: a batch queued behind a running one takes requests until its thread starts it (False: it
        is queued there only when full, and closed)."""
        backends = [backends] if isinstance(backends, Engine) else list(backends)
        if not backends:
            raise ValueError("a batcher needs at least one backend instance")
        self.backend = backends[0]  # the model's description (inputs, outputs); every instance has the same
        self.settings = settings
        if metrics is None or isinstance(metrics, Metrics):
            metrics = (metrics or Metrics()).for_model(self.backend.spec.model, self.backend.spec.version)
        self.metrics: ModelMetrics = metrics
        self._instances = [_Instance(b, i, cpus) for i, b in enumerate(backends)]
        self.gate = gate if gate is not None else ComputeGate(len(backends))
        self._idle: list[_Instance] = list(reversed(self._instances))  # pop() takes instance 0 first
        self._queues: tuple[collections.deque[_Pending], collections.deque[_Pending]] = (
            collections.deque(), collections.deque())
        self._queued_samples = 0
        self._staged_samples = 0  # in batches waiting on a busy inference thread
        self._wake = asyncio.Event()
        # requests with the default timeout, in the order (and so the deadline order) they came: one timer (_sweep)
        self._timeouts: collections.deque[tuple[float, weakref.ref[_Pending]]] = collections.deque()
        self._dead = 0  # cancelled requests left in the queues (a hint for _compact)
        self._sweeper: asyncio.TimerHandle | None = None
        self._ev_loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._closing = False
        self._task: asyncio.Task | None = None
        self._running: dict[asyncio.Task, list[_Pending]] = {}  # batches being run, by their task
        self._arrived_while_running = 0
        self._forming: list[_Pending] = []  # the batch being formed; failed if the loop is cancelled
        self._in_axes = {t.name: t.batch_axis for t in self.backend.inputs}
        self._out_axes = [t.batch_axis for t in self.backend.outputs]
        self._in_names = [t.name for t in self.backend.inputs]
        # a model with an unbatched input runs each request alone, whatever its size: no batch limit applies
        self._batchable = all(a is not None for a in self._in_axes.values())
        self._preferred = sorted(set(settings.preferred_batch_sizes))
        # batches queued behind a running one stay open (later requests join them) when every input is batched
        # along its first axis: each request is copied once into its rows of a reused buffer
        self._open_cap = self._preferred[-1] if self._preferred else settings.max_batch_size
        self._open = open_batches and self._batchable and all(a == 0 for a in self._in_axes.values())
        # the compute times of the latest lone calls: a lone request runs inline when every one was below
        # inline_max_us (one slow call, and the next lone requests go to the thread until it has aged out)
        self._lone_s: collections.deque[float] = collections.deque(maxlen=8)
        self._inline_ok = settings.inline_max_us > 0 and all(
            b.kind in ("onnxruntime", "litert") and "CPU" in b.device for b in backends)  # where it says it runs

    @property
    def instances(self) -> int:
        return len(self._instances)

    @property
    def queued_samples(self) -> int:
        """Samples waiting: in the queues and in batches waiting behind a running one on a thread."""
        return self._queued_samples + self._staged_samples

    def start(self) -> None:
        # the loop it serves on, kept: asyncio.get_running_loop() costs a getpid() system call on Python 3.11
        self._ev_loop = asyncio.get_running_loop()
        self._task = self._ev_loop.create_task(self._loop(), name="batcher")
        self.gate.on_wait.append(self._unstage_all)
        self.metrics.watch_queue(lambda: self.queued_samples)

    async def submit(self, feeds: dict[str, np.ndarray], priority: int = NORMAL,
                     timeout_s: float | None = None) -> list[np.ndarray]:
        """Queue one request (already validated) and wait for its outputs. ``timeout_s`` (at most the
        configured ``queue_timeout_s``) bounds its time in the queue."""
        p = self.enqueue(feeds, priority, timeout_s)
        try:
            return await p.future
        finally:
            self.settle(p)

    def enqueue(self, feeds: dict[str, np.ndarray], priority: int = NORMAL,
                timeout_s: float | None = None) -> _Pending:
        """``submit`` without a coroutine: queue one request -> its entry, whose ``future`` gets the outputs (or the
        error). The caller calls ``settle(entry)`` once that future is done, cancelled included (a transport that
        answers from a done-callback: no task per request). Raises as ``submit`` does when the request is refused."""
        n = next((int(feeds[k].shape[a]) for k, a in self._in_axes.items() if a is not None), 1)
        s = self.settings
        if self._batchable and n > s.request_limit:
            raise RequestError(f"request batch of {n} exceeds this model's max batch size "
                               f"{s.request_limit}; split it into smaller requests")
        if n > s.max_queue_size:
            raise RequestError(f"request batch of {n} exceeds this model's queue of {s.max_queue_size} samples")
        if self._closing:
            raise Unavailable("the model is being replaced; retry")
        if self._queued_samples + self._staged_samples + n > s.max_queue_size:
            raise QueueFull(f"queue full ({self._queued_samples + self._staged_samples} samples waiting, limit "
                            f"{s.max_queue_size}); "
                            "retry later")
        loop = self._ev_loop or asyncio.get_running_loop()
        p = _Pending(feeds, n, loop.create_future(), HIGH if priority == HIGH else NORMAL)
        timeout = s.queue_timeout_s if timeout_s is None else min(timeout_s, s.queue_timeout_s)
        if timeout == s.queue_timeout_s:  # the usual case: one timer for them all, their deadlines in order
            dq = self._timeouts
            while dq and _gone(dq[0][1]):  # answered: nothing left to watch
                dq.popleft()
            dq.append((loop.time() + timeout, weakref.ref(p)))  # weak: an answered request's inputs are not kept
            if self._sweeper is None:
                self._sweeper = loop.call_at(dq[0][0], self._sweep)
        else:
            p.timer = loop.call_later(timeout, self._expire, p, timeout)
        self._queues[p.priority].append(p)
        self._queued_samples += n
        if p.priority == HIGH and self._staged_samples:  # it goes before a batch not yet started
            self._unstage_all()
        if self._running:
            self._arrived_while_running += 1
        self._wake.set()
        return p

    def settle(self, p: _Pending) -> None:
        """``p``'s future is done: a request cancelled while queued (its client went away) leaves the queue's count
        now, and its timeout timer goes."""
        if not p.dispatched and p.counted:
            p.counted = False
            self._queued_samples -= p.n
            self._dead += 1  # still in its queue, which drops it when the batcher next looks; or compacts now
            if self._dead > DEAD_MAX and 2 * self._dead > len(self._queues[HIGH]) + len(self._queues[NORMAL]):
                self._compact()
        elif p.waiting_on_thread and p.future.cancelled():  # its client went away while its batch waited on a thread
            self._drop_if_all_done(p)
        if p.timer is not None:
            p.timer.cancel()
        p.settled = True  # the timeout queue lets it go (and holds it only weakly meanwhile)

    def _compact(self) -> None:
        """Drop the answered requests (cancelled by their clients) from the queues now: while the model is busy the
        batcher does not look at its queues, and a client that sends and cancels would otherwise fill them with
        requests the queue's count no longer holds (memory bounded to about twice what waits)."""
        for q in self._queues:
            live = [p for p in q if not p.future.done() or p.counted]
            q.clear()
            q.extend(live)
        self._dead = 0

    def _sweep(self) -> None:
        """The one timer of requests with the default timeout: expire those whose deadline has passed (oldest first:
        they were queued in deadline order), then wait for the next one."""
        self._sweeper = None
        loop = self._ev_loop or asyncio.get_running_loop()
        now, dq, timeout = loop.time(), self._timeouts, self.settings.queue_timeout_s
        while dq and (dq[0][0] <= now or _gone(dq[0][1])):
            p = dq.popleft()[1]()
            if p is not None and not p.settled:
                self._expire(p, timeout)
        if dq:
            self._sweeper = loop.call_at(dq[0][0], self._sweep)

    def _expire(self, p: _Pending, timeout: float) -> None:
        if p.future.done() or (p.dispatched and not p.waiting_on_thread):
            return
        if p.counted:
            p.counted = False
            self._queued_samples -= p.n
        staged = p.waiting_on_thread
        p.future.set_exception(Unavailable(f"request waited {time.monotonic() - p.enqueued:.3f}s in the queue "
                                           f"(timeout {timeout:g}s); retry later"))
        if staged:
            self._drop_if_all_done(p)

    def _drop_if_all_done(self, p: _Pending) -> None:
        """A batch waiting on a thread whose requests have all expired or been cancelled does not run."""
        for inst in self._instances:
            st = inst.slot
            if st is not None and p in st.batch and all(q.future.done() for q in st.batch):
                self._unstage(inst)

    # -- forming batches -------------------------------------------------------------------------
    def _peek(self) -> _Pending | None:
        """The next live request (answered ones -- expired, cancelled -- are dropped on the way)."""
        for q in self._queues:
            while q:
                p = q[0]
                if not p.future.done():
                    return p
                q.popleft()
                if p.counted:
                    p.counted = False
                    self._queued_samples -= p.n
        return None

    def _take(self, p: _Pending) -> None:
        self._queues[p.priority].popleft()
        p.counted = False
        self._queued_samples -= p.n

    def _give_back(self, items: list[_Pending]) -> None:
        for p in reversed(items):
            self._queues[p.priority].appendleft(p)
            p.counted = True
            p.dispatched = p.waiting_on_thread = False
            self._queued_samples += p.n

    def _idle_others(self, staged: bool) -> bool:
        """Another instance could take a batch now besides the one this batch is formed for."""
        if staged:
            return sum(1 for i in self._instances if i.inflight == 1 and i.slot is None) > 1
        return len(self._idle) > 1

    def _share(self, staged: bool) -> int:
        """The samples one batch may take when several instances can take a batch now (free ones; or, for a batch
        queued behind a running one, busy ones with none queued): the queue split evenly between them, so each
        starts on its share at once instead of one taking everything while the others idle."""
        takers = sum(1 for i in self._instances if i.inflight == 1 and i.slot is None) if staged else len(self._idle)
        return -(-self._queued_samples // takers) if takers > 1 else self._queued_samples

    async def _form(self, staged: bool = False) -> list[_Pending]:
        s = self.settings
        first = self._peek()
        if first is None:
            return []
        share = self._share(staged)
        self._take(first)
        batch, n = [first], first.n
        self._forming = batch
        deadline = first.enqueued + s.max_queue_delay_us / 1e6
        concurrent = self._arrived_while_running > 1
        cap = self._open_cap if staged and self._open else s.max_batch_size
        if self._idle_others(staged):
            cap = max(1, min(cap, share))
        while n < cap:
            nxt = self._peek()
            if nxt is not None:
                if n + nxt.n > cap or not nxt.stackable_with(first, self._in_axes):
                    break
                self._take(nxt)
                batch.append(nxt)
                n += nxt.n
                continue
            if self._preferred and n in self._preferred:
                break  # a preferred size: run it rather than wait
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closing or not (concurrent or len(batch) > 1) or (staged and self._open):
                break  # an open batch does not wait: later requests join it while it waits on the thread
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                break
        if self._preferred and n not in self._preferred:
            fits = [p for p in self._preferred if p <= n]
            if fits:  # run the largest preferred size; the newest requests wait for the next batch
                keep: list[_Pending] = []
                kept = 0
                for p in batch:
                    if kept + p.n > fits[-1] and keep:
                        break
                    keep.append(p)
                    kept += p.n
                self._give_back(batch[len(keep):])
                batch = keep
        live = [p for p in batch if not p.future.done()]  # expired or cancelled while the batch formed
        for p in live:
            p.dispatched = True
            if staged:  # queued on a busy thread: it may still expire there, until its batch starts
                p.waiting_on_thread = True
            elif p.timer is not None:
                p.timer.cancel()
        self._forming = []
        return live

    def _stageable(self) -> _Instance | None:
        """An instance running a batch with none queued behind it, when a full batch is waiting and nobody else
        (an install's self-test or warm-up) waits for a turn on the cores: that batch is formed now and queued on
        the instance's thread, which starts it the moment the running one ends, without a round trip through
        the event loop (measured: the inference thread waited 19% of the time for its next batch at 32
        clients, pinned)."""
        if self._closing or self.gate.waiting or self._queued_samples < (1 if self._open else
                                                                          self.settings.max_batch_size):
            return None
        # inflight 1 and an empty slot: one batch runs (or is about to), none waits behind it
        return next((i for i in self._instances if i.inflight == 1 and i.slot is None), None)

    async def _loop(self) -> None:
        while True:
            staged: _Instance | None = None
            while not (self._idle and self._peek() is not None):
                if self._idle and self._steal():
                    continue  # a free instance takes the batch waiting behind a busy one
                staged = self._stageable()
                if staged is not None:
                    break
                self._top_up()
                if self._closing and self._peek() is None and not self._running:
                    return
                self._wake.clear()
                await self._wake.wait()
            if staged is not None:
                batch = await self._form(staged=True)  # a full batch is queued: formed without waiting
                if not batch:
                    continue
                if staged.inflight == 0:  # it finished meanwhile: a fresh turn, as below
                    await self._dispatch_fresh(batch)
                else:
                    self._dispatch(staged, batch)  # the instance's permit covers the batch queued behind
                continue
            await self.gate.acquire()  # requests queued meanwhile join the batch formed next
            try:
                batch = await self._form()
            except BaseException:
                self.gate.release()
                raise
            if not batch:
                self.gate.release()
                continue
            self._dispatch(self._idle.pop(), batch)

    def _top_up(self) -> None:
        """Requests queued while open batches wait on busy threads join them (copied into their next rows), oldest
        first, each into the open batch with the fewest samples that it fits and stacks with, until their threads
        take them."""
        if not self._open or self._closing or self.gate.waiting:
            return
        while True:
            p = self._peek()
            if p is None:
                return
            fits = [i for i in self._instances if (st := i.slot) is not None and st.buffers is not None
                    and st.n + p.n <= self._open_cap and p.stackable_with(st.batch[0], self._in_axes)]
            if not fits:
                return  # first in, first out: nothing jumps the request at the head of the queue
            inst = min(fits, key=lambda i: i.slot.n if i.slot is not None else 0)
            with inst.lock:
                st = inst.slot
                if st is None or st.buffers is None or st.n + p.n > self._open_cap:
                    continue  # its thread took it meanwhile: look again
                for k, b in st.buffers.items():
                    b[st.n:st.n + p.n] = p.feeds[k]
                self._take(p)
                p.dispatched = p.waiting_on_thread = True
                st.batch.append(p)
                st.n += p.n
                self._staged_samples += p.n

    def _steal(self) -> bool:
        """An instance is free and nothing is queued, but a batch waits behind a busy instance and has not started:
        it goes back to the front of the queue (its requests keep their order), for the free instance to take now.
        -> whether one did."""
        waiting = [i for i in self._instances if i.slot is not None and i.slot.batch[0].waiting_on_thread]
        if not waiting:
            return False
        before = self._queued_samples
        self._unstage(max(waiting, key=lambda i: i.slot.n if i.slot is not None else 0))
        return self._queued_samples > before

    def _buffers(self, inst: _Instance, first: _Pending, rows: int) -> dict[str, np.ndarray]:
        """A batch buffer of at least ``rows`` rows for ``first``'s input shapes, reused when one of ``inst`` is
        free (a request larger than the batches formed runs alone: its rows are more than ``_open_cap``)."""
        rows = max(rows, self._open_cap)
        while inst.buffers:
            bufs = inst.buffers.pop()
            if all(k in bufs and bufs[k].shape[0] >= rows and bufs[k].shape[1:] == v.shape[1:]
                   and bufs[k].dtype == v.dtype for k, v in first.feeds.items()):
                return bufs
        return {k: np.empty((rows, *v.shape[1:]), v.dtype) for k, v in first.feeds.items()}

    async def _dispatch_fresh(self, batch: list[_Pending]) -> None:
        await self.gate.acquire()
        if not self._idle:  # cannot happen (one loop dispatches); keep the contract all the same
            self.gate.release()
            self._give_back(batch)
            return
        self._dispatch(self._idle.pop(), batch)

    def _dispatch(self, inst: _Instance, batch: list[_Pending]) -> None:
        """Run ``batch`` on ``inst`` (after the batch it runs now, if any). The gate's permit is held from an
        instance's first batch to the end of its last: released when nothing more is queued on it."""
        try:
            st = self._stage(inst, batch)
        except Exception as exc:  # inputs that do not stack (checked when the batch formed: not expected)
            err = InferenceFailed(f"inference failed: {exc}")
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(err)
            return
        inst.inflight += 1
        self._arrived_while_running = 0
        task = (self._ev_loop or asyncio.get_running_loop()).create_task(self._run_batch(inst, st))
        self._running[task] = batch
        task.add_done_callback(functools.partial(self._ran, inst))

    def _ran(self, inst: _Instance, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        inst.inflight -= 1
        if inst.inflight == 0:  # here, not in the task: a task cancelled before it started never runs its finally
            self._idle.append(inst)
            self.gate.release()
        self._wake.set()

    def _stack(self, batch: list[_Pending]) -> dict[str, np.ndarray]:
        """One array per input for the whole batch (on the event loop: the inference thread only runs)."""
        if len(batch) == 1:
            return batch[0].feeds
        return {k: np.concatenate([p.feeds[k] for p in batch], axis=self._in_axes[k] or 0) for k in self._in_names}

    def _infer(self, inst: _Instance, st: _Staged) -> tuple[list[np.ndarray], float, bool] | None:
        """On the instance's thread: run ``st`` unless the loop took it back before it started (-> None)."""
        with inst.lock:
            if st.behind:
                if inst.slot is not st:
                    return None
                inst.slot = None
                if st.buffers is not None:  # closed now: its rows so far
                    st.feeds = {k: b[:st.n] for k, b in st.buffers.items()}
            for p in st.batch:  # started: no longer expires or goes back to the queue
                p.waiting_on_thread = False
        t0 = time.perf_counter()
        outs = inst.backend.infer(st.feeds)
        dt = time.perf_counter() - t0
        # NaN or infinity anywhere in the batch's outputs? Checked once here, not once per request's rows: a request
        # whose outputs are answered as Outputs(finite=True) needs no check of its own (agent.kserve.ordered_outputs)
        return outs, dt, all(o.dtype.kind != "f" or bool(np.isfinite(o).all()) for o in outs)

    def _stage(self, inst: _Instance, batch: list[_Pending]) -> _Staged:
        st = _Staged(batch, {}, sum(p.n for p in batch), behind=inst.inflight > 0)
        if st.behind and self._open:
            st.buffers = self._buffers(inst, batch[0], st.n)
            row = 0
            for p in batch:
                for k, b in st.buffers.items():
                    b[row:row + p.n] = p.feeds[k]
                row += p.n
        else:
            st.feeds = self._stack(batch)
        if st.behind:
            with inst.lock:
                inst.slot = st
            st.staged = True
            self._staged_samples += st.n
        return st

    def _unstage(self, inst: _Instance) -> None:
        """Take back the batch waiting on ``inst``'s thread, if it has not started: its live requests go back
        to the front of their queues (a high-priority request arrived, an install waits for a turn, or all of
        them expired)."""
        with inst.lock:
            st = inst.slot if inst.slot is not None and inst.slot.batch[0].waiting_on_thread else None
            if st is not None:
                inst.slot = None
        if st is None:
            return
        if st.staged:
            st.staged = False
            self._staged_samples -= st.n
        live = [p for p in st.batch if not p.future.done()]
        self._give_back(live)
        self._wake.set()

    def _unstage_all(self) -> None:
        for inst in self._instances:
            if inst.slot is not None:
                self._unstage(inst)

    async def _run_batch(self, inst: _Instance, st: _Staged) -> None:
        batch = st.batch  # an open batch may still grow until its thread takes it: its size is read after
        start_t = time.monotonic()
        try:
            # the engine checked the feeds and that its outputs keep the batch (engines.Engine.infer)
            if self._inline(st):  # a lone tiny call: on the loop, cheaper than two thread hand-offs
                got = self._infer(inst, st)
            else:
                got = await (self._ev_loop or asyncio.get_running_loop()).run_in_executor(inst.executor, self._infer,
                                                                                          inst, st)
        except Exception as exc:
            err = exc if isinstance(exc, InferenceFailed) else InferenceFailed(f"inference failed: {exc}")
            log.error("batch of %d failed: %s", st.n, err)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(err)
            self._reuse(inst, st)
            return
        finally:
            if st.staged:
                st.staged = False
                self._staged_samples -= st.n
        self._reuse(inst, st)
        if got is None:  # taken back before it started (_unstage)
            return
        outs, compute_s, finite = got
        n = st.n
        if len(batch) == 1:
            self._lone_s.append(compute_s)
        self.metrics.batch(n, [start_t - p.enqueued for p in batch], compute_s)
        if len(batch) == 1:
            if not batch[0].future.done():
                batch[0].future.set_result(Outputs(outs, finite))
            return
        start = 0
        for p in batch:
            if not p.future.done():
                p.future.set_result(Outputs([o if a is None else o[(slice(None),) * a + (slice(start, start + p.n),)]
                                             for o, a in zip(outs, self._out_axes, strict=True)], finite))
            start += p.n

    def _inline(self, st: _Staged) -> bool:
        """Run ``st`` on the event loop: one request, nothing else queued or running, and its model's last lone
        calls all took less than ``inline_max_us`` (CPU engines only: a GPU context belongs to its thread). The
        price: while such a call runs, the loop waits for it, so a call that hangs would hold every request of the
        agent, not only its model's (``inline_max_us: 0`` keeps every call on the inference thread)."""
        return (self._inline_ok and not st.behind and len(st.batch) == 1 and len(self._lone_s) > 0
                and max(self._lone_s) * 1e6 < self.settings.inline_max_us and len(self._running) <= 1
                and self._peek() is None)

    @staticmethod
    def _reuse(inst: _Instance, st: _Staged) -> None:
        """``st``'s buffer back to its instance, once its thread is done with it (ran, failed or taken back)."""
        if st.buffers is not None and len(inst.buffers) < 2:
            inst.buffers.append(st.buffers)
            st.buffers = None

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, finish the queued ones, release the inference threads."""
        self._closing = True
        self._wake.set()
        with contextlib.suppress(ValueError):
            self.gate.on_wait.remove(self._unstage_all)
        stuck: list[_Pending] = []
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), drain_timeout_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                stuck = list(self._forming)  # the loop's own clean-up forgets them when cancelled
                self._task.cancel()
                log.error("batcher did not drain in %.0fs; failing what is left", drain_timeout_s)
                with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._task, 1.0)
            except Exception:
                log.exception("the batching loop had crashed")
        gone = Unavailable("the model was replaced before this request ran; retry")
        running = [p for batch in self._running.values() for p in batch]  # only after a drain timeout
        for p in [*stuck, *self._forming, *running, *self._queues[HIGH], *self._queues[NORMAL]]:
            if not p.future.done():
                p.future.set_exception(gone)
        for q in self._queues:
            q.clear()
        self._queued_samples = 0
        if self._sweeper is not None:  # everyone is answered: no timeout left to watch
            self._sweeper.cancel()
            self._sweeper = None
        self._timeouts.clear()
        for t in list(self._running):  # their threads are let go below; the tasks must not wait for them
            t.cancel()
        self.metrics.retire()
        for inst in self._instances:
            # an inference still running after a drain timeout must not block the event loop
            inst.executor.shutdown(wait=False)
