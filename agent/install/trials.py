"""What an install's trials found, kept with the installed version so that a restart serves at once.

The precision, runtime, layout and batch trials (agent/install/precision.py, runtime_choice.py, job.py's
measure_layouts and tune_batches) time a version on this box. Their results depend on the bundle, the CPU, the CPUs
the agent may use, the runtimes installed and the agent's settings, and on nothing that a restart changes: a box
that reboots with all of those unchanged would only time the same figures again (digits: 8 s before its first
answer, issue 41). So the figures are written, once a version's trials are done, to
``<data_dir>/store/trials/<bundle sha256>.json`` (atomically), with the :func:`trial_key` they were measured under.
At start the agent serves from a record whose key equals today's; a missing, unreadable, malformed or differently
keyed record is ignored (logged) and the trials run again before serving, as at install, and the record is
rewritten. A record is never trusted beyond its key: every field is checked for type and range on reading.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ...protocol import mqtt as proto
from ...protocol.cpu import cpu_arch, cpu_features
from ...protocol.fsutil import atomic_write
from ..core.batching.tuning import LayoutFigures
from ..core.runtime_pick import RuntimePick, RuntimeTiming

__all__ = ["FORMAT", "MAX_RECORD_BYTES", "TrialRecord", "TrialStore", "trial_key"]

log = logging.getLogger("edgefleet.agent")

FORMAT = 1
MAX_RECORD_BYTES = 1 << 20  # a record is a few KiB; a bigger file is not one
SETTINGS = ("runtime", "precision", "batch_tuning", "max_batch_size", "instances", "intra_op_threads",
            "inference_cpus", "onnxruntime_providers")  # the agent settings the trials' results depend on
_MAX_ITEMS = 64  # timings, layouts, batch sizes: more than any trial makes


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f.read(1 << 20).splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu_arch()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def trial_key(bundle_sha256: str, config: Any, max_batch_size: int) -> dict[str, Any]:
    """What the trials of a bundle depend on here: the bundle's digest, the CPU model and flags, the CPUs this process
    may use, the runtime versions, and the agent settings that change what is timed (operator-set ones marked)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [os.cpu_count() or 1]
    settings = {k: getattr(config, k) for k in SETTINGS}
    settings["max_batch_size"] = max_batch_size
    settings["operator_set"] = sorted(set(SETTINGS) & config.model_fields_set)
    return json.loads(json.dumps({
        "bundle_sha256": bundle_sha256, "cpu_model": _cpu_model(), "cpu_flags": sorted(cpu_features()),
        "cpus": cpus, "runtimes": {d: _version(d) for d in ("onnxruntime", "openvino")}, "settings": settings}))


@dataclass
class TrialRecord:
    """One version's trial results (each None until its trial ran; ``layout`` and ``batch`` stay None where that
    trial does not run under these settings)."""

    precision: tuple[str, str, str, tuple[proto.PrecisionTiming, ...]] | None = None  # precision, source, note, timings
    runtime: RuntimePick | None = None
    layout: tuple[tuple[int, int], tuple[LayoutFigures, ...]] | None = None  # chosen (instances, threads), figures
    batch: tuple[tuple[int, float], ...] | None = None  # images/s by batch size (measured without a layout trial)
    recalled: bool = False  # read from disk (the trials did not run)
    timed_s: dict[str, float] = field(default_factory=dict)  # trial -> seconds it took (this process)

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": None if self.precision is None else {
                "precision": self.precision[0], "source": self.precision[1], "note": self.precision[2],
                "timings": [t.model_dump(mode="json") for t in self.precision[3]]},
            "runtime": None if self.runtime is None else {
                "runtime": self.runtime.runtime, "source": self.runtime.source, "note": self.runtime.note,
                "timings": [{"runtime": t.runtime, "items_per_s": t.items_per_s, "timings": list(t.timings)}
                            for t in self.runtime.timings]},
            "layout": None if self.layout is None else {
                "chosen": list(self.layout[0]),
                "figures": [{"instances": f.instances, "threads": f.threads, "images_per_s": list(f.images_per_s),
                             "lone_ms": f.lone_ms} for f in self.layout[1]]},
            "batch": None if self.batch is None else list(self.batch)}

    @classmethod
    def from_json(cls, doc: Any) -> TrialRecord:
        """A record as written by :meth:`to_json`; ValueError (TypeError, KeyError) on anything else."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        rec = cls(recalled=True)
        if (p := doc["precision"]) is not None:
            rec.precision = (_str(p["precision"]), _str(p["source"]), _str(p["note"]),
                             tuple(proto.PrecisionTiming.model_validate(t) for t in _list(p["timings"])))
        if (r := doc["runtime"]) is not None:
            rec.runtime = RuntimePick(_str(r["runtime"]), _str(r["source"]), tuple(
                RuntimeTiming(_str(t["runtime"]), _rate(t["items_per_s"]), _pairs(t["timings"]))
                for t in _list(r["timings"])), _str(r["note"]))
        if (lay := doc["layout"]) is not None:
            figures = tuple(LayoutFigures(_count(f["instances"]), _count(f["threads"]), _pairs(f["images_per_s"]),
                                          _rate(f["lone_ms"])) for f in _list(lay["figures"]))
            chosen = tuple(_count(v) for v in _list(lay["chosen"]))
            if len(chosen) != 2 or not any((f.instances, f.threads) == chosen for f in figures):
                raise ValueError("the chosen layout is not among the figures")
            rec.layout = ((chosen[0], chosen[1]), figures)
        if (b := doc["batch"]) is not None:
            rec.batch = _pairs(b)
        return rec


def _str(v: Any) -> str:
    if not isinstance(v, str) or len(v) > 4096:
        raise ValueError("not a string")
    return v


def _list(v: Any) -> list:
    if not isinstance(v, list) or len(v) > _MAX_ITEMS:
        raise ValueError("not a list")
    return v


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 4096:
        raise ValueError("not a count")
    return v


def _rate(v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e12:
        raise ValueError("not a rate")
    return float(v)


def _pairs(v: Any) -> tuple[tuple[int, float], ...]:
    out = tuple((_count(p[0]), _rate(p[1])) for p in _list(v) if len(_list(p)) == 2)
    if len(out) != len(v):
        raise ValueError("not (batch size, rate) pairs")
    return out


class TrialStore:
    """The trial records under ``<store>/trials`` (``root`` None: none kept, none recalled)."""

    def __init__(self, root: Path | None):
        self.root = root

    def path(self, bundle_sha256: str) -> Path:
        if self.root is None:
            raise ValueError("no folder for trial records")
        if len(bundle_sha256) != 64 or not all(c in "0123456789abcdef" for c in bundle_sha256):
            raise ValueError(f"not a sha256: {bundle_sha256!r}")
        return self.root / f"{bundle_sha256}.json"

    def recall(self, key: dict[str, Any]) -> TrialRecord | None:
        """The record kept for ``key``'s bundle if it was measured under ``key``; None (logged) otherwise."""
        if self.root is None:
            return None
        path = self.path(key["bundle_sha256"])
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("trial record %s unreadable (%s): timing again", path.name, exc)
            return None
        try:
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError("not a trial record of format 1")
            if doc.get("key") != key:
                changed = sorted(k for k in key if not isinstance(doc.get("key"), dict) or doc["key"].get(k) != key[k])
                log.info("trial record %s was measured under other conditions (%s changed): timing again",
                         path.name, ", ".join(changed) or "its key")
                return None
            return TrialRecord.from_json(doc["record"])
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            log.warning("trial record %s is not a valid record (%s): ignored, timing again", path.name, exc)
            return None

    def keep(self, key: dict[str, Any], record: TrialRecord) -> None:
        """Write ``record`` for ``key`` atomically (an OSError is logged: the next start times again)."""
        if self.root is None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path(key["bundle_sha256"]),
                         json.dumps({"format": FORMAT, "key": key, "record": record.to_json()}).encode())
        except OSError as exc:
            log.warning("could not keep the trial record of %s: %s", key["bundle_sha256"][:12], exc)

    def prune(self, keep: set[str]) -> None:
        """Remove the records of bundles no longer installed (``keep``: the sha256s still in the store)."""
        if self.root is None or not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if (p.suffix == ".json" and p.stem not in keep) or p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
