"""Precision chosen on the device. A bundle compiled where its devices' CPU could not be timed (another
architecture, or CPU features the build host lacks) carries every precision that passed the gate
(``Manifest.variants``). At install, and again at each start (the figures are this box's, today), the agent
loads each, runs each one's own self-test, times them in alternation on its own cores (every call in its turn
with the version serving: ``turn``) and serves the faster. The bundle's own engine (the compiler's default)
is kept unless another is more than :data:`TIE` faster, so noise does not flip a choice between equals.

``precision`` in the agent's config: ``auto`` (time them), ``bundle`` (serve the bundle's own engine, never
time), or a precision (serve it when the bundle has it; otherwise time them, and say so).

A bf16 variant is a candidate only on a CPU that computes bf16 (avx512_bf16 or amx_bf16: :func:`cannot_run`),
whatever the setting: elsewhere OpenVINO would run it in f32, answers its gate never judged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ...engines import Engine
from ...protocol import mqtt as proto
from ...protocol.cpu import BF16_FEATURES, bf16_feature
from ...protocol.manifest import Manifest
from ..errors import BackendError, SelfTestFailed
from .selftest import Turn, now, self_test
from .store import StagedModel
from .timed_choice import geomean, keep_unless_faster, time_in_alternation, timing_sizes

__all__ = ["TIE", "PrecisionPick", "cannot_run", "pick_precision"]

log = logging.getLogger("edgefleet.agent")

TIE = 0.03  # another precision must be this much faster than the bundle's own to replace it


@dataclass(frozen=True)
class PrecisionPick:
    staged: StagedModel  # the bundle as the chosen precision's (Manifest.as_variant)
    source: str  # bundle | device | operator (proto.ServingChoice.precision_source)
    timings: tuple[proto.PrecisionTiming, ...] = ()
    note: str = ""  # why, in a sentence (logged)


def cannot_run(precision: str, have: frozenset[str] | None = None) -> str | None:
    """Why this CPU (or one with the features ``have``) cannot serve a ``precision`` engine; None when it can."""
    if precision == "bf16" and bf16_feature(have) is None:
        return f"this CPU has neither {' nor '.join(sorted(BF16_FEATURES))}, so it cannot run bf16"
    return None


def pick_precision(staged: StagedModel, setting: str, load: Callable[[Manifest], Engine], max_batch_size: int,
                   turn: Turn = now, have: frozenset[str] | None = None) -> PrecisionPick:
    """The precision to serve ``staged`` in. ``load`` makes one engine of a manifest (closed here). A precision
    whose self-test fails on this CPU (or whose engine fails while timed), or that this CPU cannot run at all
    (:func:`cannot_run`; ``have``: the CPU's features, default CPUID's), is not a candidate; if every one fails,
    the first failure is raised."""
    m = staged.manifest
    if not m.variants:
        return PrecisionPick(staged, "bundle")
    if setting == "bundle":
        return PrecisionPick(staged, "bundle", note=f"{m.precision}: the bundle's own engine (precision: bundle)")
    why_not = cannot_run(setting, have)
    if setting in m.precisions and why_not is None:
        return PrecisionPick(_as(staged, setting), "operator", note=f"{setting}: set in the agent's config")
    asked = "" if setting == "auto" else (f"precision {setting}: {why_not}; " if setting in m.precisions else
                                          f"precision {setting} is not in this bundle ({', '.join(m.precisions)}); ")
    sizes = timing_sizes(m.batchable, max_batch_size)
    candidates: dict[str, tuple[StagedModel, Engine]] = {}
    failures: list[Exception] = []
    try:
        for p in m.precisions:
            if (why := cannot_run(p, have)) is not None:
                log.warning("%s %s: the %s engine is not a candidate: %s", m.name, m.version, p, why)
                failures.append(SelfTestFailed(f"the {p} engine cannot run on this device: {why}"))
                continue
            view = _as(staged, p)
            try:
                engine = load(view.manifest)
            except BackendError as exc:
                log.warning("%s %s: the %s engine does not load here, not a candidate: %s", m.name, m.version, p, exc)
                failures.append(SelfTestFailed(f"the {p} engine does not load on this device: {exc}"))
                continue
            try:
                self_test(engine, view, turn)
            except SelfTestFailed as exc:
                engine.close()
                log.warning("%s %s: the %s engine fails its self-test on this CPU, not a candidate: %s",
                            m.name, m.version, p, exc)
                failures.append(exc)
                continue
            candidates[p] = (view, engine)

        def dropped(p: str, exc: SelfTestFailed) -> None:
            log.warning("%s %s: the %s engine fails while timed on this CPU, not a candidate: %s",
                        m.name, m.version, p, exc)

        best = time_in_alternation(candidates, sizes, turn, failures, dropped)
    finally:
        for _, engine in candidates.values():
            engine.close()
    timings = tuple(proto.PrecisionTiming(
        precision=p, items_per_s=round(geomean(list(figs.values())), 1),  # type: ignore[arg-type]
        timings=tuple(proto.Timing(batch_size=n, items_per_s=v) for n, v in sorted(figs.items())))
        for p, figs in best.items())
    chosen, why = keep_unless_faster(m.precision, {t.precision: t.items_per_s for t in timings}, TIE, sizes,
                                     "the bundle's own")
    return PrecisionPick(candidates[chosen][0], "device", timings, asked + why)


def _as(staged: StagedModel, precision: str) -> StagedModel:
    return StagedModel(staged.manifest.as_variant(precision), staged.directory, staged.bundle_sha256)
