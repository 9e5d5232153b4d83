"""bench/serve.py's yardstick: **the limit**, the runtime called bare in this process (the agent's session options,
every layout of the inference CPUs, batch 1..16), each runtime's spot rate beside a load level, and the memory of a
bare process holding the same sessions (``python bench/serve_limit.py --bare-sessions ...``, run by ``bare_rss``).

``PIN`` (set by serve.py's ``--pin``, or a script that drives these functions): the inference CPUs and the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO
from serve_bench import _die_with_parent

# --pin: (the inference CPUs, the rest): the limit's sessions, the agent's inference threads and the naive server
# (whose runtime runs in its event loop) on the first; the agent's event loop and the load generator on the rest
PIN: tuple[frozenset[int], frozenset[int]] | None = None


@contextlib.contextmanager
def _pinned(cpus: frozenset[int] | None) -> Any:
    """This thread (and the threads it starts meanwhile, e.g. onnxruntime's pool) on ``cpus`` for a while."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def on_inference_cpus() -> None:  # in a child before exec: --pin puts it (the naive server, the bare sessions)
    # on the inference CPUs
    _die_with_parent()
    if PIN:
        os.sched_setaffinity(0, PIN[0])


def _session(engine: Path, threads: int) -> Any:
    import onnxruntime as ort

    from edgefleet.engines.onnxruntime import session_options

    # the agent's own session options (engines.onnxruntime), called raw: the runtime's limit
    return ort.InferenceSession(str(engine), session_options(ort, threads), providers=["CPUExecutionProvider"])


class _OpenVINORaw:
    """Raw OpenVINO as the agent's engine compiles it (engines.openvino.compile_config: the bundle's precision hint,
    one stream of ``threads`` threads, latency hint, no pinning): one compiled model and one infer request, the
    batch's array shared in and the outputs shared out. ``run`` as InferenceSession's, for the limit's loops."""

    def __init__(self, engine: Path, threads: int, precision: str):
        from edgefleet.engines.openvino import HINTS, compile_config, core

        ov_core = core()
        self.compiled = ov_core.compile_model(ov_core.read_model(str(engine)), "CPU",
                                              compile_config(HINTS[precision][0], threads))
        self.request = self.compiled.create_infer_request()

    def run(self, _names: Any, feed: dict[str, np.ndarray]) -> Any:
        return self.request.infer(feed, share_inputs=True, share_outputs=True)


def _runner(runtime: str, engine: Path, threads: int, precision: str) -> Any:
    """A bare session of ``runtime`` on ``engine``: onnxruntime's InferenceSession with the agent's options, or raw
    OpenVINO with the agent's properties."""
    if runtime == "openvino":
        return _OpenVINORaw(engine, threads, precision)
    return _session(engine, threads)


def limit_runtimes(setting: str, precision: str) -> list[str]:
    """``--limit-runtimes``: the runtimes whose bare limit is timed. ``all``: every runtime installed here that runs
    an onnxruntime bundle of ``precision`` (engines.runtimes_for; onnxruntime first where it runs it)."""
    from edgefleet.engines import runtime_installed, runtimes_for

    able = runtimes_for("onnxruntime", precision)
    if setting == "all":
        return [r for r in able if runtime_installed(r)]
    asked = [r.strip() for r in setting.split(",") if r.strip()]
    return [r for r in asked if r in able] or [r for r in able if runtime_installed(r)][:1]


def _rate(sess: Any, x: np.ndarray, seconds: float, start: Any = None) -> tuple[float, list[float]]:
    """Images/s and call times of ``sess.run`` on ``x`` for about ``seconds`` (at most 5000 calls), after a
    warm-up and, if given, a ``threading.Barrier`` shared with the sessions that run at the same time."""
    for _ in range(3):
        sess.run(None, {"input": x})
    if start is not None:
        start.wait()
    times = []
    t_end = time.perf_counter() + seconds
    for _ in range(5000):
        t0 = time.perf_counter()
        sess.run(None, {"input": x})
        times.append(time.perf_counter() - t0)
        if t0 > t_end:
            break
    return len(x) * len(times) / sum(times), times


def the_limit(engine: Path, images: np.ndarray, threads: int, seconds_each: float, runtime: str = "onnxruntime",
              precision: str = "fp32") -> dict[str, Any]:
    """Images/s of a bare ``runtime`` session (InferenceSession.run, or raw OpenVINO: :func:`_runner`) at batch 1..16
    in every layout of ``threads`` CPUs the agent may choose (one session of ``threads`` intra-op threads, ...,
    ``threads`` sessions of one thread each), the sessions called from as many Python threads at once (on CPUs
    one-thread sessions often do more per second); the limit is the best of all. Also each layout's batch-1 median
    call time."""
    with _pinned(PIN[0] if PIN else None):
        return _the_limit(engine, images, threads, seconds_each, runtime, precision)


def _the_limit(engine: Path, images: np.ndarray, threads: int, seconds_each: float, runtime: str = "onnxruntime",
               precision: str = "fp32") -> dict[str, Any]:
    import threading

    from edgefleet.agent.core.batching.tuning import layout_candidates

    layouts = list(layout_candidates(threads))  # every layout the agent may choose: 1xT, ..., Tx1
    out: dict[str, Any] = {"by_layout": {}, "batch1_ms": {}}
    best = (0.0, "", 0)
    for instances, per in layouts:
        name = f"{instances}x{per}"
        sessions = [_runner(runtime, engine, per, precision) for _ in range(instances)]
        rates: dict[int, float] = {}
        for batch in (1, 2, 4, 8, 16):
            x = np.ascontiguousarray(np.resize(images, (batch, *images.shape[1:])), dtype=np.float32)
            got: list[tuple[float, list[float]]] = [(0.0, [])] * instances
            start = threading.Barrier(instances)

            def work(i: int, x: np.ndarray = x, start: Any = start, got: list = got, sessions: list = sessions) -> None:
                got[i] = _rate(sessions[i], x, seconds_each, start)

            workers = [threading.Thread(target=work, args=(i,)) for i in range(instances)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            rates[batch] = sum(r for r, _ in got)
            if batch == 1:
                out["batch1_ms"][name] = statistics.median(got[0][1]) * 1000
        out["by_layout"][name] = {b: round(r, 1) for b, r in rates.items()}
        b = max(rates, key=lambda k: rates[k])
        if rates[b] > best[0]:
            best = (rates[b], name, b)
    out.update(images_per_s=best[0], layout=best[1], best_batch=best[2], runtime=runtime)
    return out


def spot_limits(engine: Path, images: np.ndarray, limits: dict[str, dict[str, Any]], precision: str,
                seconds: float) -> dict[str, tuple[float, float]]:
    """Each runtime's bare (images/s, images per CPU-second of this process) now, at the layout and batch size where
    its limit was best (``limits``: from :func:`the_limit`): a baseline taken next to one load level, so that the
    box's load, which moves the limit by up to 2x within one run here, is nearly the same for both. The CPU figure
    (all this process's threads: the runtime's own pools too) does not move with the load."""
    import threading

    out = {}
    with _pinned(PIN[0] if PIN else None):
        for runtime, lim in limits.items():
            instances, per = (int(v) for v in lim["layout"].split("x"))
            sessions = [_runner(runtime, engine, per, precision) for _ in range(instances)]
            x = np.ascontiguousarray(np.resize(images, (lim["best_batch"], *images.shape[1:])), dtype=np.float32)
            for sess in sessions:  # warm: the first calls at a size set up per shape
                for _ in range(3):
                    sess.run(None, {"input": x})
            done = [0] * instances
            start = threading.Barrier(instances + 1)
            until = [0.0]  # set just before the start: the end of the timed calls

            def work(i: int, x: np.ndarray = x, start: Any = start, done: list = done,
                     sessions: list = sessions, until: list = until) -> None:
                start.wait()
                for _ in range(5000):
                    sessions[i].run(None, {"input": x})
                    done[i] += len(x)
                    if time.perf_counter() > until[0]:
                        break

            workers = [threading.Thread(target=work, args=(i,)) for i in range(instances)]
            for w in workers:
                w.start()
            until[0] = time.perf_counter() + seconds
            cpu0, t0 = time.process_time(), time.perf_counter()
            start.wait()
            for w in workers:
                w.join()
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            out[runtime] = (round(sum(done) / wall, 1), round(sum(done) / max(cpu, 1e-9), 1))
    return out


def _layout_bests(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """Each layout the limit measured -> (its best images/s, the mean of before and after; the batch it was best at
    after)."""
    out = {}
    for name, rates in after["by_layout"].items():
        b = max(rates, key=lambda k: rates[k])
        both = [max(r[name].values()) for r in (before["by_layout"], after["by_layout"]) if name in r]
        out[name] = (sum(both) / len(both), int(b))
    return out


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (``VmRSS``) or at its peak (``VmHWM``), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bare_sessions(engine: str, instances: int, threads: int, batch: int, seconds: float) -> None:
    """In a process of its own (``--bare-sessions``): ``instances`` sessions of ``threads`` threads (the agent's
    session options) loaded and run at once at ``batch`` for ``seconds``; prints its RSS and peak RSS (JSON)."""
    import threading

    sessions = [_session(Path(engine), threads) for _ in range(instances)]
    shape = [d if isinstance(d, int) else 1 for d in sessions[0].get_inputs()[0].shape][1:]
    x = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)
    loaded = _rss_mb(os.getpid())
    workers = [threading.Thread(target=_rate, args=(s, x, seconds)) for s in sessions]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps({"loaded_mb": loaded, "rss_mb": _rss_mb(os.getpid()), "peak_mb": _rss_mb(os.getpid(), "VmHWM")}))


def bare_rss(engine: Path, layout: str, batch: int, seconds: float = 2.0) -> dict[str, float]:
    """RSS of a bare process (numpy and onnxruntime only) holding ``layout``'s sessions, run at ``batch``: what the
    agent's memory is held against (after the run, and its peak)."""
    instances, threads = (int(v) for v in layout.split("x"))
    done = subprocess.run([sys.executable, __file__, "--bare-sessions", str(engine), str(instances), str(threads),
                           str(batch), str(seconds)], capture_output=True, timeout=300, check=True, cwd=REPO,
                          preexec_fn=on_inference_cpus)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


if __name__ == "__main__":  # the bare sessions' own process (bare_rss)
    if sys.argv[1:2] != ["--bare-sessions"]:
        raise SystemExit("usage: serve_limit.py --bare-sessions ENGINE INSTANCES THREADS BATCH SECONDS")
    a = sys.argv[2:]
    bare_sessions(a[0], int(a[1]), int(a[2]), int(a[3]), float(a[4]))
