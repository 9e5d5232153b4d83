"""One install of a desired state, walked through the install's states (agent.install.states) by its steps: one
step a state that is not final (``received``: decide; ``downloading``: fetch and check the signed bundle;
``installing``: stage, load, self-test, warm up, then mirror to it or swap it in), each ending in an event, and
one function that moves the install (:meth:`InstallRun.move`: the table's move, the fleet's report). What an
install remembers across installs (failed bundles, the newest rollout, what is not serving) is the
:class:`~edgefleet.agent.install.job.Installer`'s; how a version is loaded and tuned here too."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...engines import Engine
from ...protocol import mqtt as proto
from ...protocol.errors import ContractError
from ...protocol.manifest import Manifest
from ...protocol.window import MaintenanceWindow
from ..core.batching.settings import BatchSettings
from ..core.batching.tuning import BatchTuning
from ..core.shadow import PipelineShadow, ShadowMirror
from ..errors import BackendError, FetchError, RefusedUpdate, SelfTestFailed, TrustError, UpdateError
from ..link.resume import DownloadProgress
from .job import Installer
from .selftest import self_test, warm_up
from .states import (
    FINAL,
    REPORTED,
    TRANSITIONS,
    Event,
    InstallEvent,
    InstallState,
    next_state,
)
from .store import StagedModel
from .trusted import Decision, decide
from .window import wait_for_window

if TYPE_CHECKING:
    from ..core.pipeline import PipelineStages

__all__ = ["InstallRun", "Ready"]

log = logging.getLogger("edgefleet.agent")


@dataclass(frozen=True)
class Ready:
    """A version loaded and checked, ready to mirror to or swap in."""

    manifest: Manifest
    backend: Engine  # its first engine
    measured: proto.SelfTestResult
    settings: BatchSettings | None
    tuning: BatchTuning | None
    serving: proto.ServingChoice
    stages: PipelineStages | None  # a pipeline's


@dataclass
class InstallRun:
    """One install, from its desired state to its final state: what it holds on the way, and its steps."""

    job: Installer
    desired: proto.DesiredState
    t0: float = field(default_factory=time.monotonic)  # when it was taken up
    fetched: Any = None  # the fetcher's answer once downloaded (None: superseded)
    staged: StagedModel | None = None  # its files in the store until committed (discarded on failure)
    loaded: list[Engine] = field(default_factory=list)  # its engines, closed on failure until the host owns them
    bundle_fault: bool = False  # the signed bundle is here and not yet checked: a failure now is the bundle's
    fetching: bool = False  # the fetcher may hold files of it (cleaned when the install ends)

    @property
    def shadow(self) -> bool:
        """Loaded in shadow: mirrored to, serving nothing."""
        return self.desired.mode == "shadow"

    @property
    def profile(self) -> str:
        """The hardware profile its target names."""
        return self.desired.target.rsplit("/", 1)[-1].removesuffix(".tar")

    def walk(self) -> InstallState:
        """Walk the desired state through the install's states (agent.install.states): each state's step ends in
        an event, :meth:`move` takes the install to the state the table says and reports it; the walk ends in a
        final state (installed, shadowing, failed, or ignored) -> that state."""
        steps: dict[InstallState, Callable[[], Event]] = {
            InstallState.RECEIVED: self.decide, InstallState.DOWNLOADING: self.download,
            InstallState.INSTALLING: self.load_and_swap}
        state = InstallState.RECEIVED
        try:
            for _ in range(len(TRANSITIONS)):  # the table has no cycle: a walk passes each state at most once
                if state in FINAL:
                    break
                state = self.move(state, steps[state]())
        finally:
            self.end_fetch()
        return state

    def move(self, state: InstallState, event: Event) -> InstallState:
        """The one place an install changes state: the move checked against the table (agent.install.states), the
        fetcher's files cleaned once the install ends, the new state reported when the fleet has a name for it."""
        new = next_state(state, event.kind)
        if new in FINAL:
            self.end_fetch()
        if new in REPORTED:
            self.job.report(new, self.desired, error=event.error, install_s=event.install_s, selftest=event.selftest,
                        serving=event.serving)
        return new

    def end_fetch(self) -> None:
        if self.fetching:
            self.fetching = False
            fetcher = self.job.fetcher()
            if fetcher is not None:
                fetcher.clean()

    def decide(self) -> Event:
        """``received``: already shadowing it, a stale replay of an older rollout, the version serving (kept),
        refused (trust, profile, failed here before), or accepted (downloading next)."""
        d = self.desired
        sh = self.job.host.shadow
        held = self.shadow and sh is not None and (sh.manifest.name, sh.manifest.version) == (d.model, d.version)
        if not held:  # any other desired state ends a shadow; the install of the bundle it ran keeps its files
            promoted = not self.shadow and sh is not None and sh.staged is not None \
                and sh.staged.bundle_sha256 == d.sha256
            self.job.drop_shadow(keep_files=promoted)
        if held:
            event = Event(InstallEvent.SHADOW_HELD)  # already shadowing it (a re-sent desired state)
        elif d.rollout_id is not None and self.job.max_rollout is not None and d.rollout_id < self.job.max_rollout:
            log.warning("ignored desired state of rollout %s: rollout %s is newer", d.rollout_id, self.job.max_rollout)
            event = Event(InstallEvent.STALE)
        else:
            if d.rollout_id is not None:
                self.job.max_rollout = d.rollout_id
            cur = self.job.store.current
            decision = decide(self.job.store.trusted, cur.installed if cur else None, d.model, d.version, d.sha256,
                              self.profile, self.job.config.profiles, frozenset(self.job.failed))
            if decision.action == "install" and self.job.store.trusted_error is not None:
                decision = Decision("refuse", self.job.store.trusted_error)
            if decision.action == "keep":
                event = Event(InstallEvent.KEPT)
            elif decision.action == "refuse":
                reason = self.job.failed.get(d.sha256, decision.reason) if "already failed" in decision.reason \
                    else decision.reason
                log.error("refused %s %s: %s", d.model, d.version, reason)
                event = Event(InstallEvent.REFUSED, error=reason)
            else:
                log.info("%s %s %s (rollout %s)", "loading in shadow" if self.shadow else "installing", d.model,
                         d.version, d.rollout_id)
                event = Event(InstallEvent.ACCEPTED)
        return event

    def download(self) -> Event:
        """``downloading``: the signed bundle fetched (with retries) and checked against the desired state."""
        d = self.desired
        self.fetching = True
        try:
            self.fetched = self.job.fetch_with_retries(d, self.profile)
            if self.fetched is not None:
                self.bundle_fault = True  # the signed bundle is here: from now on a failure is the bundle's
                signed = self.fetched.custom
                said = (d.model, d.version, self.profile)
                if (signed.name, signed.version, signed.profile) != said:
                    raise TrustError(f"signed target says {signed.name} {signed.version} {signed.profile}, "
                                     f"desired state says {' '.join(said)}")
            if self.fetched is not None and d.install_window is not None and not self.shadow \
                    and not self.in_window(d.install_window):
                self.fetched = None  # downloaded, and superseded (or stopping) before its window opened
            # None: superseded by a newer desired state, or stopping
            event = Event(InstallEvent.FETCHED if self.fetched is not None else InstallEvent.SUPERSEDED)
        except (UpdateError, ContractError, OSError) as exc:
            self.forget(exc)
            event = Event(InstallEvent.BROKE, error=str(exc))
        return event

    def in_window(self, window: MaintenanceWindow) -> bool:
        """Wait, downloaded, until the time this box trusts is inside its maintenance window (agent.install.window);
        False when stopping or superseded meanwhile."""
        fetcher = self.job.fetcher()
        if fetcher is None:
            raise FetchError("not connected to the fleet: no trusted time to judge the maintenance window on")
        n = self.fetched.length
        fetcher.progress = DownloadProgress(self.desired.target, n, n, 0.0, 0.0, 0)  # telemetry: whole, waiting
        try:
            return wait_for_window(window, lambda: fetcher.clock.reading().trusted, self.job.stop,
                                   self.job.desired_pending)
        finally:
            fetcher.progress = None

    def load_and_swap(self) -> Event:
        """``installing``: the bundle staged, loaded, self-tested and warmed up beside the version serving, then
        mirrored to (shadow) or committed and swapped in."""
        try:
            ready = self.load_checked()
            self.bundle_fault = False
            if self.shadow:
                self.start_shadow(ready)
                event = Event(InstallEvent.SHADOW_STARTED, selftest=ready.measured)
            else:
                self.swap_in(ready)
                install_s = time.monotonic() - self.t0
                log.info("installed %s %s in %.2fs", self.desired.model, self.desired.version, install_s)
                event = Event(InstallEvent.SWAPPED, install_s=round(install_s, 3), selftest=ready.measured,
                              serving=ready.serving)
        except (UpdateError, ContractError, OSError) as exc:
            self.forget(exc)
            event = Event(InstallEvent.BROKE, error=str(exc))
        return event

    def load_checked(self) -> Ready:
        """Stage the fetched bundle, check it names what was asked and fits this CPU, load it (a pipeline: both
        stages; else the precision faster here, ``instances`` engines), self-test and warm it up in turns with the
        version serving, and choose its batch sizes."""
        d = self.desired
        self.staged = staged = self.job.store.stage(self.fetched.path, self.fetched.sha256)
        m = staged.manifest
        if (m.name, m.version, m.profile) != (d.model, d.version, self.profile):
            raise TrustError(f"bundle manifest says {m.name} {m.version} {m.profile}, "
                             f"expected {d.model} {d.version} {self.profile}")
        self.job.require_cpu(self.profile, m.cpu_features)
        if self.shadow:
            self.job.check_shadow(m)
        if m.pipeline is not None:  # both stages loaded, each self-tested, then the end-to-end self-test
            stages = self.job.prepare_pipeline(staged)
            self.loaded = stages.engines
            if self.shadow:
                self.job.check_shadow(m, stages.size)
            ready = Ready(m, self.loaded[0], stages.selftest, None, None, self.job.pipeline_serving(m, stages), stages)
        else:
            pick = self.job.pick_precision(staged)  # a bundle with several precisions: the faster on this CPU
            self.staged = staged = pick.staged
            m = staged.manifest
            self.loaded = self.job.load_instances(m, staged.directory)
            backend = self.loaded[0]
            # the old version serves all along: the new one is loaded, self-tested and warmed up first, in turns
            # with the old one's batches
            turn = self.job.turn(m.name, len(self.loaded))
            measured = self_test(backend, staged, turn)
            warm_up(self.loaded, staged, self.job.warm_batch_sizes(), turn)
            settings, tuning = (None, None) if self.shadow else self.job.tune_batches(backend, staged, turn)
            ready = Ready(m, backend, measured, settings, tuning,
                           self.job.serving_choice(pick, settings, tuning, len(self.loaded)), None)
        return ready

    def start_shadow(self, ready: Ready) -> None:
        """Serve nothing from it: mirror live requests to it and report how it agrees."""
        m, staged = ready.manifest, self.staged
        mirror: ShadowMirror
        if ready.stages is not None:  # its end answers against the serving pipeline's (one instance a stage)
            mirror = PipelineShadow(m, ready.stages, self.job.config.shadow_sample_rate, staged)
            keep = {id(mirror.backend), id(mirror.reader)}
        else:
            mirror = ShadowMirror(m, ready.backend, self.job.config.shadow_sample_rate, staged)
            keep = {id(ready.backend)}
        for extra in self.loaded:
            if id(extra) not in keep:
                extra.close()
        self.job.host.start_shadow(mirror)
        self.loaded, self.staged = [], None
        log.info("shadowing %s %s on %.0f%% of live requests", m.name, m.version,
                 100 * self.job.config.shadow_sample_rate)

    def swap_in(self, ready: Ready) -> None:
        """Commit the staged version and swap it in; the old one stays current if the swap fails."""
        assert self.staged is not None and self.job.loop is not None
        m = ready.manifest
        self.job.store.commit(self.staged, self.desired.rollout_id)  # the commit point; OSError (disk full) fails here
        self.staged = None
        new = ready.backend
        loaded_now, self.loaded = self.loaded, []  # from here the host may own them: never close one that may serve
        try:
            swap = self.job.host.swap(m, loaded_now, ready.settings, ready.tuning, ready.serving, ready.stages)
            asyncio.run_coroutine_threadsafe(swap, self.job.loop).result(timeout=120)
        except Exception as exc:
            current = self.job.host.current
            if current is None or current.backend is not new:  # not serving it: the old model stays current
                self.job.store.revert()
                raise UpdateError(f"could not swap the new model in: {exc!r}") from exc
            log.warning("the new model is serving; retiring the old one failed: %r", exc)
        self.job.unavailable.pop((m.name, m.version), None)

    def forget(self, exc: Exception) -> None:
        """An install that failed: remembered (a bundle's fault: never tried again), its engines closed, its
        staged files discarded."""
        d = self.desired
        if isinstance(exc, RefusedUpdate) or (
                self.bundle_fault and isinstance(exc, (TrustError, ContractError, SelfTestFailed, BackendError))):
            self.job.failed[d.sha256] = str(exc)
        log.error("install of %s %s failed: %s", d.model, d.version, exc)
        self.job.unavailable[(d.model, d.version)] = str(exc)
        for b in self.loaded:
            b.close()
        self.loaded = []
        if self.staged is not None:
            self.job.store.discard(self.staged)
            self.staged = None
