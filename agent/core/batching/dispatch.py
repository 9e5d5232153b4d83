"""Dispatch: batches handed to engine instances, each with its own inference thread.

A batch goes to a free *instance*: a backend object with its own inference thread, so several batches run at
once when a model has several instances. Inference never runs on the event loop (but for a lone tiny call of a
CPU engine: ``BatchSettings.inline_max_us``).

While an instance runs a batch and a full batch is already queued, that batch is formed at once (its inputs
copied into one array on the event loop) and queued on the instance's thread, which starts it the moment the
running batch ends: the runtime never waits for the event loop between two batches under load. At most one
batch waits on a thread this way, and only when nothing else waits for a turn on the cores.

Which batch a waiting request joins (:meth:`Dispatcher.top_up`): the batches queued behind running ones are filled
to a *target* size before another instance's is opened, the target being half the samples the model holds (queued,
waiting on threads, running) per instance (one batch running and one behind on each), at most the batch size the
install chose: with 4 requests per instance (64 clients, 16 instances) every instance runs batches of 2 or more with
one behind, where spreading them one per open batch first ran a mix of 1s and larger ones. Fewer held, and they are
spread one per instance (every instance kept fed first). A new one opens on the instance whose running batch
started first (the one to finish first). Where the install's figures say a larger batch serves more and the
instances' idle gap, measured, says waiting for it costs less, batches *gather* instead (gathering.py): a batch
starts with that size although an instance is free, and opens behind a running one only once that many wait.

A batch whose outputs do not match its inputs, or that raises, fails every request in it with the same error.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ....engines import Engine
from ...errors import InferenceFailed
from ..metrics import ModelMetrics
from .gathering import Gathering
from .request_queue import Pending, RequestQueue
from .settings import BatchSettings
from .turns import ComputeTurns

__all__ = ["Dispatcher", "Instance", "Outputs", "Staged", "pin_thread"]

log = logging.getLogger("edgefleet.agent.batcher")  # the batcher's logger, as before the package


class Outputs(list):  # type: ignore[type-arg]
    """One request's outputs (a list of arrays, one per model output), and whether the whole batch they came from was
    checked to hold no NaN or infinity (``finite``: then no check of each request's rows is needed)."""

    def __init__(self, arrays: list[np.ndarray], finite: bool = False):
        super().__init__(arrays)
        self.finite = finite


def pin_thread(cpus: Collection[int] | None) -> None:
    """Run the calling thread (only it: Linux's affinity is per thread; threads it starts inherit it) on ``cpus``."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cpus))


class Instance:
    """One backend object and the one thread that runs it (on ``cpus``, if given)."""

    def __init__(self, backend: Engine, index: int, cpus: Collection[int] | None = None):
        self.backend = backend
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infer-{index}",
                                           initializer=pin_thread, initargs=(cpus,))
        self.inflight = 0  # batches handed to its thread and not finished: at most 2 (one runs, one waits)
        self.slot: Staged | None = None  # the batch its thread starts next; taken under ``lock``
        self.lock = threading.Lock()
        self.buffers: list[dict[str, np.ndarray]] = []  # batch buffers not in use (two at most: one runs, one fills)
        self.since = 0.0  # when its running batch started (monotonic, as the loop saw it): the first to finish
        self.ended: float | None = None  # when its thread ended its last batch (perf_counter, on the thread)


@dataclass(eq=False)
class Staged:
    batch: list[Pending]
    feeds: dict[str, np.ndarray]
    n: int  # samples
    behind: bool = False  # queued behind a running batch: in its instance's slot until its thread takes it
    staged: bool = False  # counted in the queue's limit (staged_samples) until it ends or is taken back
    # an open batch: its requests' inputs copied into rows of these (one per input, max_batch_size rows), and
    # requests arriving while it waits in the slot join it (copied into the next rows) until its thread takes it
    buffers: dict[str, np.ndarray] | None = None


class Dispatcher:
    """A model's engine instances and the batches on them: running, or queued behind the running one (``slot``).
    Batches come from the loop of :class:`~edgefleet.agent.core.batching.batcher.Batcher`; a batch taken back before
    it started goes back to ``queue``; ``wake`` is set whenever the loop may have something to do."""

    def __init__(self, backends: Sequence[Engine], settings: BatchSettings, metrics: ModelMetrics,
                 turns: ComputeTurns, queue: RequestQueue, wake: asyncio.Event,
                 cpus: Collection[int] | None = None, open_batches: bool = True):
        self.settings = settings
        self.metrics = metrics
        self.turns = turns
        self.queue = queue
        self._wake = wake
        self.instances = [Instance(b, i, cpus) for i, b in enumerate(backends)]
        self.idle: list[Instance] = list(reversed(self.instances))  # pop() takes instance 0 first
        self.staged_samples = 0  # in batches waiting on a busy inference thread
        self.running: dict[asyncio.Task, list[Pending]] = {}  # batches being run, by their task
        self.arrived_while_running = 0  # requests that came while a batch ran: evidence of concurrent clients
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it serves on, once started
        model = backends[0]  # the model's description (inputs, outputs); every instance has the same
        self.in_axes = queue.in_axes
        self._out_axes = [t.batch_axis for t in model.outputs]
        self._in_names = [t.name for t in model.inputs]
        # batches queued behind a running one stay open (later requests join them) when every input is batched
        # along its first axis: each request is copied once into its rows of a reused buffer
        self.open_cap = max(settings.preferred_batch_sizes, default=settings.max_batch_size)
        self.open = open_batches and queue.batchable and all(a == 0 for a in self.in_axes.values())
        # the compute times of the latest lone calls: a lone request runs inline when every one was below
        # inline_max_us (one slow call, and the next lone requests go to the thread until it has aged out)
        self._lone_s: collections.deque[float] = collections.deque(maxlen=8)
        # batches that wait for a larger size although an instance is free, when measured to serve more (gathering.py)
        self.gathering = (Gathering(settings.call_ms, len(self.instances), self.open_cap)
                          if settings.call_ms and queue.batchable and self.open_cap > 1 else None)
        self._inline_ok = settings.inline_max_us > 0 and all(
            b.kind in ("onnxruntime", "litert") and "CPU" in b.device for b in backends)  # where it says it runs

    def takers(self, staged: bool) -> int:
        """The instances that could take a batch now: free ones; or, for a batch queued behind a running one, busy
        ones with none queued."""
        if staged:
            return sum(1 for i in self.instances if i.inflight == 1 and i.slot is None)
        return len(self.idle)

    def note_arrival(self) -> None:
        """A request was queued: one more sign of concurrent clients if a batch is running."""
        if self.running:
            self.arrived_while_running += 1

    def stageable(self) -> Instance | None:
        """An instance running a batch with none queued behind it, when a full batch is waiting and nobody else
        (an install's self-test or warm-up) waits for a turn on the cores: that batch is formed now and queued on
        the instance's thread, which starts it the moment the running one ends, without a round trip through
        the event loop (measured: the inference thread waited 19% of the time for its next batch at 32
        clients, pinned)."""
        if self.queue.closed or self.turns.waiting or self.queue.samples < (self.least() if self.open else
                                                                           self.settings.max_batch_size):
            return None
        # inflight 1 and an empty slot: one batch runs (or is about to), none waits behind it; of those, the one
        # whose batch started first (it finishes first, batches of a size taking about the same time)
        return min((i for i in self.instances if i.inflight == 1 and i.slot is None), key=lambda i: i.since,
                   default=None)

    def held_samples(self) -> int:
        """The samples this model holds: queued, in batches waiting on threads, and running (a batch taken back
        and not yet dropped by its thread may count twice, briefly)."""
        running = sum(p.n for batch in self.running.values() for p in batch
                      if p.dispatched and not p.waiting_on_thread and not p.future.done())
        return self.queue.samples + self.staged_samples + running

    def live_samples(self) -> int:
        """The samples of the requests inside the model and not yet answered: queued, in batches waiting on threads
        or running, each once (``held_samples`` counts a batch that waited behind a running one twice from its start
        to its end, which the spread's target was tuned with)."""
        return self.queue.samples + sum(p.n for batch in self.running.values() for p in batch if not p.future.done())

    def spread_target(self) -> int:
        """The size a batch queued behind a running one is filled to before another instance's is opened, spreading:
        half the samples held per instance (each instance one batch running, one queued behind it), rounded up from
        seven eighths, at least 1, at most ``open_cap``. Filled beyond that, an instance that finishes finds nothing
        queued and waits for the next request. Tried and measured (bench/serve.py --simulate, 16x1 INT8, 32
        clients): filling to the samples held per instance (2) ran 1.4-1.8 samples a call instead of 1.05-1.1, kept
        the instances busy 90-95% instead of 95-97%, and served 1-3 points less of the limit with batches allowed up
        to 8, none more with up to 2 (docs/scaling.md); where that pays is :meth:`least`'s to find out."""
        m = len(self.instances)
        return max(1, min(self.open_cap, (8 * self.held_samples() + 2 * m) // (16 * m)))

    def least(self) -> int:
        """The least samples a batch starts with now: 1, or the size being gathered (gathering.py)."""
        return 1 if self.gathering is None else self.gathering.least()

    def target(self) -> int:
        """The size open batches are filled to before another is opened: the spread's target, or the size
        being gathered when larger."""
        t = self.spread_target()
        return t if self.gathering is None else max(t, self.gathering.least())

    def top_up(self) -> None:
        """Requests queued while open batches wait on busy threads join them (copied into their next rows), oldest
        first, until their threads take them: each into the fullest open batch below :meth:`target` that it fits
        and stacks with; when none is below it, a busy instance with none queued gets a new one (``stageable``:
        left to the batching loop), and only when there is none, the open batch with the fewest samples."""
        if not self.open or self.queue.closed or self.turns.waiting:
            return
        target = 0  # computed once the first request finds an open batch
        while True:
            p = self.queue.peek()
            if p is None:
                return
            fits = [i for i in self.instances if (st := i.slot) is not None and st.buffers is not None
                    and st.n + p.n <= self.open_cap and p.stackable_with(st.batch[0], self.in_axes)]
            if not fits:
                return  # first in, first out: nothing jumps the request at the head of the queue
            target = target or self.target()
            below = [i for i in fits if i.slot is not None and i.slot.n < target]
            if below:
                inst = max(below, key=lambda i: (i.slot.n if i.slot is not None else 0, -i.since))
            elif any(i.inflight == 1 and i.slot is None for i in self.instances):
                return  # a new batch opens behind a busy instance (the loop's stageable) before these grow further
            else:
                inst = min(fits, key=lambda i: i.slot.n if i.slot is not None else 0)
            with inst.lock:
                st = inst.slot
                if st is None or st.buffers is None or st.n + p.n > self.open_cap:
                    continue  # its thread took it meanwhile: look again
                for k, b in st.buffers.items():
                    b[st.n:st.n + p.n] = p.feeds[k]
                self.queue.take(p)
                p.dispatched = p.waiting_on_thread = True
                st.batch.append(p)
                st.n += p.n
                self.staged_samples += p.n

    def steal(self) -> bool:
        """An instance is free and nothing is queued, but a batch waits behind a busy instance and has not started:
        it goes back to the front of the queue (its requests keep their order), for the free instance to take now.
        -> whether one did."""
        waiting = [i for i in self.instances if i.slot is not None and i.slot.batch[0].waiting_on_thread]
        if not waiting:
            return False
        before = self.queue.samples
        self.unstage(max(waiting, key=lambda i: i.slot.n if i.slot is not None else 0))
        return self.queue.samples > before

    def _buffers(self, inst: Instance, first: Pending, rows: int) -> dict[str, np.ndarray]:
        """A batch buffer of at least ``rows`` rows for ``first``'s input shapes, reused when one of ``inst`` is
        free (a request larger than the batches formed runs alone: its rows are more than ``open_cap``)."""
        rows = max(rows, self.open_cap)
        while inst.buffers:
            bufs = inst.buffers.pop()
            if all(k in bufs and bufs[k].shape[0] >= rows and bufs[k].shape[1:] == v.shape[1:]
                   and bufs[k].dtype == v.dtype for k, v in first.feeds.items()):
                return bufs
        return {k: np.empty((rows, *v.shape[1:]), v.dtype) for k, v in first.feeds.items()}

    async def dispatch_fresh(self, batch: list[Pending]) -> None:
        """Run ``batch`` on a free instance, once its turn comes."""
        await self.turns.acquire()
        if not self.idle:  # cannot happen (one loop dispatches); keep the contract all the same
            self.turns.release()
            self.queue.give_back(batch)
            return
        self.dispatch(self.idle.pop(), batch)

    def dispatch(self, inst: Instance, batch: list[Pending]) -> None:
        """Run ``batch`` on ``inst`` (after the batch it runs now, if any). The turn's permit is held from an
        instance's first batch to the end of its last: released when nothing more is queued on it."""
        try:
            st = self._stage(inst, batch)
        except Exception as exc:  # inputs that do not stack (checked when the batch formed: not expected)
            err = InferenceFailed(f"inference failed: {exc}")
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(err)
            return
        if inst.inflight == 0:
            inst.since = time.monotonic()
        inst.inflight += 1
        self.arrived_while_running = 0
        task = (self.loop or asyncio.get_running_loop()).create_task(self._run_batch(inst, st))
        self.running[task] = batch
        if self.gathering is not None:
            self.gathering.note_held(self.live_samples())
        task.add_done_callback(functools.partial(self._ran, inst))

    def _ran(self, inst: Instance, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        inst.inflight -= 1
        if inst.inflight == 0:  # here, not in the task: a task cancelled before it started never runs its finally
            self.idle.append(inst)
            self.turns.release()
        else:  # the batch queued behind has started on its thread
            inst.since = time.monotonic()
        self._wake.set()

    def _stack(self, batch: list[Pending]) -> dict[str, np.ndarray]:
        """One array per input for the whole batch (on the event loop: the inference thread only runs)."""
        if len(batch) == 1:
            return batch[0].feeds
        return {k: np.concatenate([p.feeds[k] for p in batch], axis=self.in_axes[k] or 0) for k in self._in_names}

    def _infer(self, inst: Instance, st: Staged) -> tuple[list[np.ndarray], float, bool] | None:
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
        if inst.ended is not None and self.gathering is not None:
            self.gathering.note_gap(t0 - inst.ended)  # idle since its last batch (~0 for a batch queued behind)
        try:
            outs = inst.backend.infer(st.feeds)
        finally:
            inst.ended = time.perf_counter()
        dt = inst.ended - t0
        # NaN or infinity anywhere in the batch's outputs? Checked once here, not once per request's rows: a request
        # whose outputs are answered as Outputs(finite=True) needs no check of its own
        # (agent.transports.kserve.ordered_outputs)
        return outs, dt, all(o.dtype.kind != "f" or bool(np.isfinite(o).all()) for o in outs)

    def _stage(self, inst: Instance, batch: list[Pending]) -> Staged:
        st = Staged(batch, {}, sum(p.n for p in batch), behind=inst.inflight > 0)
        if st.behind and self.open:
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
            self.staged_samples += st.n
        return st

    def unstage(self, inst: Instance) -> None:
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
            self.staged_samples -= st.n
        live = [p for p in st.batch if not p.future.done()]
        self.queue.give_back(live)
        self._wake.set()

    def unstage_all(self) -> None:
        for inst in self.instances:
            if inst.slot is not None:
                self.unstage(inst)

    def drop_if_all_done(self, p: Pending) -> None:
        """A batch waiting on a thread whose requests have all expired or been cancelled does not run."""
        for inst in self.instances:
            st = inst.slot
            if st is not None and p in st.batch and all(q.future.done() for q in st.batch):
                self.unstage(inst)

    async def _run_batch(self, inst: Instance, st: Staged) -> None:
        batch = st.batch  # an open batch may still grow until its thread takes it: its size is read after
        start_t = time.monotonic()
        try:
            # the engine checked the feeds and that its outputs keep the batch (engines.Engine.infer)
            if self._inline(st):  # a lone tiny call: on the loop, cheaper than two thread hand-offs
                got = self._infer(inst, st)
            else:
                got = await (self.loop or asyncio.get_running_loop()).run_in_executor(inst.executor, self._infer,
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
                self.staged_samples -= st.n
        self._reuse(inst, st)
        if got is None:  # taken back before it started (unstage)
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

    def _inline(self, st: Staged) -> bool:
        """Run ``st`` on the event loop: one request, nothing else queued or running, and its model's last lone
        calls all took less than ``inline_max_us`` (CPU engines only: a GPU context belongs to its thread). The
        price: while such a call runs, the loop waits for it, so a call that hangs would hold every request of the
        agent, not only its model's (``inline_max_us: 0`` keeps every call on the inference thread)."""
        return (self._inline_ok and not st.behind and len(st.batch) == 1 and len(self._lone_s) > 0
                and max(self._lone_s) * 1e6 < self.settings.inline_max_us and len(self.running) <= 1
                and self.queue.peek() is None)

    @staticmethod
    def _reuse(inst: Instance, st: Staged) -> None:
        """``st``'s buffer back to its instance, once its thread is done with it (ran, failed or taken back)."""
        if st.buffers is not None and len(inst.buffers) < 2:
            inst.buffers.append(st.buffers)
            st.buffers = None

    def shut_down(self) -> None:
        """Let go of the inference threads (the batches still running after a drain timeout are cancelled first:
        their tasks must not wait for the threads)."""
        for t in list(self.running):
            t.cancel()
        for inst in self.instances:
            # an inference still running after a drain timeout must not block the event loop
            inst.executor.shutdown(wait=False)
