"""The agent's MQTT link: status with a last will, desired state in, reports and telemetry out.

paho-mqtt runs the network loop in its own thread and reconnects by itself, each wait a full-jitter draw
(``protocol.backoff``: uniform in [0, min(15 s, 1 s * 2**attempt)]), so a fleet's boxes that lost the broker
together do not come back in one burst. Telemetry goes
through the on-disk spool: a record is deleted only when the fleet acks its seq (see
``protocol.mqtt``), and unacked records are sent again, so nothing made while the broker or the
fleet is away is lost. The last report is retained, kept on disk (``<spool>/report.json``), sent
again on every reconnect (also after a restart during an outage) and, until the fleet acks it
(``TelemetryAck.report_ts``), again after ``ack_timeout_s``, doubling up to 5 minutes.

Order: after a (re)connect the fleet may not be subscribed yet (after a broker restart both sides
race back), and records sent into that gap would be resent later, behind newer ones. So until the
first ack after a connect, only the oldest record goes out (resent every ``probe_interval_s``);
then up to ``window`` records flow, oldest first.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt

from ... import protocol
from ...protocol import mqtt as proto
from ...protocol.backoff import MQTT_RECONNECT_BASE_S, MQTT_RECONNECT_CAP_S, Backoff, paho_next_delay
from ...protocol.cpu import cpu_arch, cpu_features
from ...protocol.errors import ContractError
from ...protocol.fsutil import atomic_write
from .spool import Spool

__all__ = ["MqttLink", "MqttSecurity"]

log = logging.getLogger("edgefleet.agent.mqtt")
REPORT_RESEND_MAX_S = 300.0  # an unacked report is sent again after ack_timeout_s, doubling up to this


@dataclass(frozen=True)
class MqttSecurity:
    """The device's identity on the broker: the credentials from enrollment and, for TLS, the
    broker's CA (``mqtts://`` URLs need it); for mutual TLS also this device's certificate and key."""

    username: str | None = None
    password: str | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None


class MqttLink:
    def __init__(self, device_id: str, url: str, spool: Spool, inference_url: str,
                 on_desired: Callable[[proto.DesiredState], None], ack_timeout_s: float = 10.0,
                 window: int = 100, probe_interval_s: float = 1.0, security: MqttSecurity | None = None):
        self.device_id = device_id
        tls = proto.mqtt_tls(url)
        self.host, self.port = proto.parse_mqtt_url(url)
        self.spool = spool
        self.inference_url = inference_url
        self.on_desired = on_desired
        self.ack_timeout_s = ack_timeout_s  # resend a record the fleet has not acked after this long
        self.window = window  # records in flight (sent, not yet acked) at most
        self.probe_interval_s = probe_interval_s  # resend the oldest record this often until the fleet acks
        self._fleet_listens = threading.Event()  # an ack arrived since the last connect
        self._inflight: dict[int, float] = {}  # seq -> monotonic time last sent
        self._inflight_lock = threading.Lock()
        self._report_path: Path = spool.dir / "report.json"
        self._last_report: proto.ReportedState | None = self._load_report()
        # the latest report until the fleet acks it: the ts it was last sent with, when, and the wait before the
        # next resend (doubling up to REPORT_RESEND_MAX_S); None once acked
        self._report_lock = threading.Lock()
        self._report_sent: tuple[float, float, float] | None = None  # (ts, monotonic sent, resend after s)
        self.connected = threading.Event()
        self._stop = threading.Event()
        # the client id is the device id (its username): the embedded broker refuses another device's, and
        # Mosquitto's device listeners (use_username_as_clientid) make it the username whatever is sent
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=proto.client_id(device_id),
                                   protocol=mqtt.MQTTv311, clean_session=True)
        will = proto.StatusMessage(device_id=device_id, ts=0.0, state="offline")
        self._client.will_set(proto.topic(device_id, "status"), proto.encode(will), qos=1, retain=True)
        # paho's wait before each reconnect: a fresh draw from on_disconnect / on_connect_fail (paho_next_delay)
        self.reconnects = Backoff(MQTT_RECONNECT_BASE_S, MQTT_RECONNECT_CAP_S)
        self._client.reconnect_delay_set(min_delay=1, max_delay=int(MQTT_RECONNECT_CAP_S))
        sec = security or MqttSecurity()
        if sec.username is not None:
            self._client.username_pw_set(sec.username, sec.password)
        if tls or sec.ca_file is not None:
            self._client.tls_set(ca_certs=str(sec.ca_file) if sec.ca_file else None,
                                 certfile=str(sec.cert_file) if sec.cert_file else None,
                                 keyfile=str(sec.key_file) if sec.key_file else None,
                                 tls_version=ssl.PROTOCOL_TLS_CLIENT)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_message = self._on_message
        self._sender = threading.Thread(target=self._send_spool, name="telemetry-sender", daemon=True)

    def start(self) -> None:
        self._client.connect_async(self.host, self.port, keepalive=15)
        self._client.loop_start()
        self._sender.start()

    def stop(self) -> None:
        self._stop.set()
        if self.connected.is_set():
            msg = proto.StatusMessage(device_id=self.device_id, ts=time.time(), state="offline")
            self._client.publish(proto.topic(self.device_id, "status"), proto.encode(msg), qos=1,
                                 retain=True).wait_for_publish(2)
        self._client.disconnect()
        self._client.loop_stop()
        self._sender.join(timeout=5)

    def _load_report(self) -> proto.ReportedState | None:
        try:
            msg = proto.decode(proto.ReportedState, self._report_path.read_bytes(), source=str(self._report_path))
        except FileNotFoundError:
            return None
        except (OSError, ContractError) as exc:
            log.warning("ignored the saved report: %s", exc)
            return None
        return msg if msg.device_id == self.device_id else None

    def report(self, msg: proto.ReportedState) -> None:
        """Publish (retained) the device's latest install state; it is kept on disk and sent again on
        every reconnect."""
        self._last_report = msg
        try:
            atomic_write(self._report_path, proto.encode(msg))
        except OSError as exc:
            log.error("could not save the report on disk: %s", exc)
        self._send_report(msg, self.ack_timeout_s)

    def _send_report(self, msg: proto.ReportedState, resend_after_s: float) -> None:
        with self._report_lock:
            self._report_sent = (msg.ts, time.monotonic(), resend_after_s)
        self._client.publish(proto.topic(self.device_id, "reported"), proto.encode(msg), qos=1, retain=True)

    def _resend_report_if_unacked(self) -> None:
        """The latest report again (with a new ts) if the fleet has not acked it in time: a broker may drop the
        fleet's copy, and a fleet away when it came reads only what is retained."""
        with self._report_lock:
            sent, last = self._report_sent, self._last_report
        if sent is None or last is None or time.monotonic() - sent[1] < sent[2]:
            return
        self._send_report(last.model_copy(update={"ts": time.time()}), min(sent[2] * 2, REPORT_RESEND_MAX_S))

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("the broker refused the agent: %s", reason_code)
            return
        log.info("connected to MQTT %s:%s", self.host, self.port)
        self.reconnects.reset()
        status = proto.StatusMessage(device_id=self.device_id, ts=time.time(), state="online",
                                     agent_version=protocol.__version__, inference_url=self.inference_url,
                                     arch=cpu_arch(), cpu_features=tuple(sorted(cpu_features())))
        client.publish(proto.topic(self.device_id, "status"), proto.encode(status), qos=1, retain=True)
        client.subscribe([(proto.topic(self.device_id, "desired"), 1), (proto.topic(self.device_id, "ack"), 1)])
        if self._last_report is not None:
            self._send_report(self._last_report.model_copy(update={"ts": time.time()}), self.ack_timeout_s)
        with self._inflight_lock:
            self._inflight.clear()  # whatever was in flight may have died with the connection: resend
            self._fleet_listens.clear()
        self.connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        delay = paho_next_delay(client, self.reconnects)
        if not self._stop.is_set():
            log.warning("lost MQTT %s:%s (%s); reconnecting in %.1fs, telemetry is spooled on disk",
                        self.host, self.port, reason_code, delay)

    def _on_connect_fail(self, client, userdata) -> None:
        delay = paho_next_delay(client, self.reconnects)
        log.info("MQTT %s:%s not reachable; trying again in %.1fs", self.host, self.port, delay)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        if message.topic == proto.topic(self.device_id, "ack"):
            self._on_ack(bytes(message.payload))
            return
        if message.topic != proto.topic(self.device_id, "desired") or not message.payload:
            return
        try:
            desired = proto.decode(proto.DesiredState, bytes(message.payload), source=message.topic)
            if desired.device_id != self.device_id:
                raise ContractError(f"desired state addressed to {desired.device_id!r}")
        except ContractError as exc:
            log.error("ignored a malformed desired state: %s", exc)
            return
        try:
            self.on_desired(desired)
        except Exception:
            log.exception("desired-state handler failed")

    def _on_ack(self, payload: bytes) -> None:
        try:
            ack = proto.decode(proto.TelemetryAck, payload, source="ack")
        except ContractError as exc:
            log.warning("ignored a malformed ack: %s", exc)
            return
        if ack.report_ts is not None:
            with self._report_lock:
                if self._report_sent is not None and abs(self._report_sent[0] - ack.report_ts) < 1e-6:
                    self._report_sent = None  # the fleet stored the latest report
            return
        if ack.stream != self.spool.stream:
            return  # an ack for the spool this device had before it was re-imaged
        with self._inflight_lock:
            self._fleet_listens.set()
            for seq in ack.seqs:
                self._inflight.pop(seq, None)
                self.spool.ack_seq(seq)
            for seq in ack.rejected:
                self._inflight.pop(seq, None)
                if self.spool.set_aside(seq):
                    log.error("the fleet cannot store telemetry record %d (%s); kept in %s", seq, ack.reason,
                              self.spool.rejected_dir)

    def _send_spool(self) -> None:
        """Send spooled telemetry oldest first, at most ``window`` unacked at a time; resend stale ones."""
        while not self._stop.is_set():
            if not self.connected.wait(timeout=0.5):
                continue
            now = time.monotonic()
            sent = 0
            probing = not self._fleet_listens.is_set()
            resend_after = self.probe_interval_s if probing else self.ack_timeout_s
            for path in self.spool.pending(1 if probing else self.window):
                if self._stop.is_set() or not self.connected.is_set():
                    break
                seq = int(path.stem)
                with self._inflight_lock:
                    last = self._inflight.get(seq)
                    if last is not None and now - last < resend_after:
                        continue
                    self._inflight[seq] = now
                try:
                    payload = path.read_bytes()
                except FileNotFoundError:  # acked or dropped meanwhile
                    with self._inflight_lock:
                        self._inflight.pop(seq, None)
                    continue
                info = self._client.publish(proto.topic(self.device_id, "telemetry"), payload, qos=1)
                if info.rc != mqtt.MQTT_ERR_SUCCESS:
                    with self._inflight_lock:
                        self._inflight.pop(seq, None)
                    break
                sent += 1
            self._resend_report_if_unacked()
            self._stop.wait(0.05 if sent else 0.25)
