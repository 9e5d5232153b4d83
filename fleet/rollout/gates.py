"""The gates: pure functions of a wave's recorded figures (no database, no broker), each giving its value, the
threshold and a sentence saying why; tests/test_rollout.py drives them directly."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .spec import Gates, ShadowGate


@dataclass(frozen=True)
class WaveFigures:
    size: int
    installed: int
    failed: int
    requests: int  # on the new model, summed over the wave's devices
    errors: int
    p99_before_ms: float | None  # mean over the devices that have both figures
    p99_after_ms: float | None
    p99_devices: int
    drift_psi: float | None = None  # new version vs previous on the wave's devices (None: not judged)
    drift_detail: str = ""


@dataclass(frozen=True)
class GateResult:
    name: str
    value: float | None
    threshold: float
    passed: bool
    detail: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShadowWaveFigures:
    devices: int  # devices of the wave that reported shadow figures
    samples: int
    agreement: float | None  # sample-weighted top-1 agreement
    max_abs_error: float | None


def evaluate_shadow(f: ShadowWaveFigures, gate: ShadowGate) -> GateResult | None:
    """None until the wave has mirrored enough requests; then the agreement against the threshold."""
    if f.samples < gate.min_samples:
        return None
    ok = f.agreement is not None and f.agreement >= gate.agreement_min
    detail = (f"{f.samples} live requests mirrored on {f.devices} devices; top-1 agreement with the active model "
              f"{'n/a' if f.agreement is None else f'{f.agreement:.4f}'}")
    if gate.max_abs_error is not None:
        ok = ok and f.max_abs_error is not None and f.max_abs_error <= gate.max_abs_error
        detail += f"; max abs error {f.max_abs_error}"
    return GateResult("shadow_agreement", f.agreement, gate.agreement_min, ok, detail)


def install_gate_lost(f: WaveFigures, gates: Gates) -> bool:
    """True once the failures alone make the install-success threshold unreachable."""
    if gates.install_success_min is None:
        return False
    allowed = math.floor((1.0 - gates.install_success_min) * f.size + 1e-9)
    return f.failed > allowed


def evaluate_gates(f: WaveFigures, gates: Gates) -> list[GateResult]:
    """Each configured gate against its threshold. A telemetry gate without data passes, saying so."""
    out = []
    if gates.install_success_min is not None:
        done = f.installed + f.failed
        ratio = f.installed / done if done else None
        ok = ratio is not None and ratio >= gates.install_success_min and not install_gate_lost(f, gates)
        out.append(GateResult("install_success", ratio, gates.install_success_min, ok,
                              f"{f.installed} of {done} reported installs succeeded ({f.size} in the wave)"))
    if gates.error_rate_max is not None:
        rate = f.errors / f.requests if f.requests else None
        out.append(GateResult("error_rate", rate, gates.error_rate_max, rate is None or rate <= gates.error_rate_max,
                              f"{f.errors} errors in {f.requests} requests on the new model"
                              if f.requests else "no requests on the new model yet: not judged"))
    if gates.p99_ratio_max is not None:
        if f.p99_before_ms and f.p99_after_ms is not None:
            ratio = f.p99_after_ms / f.p99_before_ms
            out.append(GateResult("p99_latency_ratio", ratio, gates.p99_ratio_max, ratio <= gates.p99_ratio_max,
                                  f"p99 {f.p99_after_ms:.2f} ms vs {f.p99_before_ms:.2f} ms on the previous model "
                                  f"(mean over {f.p99_devices} devices)"))
        else:
            out.append(GateResult("p99_latency_ratio", None, gates.p99_ratio_max, True,
                                  "no device has p99 figures on both models yet: not judged"))
    if gates.max_drift_psi is not None:
        if f.drift_psi is not None:
            out.append(GateResult("drift_psi", f.drift_psi, gates.max_drift_psi, f.drift_psi <= gates.max_drift_psi,
                                  f"answers of the new version vs the previous one: {f.drift_detail}"))
        else:
            out.append(GateResult("drift_psi", None, gates.max_drift_psi, True,
                                  f.drift_detail or "no drift figures yet: not judged"))
    return out
