"""The runtime chosen on the device. An ``onnxruntime`` bundle's ONNX/QDQ file runs on onnxruntime and, where
``edgefleet[openvino]`` is installed, on OpenVINO too (engines.runtimes_for); which is faster depends on the CPU
(OpenVINO ran the compiler's QDQ INT8 models 1.1-1.9x faster on an AVX-512 EPYC, issue 35). At install, and again
at each start, after the precision is chosen (agent/install/precision.py), the agent loads the bundle on each runtime
installed here that can run its precision, runs each one's self-test (the bundle's own sample and expected answers,
the same check whatever runs it), times them in alternation on its own cores (each call in its turn with the
version serving: ``turn``) and serves the fastest. The bundle's own runtime (its backend) is kept unless another is
more than :data:`TIE` faster, so noise does not flip a choice between equals.

The timing runs in a child process (:func:`pick_runtime_in_child`: ``python -m edgefleet.agent.install.runtime_choice
--trial``, started from the install thread, so on the inference CPUs), like the layout trial (agent/install/bench.py): a
runtime that is timed and not chosen leaves nothing in the agent. Measured (bench/runtime_memory.py), in-process
timing kept OpenVINO's libraries and CPU plugin in an agent that then served onnxruntime. As in the layout trial,
the child's calls take no turns with a version serving the model (they share its cores for the trial's seconds).
Where the interpreter cannot start itself (qemu-user without binfmt, a box without exec rights) the trial runs in
the agent's process (:func:`pick_runtime`).

``runtime`` in the agent's config: ``auto`` (time them), or a runtime, which serves the bundles it can run untimed
(a pinned runtime that is not installed fails their install with the extra to install, and the version serving
keeps serving); a bundle it cannot run (LiteRT, TensorRT, bf16 for onnxruntime) goes to the runtimes that can.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...engines import EXTRAS, Engine, EngineError, load_bundle_engine, runtime_installed, runtimes_for
from ..core.batching.tuning import LayoutFigures
from ..core.runtime_pick import RuntimePick, RuntimeTiming
from ..errors import BackendError, SelfTestFailed
from .selftest import Turn, now, self_test
from .store import StagedModel
from .timed_choice import (
    child_answer,
    child_reply,
    geomean,
    keep_unless_faster,
    layout_doc,
    layout_figures,
    run_child,
    time_in_alternation,
    timing_sizes,
)

__all__ = ["TIE", "TRIAL_TIMEOUT_S", "RuntimePick", "RuntimeTiming", "candidates", "pick_runtime",
           "pick_runtime_in_child"]

log = logging.getLogger("edgefleet.agent")

TIE = 0.03  # another runtime must be this much faster than the bundle's own to replace it
TRIAL_TIMEOUT_S = 300.0  # a child trial still running after this is killed (the install fails with that reason)


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
        return _untimed(staged, names, source)
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


def _untimed(staged: StagedModel, names: tuple[str, ...], source: str) -> RuntimePick:
    note = (f"{names[0]}: set in the agent's config" if source == "operator" else
            f"{names[0]}: the only runtime here that runs this {staged.manifest.backend} {staged.manifest.precision} "
            "bundle")
    return RuntimePick(names[0], source, note=note)


def _loader(staged: StagedModel, threads: int, providers: tuple[str, ...] | None) -> Callable[[str], Engine]:
    """One engine of the bundle on a runtime, as the agent loads its instances (an engine that cannot load here is a
    BackendError)."""
    m = staged.manifest

    def load(runtime: str) -> Engine:
        try:
            return load_bundle_engine(m, staged.directory / m.engine, threads, providers, runtime)
        except EngineError as exc:
            raise BackendError(str(exc)) from exc

    return load


def pick_runtime_in_child(staged: StagedModel, setting: str, max_batch_size: int, threads: int,
                          providers: tuple[str, ...] | None = None, timeout_s: float = TRIAL_TIMEOUT_S,
                          installed: Callable[[str], bool] = runtime_installed,
                          layout: dict[str, Any] | None = None,
                          layouts_out: list[LayoutFigures] | None = None) -> RuntimePick:
    """:func:`pick_runtime` with the candidates loaded, self-tested and timed in a child process (``python -m
    edgefleet.agent.install.runtime_choice --trial``, from the calling thread: on its CPUs), each engine of ``threads``
    threads: their libraries and memory leave with it. An untimed choice (pinned, or one runtime here) starts no
    child. Failures come back as in-process: the first failure raised (BackendError or SelfTestFailed) when no
    runtime is left; a child that outlives ``timeout_s`` is a SelfTestFailed. ``layout`` (candidates, sizes, seconds,
    cpus: agent.install.bench.layout_trial's) runs the layout trial too, in the same child on the runtime chosen, its
    figures appended to ``layouts_out``: one interpreter start (and its imports) for both trials."""
    m = staged.manifest
    names, source = candidates(m.backend, m.precision, setting, installed)
    if len(names) == 1:
        return _untimed(staged, names, source)
    doc = {"manifest": m.model_dump(mode="json"), "directory": str(staged.directory), "names": list(names),
           "max_batch_size": max_batch_size, "threads": threads, "providers": list(providers) if providers else None,
           "layout": layout}
    done = run_child("edgefleet.agent.install.runtime_choice", "--trial", doc, timeout_s, "runtime trial", log)
    if done is None:
        return pick_runtime(staged, setting, _loader(staged, threads, providers), max_batch_size,
                            installed=installed)
    for line in done.stderr.decode(errors="replace").splitlines():  # the child's warnings: each runtime dropped
        if line.startswith("WARNING "):
            log.warning("runtime trial: %s", line.removeprefix("WARNING "))
    out = child_answer(done, "runtime trial")
    if layouts_out is not None:
        layouts_out.extend(layout_figures(out.get("layouts") or ()))
    timings = tuple(RuntimeTiming(str(t["runtime"]), float(t["items_per_s"]),
                                  tuple((int(n), float(v)) for n, v in t["timings"])) for t in out["timings"])
    return RuntimePick(str(out["runtime"]), str(out["source"]), timings, str(out["note"]))


def _trial_main() -> int:
    """The child of :func:`pick_runtime_in_child`: a trial described on stdin -> the pick on stdout (JSON)."""
    import json
    import sys

    from ...protocol.manifest import parse_manifest

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    doc = json.loads(sys.stdin.buffer.read(1 << 22))
    staged = StagedModel(parse_manifest(doc["manifest"]), Path(doc["directory"]), "")
    names = tuple(doc["names"])

    def answer() -> dict[str, Any]:
        providers = tuple(doc["providers"]) if doc["providers"] else None
        pick = pick_runtime(staged, "auto", _loader(staged, int(doc["threads"]), providers),
                            int(doc["max_batch_size"]), installed=lambda r: r in names)
        figures = []
        if doc.get("layout"):  # then the layouts, on the runtime chosen
            from .bench import layout_trial

            lay = doc["layout"]
            figures = layout_trial(staged.manifest, staged.directory, [(int(i), int(t)) for i, t in lay["candidates"]],
                                   tuple(lay["sizes"]), float(lay["seconds"]), lay["cpus"], providers,
                                   runtime=pick.runtime)
        return {"runtime": pick.runtime, "source": pick.source, "note": pick.note,
                "timings": [{"runtime": t.runtime, "items_per_s": t.items_per_s, "timings": t.timings}
                            for t in pick.timings],
                "layouts": layout_doc(figures)}

    return child_reply(answer)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--trial"]:
        sys.exit("usage: python -m edgefleet.agent.install.runtime_choice --trial < trial.json "
                 "(the agent runs it at install)")
    sys.exit(_trial_main())
