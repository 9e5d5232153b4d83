"""One inference request as the core takes it, whatever transport brought it (HTTP, gRPC, the local socket):
the transports decode their wire formats into it (agent/transports/kserve.py) and the core serves it (agent.core.host,
the pipeline runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["InferRequest"]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 5x as much, on every request
class InferRequest:
    feeds: dict[str, np.ndarray]
    outputs: tuple[str, ...] | None  # names asked for, in order; None: every output
    binary_outputs: frozenset[str]  # outputs to return as binary data
    id: str | None = None
    priority: int = 0  # 0 default, 1 high, 2 normal
    timeout_us: int | None = None  # the most the request may wait in the queue
    # outputs to write into system shared memory: name -> (region, offset, byte_size) (agent/transports/shm.py)
    shm_outputs: dict[str, tuple[str, int, int]] = field(default_factory=dict)
