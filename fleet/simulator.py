"""A fleet of simulated agents: one MQTT connection each, on one asyncio loop.

Each simulated device does what an agent does on the wire (``protocol.mqtt``): it connects with a
last will (status offline, retained), says it is online with its hardware profile, follows its
retained desired state, reports installs (after a configurable time, failing at a configurable
rate) and sends telemetry whose error rate and p99 latency can depend on the model version. It
downloads and runs nothing: it is for rehearsing rollouts, for tests and for bench/fleet_scale.py.

The MQTT client is a minimal MQTT 3.1.1 one (CONNECT with will, SUBSCRIBE, PUBLISH QoS 0/1,
PUBACK, PINGREQ): paho's thread per client does not scale to 10,000 devices on two cores.
A device whose connection the broker drops (a broker restart) reconnects as the agent does, each wait
a full-jitter draw (``protocol.backoff``), and says it is online again. Failures are deterministic:
with rate r, device number i fails iff floor((i+1)r) > floor(ir), so any run of consecutive devices
holds its share of failures, rounded down.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..protocol import mqtt as proto
from ..protocol.backoff import MQTT_RECONNECT_BASE_S, MQTT_RECONNECT_CAP_S, Backoff, full_jitter

__all__ = ["SimConfig", "Simulator", "enroll_all", "fails"]

log = logging.getLogger("edgefleet.simulator")
MAX_PACKET = proto.MAX_MESSAGE_BYTES + 1024


def fails(index: int, rate: float) -> bool:
    return rate > 0 and math.floor((index + 1) * rate + 1e-9) > math.floor(index * rate + 1e-9)


@dataclass(frozen=True)
class SimConfig:
    mqtt_url: str
    devices: int
    prefix: str = "sim"
    first_index: int = 0
    profile: str = "x86-cpu"
    install_s: float = 0.05  # time from desired state to the report
    failure_rate: float = 0.0  # installs that fail, any version
    failure_rate_by_version: dict[str, float] = field(default_factory=dict)
    telemetry_interval_s: float = 0.0  # 0: no telemetry
    requests_per_interval: int = 100
    p99_ms: float = 10.0
    p99_factor_by_version: dict[str, float] = field(default_factory=dict)
    error_rate: float = 0.0
    error_rate_by_version: dict[str, float] = field(default_factory=dict)
    running: tuple[str, str] | None = None  # (model, version) each device runs at start
    connect_concurrency: int = 200
    keepalive_s: int = 60
    progress_reports: bool = False  # also report downloading/installing, as the real agent does
    passwords: dict[str, str] = field(default_factory=dict)  # device id -> MQTT password (from enrollment)
    shadow_agreement_by_version: dict[str, float] = field(default_factory=dict)  # default 1.0
    reconnect_base_s: float = MQTT_RECONNECT_BASE_S  # after a lost connection: the agent's reconnect windows
    reconnect_cap_s: float = MQTT_RECONNECT_CAP_S
    mqtt_ca_file: str | None = None  # mqtts:// brokers: their CA (None: the system's), as the agent's --mqtt-ca-file


@dataclass
class SimStats:
    connected: int = 0
    desired: int = 0
    installed: int = 0
    failed: int = 0
    telemetry_sent: int = 0
    telemetry_acked: int = 0
    telemetry_rejected: int = 0
    errors: int = 0
    reconnects: int = 0  # connections the broker dropped and the device made again

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


# -- a minimal MQTT 3.1.1 client ---------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n % 128, n // 128
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


def _packet(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + _varint(len(body)) + body


class MiniMqtt:
    def __init__(self, host: str, port: int, client_id: str, keepalive_s: int,
                 on_message: Callable[[str, bytes], None], tls: ssl.SSLContext | None = None):
        self.host, self.port, self.client_id, self.keepalive_s = host, port, client_id, keepalive_s
        self.tls = tls  # mqtts://: the broker's certificate checked against this context's CAs and the host
        self.on_message = on_message
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pid = 0
        self._tasks: list[asyncio.Task] = []
        self.closed = asyncio.Event()

    async def connect(self, will_topic: str, will: bytes, timeout_s: float = 30.0,
                      username: str | None = None, password: str | None = None) -> None:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, ssl=self.tls),
                                               timeout_s)
        self._reader, self._writer = reader, writer
        flags = 0x02 | 0x04 | 0x08 | 0x20  # clean session, will, will QoS 1, will retain
        creds = b""
        if username is not None:
            flags |= 0x80
            creds += _str(username)
            if password is not None:
                flags |= 0x40
                creds += _str(password)
        body = _str("MQTT") + bytes([4, flags]) + struct.pack("!H", self.keepalive_s) + _str(self.client_id) \
            + _str(will_topic) + _str(will) + creds
        writer.write(_packet(0x10, body))
        kind, payload = await asyncio.wait_for(self._read(), timeout_s)
        if kind >> 4 != 2 or len(payload) < 2 or payload[1] != 0:
            raise ConnectionError(f"{self.client_id}: broker refused the connection ({payload!r})")
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._ping_loop())]

    async def _read(self) -> tuple[int, bytes]:
        assert self._reader is not None
        head = await self._reader.readexactly(1)
        n, mult = 0, 1
        for _ in range(4):
            b = (await self._reader.readexactly(1))[0]
            n += (b & 0x7F) * mult
            mult *= 128
            if not b & 0x80:
                break
        if n > MAX_PACKET:
            raise ConnectionError(f"{self.client_id}: packet of {n} bytes exceeds {MAX_PACKET}")
        return head[0], await self._reader.readexactly(n)

    async def _read_loop(self) -> None:
        try:
            while True:
                kind, body = await self._read()
                if kind >> 4 == 3:  # PUBLISH
                    qos = (kind >> 1) & 3
                    tlen = struct.unpack("!H", body[:2])[0]
                    topic = body[2:2 + tlen].decode()
                    i = 2 + tlen
                    if qos:
                        pid = body[i:i + 2]
                        i += 2
                        self._send(_packet(0x40, pid))
                    self.on_message(topic, body[i:])
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.closed.set()

    async def _ping_loop(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s / 2)
            self._send(b"\xc0\x00")

    def _next_pid(self) -> int:
        self._pid = self._pid % 65535 + 1
        return self._pid

    def _send(self, data: bytes) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    def subscribe(self, topics: list[str]) -> None:
        body = struct.pack("!H", self._next_pid()) + b"".join(_str(t) + b"\x01" for t in topics)
        self._send(_packet(0x82, body))

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        body = _str(topic) + (struct.pack("!H", self._next_pid()) if qos else b"") + payload
        self._send(_packet(0x30 | (qos << 1) | int(retain), body))

    async def disconnect(self, clean: bool = True) -> None:
        """``clean=False`` drops the socket without DISCONNECT: the broker publishes the will."""
        if self._writer is None:
            return
        if clean:
            self._send(b"\xe0\x00")
        for t in self._tasks:
            t.cancel()
        try:
            if not clean and self._writer.transport is not None:
                self._writer.transport.abort()
            else:
                self._writer.close()
                await asyncio.wait_for(self._writer.wait_closed(), 5)
        except (OSError, TimeoutError, ConnectionError):
            pass
        self._writer = None
        self.closed.set()


# -- a simulated device ------------------------------------------------------------------------------
class SimDevice:
    def __init__(self, sim: Simulator, index: int):
        self.sim = sim
        self.cfg = sim.config
        self.index = index
        self.id = f"{self.cfg.prefix}-{index:05d}"
        self.running: tuple[str, str] | None = self.cfg.running
        self.installed_sha: str | None = None
        self.stream = f"{random.Random(self.id).getrandbits(64):016x}"
        self.seq = 0
        self.client: MiniMqtt | None = None
        self._install: asyncio.Task | None = None
        self._telemetry: asyncio.Task | None = None
        self.shadow: tuple[str, str] | None = None  # a candidate in shadow (model, version)
        self.shadow_samples = 0
        self.online = False  # counted in stats.connected
        self._watch: asyncio.Task | None = None  # reconnects when the broker drops the connection

    async def start(self) -> None:
        await self._connect()
        self._watch = asyncio.create_task(self._reconnect_when_lost())

    async def _connect(self) -> None:
        host, port = proto.parse_mqtt_url(self.cfg.mqtt_url)
        client = MiniMqtt(host, port, self.id, self.cfg.keepalive_s, self._on_message, self.sim.tls)
        will = proto.encode(proto.StatusMessage(device_id=self.id, ts=0, state="offline"))
        password = self.cfg.passwords.get(self.id)
        try:
            await client.connect(proto.topic(self.id, "status"), will, username=self.id if password else None,
                                 password=password)
        except BaseException:
            if client._writer is not None:
                client._writer.transport.abort()
            raise
        self.client = client
        self.online = True
        self.client.subscribe([proto.topic(self.id, "desired"), proto.topic(self.id, "ack")])
        online = proto.StatusMessage(device_id=self.id, ts=time.time(), state="online", agent_version="sim-0.1",
                                     arch="x86_64", cpu_features=("sse4_2", "avx2"), profile=self.cfg.profile)
        self.client.publish(proto.topic(self.id, "status"), proto.encode(online), retain=True)
        self.sim.stats.connected += 1
        if self.cfg.telemetry_interval_s > 0 and (self._telemetry is None or self._telemetry.done()):
            self._telemetry = asyncio.create_task(self._telemetry_loop())

    async def _reconnect_when_lost(self) -> None:
        """The broker dropped the connection (``stop()`` cancels this first): connect again, each wait a
        full-jitter draw, as the agent's link does, so the devices of a restarted broker come back spread."""
        backoff = Backoff(self.cfg.reconnect_base_s, self.cfg.reconnect_cap_s)
        while self.client is not None:
            await self.client.closed.wait()
            await self.client.disconnect(clean=False)  # its ping task and socket go with it
            self.online = False
            self.sim.stats.connected -= 1
            while True:
                delay = backoff.next_s()
                dial_at = time.monotonic() + delay  # when a box of its own would dial (this loop may run late)
                await asyncio.sleep(delay)
                try:
                    await self._connect()
                    break
                except (TimeoutError, OSError, EOFError):
                    continue
            backoff.reset()
            self.sim.stats.reconnects += 1
            self.sim.reconnects_at.append((dial_at, time.monotonic()))

    async def stop(self, clean: bool = True) -> None:
        for t in (self._watch, self._install, self._telemetry):
            if t is not None:
                t.cancel()
        self._watch = self._telemetry = None
        if self.client is not None:
            if clean and self.online:
                off = proto.StatusMessage(device_id=self.id, ts=time.time(), state="offline")
                self.client.publish(proto.topic(self.id, "status"), proto.encode(off), retain=True)
            await self.client.disconnect(clean)
            if self.online:
                self.sim.stats.connected -= 1
            self.online = False
            self.client = None

    def _on_message(self, topic: str, payload: bytes) -> None:
        kind = topic.rsplit("/", 1)[-1]
        try:
            if kind == "desired":
                d = proto.decode(proto.DesiredState, payload, topic)
                self.sim.stats.desired += 1
                if self._install is not None:
                    self._install.cancel()
                self._install = asyncio.create_task(self._apply(d))
            elif kind == "ack":
                a = proto.decode(proto.TelemetryAck, payload, topic)
                self.sim.stats.telemetry_acked += len(a.seqs)
                self.sim.stats.telemetry_rejected += len(a.rejected)
        except Exception as exc:  # a bad message must not kill the device
            self.sim.stats.errors += 1
            log.warning("%s: %s", self.id, exc)

    def _report(self, state: str, d: proto.DesiredState, error: str | None = None) -> None:
        assert self.client is not None
        run = self.running
        msg = proto.ReportedState(device_id=self.id, ts=time.time(), state=state,  # type: ignore[arg-type]
                                  rollout_id=d.rollout_id, model=d.model, version=d.version,
                                  running_model=run[0] if run else None, running_version=run[1] if run else None,
                                  error=error, install_s=self.cfg.install_s if state == "installed" else None)
        self.client.publish(proto.topic(self.id, "reported"), proto.encode(msg), retain=True)

    async def _apply(self, d: proto.DesiredState) -> None:
        if d.mode == "shadow":
            if self.cfg.install_s > 0:
                await asyncio.sleep(self.cfg.install_s)
            if self.shadow != (d.model, d.version):
                self.shadow, self.shadow_samples = (d.model, d.version), 0
            self._report("shadowing", d)
            return
        self.shadow = None
        if self.installed_sha == d.sha256:
            self._report("installed", d)  # already running it: say so again
            return
        if self.cfg.progress_reports:
            self._report("downloading", d)
        if self.cfg.install_s > 0:
            await asyncio.sleep(self.cfg.install_s)
        rate = self.cfg.failure_rate_by_version.get(d.version, self.cfg.failure_rate)
        if fails(self.index, rate):
            self.sim.stats.failed += 1
            self._report("failed", d, f"simulated install failure of {d.model} {d.version}")
            return
        self.running = (d.model, d.version)
        self.installed_sha = d.sha256
        self.sim.stats.installed += 1
        self._report("installed", d)

    async def _telemetry_loop(self) -> None:
        cfg = self.cfg
        await asyncio.sleep(random.Random(self.id).random() * cfg.telemetry_interval_s)
        while self.client is not None:
            self.send_telemetry()
            await asyncio.sleep(cfg.telemetry_interval_s)

    def _shadow_figures(self, n: int, p99: float) -> proto.ShadowFigures | None:
        if self.shadow is None:
            return None
        self.shadow_samples += max(1, n // 10)  # a tenth of the requests is mirrored
        return proto.ShadowFigures(model=self.shadow[0], version=self.shadow[1], samples=self.shadow_samples,
                                   top1_agreement=self.cfg.shadow_agreement_by_version.get(self.shadow[1], 1.0),
                                   max_abs_error=0.0, p99_ms=p99)

    def send_telemetry(self) -> None:
        if self.client is None:
            return
        cfg = self.cfg
        version = self.running[1] if self.running else None
        n = cfg.requests_per_interval
        err = cfg.error_rate_by_version.get(version or "", cfg.error_rate)
        p99 = cfg.p99_ms * cfg.p99_factor_by_version.get(version or "", 1.0)
        msg = proto.Telemetry(device_id=self.id, ts=time.time(), stream=self.stream, seq=self.seq,
                              interval_s=cfg.telemetry_interval_s or 1.0,
                              model=self.running[0] if self.running else None, version=version, requests=n,
                              errors=round(n * err),
                              latency=proto.LatencySummary(p50_ms=p99 / 3, p95_ms=p99 * 0.8, p99_ms=p99,
                                                           max_ms=p99 * 1.2),
                              batches=n, batch_size_mean=1.0, batch_size_max=1, cpu_percent=20.0, rss_mb=100.0,
                              device=proto.DeviceSummary(cpu_percent=35.0, memory_used_mb=900.0, memory_total_mb=4096.0,
                                                         temperature_c=45.0 + self.index % 10),
                              shadow=self._shadow_figures(n, p99))
        self.seq += 1
        self.sim.stats.telemetry_sent += 1
        self.client.publish(proto.topic(self.id, "telemetry"), proto.encode(msg), qos=1)


class Simulator:
    """``start()`` runs the devices on an event loop in a thread; ``run_forever`` on the caller's loop."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.stats = SimStats()
        self.devices = [SimDevice(self, config.first_index + i) for i in range(config.devices)]
        # TLS for mqtts:// (or a CA given): one context for every device, the broker checked as an agent checks it
        self.tls = ssl.create_default_context(cafile=config.mqtt_ca_file) \
            if proto.mqtt_tls(config.mqtt_url) or config.mqtt_ca_file else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # each reconnect: (time.monotonic() its successful attempt was drawn for, when the broker had taken it)
        self.reconnects_at: deque[tuple[float, float]] = deque(maxlen=1_000_000)

    @property
    def ids(self) -> list[str]:
        return [d.id for d in self.devices]

    async def connect_all(self) -> None:
        sem = asyncio.Semaphore(self.config.connect_concurrency)

        async def one(d: SimDevice) -> None:
            async with sem:
                for attempt in range(5):  # bounded: a busy broker may drop a few connects
                    try:
                        await d.start()
                        return
                    except (OSError, ConnectionError, TimeoutError) as exc:
                        if attempt == 4:
                            raise ConnectionError(f"{d.id} could not connect: {exc}") from exc
                        await asyncio.sleep(full_jitter(attempt, 0.2, 2.0))

        await asyncio.gather(*(one(d) for d in self.devices))

    async def stop_all(self) -> None:
        await asyncio.gather(*(d.stop() for d in self.devices), return_exceptions=True)

    # -- in a thread (tests, bench) ------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.connect_all())
            except BaseException as exc:
                failure.append(exc)
            ready.set()
            if not failure:
                loop.run_forever()
            loop.run_until_complete(self.stop_all())
            loop.close()

        self._thread = threading.Thread(target=run, name="fleet-simulator", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"the simulated devices did not connect in {timeout_s}s")
        if failure:  # the thread closes the connections that did open, then ends by itself
            self._thread.join(30)
            raise failure[0]

    def call(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """Run ``fn`` (a coroutine function or a plain one) on the simulator's loop and wait for it."""
        assert self._loop is not None

        async def wrap() -> Any:
            r = fn()
            return await r if asyncio.iscoroutine(r) else r

        return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result(timeout_s)

    def kill(self, indices: list[int]) -> None:
        """Drop these devices' connections without a goodbye: the broker publishes their last will."""
        self.call(lambda: asyncio.gather(*(self.devices[i].stop(clean=False) for i in indices)))

    def revive(self, indices: list[int]) -> None:
        self.call(lambda: asyncio.gather(*(self.devices[i].start() for i in indices)))

    def send_telemetry(self) -> None:
        """One telemetry record from every connected device, now."""
        def all_devices() -> None:
            for d in self.devices:
                d.send_telemetry()

        self.call(all_devices)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


def enroll_all(fleet_url: str, device_ids: list[str], token: str | None, concurrency: int = 16) -> dict[str, str]:
    """Enroll simulated devices through the fleet's API: device id -> MQTT password."""
    from concurrent.futures import ThreadPoolExecutor

    from .client import FleetClient

    client = FleetClient(fleet_url, token=token)

    def one(device_id: str) -> tuple[str, str]:
        return device_id, client.enroll(client.enrollment_token(device_id, ttl_s=600).token).mqtt_password

    with ThreadPoolExecutor(concurrency) as pool:
        return dict(pool.map(one, device_ids))
