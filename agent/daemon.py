"""The agent daemon: serves the installed model locally and follows the fleet's desired state.

Threads: the asyncio loop (HTTP server, batcher), paho's network loop, the installer, the
telemetry recorder, the spool sender. Local serving never waits on the fleet: the agent starts
serving its last committed model before it has even found the broker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..protocol import mqtt as proto
from ..protocol.backoff import Backoff
from ..protocol.errors import ConfigError
from ..protocol.httpguard import HttpLimits, guarded
from ._compat import run_with_loop
from .config import AgentConfig
from .core.batching.dispatch import pin_thread
from .core.batching.settings import BatchSettings
from .core.host import ModelHost
from .core.metrics import Metrics
from .core.versions import VersionNumbers
from .errors import FetchError, TrustError
from .install.job import Installer
from .install.store import ModelStore
from .link.spool import Spool
from .systemd import sd_notify
from .transports.http import create_app, peer_tagging
from .transports.image import ImageLimits
from .transports.shm import SharedMemory

if TYPE_CHECKING:
    from ..protocol.manifest import Manifest
    from .link.fetch import FleetHttp
    from .link.mqtt import MqttLink
    from .link.telemetry import DeviceSampler, DeviceStats
    from .link.updater import BundleFetcher

# The serving start (issue 41: a restart serves in a second) imports what serving needs; the fleet link (TUF, MQTT,
# enrolment, telemetry sampling) and an install's steps are imported by their threads once the agent listens
# (tests/test_agent_start_imports.py names what stays off the start).

__all__ = ["Agent", "event_loop_factory", "require_trust_anchor", "run_agent", "run_until_stopped"]

log = logging.getLogger("edgefleet.agent")


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
        self.cpus = cpu_split(config.inference_cpus)  # (inference CPUs, the rest), or None: no pinning
        self.host = ModelHost(BatchSettings(max_batch_size=config.max_batch_size,
                                            max_queue_delay_us=config.max_queue_delay_us,
                                            queue_timeout_s=config.queue_timeout_ms / 1000,
                                            max_queue_size=config.max_queue_size,
                                            inline_max_us=config.inline_max_us), self.metrics,
                              self.cpus[0] if self.cpus else None,
                              VersionNumbers(config.data_dir / "version-numbers.json"))
        self.store = ModelStore(config.data_dir / "store")
        self.spool = Spool(config.data_dir / "spool", config.max_spool_records)
        self.link: MqttLink | None = None
        self.fetcher: BundleFetcher | None = None
        self.inference_url = ""
        self.grpc_port: int | None = None  # where gRPC listens, once it does
        self.local_socket: Path | None = None  # where the on-box socket listens, once it does
        self.shm = SharedMemory(config.max_shm_regions_per_client, config.max_shm_regions, config.max_shm_bytes,
                                config.shm_idle_timeout_s, max_read_bytes=config.max_body_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._desired: proto.DesiredState | None = None
        self._desired_lock = threading.Lock()
        self._desired_event = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: Any = None
        self.ready = threading.Event()  # HTTP is listening (for tests and the demo)
        self.device_stats: DeviceStats | None = None  # the latest sample of the box itself
        self.installer = Installer(config, self.store, self.host,
                                   lambda *a, **kw: self._report(*a, **kw),  # late-bound: tests may replace it
                                   lambda: self.fetcher, self._stop, self._desired_event.is_set)

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        import uvicorn

        self._loop = asyncio.get_running_loop()
        if self.cpus is not None:
            # the event loop (and the threads it starts) on the CPUs left; loading sessions (whose onnxruntime
            # threads inherit the loading thread's CPUs) and the inference threads on the inference CPUs
            pin_thread(self.cpus[1])
            self._loop.set_default_executor(ThreadPoolExecutor(max_workers=4, thread_name_prefix="agent-pinned",
                                                               initializer=pin_thread, initargs=(self.cpus[0],)))
        self.store.recover()
        self.host.set_index(self.installer.index)
        self.installer.loop = self._loop
        await self.installer.load_installed()
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
                             self.config.queue_timeout_ms / 1000, self.config.max_image_scans),
                         self.shm if self.shm.enabled else None)
        # on SIGTERM uvicorn stops accepting, lets the requests in flight finish (their batches still run: the
        # batchers close only after it returns), then waits for the connections for at most the grace period
        # http: uvicorn's own protocol, each connection's client told once (agent/transports/http.py: peer_tagging)
        # and held to the connection limits (protocol/httpguard.py)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        cfg = self.config
        limits = HttpLimits(head_timeout_s=cfg.http_head_timeout_s, idle_timeout_s=cfg.http_idle_timeout_s,
                            body_grace_s=cfg.http_head_timeout_s, max_connections=cfg.http_max_connections,
                            max_connections_per_peer=cfg.http_max_connections_per_peer or max(
                                1, cfg.http_max_connections // 2))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                               http=peer_tagging(guarded(HttpToolsProtocol, limits)),
                                               timeout_keep_alive=cfg.http_idle_timeout_s,  # type: ignore[arg-type]
                                               timeout_graceful_shutdown=math.ceil(self.config.shutdown_grace_s)))
        self._server = server
        grpc_server = None
        if self.config.grpc_port is not None:
            from .transports.grpc import GrpcServer, grpc_concurrency, grpc_limits

            grpc_server = GrpcServer(self.host, self.shm if self.shm.enabled else None, self.config.device_id,
                                     self.config.max_body_bytes,
                                     grpc_concurrency(self.config.max_inflight_body_bytes, self.config.max_body_bytes),
                                     grpc_limits(self.config))
            self.grpc_port = await grpc_server.start(self.config.http_host, self.config.grpc_port)
        local_server = None
        if self.config.local_socket is not None:  # the on-box socket (agent/transports/local.py)
            from .transports.local import LocalServer

            local_server = LocalServer(self.host, self.shm if self.shm.enabled else None, self.config.max_body_bytes,
                                       self.config.local_max_connections, self.config.local_max_inflight,
                                       self.config.max_inflight_body_bytes,
                                       max_connections_per_user=self.config.local_max_connections_per_user,
                                       idle_timeout_s=self.config.local_idle_timeout_s,
                                       frame_timeout_s=self.config.local_frame_timeout_s)
            self.local_socket = await local_server.start(self.config.data_dir / self.config.local_socket)
        sweeper = self._loop.create_task(self._sweep_shm())
        cur = self.host.current
        serving = f"{cur.manifest.name} {cur.manifest.version}" if cur else "no model yet"
        grpc_note = f" and grpc {self.config.http_host}:{self.grpc_port}" if grpc_server is not None else ""
        print(f"edgefleet agent {self.config.device_id}: KServe v2 on {self.inference_url}{grpc_note} ({serving}); "
              f"following {self.config.fleet_url}", file=sys.stderr, flush=True)
        # the fleet link, the installer and telemetry import their modules on their threads, from here on
        for target, name in ((self._connect_and_follow, "fleet-link"), (self._install_loop, "installer"),
                             (self._telemetry_loop, "telemetry")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.ready.set()
        self._own_signals()
        sd_notify(f"READY=1\nSTATUS=serving {serving} on {self.inference_url}")
        try:
            await server.serve(sockets=[sock])
        finally:
            sd_notify("STOPPING=1")
            sweeper.cancel()
            if grpc_server is not None:  # the requests in flight finish first (their batches still run)
                await grpc_server.stop(self.config.shutdown_grace_s)
            if local_server is not None:
                await local_server.stop(self.config.shutdown_grace_s)
            log.info("stopping: in-flight requests are done; closing the models and the fleet link")
            self._stop.set()
            self._desired_event.set()
            if self.link is not None:
                await self._loop.run_in_executor(None, self.link.stop)
            for t in self._threads:
                await self._loop.run_in_executor(None, t.join, 5)
            await self.host.close()
            self.shm.close()

    async def _sweep_shm(self) -> None:
        """Unregister shared-memory regions idle for longer than shm_idle_timeout_s."""
        while True:
            await asyncio.sleep(min(30.0, self.config.shm_idle_timeout_s / 2))
            if self.shm.sweep():
                log.info("unregistered idle shared-memory regions")

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
    def _http(self) -> FleetHttp:
        from .link.fetch import FetchLimits, FleetHttp

        c = self.config
        return FleetHttp(FetchLimits(c.download_deadline_s, c.download_grace_s, c.download_min_bytes_per_s,
                                     socket_timeout_s=min(30.0, c.download_deadline_s)))

    def _connect_and_follow(self) -> None:
        from .link.by_content import installed_files
        from .link.enroll import mqtt_security
        from .link.mqtt import MqttLink
        from .link.updater import BundleFetcher

        # every wait a full-jitter draw (protocol.backoff): boxes back from one outage do not ask at once
        unreachable, misconfigured = Backoff(1.0, 30.0), Backoff(1.0, 300.0)
        while not self._stop.is_set():
            try:
                boot = self._http().get_json(f"{self.config.fleet_url}/api/v1/bootstrap")
                root_bytes = None
                if (self.config.trusted_root is None and self.config.trust_on_first_use
                        and not (self.config.data_dir / TOFU_ROOT).exists()):
                    root_bytes = self._http().get_ok(f"{boot['tuf_metadata_url']}1.root.json", 512 * 1024)
                    log.warning("--trust-on-first-use: trusting the root.json %s serves now", self.config.fleet_url)
                self.fetcher = BundleFetcher(self.config.data_dir / "tuf", boot["tuf_metadata_url"],
                                             boot["tuf_targets_url"], self.config.trusted_root, root_bytes,
                                             self.config.download_grace_s, self.config.download_min_bytes_per_s,
                                             self.config.download_deadline_s, f"{self.config.fleet_url}/api/v1/time",
                                             self.config.clock_tolerance_s, self.config.download_max_bytes_per_s,
                                             lambda: installed_files(self.store.root / "models"))
                self._check_clock()
                mqtt_url = self.config.mqtt_url or boot["mqtt_url"]
                security = mqtt_security(self.config, bool(boot.get("mqtt_auth", False)), self._http())
                break
            except ConfigError as exc:  # only a person can fix it (a token, credentials): say so, keep serving
                log.error("not connecting to the fleet's broker: %s", exc)
                self._stop.wait(misconfigured.next_s())
                continue
            except (OSError, FetchError, ValueError, KeyError, TypeError) as exc:  # FetchError: an answer past bounds
                delay = unreachable.next_s()
                log.warning("fleet %s not reachable (%s); retrying in %.1fs", self.config.fleet_url, exc, delay)
                self._stop.wait(delay)
            except TrustError as exc:
                log.error("%s", exc)
                return
        else:
            return
        self.link = MqttLink(self.config.device_id, mqtt_url, self.spool, self.inference_url, self._on_desired,
                             security=security)
        self.link.start()

    def _check_clock(self) -> None:
        """The fleet's signed time, once on connecting: a skewed clock shows in telemetry before any update."""
        if self.fetcher is not None:
            try:
                self.fetcher.check_time()
            except (FetchError, TrustError) as exc:  # checked again, and required, before every update
                log.warning("no signed time from the fleet yet: %s", exc)

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
                install_s: float | None = None, selftest: proto.SelfTestResult | None = None,
                serving: proto.ServingChoice | None = None) -> None:
        if self.link is None:
            return
        cur = self.store.current
        msg = proto.ReportedState(
            device_id=self.config.device_id, ts=time.time(), state=state,  # type: ignore[arg-type]
            rollout_id=desired.rollout_id if desired else None,
            model=desired.model if desired else None, version=desired.version if desired else None,
            running_model=cur.installed.name if cur else None, running_version=cur.installed.version if cur else None,
            error=error, install_s=install_s, selftest=selftest, serving=serving)
        self.link.report(msg)

    # -- installing -----------------------------------------------------------------------------
    def _install_loop(self) -> None:
        if self.cpus is not None:  # loads, self-tests and warm-ups are compute: on the inference CPUs
            pin_thread(self.cpus[0])
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

    def install(self, desired: proto.DesiredState) -> None:
        """Install (or shadow) ``desired``; the running version serves until the new one is ready."""
        from .install.steps import InstallRun

        InstallRun(self.installer, desired).walk()

    async def rollback(self, name: str) -> Manifest:
        """Serve model ``name``'s previous version again (see Installer.rollback)."""
        return await self.installer.rollback(name)

    # -- telemetry ------------------------------------------------------------------------------
    def _telemetry_loop(self) -> None:
        import psutil

        from .link.telemetry import DeviceSampler

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
            drift = self.host.drift_counts(cur.manifest.name, cur.manifest.version) if cur else None
            stages = self.host.stage_figures(cur.manifest.name, cur.manifest.version) if cur else None
            last = now
            fetcher = self.fetcher
            skew = fetcher.clock_skew_s() if fetcher is not None else None  # the box's clock vs the trusted time
            got = fetcher.progress if fetcher is not None else None  # a bundle download in progress
            download = proto.DownloadFigures(
                target=got.target, bytes_done=got.bytes_done, bytes_total=got.bytes_total,
                bytes_per_s=got.bytes_per_s, eta_s=None if got.eta_s is None else round(min(got.eta_s, 2.5e6), 1),
                resumes=got.resumes) if got is not None else None

            def make(seq: int, snap=snap, cur=cur, cpu=cpu, rss=rss, interval=interval, drift=drift,
                     stages=stages, skew=skew, download=download) -> bytes:
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
                    shadow=self.host.shadow.figures() if self.host.shadow is not None else None,
                    serving=cur.serving if cur else None, drift=drift, stages=stages,
                    clock_skew_s=skew, download=download))

            try:
                self.spool.append(make)
            except OSError as exc:
                log.error("could not spool telemetry: %s", exc)


def check_runtime_config(config: AgentConfig) -> None:
    """What a config asks of this machine, checked before the agent starts (ConfigError): the CPUs it pins to
    exist here, and gRPC's packages are installed if it serves gRPC."""
    cpu_split(config.inference_cpus)
    if config.grpc_port is not None:
        import importlib.util

        if importlib.util.find_spec("grpc") is None or importlib.util.find_spec("tritonclient") is None:
            raise ConfigError("grpc_port: gRPC needs grpcio and tritonclient's service messages: install "
                              "edgefleet[grpc]")


def cpu_split(inference_cpus: tuple[int, ...] | None) -> tuple[frozenset[int], frozenset[int]] | None:
    """(the inference CPUs, the CPUs left for everything else) of those this process may use; None: no pinning.
    Raises ConfigError for a CPU this process may not run on. With no CPU left over, everything shares them."""
    if inference_cpus is None:
        return None
    if not hasattr(os, "sched_getaffinity"):
        raise ConfigError("inference_cpus: this platform has no CPU affinity (Linux only)")
    allowed = frozenset(os.sched_getaffinity(0))
    bad = sorted(set(inference_cpus) - allowed)
    if bad:
        raise ConfigError(f"inference_cpus: CPU(s) {bad} are not available to this process (it may use "
                          f"{sorted(allowed)})")
    mine = frozenset(inference_cpus)
    rest = allowed - mine
    if not rest:
        log.warning("inference_cpus %s leave no CPU for the event loop: it shares them", sorted(mine))
        rest = mine
    return mine, rest


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
    run_with_loop(agent.run(), event_loop_factory())  # asyncio.Runner, or its steps on Python 3.10


def run_agent(config: AgentConfig) -> None:
    run_until_stopped(Agent(config))


