"""The agent daemon: serves the installed model locally and follows the fleet's desired state.

Threads: the asyncio loop (HTTP server, batcher), paho's network loop, the installer, the
telemetry recorder, the spool sender. Local serving never waits on the fleet: the agent starts
serving its last committed model before it has even found the broker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from agent.batcher import BatchSettings
from agent.config import AgentConfig
from agent.enroll import mqtt_security
from agent.errors import BackendError, FetchError, RefusedUpdate, SelfTestFailed, TrustError, UpdateError
from agent.image import ImageLimits
from agent.link import MqttLink
from agent.metrics import Metrics
from agent.server import IndexEntry, ModelHost, create_app
from agent.shadow import ShadowMirror
from agent.spool import Spool
from agent.store import ModelStore, StagedModel
from agent.telemetry import DeviceSampler, DeviceStats
from agent.trusted import Decision, check_cpu, decide
from agent.updater import BundleFetcher
from engines import Engine, EngineError, load_bundle_engine
from protocol import mqtt as proto
from protocol.cpu import cpu_features
from protocol.errors import ConfigError, ContractError
from protocol.manifest import Manifest
from protocol.profile import load_profile

__all__ = ["Agent", "event_loop_factory", "install_unit", "render_unit", "run_agent", "run_until_stopped", "sd_notify",
           "self_test"]

log = logging.getLogger("edgefleet.agent")
WARMUP_RUNS = 3


_T = TypeVar("_T")
Turn = Callable[..., Any]  # runs fn(*args) in its turn on the model's cores: ComputeGate.call, bound to a loop


def _now(fn: Callable[..., _T], *args: Any) -> _T:
    return fn(*args)


def self_test(backend: Engine, staged: StagedModel, turn: Turn = _now) -> proto.SelfTestResult:
    """Run the bundle's own sample; outputs must match what the compiler recorded. Returns the figures
    measured on this device's CPU, for the install report. Each run goes through ``turn`` (while another
    version serves: between its batches)."""
    path = staged.directory / staged.manifest.selftest
    try:
        with np.load(path, allow_pickle=False) as npz:
            feeds = {s.name: npz[f"input:{s.name}"] for s in backend.inputs}
            expected = [npz[f"expected:{s.name}"] for s in backend.outputs]
            labels = npz["labels"] if "labels" in npz.files else None
    except (KeyError, ValueError, OSError) as exc:
        raise SelfTestFailed(f"self-test sample {path.name} is unreadable: {exc}") from exc
    try:
        for _ in range(WARMUP_RUNS):
            got = turn(backend.infer, feeds)
    except Exception as exc:  # the runtime's own error types
        raise SelfTestFailed(f"self-test: the engine failed on its own sample: {exc}") from exc
    drift = 0.0
    for spec, g, e in zip(backend.outputs, got, expected, strict=True):
        if g.shape != e.shape:
            raise SelfTestFailed(f"self-test: output {spec.name!r} has shape {g.shape}, expected {e.shape}")
        if not np.isfinite(g).all():
            raise SelfTestFailed(f"self-test: output {spec.name!r} has NaN or infinite values on this device's CPU")
        tol = 1e-3 + 0.02 * float(np.abs(e).max(initial=0.0))
        diff = float(np.abs(g.astype(np.float64) - e.astype(np.float64)).max(initial=0.0))
        drift = max(drift, diff / tol)
        if not diff <= tol:
            raise SelfTestFailed(f"self-test: output {spec.name!r} differs by {diff:.4g} (tolerance {tol:.4g}) "
                                 "on this device's CPU")
        if e.ndim == 2 and not np.array_equal(g.argmax(1), e.argmax(1)):
            raise SelfTestFailed(f"self-test: output {spec.name!r} ranks classes differently from the build")
    first, want = got[0], expected[0]
    classes = first.ndim == 2 and len(first) > 0 and backend.outputs[0].batch_axis == 0
    axis = backend.inputs[0].batch_axis if backend.inputs else None
    sample = feeds[backend.inputs[0].name] if backend.inputs else first
    return proto.SelfTestResult(
        samples=int(sample.shape[axis]) if axis is not None and sample.ndim > axis else 1,
        top1=float((first.argmax(1) == labels).mean()) if classes and labels is not None
        and labels.shape == (len(first),) else None,
        top1_agreement=float((first.argmax(1) == want.argmax(1)).mean()) if classes else None,
        drift=round(drift, 4))


def warm_up(backends: list[Engine], staged: StagedModel, batch_sizes: tuple[int, ...], turn: Turn = _now) -> None:
    """Run every instance once at each batch size the batcher will form that its backend wants warmed
    (``Engine.warm_up_sizes``), on the bundle's own sample, before the version takes traffic: the first
    call at a new shape can be costly (LiteRT tensor resizes, TensorRT shape setup) and would otherwise
    land on a client's request. Each call goes through ``turn``."""
    path = staged.directory / staged.manifest.selftest
    try:
        with np.load(path, allow_pickle=False) as npz:
            sample = {s.name: npz[f"input:{s.name}"] for s in staged.manifest.inputs}
    except (KeyError, ValueError, OSError) as exc:
        raise SelfTestFailed(f"warm-up: self-test sample {path.name} is unreadable: {exc}") from exc
    axes = {s.name: s.batch_axis for s in staged.manifest.inputs}
    batchable = staged.manifest.batchable
    for b in backends:
        for n in b.warm_up_sizes(batch_sizes) if batchable else (None,):
            feeds = {k: v if (a := axes[k]) is None or n is None else
                     np.ascontiguousarray(np.take(v, np.arange(n) % v.shape[a], axis=a)) for k, v in sample.items()}
            try:
                turn(b.infer, feeds)
            except Exception as exc:  # the runtime's own error types
                raise SelfTestFailed(f"warm-up at batch size {n}: the engine failed: {exc}") from exc


CRASH_ENV = "EDGEFLEET_TEST_CRASH_AT"


def sd_notify(message: str) -> bool:
    """Tell systemd (``Type=notify`` units) about the service: "READY=1", "STOPPING=1", "STATUS=...". A no-op
    outside systemd (no ``$NOTIFY_SOCKET``). Returns whether the message was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or address[0] not in "/@":
        return False
    if address[0] == "@":  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(address)
            s.sendall(message.encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def _crash_hook():
    """Test hook: with EDGEFLEET_TEST_CRASH_AT=<point> the process dies (os._exit, no clean-up, like a
    power cut) when the model store reaches that point: extracted, moved, before_commit, after_commit."""
    import os

    point = os.environ.get(CRASH_ENV)
    if not point:
        return None

    def crash(at: str) -> None:
        if at == point:
            print(f"{CRASH_ENV}={point}: crashing now", file=sys.stderr, flush=True)
            os._exit(137)

    return crash


def _device_summary(st: DeviceStats | None) -> proto.DeviceSummary | None:
    if st is None:
        return None
    temps = [t for t in st.temperatures_c.values() if math.isfinite(t)]
    return proto.DeviceSummary(cpu_percent=round(st.cpu_percent, 1), memory_used_mb=round(st.memory_used_mb, 1),
                               memory_total_mb=round(st.memory_total_mb, 1),
                               temperature_c=round(max(temps), 1) if temps else None)


TOFU_ROOT = Path("tuf/metadata/root.json")  # under data_dir: the root this device trusts once it has one


def require_trust_anchor(config: AgentConfig) -> None:
    """ConfigError unless the agent has something to anchor trust in: a root given, a root it already holds,
    or trust on first use asked for out loud."""
    if config.trusted_root is not None or config.trust_on_first_use or (config.data_dir / TOFU_ROOT).exists():
        return
    raise ConfigError(
        "no trusted root: pass --trusted-root PATH (the root.json that 'edgefleet keys init' or 'edgefleet keys "
        "create' wrote; key trusted_root in --config), or --trust-on-first-use (key trust_on_first_use: true) to "
        f"trust whatever root {config.fleet_url} serves the first time this device connects (anyone who can "
        f"answer for that address then, can sign its models); {config.data_dir / TOFU_ROOT} does not exist yet")


class Agent:
    def __init__(self, config: AgentConfig):
        require_trust_anchor(config)
        self.config = config
        self.metrics = Metrics()
        self.host = ModelHost(BatchSettings(max_batch_size=config.max_batch_size,
                                            max_queue_delay_us=config.max_queue_delay_us,
                                            queue_timeout_s=config.queue_timeout_ms / 1000,
                                            max_queue_size=config.max_queue_size), self.metrics)
        self.store = ModelStore(config.data_dir / "store", fault=_crash_hook())
        self.spool = Spool(config.data_dir / "spool", config.max_spool_records)
        self.link: MqttLink | None = None
        self.fetcher: BundleFetcher | None = None
        self.inference_url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._desired: proto.DesiredState | None = None
        self._desired_lock = threading.Lock()
        self._desired_event = threading.Event()
        self._failed: dict[str, str] = {}  # bundle sha256 -> why it failed (bundle faults only)
        self._max_rollout: int | None = None  # desired states from older rollouts are stale replays
        self._threads: list[threading.Thread] = []
        self._server: Any = None
        self.ready = threading.Event()  # HTTP is listening (for tests and the demo)
        self.device_stats: DeviceStats | None = None  # the latest sample of the box itself
        self._unavailable: dict[tuple[str, str], str] = {}  # (model, version) -> why it is not serving

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        import uvicorn

        self._loop = asyncio.get_running_loop()
        self.store.recover()
        self.host.index = self._index
        # every model on disk, the one installed last last (it is "current" for the fleet): its active version,
        # else the previous one; the store changes (and forgets the failed one) only once a fallback actually
        # loaded: a broken runtime must not cost both versions
        slots = self.store.active()
        primary = self.store.current.installed.name if self.store.current else None
        for name in sorted(slots, key=lambda n: n == primary):
            for which, entry in zip(("current", "previous"), slots[name], strict=True):
                if entry is None:
                    continue
                try:
                    manifest = self.store.load_manifest(entry, verify=False)
                    self._require_cpu(manifest.profile, manifest.cpu_features)  # the disk may have moved boxes
                    backends = await self._loop.run_in_executor(
                        None, self._load_instances, manifest, self.store.models_dir / entry.directory)
                except (UpdateError, ContractError) as exc:
                    log.error("could not load the %s model %s: %s", which, entry.directory, exc)
                    self._unavailable[(entry.installed.name, entry.installed.version)] = str(exc)
                    continue
                await self.host.swap(manifest, backends)
                if which == "previous":
                    log.error("serving the previous model %s; the committed one would not load", entry.directory)
                    if name == primary:
                        self.store.revert()
                    else:
                        self.store.rollback(name)
                break
        if self.store.current is not None:
            self._max_rollout = self.store.current.rollout_id
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the
        # listening socket says so; without it keep-alive responses stall ~40 ms (Nagle + delayed ACK)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.http_host, self.config.http_port))
        sock.listen(2048)  # connections queue from here on, so READY below is true before uvicorn's first accept
        port = sock.getsockname()[1]
        self.inference_url = f"http://{self.config.http_host}:{port}"
        app = create_app(self.host, self.config.max_body_bytes, self.config.device_id,
                         self.config.max_inflight_body_bytes, ImageLimits(
                             self.config.max_image_decoded_bytes, self.config.max_concurrent_image_decodes,
                             self.config.queue_timeout_ms / 1000))
        # on SIGTERM uvicorn stops accepting, lets the requests in flight finish (their batches still run: the
        # batchers close only after it returns), then waits for the connections for at most the grace period
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=math.ceil(self.config.shutdown_grace_s)))
        self._server = server
        for target, name in ((self._connect_and_follow, "fleet-link"), (self._install_loop, "installer"),
                             (self._telemetry_loop, "telemetry")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        cur = self.host.current
        serving = f"{cur.manifest.name} {cur.manifest.version}" if cur else "no model yet"
        print(f"edgefleet agent {self.config.device_id}: KServe v2 on {self.inference_url} ({serving}); "
              f"following {self.config.fleet_url}", file=sys.stderr, flush=True)
        self.ready.set()
        self._own_signals()
        sd_notify(f"READY=1\nSTATUS=serving {serving} on {self.inference_url}")
        try:
            await server.serve(sockets=[sock])
        finally:
            sd_notify("STOPPING=1")
            log.info("stopping: in-flight requests are done; closing the models and the fleet link")
            self._stop.set()
            self._desired_event.set()
            if self.link is not None:
                await self._loop.run_in_executor(None, self.link.stop)
            for t in self._threads:
                await self._loop.run_in_executor(None, t.join, 5)
            await self.host.close()

    def _own_signals(self) -> None:
        """SIGTERM and SIGINT stop the agent gracefully. uvicorn catches them while it serves and raises them
        again once it has finished the requests in flight; with the default handler that second delivery
        would kill the process before the models are closed and the fleet link says goodbye, so the handler
        uvicorn restores is this one, which only asks for a stop."""
        if threading.current_thread() is not threading.main_thread():
            return  # tests run the agent in a thread; signals belong to the main one

        def handle(signum: int, frame: object) -> None:
            self.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handle)

    def request_stop(self) -> None:
        """Ask a running agent (from any thread) to shut down as on SIGTERM."""
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True

    # -- fleet connection -----------------------------------------------------------------------
    def _get_json(self, url: str, timeout_s: float = 5.0) -> Any:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.loads(r.read(1024 * 1024))

    def _connect_and_follow(self) -> None:
        delay = 1.0
        while not self._stop.is_set():
            try:
                boot = self._get_json(f"{self.config.fleet_url}/api/v1/bootstrap")
                root_bytes = None
                if (self.config.trusted_root is None and self.config.trust_on_first_use
                        and not (self.config.data_dir / TOFU_ROOT).exists()):
                    with urllib.request.urlopen(f"{boot['tuf_metadata_url']}1.root.json", timeout=5) as r:
                        root_bytes = r.read(512 * 1024)
                    log.warning("--trust-on-first-use: trusting the root.json %s serves now", self.config.fleet_url)
                self.fetcher = BundleFetcher(self.config.data_dir / "tuf", boot["tuf_metadata_url"],
                                             boot["tuf_targets_url"], self.config.trusted_root, root_bytes,
                                             self.config.download_grace_s, self.config.download_min_bytes_per_s)
                mqtt_url = self.config.mqtt_url or boot["mqtt_url"]
                security = mqtt_security(self.config, bool(boot.get("mqtt_auth", False)))
                break
            except ConfigError as exc:  # only a person can fix it (a token, credentials): say so, keep serving
                log.error("not connecting to the fleet's broker: %s", exc)
                self._stop.wait(delay)
                delay = min(delay * 2, 300.0)
                continue
            except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
                log.warning("fleet %s not reachable (%s); retrying in %.0fs", self.config.fleet_url, exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)
            except TrustError as exc:
                log.error("%s", exc)
                return
        else:
            return
        self.link = MqttLink(self.config.device_id, mqtt_url, self.spool, self.inference_url, self._on_desired,
                             security=security)
        self.link.start()

    def _on_desired(self, desired: proto.DesiredState) -> None:
        with self._desired_lock:
            held = self._desired
            if (held is not None and held.rollout_id is not None and desired.rollout_id is not None
                    and desired.rollout_id < held.rollout_id):
                log.warning("ignored desired state of rollout %s: rollout %s arrived first", desired.rollout_id,
                            held.rollout_id)
                return
            self._desired = desired
        self._desired_event.set()

    def _report(self, state: str, desired: proto.DesiredState | None, error: str | None = None,
                install_s: float | None = None, selftest: proto.SelfTestResult | None = None) -> None:
        if self.link is None:
            return
        cur = self.store.current
        msg = proto.ReportedState(
            device_id=self.config.device_id, ts=time.time(), state=state,  # type: ignore[arg-type]
            rollout_id=desired.rollout_id if desired else None,
            model=desired.model if desired else None, version=desired.version if desired else None,
            running_model=cur.installed.name if cur else None, running_version=cur.installed.version if cur else None,
            error=error, install_s=install_s, selftest=selftest)
        self.link.report(msg)

    # -- installing -----------------------------------------------------------------------------
    def _install_loop(self) -> None:
        while not self._stop.is_set():
            if not self._desired_event.wait(timeout=1.0):
                continue
            self._desired_event.clear()
            with self._desired_lock:
                desired = self._desired
            if desired is not None and not self._stop.is_set():
                try:
                    self.install(desired)
                except Exception as exc:  # keep serving whatever happens
                    log.exception("install failed unexpectedly")
                    self._report("failed", desired, error=f"internal error: {exc}")

    def _drop_shadow(self) -> None:
        sh, self.host.shadow = self.host.shadow, None
        if sh is not None:
            sh.close()
            if sh.staged is not None:
                self.store.discard(sh.staged)
            log.info("dropped the shadow of %s %s", sh.manifest.name, sh.manifest.version)

    def install(self, desired: proto.DesiredState) -> None:
        t0 = time.monotonic()
        shadow = desired.mode == "shadow"
        if not shadow or (self.host.shadow is not None and (self.host.shadow.manifest.name,
                                                            self.host.shadow.manifest.version)
                          != (desired.model, desired.version)):
            self._drop_shadow()  # any other desired state ends a shadow
        elif self.host.shadow is not None:
            self._report("shadowing", desired)  # already shadowing it (a re-sent desired state)
            return
        if desired.rollout_id is not None:
            if self._max_rollout is not None and desired.rollout_id < self._max_rollout:
                log.warning("ignored desired state of rollout %s: rollout %s is newer", desired.rollout_id,
                            self._max_rollout)
                return
            self._max_rollout = desired.rollout_id
        cur = self.store.current
        profile = desired.target.rsplit("/", 1)[-1].removesuffix(".tar")
        decision = decide(self.store.trusted, cur.installed if cur else None, desired.model, desired.version,
                          desired.sha256, profile, self.config.profiles, frozenset(self._failed))
        if decision.action == "install" and self.store.trusted_error is not None:
            decision = Decision("refuse", self.store.trusted_error)
        if decision.action == "keep":
            self._report("installed", desired)
            return
        if decision.action == "refuse":
            reason = self._failed.get(desired.sha256, decision.reason) if "already failed" in decision.reason \
                else decision.reason
            log.error("refused %s %s: %s", desired.model, desired.version, reason)
            self._report("failed", desired, error=reason)
            return
        log.info("%s %s %s (rollout %s)", "loading in shadow" if shadow else "installing", desired.model,
                 desired.version, desired.rollout_id)
        self._report("downloading", desired)
        staged: StagedModel | None = None
        backend: Engine | None = None
        loaded: list[Engine] = []  # instances of the new version, closed on failure until the host owns them
        bundle_fault = False  # True once the signed bundle is here: from then on a failure is the bundle's
        try:
            fetched = self._fetch_with_retries(desired, profile)
            if fetched is None:
                return  # superseded by a newer desired state, or stopping
            bundle_fault = True
            signed = fetched.custom
            said = (desired.model, desired.version, profile)
            if (signed.get("name"), signed.get("version"), signed.get("profile")) != said:
                raise TrustError(f"signed target says {signed.get('name')} {signed.get('version')} "
                                 f"{signed.get('profile')}, desired state says {' '.join(said)}")
            self._report("installing", desired)
            staged = self.store.stage(fetched.path, fetched.sha256)
            m = staged.manifest
            if (m.name, m.version, m.profile) != (desired.model, desired.version, profile):
                raise TrustError(f"bundle manifest says {m.name} {m.version} {m.profile}, "
                                 f"expected {desired.model} {desired.version} {profile}")
            self._require_cpu(profile, m.cpu_features)
            loaded = self._load_instances(m, staged.directory)
            backend = loaded[0]
            # the old version serves all along: the new one is loaded, self-tested and warmed up first, in
            # turns with the old one's batches
            turn = self._turn(m.name, len(loaded))
            measured = self_test(backend, staged, turn)
            warm_up(loaded, staged, self._warm_batch_sizes(), turn)
            bundle_fault = False
            if shadow:  # serve nothing from it: mirror live requests to it and report how it agrees
                for extra in loaded[1:]:
                    extra.close()
                self.host.shadow = ShadowMirror(m, backend, self.config.shadow_sample_rate, staged)
                loaded, backend, staged = [], None, None
                self._report("shadowing", desired, selftest=measured)
                log.info("shadowing %s %s on %.0f%% of live requests", m.name, m.version,
                         100 * self.config.shadow_sample_rate)
                return
            self.store.commit(staged, desired.rollout_id)  # the commit point; OSError (disk full) fails here
            staged = None
            assert self._loop is not None
            new = backend
            backend = None  # from here the host may own it; never close a backend that might be serving
            loaded_now, loaded = loaded, []
            try:
                asyncio.run_coroutine_threadsafe(self.host.swap(m, loaded_now), self._loop).result(timeout=120)
            except Exception as exc:
                serving = self.host.current
                if serving is None or serving.backend is not new:  # not serving it: the old model stays current
                    self.store.revert()
                    raise UpdateError(f"could not swap the new model in: {exc!r}") from exc
                log.warning("the new model is serving; retiring the old one failed: %r", exc)
            self._unavailable.pop((m.name, m.version), None)
        except (UpdateError, ContractError, OSError) as exc:
            if isinstance(exc, RefusedUpdate) or (
                    bundle_fault and isinstance(exc, (TrustError, ContractError, SelfTestFailed, BackendError))):
                self._failed[desired.sha256] = str(exc)
            log.error("install of %s %s failed: %s", desired.model, desired.version, exc)
            self._unavailable[(desired.model, desired.version)] = str(exc)
            for b in loaded:
                b.close()
            if staged is not None:
                self.store.discard(staged)
            self._report("failed", desired, error=str(exc))
            return
        finally:
            if self.fetcher is not None:
                self.fetcher.clean()
        self._report("installed", desired, install_s=round(time.monotonic() - t0, 3), selftest=measured)
        log.info("installed %s %s in %.2fs", desired.model, desired.version, time.monotonic() - t0)

    # -- model lifecycle ------------------------------------------------------------------------
    def _load_instances(self, manifest: Manifest, directory: Path) -> list[Engine]:
        """``instances`` loaded engines of one model version (each its own runtime session/interpreter)."""
        out: list[Engine] = []
        try:
            for _ in range(self.config.instances):
                out.append(load_bundle_engine(manifest, directory / manifest.engine, self.config.intra_op_threads,
                                              self.config.onnxruntime_providers))
        except BaseException as exc:
            for b in out:
                b.close()
            if isinstance(exc, EngineError):  # the engine cannot run here: the update fails, the old model serves
                raise BackendError(str(exc)) from exc
            raise
        return out

    def _turn(self, name: str, instances: int) -> Turn:
        """Run a call on model ``name``'s cores in turn with the version serving it (if the loop runs)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return _now
        gate = self.host.gate(name, instances)
        return lambda fn, *args: gate.call(loop, fn, *args)

    def _warm_batch_sizes(self) -> tuple[int, ...]:
        s = self.host.settings
        return tuple(sorted({1, s.max_batch_size, *s.preferred_batch_sizes}))

    def _index(self) -> list[IndexEntry]:
        """Versions on disk and versions that failed, for the repository index (serving ones are added by
        the host as READY)."""
        out = []
        for name, (active, prev) in self.store.active().items():
            out.append(IndexEntry(name, active.installed.version, "UNAVAILABLE", "installed; not loaded"))
            if prev is not None:
                out.append(IndexEntry(name, prev.installed.version, "UNAVAILABLE",
                                      "previous version, kept for rollback"))
        # why a version failed says more than where it lies (later entries win)
        return out + [IndexEntry(n, v, "UNAVAILABLE", why) for (n, v), why in self._unavailable.items()]

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
        staged = StagedModel(manifest, directory, prev.installed.sha256)
        backends = await loop.run_in_executor(None, self._load_instances, manifest, directory)
        try:
            turn = self._turn(manifest.name, len(backends))
            await loop.run_in_executor(None, self_test, backends[0], staged, turn)
            await loop.run_in_executor(None, warm_up, backends, staged, self._warm_batch_sizes(), turn)
        except BaseException as exc:
            for b in backends:
                b.close()
            self._unavailable[(manifest.name, manifest.version)] = str(exc)
            log.error("rollback of %s to %s failed; %s keeps serving: %s", name, manifest.version,
                      slots[name][0].installed.version, exc)
            raise
        await loop.run_in_executor(None, self.store.rollback, name)  # writes and fsyncs: not on the loop
        await self.host.swap(manifest, backends)
        self._unavailable.pop((manifest.name, manifest.version), None)
        log.warning("rolled %s back to %s", name, manifest.version)
        return manifest

    @staticmethod
    def _require_cpu(profile: str, required: object) -> None:
        """Refuse a bundle whose (signed) CPU requirements this CPU does not meet."""
        if not isinstance(required, (list, tuple)) or not all(isinstance(f, str) for f in required):
            # a repository or manifest from before edgefleet recorded CPU features: what the profile
            # promises today, if this agent knows the profile, is the best evidence there is
            try:
                required = load_profile(profile).cpu_features
            except ContractError:  # a profile this agent does not know: nothing to check against
                return
        decision = check_cpu(profile, tuple(required), cpu_features())
        if decision.action == "refuse":
            raise RefusedUpdate(decision.reason)

    def _fetch_with_retries(self, desired: proto.DesiredState, profile: str):
        delay = 1.0
        attempt = 0
        while True:
            if self.fetcher is None:
                raise FetchError("not connected to the fleet yet")
            try:
                return self.fetcher.fetch(
                    desired.target, desired.sha256,
                    precheck=lambda custom: self._require_cpu(profile, custom.get("cpu_features")))
            except FetchError as exc:
                attempt += 1
                if attempt > self.config.install_retries:
                    raise
                log.warning("fetch attempt %d failed (%s); retrying in %.0fs", attempt, exc, delay)
                if self._stop.wait(delay) or self._desired_event.is_set():
                    return None
                delay = min(delay * 2, 30.0)

    # -- telemetry ------------------------------------------------------------------------------
    def _telemetry_loop(self) -> None:
        import psutil

        proc = psutil.Process()
        proc.cpu_percent(None)
        last = time.monotonic()
        sampler = DeviceSampler(self.config.data_dir, self.config.sysfs_root, self.config.tegrastats,
                                self.config.telemetry_interval_s)
        try:
            self._telemetry_until_stopped(proc, last, sampler)
        finally:
            sampler.close()

    def _telemetry_until_stopped(self, proc: Any, last: float, sampler: DeviceSampler) -> None:
        while not self._stop.wait(self.config.telemetry_interval_s):
            try:
                self.device_stats = sampler.sample()
            except Exception as exc:  # a sensor must never stop the agent's own figures
                log.warning("device telemetry failed: %s", exc)
            now = time.monotonic()
            snap = self.metrics.snapshot_and_reset()
            cur = self.host.current
            cpu = proc.cpu_percent(None)
            rss = proc.memory_info().rss / 2**20
            interval = now - last
            last = now

            def make(seq: int, snap=snap, cur=cur, cpu=cpu, rss=rss, interval=interval) -> bytes:
                return proto.encode(proto.Telemetry(
                    device_id=self.config.device_id, ts=time.time(), stream=self.spool.stream, seq=seq,
                    interval_s=round(interval, 3),
                    model=cur.manifest.name if cur else None, version=cur.manifest.version if cur else None,
                    requests=snap.requests, errors=snap.errors,
                    latency=proto.LatencySummary(p50_ms=snap.latency_p50_ms, p95_ms=snap.latency_p95_ms,
                                                 p99_ms=snap.latency_p99_ms, max_ms=snap.latency_max_ms),
                    batches=snap.batches, batch_size_mean=snap.batch_size_mean, batch_size_max=snap.batch_size_max,
                    cpu_percent=round(cpu, 1), rss_mb=round(rss, 1), dropped=self.spool.dropped or None,
                    device=_device_summary(self.device_stats),
                    shadow=self.host.shadow.figures() if self.host.shadow is not None else None))

            try:
                self.spool.append(make)
            except OSError as exc:
                log.error("could not spool telemetry: %s", exc)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (the agent extra installs it, except on Windows), else asyncio's own loop.
    The agent runs its own loop (uvicorn's ``loop="auto"`` applies only when uvicorn makes the loop): uvloop
    hands a finished batch back to the loop in about a third of the time after an idle spell (measured here:
    58 vs 192 us) and spends less per request on sockets."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_until_stopped(agent: Agent) -> None:
    """Run ``agent`` on the loop of :func:`event_loop_factory` until it stops (the daemon and the tests)."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(agent.run())


def run_agent(config: AgentConfig) -> None:
    run_until_stopped(Agent(config))


# -- running as a systemd service ---------------------------------------------------------------------------
SERVICE_NAME = "edgefleet-agent"
UNIT_TEMPLATE = "edgefleet-agent.service"  # package data beside this module


def _agent_command() -> str:
    """How systemd starts this installation's CLI: the ``edgefleet`` script of this environment, else
    ``python -m edgefleet`` (absolute paths: a unit has no PATH to search)."""
    exe = Path(sys.executable)
    script = exe.parent / "edgefleet"
    return str(script) if script.is_file() else f"{exe} -m edgefleet"


def render_unit(config_path: Path, config: AgentConfig, user: str = "edgefleet",
                supplementary_groups: tuple[str, ...] = ("video", "render")) -> str:
    """The systemd unit for an agent run with ``config_path`` (already validated into ``config``).
    ``supplementary_groups``: on a Jetson the GPU device nodes belong to ``video`` and ``render``."""
    from importlib import resources

    template = resources.files("agent").joinpath(UNIT_TEMPLATE).read_text(encoding="utf-8")
    data = config.data_dir.resolve()
    if data.is_relative_to("/var/lib") and data != Path("/var/lib"):
        # systemd creates it owned by User= and makes it writable despite ProtectSystem=strict
        access = f"StateDirectory={data.relative_to('/var/lib')}\nStateDirectoryMode=0750"
    else:
        access = f"ReadWritePaths={data}"
    for value, what in ((str(config_path), "config path"), (str(data), "data_dir"), (user, "user")):
        if any(c in value for c in "\n\r%$\\\"'") or " " in value:
            raise ConfigError(f"{what} {value!r} has characters a systemd unit would misread; use a plain path/name")
    fields = {"@NAME@": SERVICE_NAME, "@EXEC@": _agent_command(), "@CONFIG@": str(config_path), "@USER@": user,
              "@SUPPLEMENTARY_GROUPS@": f"SupplementaryGroups={' '.join(supplementary_groups)}"
              if supplementary_groups else "", "@STOP_TIMEOUT@": str(math.ceil(config.shutdown_grace_s) + 15),
              "@DATA_ACCESS@": access}
    for key, value in fields.items():
        template = template.replace(key, value)
    return template


def install_unit(unit_text: str, unit_dir: Path) -> Path:
    """Write the unit atomically into ``unit_dir`` (never runs systemctl)."""
    from protocol.fsutil import atomic_write

    if not unit_dir.is_dir():
        raise ConfigError(f"{unit_dir}: no such directory for the unit file")
    path = unit_dir / f"{SERVICE_NAME}.service"
    try:
        atomic_write(path, unit_text.encode())
        path.chmod(0o644)
    except PermissionError as exc:
        raise ConfigError(f"{path}: permission denied (run as root, or give --unit-dir)") from exc
    return path

