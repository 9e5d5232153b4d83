"""A choice between engines made by timing them on the device: the precision (agent/install/precision.py) and the
runtime (agent/install/runtime_choice.py) are picked the same way. Each candidate is timed at batch 1 and the largest
batch formed (:func:`timing_sizes`), :data:`ROUNDS` times in alternation (every call in its turn with the version
serving: ``turn``), the best figure per batch size counting; the candidates are compared by the geometric mean over
the batch sizes, and the bundle's own is kept unless another is more than a tie faster (:func:`keep_unless_faster`).
The trials that run in a child process (the runtime trial, the layout trial) start it with :func:`run_child` and read
its answer with :func:`child_answer`, which the child prints with :func:`child_reply`; layout figures cross as JSON
through :func:`layout_doc` and :func:`layout_figures`.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ...engines import Engine, EngineError
from ..core.batching.tuning import LayoutFigures
from ..errors import BackendError, SelfTestFailed
from .selftest import Turn, measure_batch_sizes
from .store import StagedModel

__all__ = ["MAX_BATCH_TIMED", "ROUNDS", "ROUND_BUDGET_S", "child_answer", "child_reply", "geomean",
           "keep_unless_faster", "layout_doc", "layout_figures", "run_child", "time_in_alternation", "timing_sizes"]

ROUNDS = 3  # each candidate is timed this many times, in alternation; the best figure per batch size counts
ROUND_BUDGET_S = 0.1  # seconds of calls per candidate per round (0.3 before issue 41: the trials bounded)
MAX_BATCH_TIMED = 8  # batch 1 (a lone request) and the largest batch formed, up to this


def timing_sizes(batchable: bool, max_batch_size: int) -> tuple[int, ...]:
    """Batch 1 (a lone request) and the largest batch the agent forms, up to 8 (enough to see the batched rate)."""
    if not batchable or max_batch_size <= 1:
        return (1,)
    return (1, min(MAX_BATCH_TIMED, max_batch_size))


def time_in_alternation(candidates: dict[str, tuple[StagedModel, Engine]], sizes: tuple[int, ...], turn: Turn,
                        failures: list[Exception], dropped: Callable[[str, SelfTestFailed], None],
                        ) -> dict[str, dict[int, float]]:
    """Items per second of each candidate (the bundle as it runs it, and its engine) at each of ``sizes``: the best
    of :data:`ROUNDS` rounds, timed in alternation so that a slow spell of the box lands on every candidate alike.
    A candidate that fails while timed (at a batch size its self-test did not run) is closed, taken out of
    ``candidates``, handed to ``dropped`` (which says so) and added to ``failures``; the others stay open, for the
    caller to close. With no candidate (none given, or every one failed), the first of ``failures`` (those that
    were never candidates come first) is raised."""
    if not candidates:
        raise failures[0]
    best: dict[str, dict[int, float]] = {k: {} for k in candidates}
    for _ in range(ROUNDS):
        for k, (staged, engine) in list(candidates.items()):
            try:
                measured = measure_batch_sizes(engine, staged, sizes, turn, budget_s=ROUND_BUDGET_S, calls=2)
            except SelfTestFailed as exc:
                del candidates[k], best[k]
                engine.close()
                dropped(k, exc)
                failures.append(exc)
                continue
            for n, v in measured:
                best[k][n] = max(best[k].get(n, 0.0), v)
    if not candidates:
        raise failures[0]
    return best


def geomean(values: list[float]) -> float:
    vals = [max(v, 1e-9) for v in values]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else 0.0


def keep_unless_faster(own: str, figures: dict[str, float], tie: float, sizes: tuple[int, ...],
                       own_kept: str) -> tuple[str, str]:
    """(chosen, why in a sentence) of the candidates' ``figures`` (items/s, timed at ``sizes``): ``own`` unless it is
    missing or another is more than ``tie`` faster; ``own_kept`` names ``own`` where a faster one within the tie
    did not replace it."""
    fastest = max(figures, key=lambda k: figures[k])
    chosen = own if own in figures and figures[own] * (1 + tie) >= figures[fastest] else fastest
    shown = ", ".join(f"{k} {v:g}/s" for k, v in figures.items())
    return chosen, (f"{chosen}: timed here ({shown}, geometric mean over batch sizes {sizes})"
                    + ("" if chosen != own or fastest == own else f"; {fastest} is within {tie:.0%}, {own_kept} kept"))


def run_child(module: str, flag: str, doc: dict[str, Any], timeout_s: float, what: str,
              log: logging.Logger) -> subprocess.CompletedProcess | None:
    """``python -m MODULE FLAG`` with ``doc`` as JSON on stdin, for at most ``timeout_s`` (past it, killed: a
    SelfTestFailed naming ``what``). None, with a warning on ``log``, when this interpreter cannot start itself (a box
    without exec rights, or qemu-user without binfmt, where sys.executable is a foreign binary): the caller then
    times in this process, the memory kept."""
    try:
        return subprocess.run([sys.executable, "-m", module, flag], input=json.dumps(doc).encode(),
                              capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SelfTestFailed(f"{what}: not done in {timeout_s:g} s (killed)") from exc
    except OSError as exc:
        log.warning("%s: could not start a child process (%s); timing in this process instead", what, exc)
        return None


def layout_doc(figures: Iterable[LayoutFigures]) -> list[dict[str, Any]]:
    """Layout figures as a trial's child prints them (JSON); :func:`layout_figures` reads them back."""
    return [{"instances": f.instances, "threads": f.threads, "images_per_s": f.images_per_s, "lone_ms": f.lone_ms}
            for f in figures]


def layout_figures(docs: Iterable[dict[str, Any]]) -> list[LayoutFigures]:
    return [LayoutFigures(int(f["instances"]), int(f["threads"]),
                          tuple((int(n), float(v)) for n, v in f["images_per_s"]), float(f["lone_ms"]))
            for f in docs]


def child_answer(done: subprocess.CompletedProcess, what: str) -> dict[str, Any]:
    """The JSON document a trial's child process printed last (the layout trial, the runtime trial): SelfTestFailed
    naming ``what`` and the tail of its stderr when it failed or printed none; its own error raised as the agent's."""
    try:
        out = json.loads(done.stdout.decode(errors="replace").strip().rsplit("\n", 1)[-1])
    except ValueError:
        out = None
    if not isinstance(out, dict) or done.returncode not in (0, 3):
        tail = " ".join(done.stderr.decode(errors="replace").split())[-500:]
        raise SelfTestFailed(f"{what}: the child process failed (exit {done.returncode}): {tail}")
    if "error" in out:
        raise (BackendError if out.get("kind") == "backend" else SelfTestFailed)(str(out["error"]))
    return out


def child_reply(answer: Callable[[], dict[str, Any]]) -> int:
    """A trial child's side of :func:`child_answer`: the document ``answer()`` makes, printed as JSON (exit 0), or
    the error it raised, of kind "backend" (EngineError, BackendError) or "selftest" (SelfTestFailed) (exit 3)."""
    try:
        doc = answer()
    except (EngineError, BackendError) as exc:
        print(json.dumps({"error": str(exc), "kind": "backend"}))
        return 3
    except SelfTestFailed as exc:
        print(json.dumps({"error": str(exc), "kind": "selftest"}))
        return 3
    print(json.dumps(doc))
    return 0
