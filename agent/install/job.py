"""Installing a model version: what installs remember, how a version is loaded, timed and tuned here, and the
local rollback to the previous version. One install (decide, fetch, verify, stage, load, self-test, warm up, commit,
swap) walks the states of agent.install.states in agent.install.steps. The running version serves throughout; any
failure leaves it serving and is reported with the reason. The daemon (:mod:`agent.daemon`) composes this with the
fleet link.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ...engines import Engine, EngineError, load_bundle_engine
from ...protocol import mqtt as proto
from ...protocol.backoff import Backoff
from ...protocol.cpu import cpu_features
from ...protocol.errors import ContractError
from ...protocol.manifest import Manifest
from ...protocol.profile import load_profile
from ..config import AgentConfig
from ..core.batching.settings import BatchSettings
from ..core.batching.tuning import (
    BatchTuning,
    LayoutFigures,
    batch_ladder,
    choose_batch_size,
    choose_layout,
    layout_candidates,
)
from ..core.host import IndexEntry, ModelHost
from ..core.runtime_pick import RuntimePick
from ..errors import BackendError, DownloadCut, FetchError, RefusedUpdate, UpdateError
from .precision import PrecisionPick, pick_precision
from .selftest import Turn, measure_batch_sizes, now, self_test, warm_up
from .states import InstallState
from .store import ModelStore, StagedModel
from .trials import TrialRecord, TrialStore, trial_key
from .trusted import check_cpu

if TYPE_CHECKING:
    from ..core.pipeline import PipelineStages
    from ..link.updater import BundleFetcher

# the layout and runtime trials (.bench, .runtime_choice) are imported where they run: a restart served from its trial
# record (issue 41) runs neither, nor does it need the fleet link's TUF client (..link.updater)

__all__ = ["Installer", "Report"]

log = logging.getLogger("edgefleet.agent")
MAX_RESUMES = 1000  # cuts of one download that moved it forward and were resumed, not counted as failed tries



class Report(Protocol):
    """Tells the fleet where an install stands (the agent's MQTT report; agent.install.states.REPORTED)."""

    def __call__(self, state: InstallState, desired: proto.DesiredState | None, error: str | None = None,
                 install_s: float | None = None, selftest: proto.SelfTestResult | None = None,
                 serving: proto.ServingChoice | None = None) -> None: ...


class Installer:
    """What installs remember: bundles that failed here (never tried again), the newest rollout seen (older
    desired states are stale replays), and why a version is not serving; and how a version is loaded here (an
    install's steps, agent.install.steps.InstallRun, call these)."""

    def __init__(self, config: AgentConfig, store: ModelStore, host: ModelHost, report: Report,
                 fetcher: Callable[[], BundleFetcher | None], stop: threading.Event,
                 desired_pending: Callable[[], bool]):
        self.config = config
        self.store = store
        self.host = host
        self.report = report
        self.fetcher = fetcher  # the TUF client, once the fleet's bootstrap was read
        self.stop = stop
        self.desired_pending = desired_pending  # a newer desired state arrived: stop retrying this one
        self.loop: asyncio.AbstractEventLoop | None = None  # the agent's, once it runs
        self.failed: dict[str, str] = {}  # bundle sha256 -> why it failed (bundle faults only)
        self.max_rollout: int | None = None  # desired states from older rollouts are stale replays
        self.unavailable: dict[tuple[str, str], str] = {}  # (model, version) -> why it is not serving
        # the layout load_instances measured for a set of engines, by its first engine, until tune_batches takes it
        self.measured_layouts: dict[int, tuple[Engine, LayoutFigures, tuple[LayoutFigures, ...]]] = {}
        self._layouts_lock = threading.Lock()
        # the runtime each model's version serves on (agent.install.runtime_choice), by model:
        # (version, precision, pick)
        self.runtimes: dict[str, tuple[str, str, RuntimePick]] = {}
        # the trials' results kept with each installed version (agent.install.trials): a restart with nothing
        # changed serves from them; by version directory, the record being recalled or measured until tune_batches
        self.trials = TrialStore(store.root / "trials" if store is not None else None)
        self.records: dict[str, tuple[dict[str, Any], TrialRecord]] = {}
        self.trial_runs = 0  # versions whose trials ran in this process (not served from a record)

    async def load_installed(self) -> None:
        """Serve every model on disk, the one installed last last (it is "current" for the fleet): its active
        version, else the previous one."""
        # the store changes (and forgets the failed one) only once a fallback actually
        # loaded: a broken runtime must not cost both versions
        slots = self.store.active()
        primary = self.store.current.installed.name if self.store.current else None
        for name in sorted(slots, key=lambda n: n == primary):
            for which, entry in zip(("current", "previous"), slots[name], strict=True):
                if entry is None:
                    continue
                stages: PipelineStages | None = None
                try:
                    manifest = self.store.load_manifest(entry, verify=False)
                    self.require_cpu(manifest.profile, manifest.cpu_features)  # the disk may have moved boxes
                    directory = self.store.models_dir / entry.directory
                    if manifest.pipeline is not None:  # its stages loaded and checked again: this box, today
                        stages = await asyncio.get_running_loop().run_in_executor(
                            None, self.prepare_pipeline, StagedModel(manifest, directory, entry.installed.sha256))
                    else:
                        pick = await asyncio.get_running_loop().run_in_executor(  # timed again: this box, today
                            None, self.pick_precision, StagedModel(manifest, directory, entry.installed.sha256))
                        manifest = pick.staged.manifest
                        backends = await asyncio.get_running_loop().run_in_executor(
                            None, self.load_instances, manifest, directory)
                except (UpdateError, ContractError) as exc:
                    log.error("could not load the %s model %s: %s", which, entry.directory, exc)
                    self.unavailable[(entry.installed.name, entry.installed.version)] = str(exc)
                    continue
                if stages is not None:
                    await self.host.swap(manifest, (), serving=self.pipeline_serving(manifest, stages), stages=stages)
                else:
                    try:  # measured again at each start: the figures are this box's, today
                        settings, tuning = await asyncio.get_running_loop().run_in_executor(
                            None, self.tune_batches, backends[0],
                            StagedModel(manifest, directory, entry.installed.sha256),
                            self.turn(manifest.name, len(backends)))
                    except UpdateError as exc:
                        for b in backends:
                            b.close()
                        log.error("could not load the %s model %s: %s", which, entry.directory, exc)
                        self.unavailable[(entry.installed.name, entry.installed.version)] = str(exc)
                        continue
                    await self.host.swap(manifest, backends, settings, tuning,
                                         self.serving_choice(pick, settings, tuning, len(backends)))
                if which == "previous":
                    log.error("serving the previous model %s; the committed one would not load", entry.directory)
                    if name == primary:
                        self.store.revert()
                    else:
                        self.store.rollback(name)
                break
        if self.store.current is not None:
            self.max_rollout = self.store.current.rollout_id
        self.trials.prune({e.installed.sha256 for pair in slots.values() for e in pair if e is not None})

    def drop_shadow(self, keep_files: bool = False) -> None:
        """End the shadow; its files are removed, unless ``keep_files`` (the install of that very bundle follows: its
        download copies them by content, and the store stages the bundle into the same folder; a later install's
        collection removes them if that install never commits)."""
        sh = self.host.end_shadow()
        if sh is not None:
            sh.close()
            if sh.staged is not None and not keep_files:
                self.store.discard(sh.staged)
            log.info("dropped the shadow of %s %s%s", sh.manifest.name, sh.manifest.version,
                     " (its files kept for its install)" if keep_files else "")

    def check_shadow(self, m: Manifest, size: tuple[int, int] | None = None) -> None:
        """A candidate in shadow is compared with the version of its name serving here, so both must answer alike:
        a pipeline shadows a pipeline that reads the same way (ctc or top-k) at the same image size (``size``: the
        candidate's, once its stages are loaded), a single model a single model. UpdateError naming both; not
        remembered as the bundle's failure (the same bundle may shadow once the device serves another version)."""
        served = self.host.models.get(m.name)
        if served is None:
            return
        have = f"{m.name} {served.manifest.version} serving here"
        if m.pipeline is not None and served.pipeline is None:
            raise UpdateError(f"{m.name} {m.version} is a pipeline and {have} is a single model: a pipeline's end "
                              "answers (boxes and what was read in them) cannot be compared with a single model's "
                              "outputs, so it cannot run in its shadow; install it, or shadow it where a pipeline "
                              "serves")
        if m.pipeline is None and served.pipeline is not None:
            raise UpdateError(f"{m.name} {m.version} is a single model and {have} is a pipeline: a single model's "
                              "outputs cannot be compared with a pipeline's end answers, so it cannot run in its "
                              "shadow; install it, or shadow it where a single model serves")
        if m.pipeline is None or served.pipeline is None:
            return
        mine, theirs = m.pipeline.spec.read.op, served.pipeline.spec.read.op
        if mine != theirs:
            raise UpdateError(f"{m.name} {m.version} reads with {mine} and {have} with {theirs}: their end answers "
                              "cannot be compared, so it cannot run in its shadow; install it instead")
        if size is not None and size != served.pipeline.size:
            raise UpdateError(f"{m.name} {m.version} reads {size[0]}x{size[1]} images and {have} reads "
                              f"{served.pipeline.size[0]}x{served.pipeline.size[1]}: it cannot answer the requests "
                              "mirrored to it, so it cannot run in its shadow; install it instead")

    # -- model lifecycle ------------------------------------------------------------------------
    def load_instances(self, manifest: Manifest, directory: Path, count: int | None = None,
                       threads: int | None = None, runtime: str | None = None) -> list[Engine]:
        """``instances`` (or ``count``) loaded engines of one model version (each its own runtime session of
        ``intra_op_threads``, or ``threads``). The serving instances (no ``count``) of a CPU engine, with
        ``batch_tuning: auto`` and neither instances nor intra_op_threads set by the operator: the layout measured
        here (:meth:`measure_layouts`), its figures kept for :meth:`tune_batches`."""
        out: list[Engine] = []
        record = self.records.get(str(directory)) if count is None else None
        n = self.config.instances if count is None else count
        if record is not None and record[1].layout is not None:
            n, threads = record[1].layout[0]  # the layout its kept trial chose: loaded at once, not reloaded
        threads = threads or self.config.intra_op_threads
        try:
            for _ in range(n):
                out.append(load_bundle_engine(manifest, directory / manifest.engine, threads,
                                              self.config.onnxruntime_providers,
                                              runtime or self.runtime_for(manifest)))
        except BaseException as exc:
            for b in out:
                b.close()
            if isinstance(exc, EngineError):  # the engine cannot run here: the update fails, the old model serves
                raise BackendError(str(exc)) from exc
            raise
        device = str(getattr(out[0], "device", "CPU"))
        if count is None and self.config.batch_tuning == "auto" and "CUDA" not in device and "Tensorrt" not in device \
                and not {"instances", "intra_op_threads"} & self.config.model_fields_set:
            try:
                out = self.measure_layouts(manifest, directory, out, threads)
            except BaseException:
                for b in out:
                    b.close()
                raise
        return out

    def measure_layouts(self, manifest: Manifest, directory: Path, loaded: list[Engine],
                        threads: int) -> list[Engine]:
        """Each layout of this box's inference CPUs (agent.core.batching.tuning.layout_candidates: 1x2 and 2x1 on
        two, 1x1 alone on one) timed as bench/serve.py times the runtime's limit (agent.install.bench.layout_trial: all
        its instances driven at once, each on its own thread on the serving threads' CPUs, at the batch sizes the
        batcher may form; and a lone batch-1 call), in a child process whose memory goes with it
        (agent.install.bench.layout_trial_in_child). -> the chosen layout's engines
        (agent.core.batching.tuning.choose_layout), loaded here; ``loaded`` (the configured layout) is reused if chosen,
        else closed first. While another version serves the model, the trial shares its cores with it for the trial's
        few seconds (no turns: a turn per call cannot run several instances at once)."""
        cpus, candidates, sizes = self.layout_plan(manifest)
        t0 = time.monotonic()
        record = self.records.get(str(directory))
        if record is not None and record[1].layout is not None \
                and {(f.instances, f.threads) for f in record[1].layout[1]} == set(candidates):
            return self.use_layout(manifest, directory, loaded, threads, *record[1].layout)
        from .bench import layout_trial_in_child, slice_seconds

        try:
            # on the runtime that will serve it (chosen before: agent.install.runtime_choice), whose best layout and
            # batch size may differ from onnxruntime's
            figures = layout_trial_in_child(manifest, directory, candidates, sizes,
                                            slice_seconds(len(candidates), len(sizes)), cpus,
                                            self.config.onnxruntime_providers, runtime=self.runtime_for(manifest))
        except BaseException:
            for b in loaded:
                b.close()
            raise
        chosen = choose_layout(figures)
        if record is not None and not record[1].recalled:
            record[1].layout = ((chosen.instances, chosen.threads), tuple(figures))
            record[1].timed_s["layout"] = time.monotonic() - t0
        out = self.use_layout(manifest, directory, loaded, threads, (chosen.instances, chosen.threads),
                              tuple(figures))
        log.info("%s %s: layout %s, timed in %.1f s (%s)", manifest.name, manifest.version, chosen.name,
                 time.monotonic() - t0, "; ".join(f"{f.name}: best {f.best:g} images/s, lone call {f.lone_ms:g} ms"
                                                   for f in figures))
        return out

    def layout_plan(self, manifest: Manifest) -> tuple[tuple[int, ...] | None, tuple[tuple[int, int], ...],
                                                       tuple[int, ...]]:
        """The layout trial's CPUs (None: this process's), candidate layouts and batch sizes for ``manifest``."""
        cpus = self.config.inference_cpus
        cores = len(cpus) if cpus else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        sizes = batch_ladder(self.host.settings.max_batch_size) if manifest.batchable else (1,)
        return cpus, layout_candidates(cores), sizes

    def use_layout(self, manifest: Manifest, directory: Path, loaded: list[Engine], threads: int,
                   layout: tuple[int, int], figures: tuple[LayoutFigures, ...]) -> list[Engine]:
        """The engines of the chosen ``layout`` (``loaded``, of ``threads`` each, reused if it is that layout, else
        closed and the layout loaded), its figures kept for :meth:`tune_batches`."""
        chosen = next(f for f in figures if (f.instances, f.threads) == layout)
        if (chosen.instances, chosen.threads) == (len(loaded), threads):
            out = loaded
        else:
            from .bench import release_memory

            for b in loaded:
                b.close()
            release_memory()
            out = self.load_instances(manifest, directory, count=chosen.instances, threads=chosen.threads)
        # for tune_batches, which gets the first instance: the chosen layout's figures (the latest install's only)
        with self._layouts_lock:  # installs, rollbacks and start-up loads run on different threads
            self.measured_layouts = {k: v for k, v in self.measured_layouts.items() if not v[0].closed}  # failed ones
            self.measured_layouts[id(out[0])] = (out[0], chosen, tuple(figures))
        return out

    def turn(self, name: str, instances: int) -> Turn:
        """Run a call on model ``name``'s cores in turn with the version serving it (if the loop runs)."""
        loop = self.loop
        if loop is None or not loop.is_running():
            return now
        turns = self.host.turns(name, instances)
        return lambda fn, *args: turns.call(loop, fn, *args)

    def prepare_pipeline(self, staged: StagedModel) -> PipelineStages:
        """A pipeline bundle's stages loaded, self-tested (each stage, then end to end) and warmed up
        (agent.install.pipeline.prepare), each call in turn with the version serving the model."""
        from .pipeline import prepare

        m = staged.manifest
        return prepare(staged, self.config, self.host.settings, self.turn(m.name, self.config.instances))

    def pipeline_serving(self, m: Manifest, stages: PipelineStages) -> proto.ServingChoice:
        """How a pipeline serves, for the install report: the lowest stage precision (the bundle's), the reader's
        largest batch and how it was chosen, the operator's layout per stage, and the detector's runtime (both
        stages' in /v2/models/{name}/config)."""
        det, rec = stages.detector, stages.reader
        operator = {"instances", "intra_op_threads"} & self.config.model_fields_set
        mode = rec.tuning.mode if rec.tuning is not None else "off"
        return proto.ServingChoice(
            precision=m.precision, precision_source="bundle",
            max_batch_size=rec.settings.max_batch_size,
            batch_source=mode if mode in ("measured", "operator") else "off",  # type: ignore[arg-type]
            batch_timings=tuple(proto.Timing(batch_size=n, items_per_s=v)
                                for n, v in (rec.tuning.images_per_s if rec.tuning is not None else ())),
            instances=len(det.backends), threads=self.config.intra_op_threads,
            layout_source="operator" if operator else "default",
            runtime=None if det.runtime is None else _runtime_record(det.runtime))

    def warm_batch_sizes(self) -> tuple[int, ...]:
        s = self.host.settings
        return tuple(sorted({1, s.max_batch_size, *s.preferred_batch_sizes}))

    def pick_precision(self, staged: StagedModel) -> PrecisionPick:
        """The precision to serve a bundle in (agent.install.precision): the bundle's own, unless it carries several and
        ``precision: auto`` times them here; each call in turn with the version serving the model."""
        m = staged.manifest
        key = trial_key(staged.bundle_sha256, self.config, self.host.settings.max_batch_size)
        recalled = self.trials.recall(key)
        if recalled is not None and recalled.precision is not None and recalled.runtime is not None \
                and recalled.precision[0] in m.precisions:
            self.records[str(staged.directory)] = (key, recalled)
            precision, source, note, timings = recalled.precision
            view = staged if precision == m.precision else \
                StagedModel(m.as_variant(precision), staged.directory, staged.bundle_sha256)
            self.runtimes[m.name] = (m.version, precision, recalled.runtime)
            return PrecisionPick(view, source, timings, note)
        record = TrialRecord()
        self.records[str(staged.directory)] = (key, record)
        t0 = time.monotonic()

        def load_one(manifest: Manifest) -> Engine:
            return self.load_instances(manifest, staged.directory, count=1)[0]

        pick = pick_precision(staged, self.config.precision, load_one, self.host.settings.max_batch_size,
                              self.turn(m.name, self.config.instances))
        if pick.note:
            log.info("%s %s: precision %s", m.name, m.version, pick.note)
        if pick.source == "device":
            record.timed_s["precision"] = time.monotonic() - t0
        t1 = time.monotonic()
        runtime = self.pick_runtime(pick.staged)  # then the runtime for that precision
        if runtime.source == "device":
            record.timed_s["runtime, layout" if record.layout is not None else "runtime"] = time.monotonic() - t1
        record.precision = (pick.staged.manifest.precision, pick.source, pick.note, pick.timings)
        record.runtime = runtime
        return pick

    def pick_runtime(self, staged: StagedModel) -> RuntimePick:
        """The runtime to serve a bundle (as its chosen precision's) on (agent.install.runtime_choice), remembered for
        load_instances; each call in turn with the version serving the model."""
        from .bench import slice_seconds
        from .runtime_choice import pick_runtime_in_child

        m = staged.manifest
        # timed in a child process (agent.install.runtime_choice.pick_runtime_in_child): a runtime not chosen leaves its
        # libraries and memory there, not here
        record = self.records.get(str(staged.directory))
        layout: dict[str, Any] | None = None
        layouts: list[LayoutFigures] = []  # the layout trial in the same child, where load_instances would run one
        if record is not None and self.config.batch_tuning == "auto" \
                and not {"instances", "intra_op_threads"} & self.config.model_fields_set \
                and set(self.config.onnxruntime_providers or ()) <= {"CPUExecutionProvider"}:
            cpus, candidates, sizes = self.layout_plan(m)
            layout = {"candidates": [list(c) for c in candidates], "sizes": list(sizes), "cpus": cpus,
                      "seconds": slice_seconds(len(candidates), len(sizes))}
        pick = pick_runtime_in_child(staged, self.config.runtime, self.host.settings.max_batch_size,
                                     self.config.intra_op_threads, self.config.onnxruntime_providers,
                                     layout=layout, layouts_out=layouts)
        if layouts and record is not None:
            chosen = choose_layout(layouts)
            record[1].layout = ((chosen.instances, chosen.threads), tuple(layouts))
            log.info("%s %s: layout %s, timed with the runtimes (%s)", m.name, m.version, chosen.name,
                     "; ".join(f"{f.name}: best {f.best:g} images/s, lone call {f.lone_ms:g} ms" for f in layouts))
        log.info("%s %s: runtime %s", m.name, m.version, pick.note)
        self.runtimes[m.name] = (m.version, m.precision, pick)
        return pick

    def runtime_for(self, manifest: Manifest) -> str | None:
        """The runtime chosen for this version and precision (None: not chosen, the bundle's default)."""
        got = self.runtimes.get(manifest.name)
        return got[2].runtime if got is not None and got[:2] == (manifest.version, manifest.precision) else None

    def serving_choice(self, pick: PrecisionPick, settings: BatchSettings | None, tuning: BatchTuning | None,
                       instances: int) -> proto.ServingChoice:
        """How a version serves, for the install report and /v2/models/{name}/config."""
        s = settings or self.host.settings
        mode = tuning.mode if tuning is not None else "off"
        return proto.ServingChoice(
            precision=pick.staged.manifest.precision, precision_source=pick.source,  # type: ignore[arg-type]
            precisions=pick.timings, max_batch_size=s.max_batch_size,
            batch_source=mode if mode in ("measured", "operator") else "off",  # type: ignore[arg-type]
            batch_timings=tuple(proto.Timing(batch_size=n, items_per_s=v)
                                for n, v in (tuning.images_per_s if tuning is not None else ())),
            instances=instances,
            threads=tuning.layout[1] if tuning is not None and tuning.layout else self.config.intra_op_threads,
            layout_source=tuning.layout_source if tuning is not None and tuning.layout else  # type: ignore[arg-type]
            "operator" if {"instances", "intra_op_threads"} & self.config.model_fields_set else "default",
            runtime=self.runtime_choice(pick.staged.manifest))

    def runtime_choice(self, manifest: Manifest) -> proto.RuntimeChoice | None:
        got = self.runtimes.get(manifest.name)
        if got is None or got[:2] != (manifest.version, manifest.precision):
            return None
        return _runtime_record(got[2])

    def tune_batches(self, backend: Engine, staged: StagedModel, turn: Turn) -> tuple[BatchSettings, BatchTuning]:
        """:meth:`batch_settings`, then the version's trial record (agent.install.trials) kept if its trials ran
        here, or said to be served from if it was recalled."""
        record = self.records.pop(str(staged.directory), None)
        out = self.batch_settings(backend, staged, turn, None if record is None else record[1])
        m = staged.manifest
        if record is None:
            pass
        elif record[1].recalled:
            self.host.metrics.model_event(m.name, m.version, "trials_recalled")
            log.info("%s %s: served from its trial record (precision %s, runtime %s, layout %s), no trials run",
                     m.name, m.version, m.precision, self.runtime_for(m) or "the bundle's",
                     "x".join(map(str, out[1].layout)) if out[1].layout else "-")
        else:
            self.trials.keep(*record)
            timed = record[1].timed_s
            if timed:
                self.trial_runs += 1
                self.host.metrics.model_event(m.name, m.version, "trials_timed")
                log.info("%s %s: trials (%s) took %.2f s; kept for the next start", m.name, m.version,
                         ", ".join(timed), sum(timed.values()))
        return out

    def batch_settings(self, backend: Engine, staged: StagedModel, turn: Turn,
                       record: TrialRecord | None) -> tuple[BatchSettings, BatchTuning]:
        """The batch settings a version serves with: the host's, unless ``batch_tuning: auto`` and the operator
        left max_batch_size unset; then measured on this device (each call in ``turn``) and the largest batch
        formed chosen from the figures, requests up to the configured max still accepted."""
        base = self.host.settings
        with self._layouts_lock:
            measured = self.measured_layouts.pop(id(backend), None)  # load_instances measured the layout
        if measured is not None and measured[0] is backend:
            _, lay, lays = measured
            layout: dict[str, Any] = {"layout": (lay.instances, lay.threads), "layout_source": "measured",
                                      "layouts": lays}
        else:
            lay = None
            layout = {"layout": (self.config.instances, self.config.intra_op_threads), "layout_source": "operator"
                      if {"instances", "intra_op_threads"} & self.config.model_fields_set else "default"}
        if self.config.batch_tuning == "off":
            return base, BatchTuning("off", **layout)
        if "max_batch_size" in self.config.model_fields_set:  # in the config file or on the command line
            return base, BatchTuning("operator", **layout)
        if not staged.manifest.batchable or base.max_batch_size == 1:
            return base, BatchTuning("off", **layout)
        # the layout's own figures (all its instances at once), else this instance's, measured now
        if lay is not None:
            figures = lay.images_per_s
        elif record is not None and record.recalled and record.batch is not None:
            figures = record.batch
        else:
            t0 = time.monotonic()
            figures = measure_batch_sizes(backend, staged, batch_ladder(base.max_batch_size), turn)
            if record is not None and not record.recalled:
                record.batch, record.timed_s["batch"] = tuple(figures), time.monotonic() - t0
        chosen = choose_batch_size(figures)
        # one call's time on one instance by batch size: the layout's figures are all its instances at once; the
        # batch trial's, one instance alone
        per = lay.instances if lay is not None else 1
        call_ms = tuple((n, 1e3 * per * n / v) for n, v in figures if v > 0 and n <= chosen)
        settings = BatchSettings(**{**base.__dict__, "max_batch_size": chosen,
                                    "preferred_batch_sizes": (chosen,) if chosen > 1 else (),
                                    "max_request_batch_size": base.request_limit, "call_ms": call_ms})
        log.info("%s %s: batches of at most %d (images/s by batch size: %s)", staged.manifest.name,
                 staged.manifest.version, chosen, ", ".join(f"{n}: {v:g}" for n, v in figures))
        return settings, BatchTuning("measured", figures, chosen, **layout)

    def index(self) -> list[IndexEntry]:
        """Versions on disk and versions that failed, for the repository index (serving ones are added by
        the host as READY)."""
        out = []
        for name, (active, prev) in self.store.active().items():
            out.append(IndexEntry(name, active.installed.version, "UNAVAILABLE", "installed; not loaded"))
            if prev is not None:
                out.append(IndexEntry(name, prev.installed.version, "UNAVAILABLE",
                                      "previous version, kept for rollback"))
        # why a version failed says more than where it lies (later entries win)
        return out + [IndexEntry(n, v, "UNAVAILABLE", why) for (n, v), why in self.unavailable.items()]

    async def rollback(self, name: str) -> Manifest:
        """Serve model ``name``'s previous version again (loaded, self-tested and warmed up while the active
        one serves). On any failure the active version keeps serving and the store is unchanged."""
        loop = asyncio.get_running_loop()
        slots = self.store.active()
        if name not in slots or slots[name][1] is None:
            raise RefusedUpdate(f"{name} has no previous version to roll back to" if name in slots
                                else f"no model {name!r} is installed")
        prev = slots[name][1]
        assert prev is not None
        directory = self.store.models_dir / prev.directory
        manifest = self.store.load_manifest(prev)
        if manifest.pipeline is not None:  # both stages loaded and checked while the active version serves
            try:
                stages = await loop.run_in_executor(None, self.prepare_pipeline,
                                                    StagedModel(manifest, directory, prev.installed.sha256))
            except BaseException as exc:
                self.unavailable[(manifest.name, manifest.version)] = str(exc)
                log.error("rollback of %s to %s failed; %s keeps serving: %s", name, manifest.version,
                          slots[name][0].installed.version, exc)
                raise
            await loop.run_in_executor(None, self.store.rollback, name)
            await self.host.swap(manifest, (), serving=self.pipeline_serving(manifest, stages), stages=stages)
            self.unavailable.pop((manifest.name, manifest.version), None)
            log.warning("rolled %s back to %s", name, manifest.version)
            return manifest
        pick = await loop.run_in_executor(None, self.pick_precision,
                                          StagedModel(manifest, directory, prev.installed.sha256))
        staged, manifest = pick.staged, pick.staged.manifest
        backends = await loop.run_in_executor(None, self.load_instances, manifest, directory)
        try:
            turn = self.turn(manifest.name, len(backends))
            await loop.run_in_executor(None, self_test, backends[0], staged, turn)
            await loop.run_in_executor(None, warm_up, backends, staged, self.warm_batch_sizes(), turn)
            settings, tuning = await loop.run_in_executor(None, self.tune_batches, backends[0], staged, turn)
        except BaseException as exc:
            for b in backends:
                b.close()
            self.unavailable[(manifest.name, manifest.version)] = str(exc)
            log.error("rollback of %s to %s failed; %s keeps serving: %s", name, manifest.version,
                      slots[name][0].installed.version, exc)
            raise
        await loop.run_in_executor(None, self.store.rollback, name)  # writes and fsyncs: not on the loop
        await self.host.swap(manifest, backends, settings, tuning,
                             self.serving_choice(pick, settings, tuning, len(backends)))
        self.unavailable.pop((manifest.name, manifest.version), None)
        log.warning("rolled %s back to %s", name, manifest.version)
        return manifest

    @staticmethod
    def require_cpu(profile: str, required: tuple[str, ...] | None) -> None:
        """Refuse a bundle whose (signed) CPU requirements this CPU does not meet."""
        if required is None:
            # a repository or manifest from before edgefleet recorded CPU features: what the profile
            # promises today, if this agent knows the profile, is the best evidence there is
            try:
                required = load_profile(profile).cpu_features
            except ContractError:  # a profile this agent does not know: nothing to check against
                return
        decision = check_cpu(profile, required, cpu_features())
        if decision.action == "refuse":
            raise RefusedUpdate(decision.reason)

    def fetch_with_retries(self, desired: proto.DesiredState, profile: str):
        """Fetch, retrying a failed download ``install_retries`` times, each wait a full-jitter draw
        (``protocol.backoff``: uniform in [0, min(30 s, 1 s * 2**retry)]): boxes a fleet-wide outage failed
        together do not all come back at the same moment."""
        backoff = Backoff(1.0, 30.0)
        attempt = resumed = 0
        while True:
            fetcher = self.fetcher()
            if fetcher is None:
                raise FetchError("not connected to the fleet yet")
            try:
                return fetcher.fetch(
                    desired.target, desired.sha256,
                    precheck=lambda custom: self.require_cpu(profile, custom.cpu_features),
                    max_bytes_per_s=desired.download_max_bytes_per_s or 0)
            except FetchError as exc:
                # a cut that moved the download forward resumes and is not a failed try (at most MAX_RESUMES)
                resumed += isinstance(exc, DownloadCut)
                attempt += not isinstance(exc, DownloadCut) or resumed > MAX_RESUMES
                if isinstance(exc, DownloadCut):
                    backoff.reset()  # the link worked until the cut: the next wait is short again
                if attempt > self.config.install_retries:
                    raise
                delay = backoff.next_s()
                log.warning("fetch attempt %d failed (%s); retrying in %.1fs", attempt, exc, delay)
                if self.stop.wait(delay) or self.desired_pending():
                    return None


def _runtime_record(pick: RuntimePick) -> proto.RuntimeChoice:
    """A runtime choice as the install report and telemetry carry it."""
    return proto.RuntimeChoice(
        runtime=pick.runtime, source=pick.source,  # type: ignore[arg-type]
        runtimes=tuple(proto.RuntimeTiming(runtime=t.runtime, items_per_s=t.items_per_s,  # type: ignore[arg-type]
                                           timings=tuple(proto.Timing(batch_size=n, items_per_s=v)
                                                         for n, v in t.timings)) for t in pick.timings))
