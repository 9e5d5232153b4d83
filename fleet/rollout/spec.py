"""The spec an operator gives a rollout: its waves, soak times, gates and shadow phase (bounded, refused with a
422 naming the field), how the waves are sized, and which devices it targets (``Selector``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_WAVE_RE = re.compile(r"^(\d+(?:\.\d+)?)%$|^(\d+)$")


# every threshold and duration an operator gives is finite and within these limits (refused with a 422 naming it)
MAX_P99_RATIO = 1000.0
MAX_GRACE_S = 30 * 86400.0
MAX_ABS_ERROR = 1e30
MAX_CONCURRENT_DOWNLOADS = 1_000_000
MAX_DRIFT_PSI = 20.0  # PSI with protocol.drift's epsilon never exceeds 18.5 (every share swapped between two bins)


class Gates(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    install_success_min: float | None = Field(default=1.0, ge=0.0, le=1.0)  # installed / (installed + failed)
    error_rate_max: float | None = Field(default=None, ge=0.0, le=1.0)  # errors / requests on the new model
    p99_ratio_max: float | None = Field(default=None, gt=0.0, le=MAX_P99_RATIO)  # p99 new / p99 previous, same devices
    # PSI of the new version's answers against the previous version's on the same devices (fleet.drift; 0.1 watch,
    # 0.25 drift; a side with fewer than 200 answers is not judged); halts a wave whose model answers differently
    max_drift_psi: float | None = Field(default=None, gt=0.0, le=MAX_DRIFT_PSI)


class ShadowGate(BaseModel):
    """Run each wave's candidate in shadow first: devices keep serving their model, mirror a sample of live
    requests to the candidate and report agreement; the wave installs only once enough samples agree."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    agreement_min: float = Field(default=0.99, ge=0.0, le=1.0)  # top-1 agreement over the wave's samples
    min_samples: int = Field(default=100, ge=1, le=10_000_000)  # mirrored requests, summed over the wave
    max_abs_error: float | None = Field(default=None, ge=0.0, le=MAX_ABS_ERROR)  # optional: the worst difference


class RolloutSpec(BaseModel):
    """How a rollout proceeds; stored with it. Defaults: one wave, no soak, every install must succeed."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    waves: tuple[str, ...] = Field(default=("100%",), min_length=1, max_length=20)  # cumulative: "1%", "10", "100%"
    soak_s: tuple[float, ...] = Field(default=(0.0,), min_length=1, max_length=20)  # per wave; the last repeats
    gates: Gates = Gates()
    shadow: ShadowGate | None = None  # None: no shadow phase
    on_failure: Literal["pause", "abort"] = "abort"
    rollback_on_failure: bool = False
    offline_grace_s: float = Field(default=300.0, ge=0.0, le=MAX_GRACE_S)  # then a wave stops waiting for offline ones
    # True: a wave whose telemetry gates have no figures yet keeps soaking until they do
    require_telemetry: bool = False
    # each device's bundle download held to this rate (the agent takes the lower of it and its own cap); None: none
    download_max_bytes_per_s: int | None = Field(default=None, ge=4096, le=10_000_000_000)
    # at most this many devices of a wave are sent their desired state and not finished at once (downloading,
    # installing, or sent and not answered); more are sent as those finish. None: the whole wave at once
    max_concurrent_downloads: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT_DOWNLOADS)
    # True: devices install at once; False: each installs only inside its maintenance window (fleet.windows)
    urgent: bool = False

    @field_validator("waves")
    @classmethod
    def _waves(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for w in v:
            if len(w) > 16:
                raise ValueError(f"wave {w[:20]!r}...: at most 16 characters, a device count or a percentage")
            m = _WAVE_RE.match(w.strip())
            if m is None:
                raise ValueError(f"wave {w!r} must be a device count like '5' or a percentage like '10%'")
            if m.group(1) is not None and not 0 < float(m.group(1)) <= 100:
                raise ValueError(f"wave {w!r}: a percentage must be in (0, 100]")
            if m.group(2) is not None and int(m.group(2)) < 1:
                raise ValueError(f"wave {w!r}: a count must be at least 1")
        return tuple(w.strip() for w in v)

    @field_validator("soak_s")
    @classmethod
    def _soak(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 <= s <= 7 * 86400 for s in v):
            raise ValueError("soak times must be between 0 and 604800 s")
        return v

    def soak_for(self, idx: int) -> float:
        return self.soak_s[min(idx, len(self.soak_s) - 1)]


def plan_waves(n: int, waves: tuple[str, ...]) -> list[int]:
    """Sizes of the waves for ``n`` targets. Each entry is a cumulative end (count or percentage,
    rounded up); ends that add nobody are dropped, and the last wave always reaches every target."""
    sizes, done = [], 0
    for w in waves:
        w = w.strip()
        end = math.ceil(n * float(w[:-1]) / 100 - 1e-9) if w.endswith("%") else int(w)
        end = min(max(end, 1), n)
        if end > done:
            sizes.append(end - done)
            done = end
    if done < n:
        sizes.append(n - done)
    return sizes




@dataclass(frozen=True)
class Selector:
    devices: tuple[str, ...] = ()
    group: str | None = None
    tags: tuple[str, ...] = ()
    profile: str | None = None
