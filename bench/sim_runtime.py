"""A simulated runtime: an engine that *takes the time* a bigger box's runtime takes, from measured serving curves,
and uses no CPU doing it (issue 44).

The agent's scheduling (queues, batch forming, which instance takes what, the layout and batch trials) runs on its
event loop; a runtime's calls release the GIL and run on their own threads. So the scheduling can be measured on a
2-core box against a runtime whose calls sleep (``time.sleep`` releases the GIL, as onnxruntime's calls do) for as
long as the curve says a call of that layout and batch size takes on the box the curve was measured on.

**The curve** (``../shared/data/xeon16-serving.json``: a 16-core Xeon, MobileNetV2 FP32 and INT8): for a set-up
(``pinned 4 CPUs``, ``unpinned 8 CPUs``) and model, layouts ``INSTANCESxTHREADS`` -> {batch size: images/s summed over
all instances, every instance running its own batches at once}. One call of an instance of layout LxT at batch b
takes ``L x b / images_per_s(LxT, b)`` (:meth:`Curve.call_s`), images/s interpolated linearly between the measured
batch sizes (the largest one's beyond it). Assumptions, named: a layout the curve did not measure (2x2, 2x4, 4x2 of
the agent's candidates) is interpolated between the measured ones linearly in log2(instances); a call takes its
curve time whether or not the other instances are busy (the curve was measured with all busy); a 16-CPU box
(:meth:`Curve.doubled`) is two of the 8-CPU box: (2L)xT serves twice what LxT serves there, and one session of 16
threads serves what one of 8 does (it is never the best layout).

**The simulated model**: its output is the first K values of each sample's input (K: the output's size per sample),
which costs a copy of K floats. :func:`build_bundle` compiles the ONNX graph that computes exactly that
(Flatten, Slice) into a bundle of any input shape, so the bundle's self-test passes on the simulated runtime and a
client can check every answer.

**Registered for a run only**: nothing here is shipped to boxes (bench/ is not packaged) and the agent has no hook
for it. :func:`registered` swaps the engines registry's records for this one runtime while a block runs (it stands
in for ``onnxruntime``, whose curves it plays, under that name: the protocol's reports know only real runtimes; the
engine's ``device`` says ``simulated (...)``), in this process (tests/test_sim_runtime.py runs an agent in-process
this way). An agent process of its own (bench/serve_sim.py) gets it from bench/sim_site/sitecustomize.py, which Python
imports at start-up when that folder is on PYTHONPATH, with the run described in ``EDGEFLEET_BENCH_SIMULATE`` (JSON:
:func:`simulation_env`): the agent and the trial processes it starts (the layout trial runs in a child) all see the
simulated runtime and a box of the curve's CPU count (``os.sched_getaffinity``, ``os.cpu_count``).

**Busy share**: every call adds its time asleep to :data:`BUSY` (this process's): busy seconds / (instances x wall)
is the share of the time the instances were running a batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.engines.base import Engine, EngineSpec, Runtime

REPO = Path(__file__).resolve().parent.parent
CURVES = REPO.parent / "shared" / "data" / "xeon16-serving.json"  # the 16-core Xeon's measured curves
ENV = "EDGEFLEET_BENCH_SIMULATE"  # the run's simulation (JSON), read by bench/sim_site/sitecustomize.py only
SITE = Path(__file__).resolve().parent / "sim_site"  # the folder to put on PYTHONPATH for an agent of its own

__all__ = ["BUSY", "CURVES", "ENV", "SITE", "Busy", "Curve", "SimulatedEngine", "build_bundle", "install_from_env",
           "registered", "simulation_env"]


def _layout(name: str) -> tuple[int, int]:
    instances, threads = (int(v) for v in name.lower().split("x"))
    if instances < 1 or threads < 1:
        raise ValueError(f"layout {name!r}: INSTANCESxTHREADS, both at least 1")
    return instances, threads


def _at_batch(rates: dict[int, float], batch: int) -> float:
    """Images/s at ``batch``, linear between the measured batch sizes (the nearest one's outside them)."""
    sizes = sorted(rates)
    if batch <= sizes[0]:
        return rates[sizes[0]]
    if batch >= sizes[-1]:
        return rates[sizes[-1]]
    hi = next(s for s in sizes if s >= batch)
    lo = max(s for s in sizes if s <= batch)
    if hi == lo:
        return rates[lo]
    return rates[lo] + (rates[hi] - rates[lo]) * (batch - lo) / (hi - lo)


@dataclass(frozen=True)
class Curve:
    """A box's serving curve: ``cores`` CPUs, ``layouts`` "LxT" -> {batch size: images/s, all instances busy}.
    ``time_scale``: every call takes this many times its curve time (1: the curve's own)."""

    cores: int
    layouts: dict[str, dict[int, float]]
    label: str = "curve"
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError(f"{self.label}: no layouts")
        if not 0.01 <= self.time_scale <= 1000:
            raise ValueError(f"{self.label}: time_scale {self.time_scale} is outside 0.01..1000")
        for name, rates in self.layouts.items():
            i, t = _layout(name)
            if i * t != self.cores:
                raise ValueError(f"{self.label}: layout {name} does not use the box's {self.cores} CPUs")
            if not rates or any(b < 1 or not 0 < v < 1e9 for b, v in rates.items()):
                raise ValueError(f"{self.label}: layout {name}: batch sizes >= 1 and images/s > 0 expected")

    @classmethod
    def from_file(cls, path: Path = CURVES, setup: str = "unpinned 8 CPUs", model: str = "mobilenetv2-int8",
                  time_scale: float = 1.0) -> Curve:
        """One set-up's curve of one model from a curves file (the xeon16-serving.json layout)."""
        doc = json.loads(Path(path).read_text())
        try:
            raw = doc["setups"][setup][model]
        except KeyError as exc:
            known = {s: sorted(m) for s, m in doc.get("setups", {}).items()}
            raise ValueError(f"{path}: no curve for set-up {setup!r}, model {model!r} (there are {known})") from exc
        layouts = {name: {int(b): float(v) for b, v in rates.items()} for name, rates in raw.items()}
        cores = max(math.prod(_layout(n)) for n in layouts)
        return cls(cores, layouts, f"{model}, {setup}", time_scale)

    def doubled(self) -> Curve:
        """A box of twice the CPUs, as two of this one: LxT (L >= 2) serves what (L/2)xT serves here, twice; one
        session of all the CPUs serves what one session of this box's CPUs does (assumed: no gain)."""
        out: dict[str, dict[int, float]] = {}
        for name, rates in self.layouts.items():
            i, t = _layout(name)
            out[f"{2 * i}x{t}"] = {b: 2 * v for b, v in rates.items()}
            if i == 1:
                out[f"1x{2 * t}"] = dict(rates)
        return Curve(2 * self.cores, out, f"{self.label}, doubled to {2 * self.cores} CPUs", self.time_scale)

    def rate(self, instances: int, batch: int) -> float:
        """Images/s of the layout of ``instances`` sessions on this box's CPUs at ``batch``, all instances busy: a
        measured layout's, or interpolated linearly in log2(instances) between the nearest measured ones."""
        by_instances = {_layout(n)[0]: r for n, r in self.layouts.items()}
        if instances in by_instances:
            return _at_batch(by_instances[instances], batch)
        below = [i for i in by_instances if i < instances]
        above = [i for i in by_instances if i > instances]
        if not below or not above:
            return _at_batch(by_instances[max(below) if below else min(above)], batch)
        lo, hi = max(below), min(above)
        w = (math.log2(instances) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return (1 - w) * _at_batch(by_instances[lo], batch) + w * _at_batch(by_instances[hi], batch)

    def instances_for(self, threads: int) -> int:
        """The instances of a layout of ``threads`` threads each on this box (the agent's layouts use every CPU)."""
        return max(1, self.cores // max(1, threads))

    def call_s(self, threads: int, batch: int) -> float:
        """Seconds one call of an instance of ``threads`` threads takes at ``batch``: instances x batch / images/s."""
        instances = self.instances_for(threads)
        return self.time_scale * instances * batch / self.rate(instances, batch)

    def best(self) -> tuple[float, str, int]:
        """(images/s, layout, batch size) of the best measured point (at ``time_scale``): the simulated limit."""
        return max(((v / self.time_scale, n, b) for n, r in self.layouts.items() for b, v in r.items()),
                   key=lambda x: x[0])

    def layout_best(self, instances: int, sizes: tuple[int, ...] = (1, 2, 4, 8, 16)) -> float:
        """The best images/s of the layout of ``instances`` instances over ``sizes`` (at ``time_scale``)."""
        return max(self.rate(instances, b) for b in sizes) / self.time_scale

    def to_json(self) -> dict[str, Any]:
        return {"cores": self.cores, "label": self.label, "time_scale": self.time_scale,
                "layouts": {n: {str(b): v for b, v in r.items()} for n, r in self.layouts.items()}}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Curve:
        return cls(int(doc["cores"]), {n: {int(b): float(v) for b, v in r.items()} for n, r in doc["layouts"].items()},
                   str(doc.get("label", "curve")), float(doc.get("time_scale", 1.0)))


@dataclass
class Busy:
    """What the simulated calls of this process did: seconds asleep in calls (``busy_s``), calls, samples; read
    with :meth:`snapshot`."""

    busy_s: float = 0.0
    calls: int = 0
    samples: int = 0
    late_s: float = 0.0  # time past the curve's, summed: the sleeps' overshoot
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float, samples: int, late_s: float) -> None:
        with self.lock:
            self.busy_s += seconds
            self.calls += 1
            self.samples += samples
            self.late_s += late_s

    def snapshot(self) -> tuple[float, int, int, float]:
        with self.lock:
            return self.busy_s, self.calls, self.samples, self.late_s


BUSY = Busy()
_CURVE: list[Curve] = []  # the curve of the run registered now (registered, install_from_env)
_HELD: list[Any] = []  # install_from_env's registration, held for the process's life


def _overshoot_s() -> float:
    """The median time a short ``time.sleep`` overruns here (each call sleeps that much less, so that calls take
    their curve time, not the curve's plus the scheduler's wake-up)."""
    got = []
    for _ in range(15):
        t0 = time.perf_counter()
        time.sleep(0.0005)
        got.append(time.perf_counter() - t0 - 0.0005)
    got.sort()
    return min(0.0005, max(0.0, got[len(got) // 2]))


class SimulatedEngine(Engine):
    """An engine whose calls take the curve's time asleep (no CPU; the GIL released) and answer with the first K
    input values of each sample (the simulated model: :func:`build_bundle`)."""

    kind = "onnxruntime"  # the runtime it stands in for (the curves are onnxruntime's; the install report and the
    # model config name the runtimes the protocol knows); ``device`` says it is simulated
    _slack_s: float | None = None  # the sleep's overshoot here, measured once per process

    def __init__(self, spec: EngineSpec, providers: tuple[str, ...] | None = None):
        super().__init__(spec, providers)
        if not _CURVE:
            raise RuntimeError("the simulated runtime is used outside a simulated run (sim_runtime.registered)")
        self.curve = _CURVE[-1]
        self.threads = 1

    def load(self, engine: Path, threads: int) -> None:
        if not Path(engine).is_file():
            raise FileNotFoundError(f"{engine}: no engine file")
        self.threads = threads
        if SimulatedEngine._slack_s is None:
            SimulatedEngine._slack_s = _overshoot_s()
        c = self.curve
        self.device = f"simulated ({c.label}: {c.instances_for(threads)}x{threads} on {c.cores} cores)"

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        first = feeds[self.inputs[0].name]
        axis = self.inputs[0].batch_axis
        n = int(first.shape[axis]) if axis is not None and first.ndim > axis else 1
        due = self.curve.call_s(self.threads, n)
        rows = first.reshape(n, -1) if axis == 0 else np.moveaxis(first, axis or 0, 0).reshape(n, -1)
        outs = []
        for spec in self.outputs:
            shape = [n if i == spec.batch_axis else d for i, d in enumerate(spec.shape)]
            k = math.prod(d for i, d in enumerate(shape) if i != spec.batch_axis)
            vals = rows[:, :k] if k <= rows.shape[1] else np.zeros((n, k), np.float32)
            outs.append(np.array(vals, dtype=np.float32, order="C").reshape(shape))  # a copy: never a view of the
            # input (a batch buffer the agent reuses), as a runtime answers
        left = due - (time.perf_counter() - t0) - (SimulatedEngine._slack_s or 0.0)
        if left > 0:
            time.sleep(left)
        took = time.perf_counter() - t0
        BUSY.add(took, n, max(0.0, took - due))
        return outs

    def _close_impl(self) -> None:
        pass


RUNTIME = Runtime(engine=SimulatedEngine, backend="onnxruntime", precisions=("fp32", "fp16", "int8", "bf16"),
                  modules=("numpy",), extra="bench/sim_runtime.py (a simulation, registered for one run)", order=0)


@contextlib.contextmanager
def registered(curve: Curve) -> Iterator[Curve]:
    """While the block runs, the engines registry holds the simulated runtime alone, in onnxruntime's place: every
    onnxruntime bundle loads on it (the agent's runtime choice then has one candidate), whatever its precision."""
    from edgefleet import engines

    saved = dict(engines._REGISTRY)
    engines._REGISTRY.clear()
    engines._REGISTRY[RUNTIME.name] = RUNTIME
    _CURVE.append(curve)
    try:
        yield curve
    finally:
        _CURVE.pop()
        engines._REGISTRY.clear()
        engines._REGISTRY.update(saved)


def simulation_env(curve: Curve) -> dict[str, str]:
    """The environment an agent process of its own needs to run on ``curve`` (its children inherit it)."""
    path = os.environ.get("PYTHONPATH", "")
    return {ENV: json.dumps(curve.to_json()), "PYTHONPATH": os.pathsep.join(p for p in (str(SITE), path) if p)}


def install_from_env() -> Curve | None:
    """In a process started with :func:`simulation_env` (bench/sim_site/sitecustomize.py calls this): the simulated
    runtime registered for the process's life, and a box of the curve's CPUs as far as the agent asks (CPU affinity,
    CPU count). -> the curve, or None without the variable."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    curve = Curve.from_json(json.loads(raw))
    held = registered(curve)
    held.__enter__()  # for the process's life: never exited (and kept: a collected one would restore the registry)
    _HELD.append(held)
    cpus = set(range(curve.cores))
    os.sched_getaffinity = lambda _pid: set(cpus)  # type: ignore[assignment]
    os.sched_setaffinity = lambda _pid, _mask: None  # type: ignore[assignment]
    os.cpu_count = lambda: curve.cores  # type: ignore[assignment]
    return curve


def build_bundle(out_dir: Path, shape: tuple[int, ...] = (1, 16, 16), classes: int = 10, name: str = "simnet",
                 version: str = "1.0.0") -> Path:
    """A bundle of the simulated model for x86-cpu (input ``[N, *shape]`` FP32, output ``logits`` ``[N, classes]``:
    the first ``classes`` input values of each sample), written as the compiler lays a bundle out: its ONNX graph
    (Flatten, Slice: the same function, for a real runtime), a self-test sample of 16 and its answers, a manifest
    whose gate compared the graph with itself. No compiler is needed (the agent's dependencies and onnx). -> its
    path."""
    import onnx
    from onnx import TensorProto, helper

    from edgefleet.protocol.bundle import sha256_file, write_bundle
    from edgefleet.protocol.manifest import MANIFEST_VERSION, parse_manifest

    size = math.prod(shape)
    if not 1 <= classes <= size:
        raise ValueError(f"classes {classes}: 1..{size} (the input's size per sample)")
    work = out_dir / f"{name}-files"
    work.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["input"], ["flat"], axis=1),
         helper.make_node("Slice", ["flat", "starts", "ends", "axes"], ["logits"])], name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", *shape])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        [helper.make_tensor("starts", TensorProto.INT64, [1], [0]),
         helper.make_tensor("ends", TensorProto.INT64, [1], [classes]),
         helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, work / "model.onnx")
    x = np.random.default_rng(0).random((16, *shape), dtype=np.float32)
    expected = np.ascontiguousarray(x.reshape(len(x), -1)[:, :classes])
    np.savez(work / "selftest.npz", **{"input:input": x, "expected:logits": expected, "labels": expected.argmax(1)})
    files = {f.name: {"sha256": sha256_file(f), "size_bytes": f.stat().st_size} for f in sorted(work.iterdir())}
    manifest = parse_manifest({
        "manifest_version": MANIFEST_VERSION, "name": name, "version": version, "profile": "x86-cpu",
        "backend": "onnxruntime", "precision": "fp32", "created_at": "2026-11-29T00:00:00+00:00",
        "engine": "model.onnx", "selftest": "selftest.npz",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, *shape], "batch_axis": 0}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, classes], "batch_axis": 0}],
        "files": files, "benchmark": None, "toolchain": {"bench/sim_runtime.py": "build_bundle"},
        "accuracy": {"metric": "agreement", "eval_samples": len(x), "reference_precision": "fp32", "reference": 1.0,
                     "candidate_precision": "fp32", "candidate": 1.0, "drop": 0.0, "max_drop": 0.0, "passed": True}})
    return write_bundle(manifest, work, out_dir / f"{name}-{version}-x86-cpu.tar")
