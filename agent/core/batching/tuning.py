"""How a served version's batches are sized and its engines laid out on the cores: the figures measured at install
(images/s by batch size, by layout) and the pure rules that choose from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BATCH_TOLERANCE", "LAYOUT_TIE", "BatchTuning", "LayoutFigures", "batch_ladder", "choose_batch_size",
           "choose_layout", "in_the_running", "layout_candidates"]

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

