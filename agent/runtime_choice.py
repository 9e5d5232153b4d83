"""The runtime chosen on the device. An ``onnxruntime`` bundle's ONNX/QDQ file runs on onnxruntime and, where
``edgefleet[openvino]`` is installed, on OpenVINO too (engines.runtimes_for); which is faster depends on the CPU
(OpenVINO ran the compiler's QDQ INT8 models 1.1-1.9x faster on an AVX-512 EPYC, issue 35). At install, and again
at each start, after the precision is chosen (agent/precision.py), the agent loads the bundle on each runtime
installed here that can run its precision, runs each one's self-test (the bundle's own sample and expected answers,
the same check whatever runs it), times them in alternation on its own cores (each call in its turn with the
version serving: ``turn``) and serves the fastest. The bundle's own runtime (its backend) is kept unless another is
more than :data:`TIE` faster, so noise does not flip a choice between equals.

``runtime`` in the agent's config: ``auto`` (time them), or a runtime, which serves the bundles it can run untimed
(a pinned runtime that is not installed fails their install with the extra to install, and the version serving
keeps serving); a bundle it cannot run (LiteRT, TensorRT, bf16 for onnxruntime) goes to the runtimes that can.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from edgefleet.agent.errors import BackendError, SelfTestFailed
from edgefleet.agent.selftest import Turn, now, self_test
from edgefleet.agent.store import StagedModel
from edgefleet.agent.timed_choice import geomean, keep_unless_faster, time_in_alternation, timing_sizes
from edgefleet.engines import EXTRAS, Engine, runtime_installed, runtimes_for

__all__ = ["TIE", "RuntimePick", "RuntimeTiming", "candidates", "pick_runtime"]

log = logging.getLogger("edgefleet.agent")

TIE = 0.03  # another runtime must be this much faster than the bundle's own to replace it


@dataclass(frozen=True)
class RuntimeTiming:
    runtime: str
    items_per_s: float  # geometric mean over the batch sizes timed: what the choice compares
    timings: tuple[tuple[int, float], ...]  # (batch size, items/s)


@dataclass(frozen=True)
class RuntimePick:
    runtime: str
    source: str  # only (one runtime here can run it) | device (timed here) | operator (the agent's config)
    timings: tuple[RuntimeTiming, ...] = ()
    note: str = ""  # why, in a sentence (logged)


def candidates(backend: str, precision: str, setting: str,
               installed: Callable[[str], bool] = runtime_installed) -> tuple[tuple[str, ...], str]:
    """The runtimes to consider for a ``backend`` bundle of ``precision`` under the config's ``runtime``
    ``setting``, and the source of the choice (``operator`` when pinned). Raises BackendError when the pinned
    runtime, or every runtime that could run the bundle, is missing here."""
    able = runtimes_for(backend, precision)
    here = tuple(r for r in able if installed(r))
    if setting != "auto" and setting in able:
        if setting not in here:
            raise BackendError(f"runtime: {setting} is set in the agent's config, and {setting} is not installed "
                               f"here; install {EXTRAS.get(setting, setting)} or set runtime: auto")
        return (setting,), "operator"
    if not here:
        raise BackendError(f"no runtime installed here runs this {backend} {precision} bundle; install "
                           + " or ".join(EXTRAS.get(r, r) for r in able))
    # a runtime pinned for what it can run (an onnxruntime bundle) leaves other bundles (LiteRT, TensorRT, bf16) to
    # the runtimes that run them
    return here, "only" if len(here) == 1 else "device"


def pick_runtime(staged: StagedModel, setting: str, load: Callable[[str], Engine], max_batch_size: int,
                 turn: Turn = now, installed: Callable[[str], bool] = runtime_installed) -> RuntimePick:
    """The runtime to serve ``staged`` (already the chosen precision's manifest) on. ``load`` makes one engine of
    the bundle on a runtime (closed here). A runtime whose engine does not load, fails its self-test or fails while
    timed is not a candidate; if every one fails, the first failure is raised."""
    m = staged.manifest
    names, source = candidates(m.backend, m.precision, setting, installed)
    if len(names) == 1:
        note = (f"{names[0]}: set in the agent's config" if source == "operator" else
                f"{names[0]}: the only runtime here that runs this {m.backend} {m.precision} bundle")
        return RuntimePick(names[0], source, note=note)
    sizes = timing_sizes(m.batchable, max_batch_size)
    engines: dict[str, tuple[StagedModel, Engine]] = {}
    failures: list[Exception] = []
    try:
        for r in names:
            try:
                engine = load(r)
            except BackendError as exc:
                log.warning("%s %s: the %s runtime does not load it here, not a candidate: %s", m.name, m.version, r,
                            exc)
                failures.append(exc)
                continue
            try:
                self_test(engine, staged, turn)
            except SelfTestFailed as exc:
                engine.close()
                log.warning("%s %s: on %s it fails its self-test, not a candidate: %s", m.name, m.version, r, exc)
                failures.append(SelfTestFailed(f"on {r}: {exc}"))
                continue
            engines[r] = (staged, engine)

        def dropped(r: str, exc: SelfTestFailed) -> None:
            log.warning("%s %s: on %s it fails while timed, not a candidate: %s", m.name, m.version, r, exc)

        best = time_in_alternation(engines, sizes, turn, failures, dropped)
    finally:
        for _, engine in engines.values():
            engine.close()
    timings = tuple(RuntimeTiming(r, round(geomean(list(figs.values())), 1), tuple(sorted(figs.items())))
                    for r, figs in best.items())
    chosen, why = keep_unless_faster(m.backend, {t.runtime: t.items_per_s for t in timings}, TIE, sizes, m.backend)
    return RuntimePick(chosen, "device", timings, why)
