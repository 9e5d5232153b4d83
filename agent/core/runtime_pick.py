"""The runtime an engine serves on, as the install chose it (agent/install/runtime_choice.py chooses; the core
serves and reports the choice: a pipeline stage's runtime, the host's model config)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RuntimePick", "RuntimeTiming"]


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
