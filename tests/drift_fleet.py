"""A fleet service on a real database with models that carry drift references, devices in a rollout, and telemetry
batches with drift counts: what tests/test_fleet_drift_batch.py and bench/drift_ingest.py feed the ingest
(FleetService.store_telemetry) with. No broker and no HTTP server: the ingest's own entry point, as the MQTT worker
calls it."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import Engine, insert

from edgefleet.fleet.db import Device, Model, Rollout, RolloutTarget, RolloutWave, make_engine
from edgefleet.fleet.keys import init_keys
from edgefleet.fleet.service import FleetService
from edgefleet.fleet.tuf_repo import KeyStore, Repository
from edgefleet.fleet.tuf_store import SqlStore
from edgefleet.protocol import drift as D
from edgefleet.protocol import mqtt as proto
from tests.fleet_harness import RecordingPublisher

MODEL = "dm"
VERSIONS = ("1.0.0", "1.1.0")  # each with a drift reference; the rollout is to 1.1.0
NO_REFERENCE = "0.9.0"  # a version without one: its counts are refused


@dataclass
class DriftFleet:
    engine: Engine
    svc: FleetService
    ref: D.DriftReference
    rollout_id: int

    def close(self) -> None:
        self.engine.dispose()


def reference() -> D.DriftReference:
    """A classification reference (features class and score) from seeded random logits of 10 classes."""
    rng = np.random.default_rng(7)
    return D.build_reference("classification", "logits", rng.normal(size=(2000, 10)).astype(np.float32))


def drift_fleet(url: str, work: Path, devices: list[str]) -> DriftFleet:
    """The fleet's schema at ``url``, models dm 1.0.0 and 1.1.0 (with a drift reference) and 0.9.0 (without), and
    ``devices`` registered, each a target of wave 0 of an in-progress rollout of dm 1.1.0."""
    engine, sessions = make_engine(url)
    init_keys(work / "keys")
    repo = Repository(SqlStore(engine), KeyStore(work / "keys"), upload_dir=work / "up")
    repo.init()
    svc = FleetService(sessions, repo, RecordingPublisher())
    ref = reference()
    with sessions.begin() as s:
        ids = {}
        for v in (*VERSIONS, NO_REFERENCE):
            manifest = {"name": MODEL, "version": v, **({"drift": ref.model_dump(mode="json")} if v != NO_REFERENCE
                                                        else {})}
            m = Model(name=MODEL, version=v, profile="x86-cpu", backend="onnxruntime", precision="fp32",
                      target_path=f"targets/{MODEL}-{v}.tar", sha256=hashlib.sha256(v.encode()).hexdigest(),
                      size_bytes=1, accuracy=0.9, manifest=manifest)
            s.add(m)
            s.flush()
            ids[v] = m.id
        r = Rollout(model_id=ids["1.1.0"], status="in_progress", model_name=MODEL, model_version="1.1.0")
        s.add(r)
        s.flush()
        s.add(RolloutWave(rollout_id=r.id, idx=0, size=len(devices), state="soaking"))
        s.execute(insert(Device), [{"id": d, "labels": {}, "registered_via": "api", "desired_rollout_id": r.id,
                                    "profile": "x86-cpu"} for d in devices])
        s.flush()
        s.execute(insert(RolloutTarget), [{"rollout_id": r.id, "device_id": d, "wave": 0, "state": "installed",
                                           "model_id": ids["1.1.0"], "previous_model_id": ids["1.0.0"]}
                                          for d in devices])
        rid = r.id
    return DriftFleet(engine, svc, ref, rid)


def counts(ref: D.DriftReference, rng: random.Random, samples: int, version: str = "1.1.0",
           bins_off: bool = False) -> D.DriftCounts:
    """``samples`` answers in ``ref``'s bins, leaning on a random bin (so scores differ); ``bins_off``: one bin too
    many on the score feature (counts that do not fit the reference)."""
    feats = []
    for f in ref.features:
        w = [x + 0.02 for x in f.shares]
        w[rng.randrange(len(w))] += rng.random()
        c = [0] * len(w)
        for i in rng.choices(range(len(w)), weights=w, k=samples):
            c[i] += 1
        if bins_off and f.name == "score":
            c.append(0)
        feats.append(D.FeatureCounts(name=f.name, counts=tuple(c)))  # type: ignore[arg-type]
    return D.DriftCounts(model=MODEL, version=version, samples=samples, features=tuple(feats))


def record(device: str, seq: int, ts: float, drift: D.DriftCounts | None, stream: str = "00000000000000aa"
           ) -> proto.Telemetry:
    """A telemetry record as an agent sends it (its model and version those of its drift counts)."""
    return proto.Telemetry(device_id=device, ts=ts, stream=stream, seq=seq, interval_s=10.0,
                           model=MODEL if drift is None else drift.model,
                           version="1.1.0" if drift is None else drift.version, requests=100, errors=1,
                           latency=proto.LatencySummary(p50_ms=2.0, p95_ms=4.0, p99_ms=5.0, max_ms=9.0),
                           batches=50, batch_size_mean=2.0, batch_size_max=4, cpu_percent=20.0, rss_mb=100.0,
                           drift=drift)


def mixed_batch(ref: D.DriftReference, rng: random.Random, devices: list[str], n: int, seq0: int, ts0: float,
                drift: bool = True) -> list[proto.Telemetry]:
    """``n`` records of ``devices`` (about a third of them twice, or all several times when ``n`` is over twice
    their number; a later record now and then ahead of an earlier one in the list): a third with >= 200 answers, the
    rest fewer (their score adds the device's earlier records), a few of 1.0.0, a few of a version without a
    reference and a few whose bins do not fit (refused). ``drift=False``: the same records without drift counts."""
    if n > 2 * len(devices):  # every device several times
        picks = [devices[i % len(devices)] for i in range(n)]
    else:
        twice = n - len(devices) if n > len(devices) else n // 3
        picks = list(devices[:n - twice]) + list(devices[:twice])
    out: list[proto.Telemetry] = []
    seen: dict[str, int] = {}
    for i, d in enumerate(picks):
        k = seen[d] = seen.get(d, -1) + 1
        r = rng.random()
        samples = rng.randint(200, 400) if r < 1 / 3 else rng.randint(20, 150)
        version = "1.0.0" if r > 0.95 else NO_REFERENCE if 0.93 < r <= 0.95 else "1.1.0"
        dc = counts(ref, rng, samples, version, bins_off=0.91 < r <= 0.93) if drift else None
        out.append(record(d, seq0 + i, ts0 + k, dc))
    # a device's second record ahead of its first now and then: the ingest orders by ts
    for i in range(len(out) - 1, 0, -1):
        if rng.random() < 0.1:
            j = rng.randrange(i)
            out[i], out[j] = out[j], out[i]
    return out
