"""The fleet's MQTT link: ingests status, reports and telemetry; publishes desired state.

paho-mqtt's network loop runs in its thread (supervised, below) and reconnects by itself, each wait a
full-jitter draw (``protocol.backoff``: uniform in [0, min(10 s, 1 s * 2**attempt)]); on every
(re)connect the bridge subscribes again and republishes desired state. Nothing a device sends can raise
out of that thread: every payload is read by the bounded parsers of ``protocol`` (size and nesting depth
checked before any JSON library recurses), and each message's handling is guarded. If the loop dies
anyway, the thread restarts it (counted in ``restarts``, shown as degraded in ``/api/v1/health``).
Telemetry and reports can be consumed through an MQTT shared subscription (``$share/<group>/...``) so several
fleet replicas split the load: each report is stored by one replica, which orders it against the device's newest
(its ``ts``, under the device's row lock: fleet.service.ingest), so two replicas handing a device's reports apart
agree. Statuses stay unshared: a status carries no stored order, and a device's ``online`` and its will split
across two replicas could be applied the wrong way round; every replica applies every status, in order.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from ..protocol import mqtt as proto
from ..protocol.backoff import Backoff, full_jitter, paho_next_delay
from ..protocol.errors import ContractError
from .audit import Rejections
from .ingest import IngestWorker

__all__ = ["RETAINED_STATUS", "MqttBridge"]

log = logging.getLogger("edgefleet.fleet.mqtt")

ACK_MAX_SEQS = 1000  # seqs per ack message (the protocol allows 10,000)
# the ingest kind of a status the broker sent because the fleet subscribed (retain flag set: on connect, or a
# read-back): the device's last word, not a sign that it is there now (fleet.presence)
RETAINED_STATUS = "status_retained"
# QoS 1 publishes paho may hold unacknowledged: its message ids are 16-bit, and past 65,535 outstanding it refuses
# a publish whose id is still in use ("Message queue full"). A 100,000-device wave queues its desired states at
# once: publish() waits for room instead (bounded by PUBLISH_WAIT_S), so none is refused
MAX_OUTSTANDING = 60_000
PUBLISH_WAIT_S = 300.0
# a publish paho refuses anyway (a message id still in use: QoS 0 acks draw ids from the same 16-bit counter, so it
# wraps onto ids still outstanding; or a full queue) waits in the retry set, the latest payload per topic, and goes
# out again when an acknowledgement makes room (or RETRY_POLL_S passes, or the fleet reconnects). The set holds at
# most RETRY_MAX topics: past that, publish() waits for room (PUBLISH_WAIT_S), then keeps the topic anyway and says so
RETRY_MAX = 1_000_000
RETRY_POLL_S = 1.0


class _SupervisedClient(mqtt.Client):
    """paho's client whose network thread outlives an exception: paho ends ``loop_forever`` (and with it
    ``loop_start``'s thread) when a callback raises, after which nothing more would be read while the
    bridge still looked connected. Here the thread reports the failure and, unless told to stop, drops
    the connection and runs the loop again (it reconnects, resubscribes and republishes by itself)."""

    def __init__(self, on_died: Callable[[BaseException], bool], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_died = on_died

    def _thread_main(self) -> None:  # paho's loop_start target (paho-mqtt 2.x)
        try:
            while True:
                try:
                    self.loop_forever(retry_first_connection=True)
                    return  # disconnect() or loop_stop(): a clean end
                except BaseException as exc:
                    if not self._on_died(exc):
                        return
                    try:
                        self.reconnect()  # a clean session: the broker does not wait on a half-handled message
                    except Exception:
                        log.warning("the MQTT broker is not reachable after the restart; paho keeps retrying")
        finally:
            self._thread = None


class MqttBridge:
    def __init__(self, url: str, shared_group: str | None = None, client_id: str | None = None,
                 username: str | None = None, password: str | None = None, ca_file: Path | None = None,
                 cert_file: Path | None = None, key_file: Path | None = None, max_queued: int = 0):
        """``mqtts://`` URLs (or a ``ca_file``) connect over TLS, verifying the broker against ``ca_file`` (the
        system's CAs if None); ``cert_file`` + ``key_file`` present a client certificate (mutual TLS).
        ``max_queued``: paho's bound on unacknowledged QoS 1 publishes (0: none but its 65,535 message ids; a small
        one forces a full queue, as the tests do)."""
        if not 0 <= max_queued <= MAX_OUTSTANDING:
            raise ValueError(f"max_queued must be in [0, {MAX_OUTSTANDING}], not {max_queued}")
        self.host, self.port = proto.parse_mqtt_url(url)
        self.shared_group = shared_group
        # set once the broker has acknowledged the fleet's subscriptions (SUBACK), not at its CONNACK: until then a
        # device's report is not delivered to the fleet, and health must not say that messages reach the database
        self.connected = threading.Event()
        self._connected_at: float | None = None  # monotonic time of the current connection (None: not connected)
        self._subscribe_mid: int | None = None  # the message id of this connection's SUBSCRIBE, until its SUBACK
        # the topic filters the broker refused on the current connection (an ACL without read access for the fleet's
        # user): the fleet stays "not connected", and health names them
        self.refused_subscriptions: list[str] = []
        self._subscriptions: list[str] = []  # the topic filters of the current connection's SUBSCRIBE
        self.rejected = 0  # malformed or spoofed messages dropped
        self.restarts = 0  # times the network loop died and was started again
        self.last_failure: tuple[float, str] | None = None  # (time.time(), what killed the loop)
        self._stopping = threading.Event()
        self.handled: dict[str, int] = {"status": 0, "reported": 0, "telemetry": 0}
        # live messages received (not retained copies): how fast each stream flows now (fleet.reconcile)
        self.received: dict[str, int] = {"status": 0, "reported": 0, "telemetry": 0}
        self.on_status: Callable[[proto.StatusMessage], object] | None = None
        self.on_reported: Callable[[proto.ReportedState], object] | None = None
        self.on_telemetry: Callable[[proto.Telemetry], object] | None = None
        self.on_connected: Callable[[], object] | None = None
        self.rejections: Rejections | None = None  # the service's counters, when wired
        self.ingest: IngestWorker | None = None  # when set, messages are stored in batches by it
        self._client = _SupervisedClient(self._loop_died, mqtt.CallbackAPIVersion.VERSION2,
                                   client_id=client_id or f"edgefleet-fleet-{uuid.uuid4().hex[:8]}",
                                   protocol=mqtt.MQTTv311, clean_session=True)
        # paho's wait before each reconnect: a fresh draw from on_disconnect / on_connect_fail (paho_next_delay)
        self.reconnects = Backoff(1.0, 10.0)
        self._client.reconnect_delay_set(min_delay=1, max_delay=10)
        if username is not None:
            self._client.username_pw_set(username, password)
        if proto.mqtt_tls(url) or ca_file is not None:
            self._client.tls_set(ca_certs=str(ca_file) if ca_file else None,
                                 certfile=str(cert_file) if cert_file else None,
                                 keyfile=str(key_file) if key_file else None, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        self._client.max_queued_messages_set(max_queued)  # 0: a wave's desired states are queued at once
        # no window of its own: with one, paho scans its whole queue of unacknowledged messages at each
        # acknowledgement for the next to send (Client._update_inflight): 47% of the MQTT thread of the replica that
        # published a 20,000-device wave (py-spy; docs/scaling.md). What is outstanding stays bounded: publish()
        # waits past MAX_OUTSTANDING
        self._client.max_inflight_messages_set(0)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._client.on_publish = self._on_publish
        self._rereads: dict[int, list[str]] = {}  # subscribe mid -> topics to unsubscribe once acked
        self._rereads_lock = threading.Lock()
        # topic -> (payload, retain) of publishes paho refused, oldest first; taken before paho's own locks, never
        # on paho's thread (which calls on_publish holding them): the retrier thread sends them again
        self._retry: dict[str, tuple[bytes, bool]] = {}
        self._retry_lock = threading.Lock()
        self._room = threading.Event()
        self._retrier: threading.Thread | None = None
        self.republished = 0  # refused publishes sent again from the retry set

    def start(self) -> None:
        self._stopping.clear()
        self._client.connect_async(self.host, self.port, keepalive=30)
        self._client.loop_start()
        self._retrier = threading.Thread(target=self._retry_loop, name="mqtt-retry", daemon=True)
        self._retrier.start()

    def stop(self) -> None:
        self._stopping.set()
        self._room.set()
        self._client.disconnect()
        self._client.loop_stop()
        if self._retrier is not None:
            self._retrier.join(timeout=10)
            self._retrier = None

    def alive(self) -> bool:
        """The network loop is running (whether or not the broker is reachable right now)."""
        thread = self._client._thread
        return thread is not None and thread.is_alive()

    def _loop_died(self, exc: BaseException) -> bool:
        """Called by the network thread when something escaped paho's loop: count it, and say whether to
        run the loop again (not once the bridge is stopping)."""
        failure = f"{type(exc).__name__}: {exc}"[:500]
        log.critical("the MQTT network loop died (%s); restarting it", failure, exc_info=exc)
        self.connected.clear()
        self.restarts += 1
        self.last_failure = (time.time(), failure)
        return not self._stopping.wait(full_jitter(self.restarts, 0.1, 10.0))

    def publish(self, topic: str, payload: bytes, retain: bool) -> None:
        """Queue a QoS 1 publish of a state topic (the latest payload per topic is what counts); paho keeps it and
        sends it once the broker is reachable. With MAX_OUTSTANDING publishes unacknowledged, wait for room (at most
        PUBLISH_WAIT_S; never on paho's own thread, which reads the acknowledgements). One paho refuses still goes
        out: it waits in the retry set until an acknowledgement makes room."""
        off_paho = threading.current_thread() is not self._client._thread
        if off_paho:
            self._wait_for_room(topic, lambda: self.outstanding() < MAX_OUTSTANDING, "the broker's acknowledgement")
            self._wait_for_room(topic, lambda: len(self._retry) < RETRY_MAX, "a retry")
        with self._retry_lock:
            self._retry.pop(topic, None)  # this payload supersedes one still waiting
            if not self._publish_now(topic, payload, retain):
                self._retry[topic] = (payload, retain)
                log.warning("paho refused a publish to %s; it waits in the retry set (%d)", topic, len(self._retry))

    def _wait_for_room(self, topic: str, room: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while not room():
            if time.monotonic() > deadline or self._stopping.is_set():
                log.error("publishes wait for %s (%d outstanding, %d to retry); queueing %s anyway", what,
                          self.outstanding(), len(self._retry), topic)
                return
            time.sleep(0.02)

    def _publish_now(self, topic: str, payload: bytes, retain: bool) -> bool:
        """Hand one QoS 1 publish to paho: False when paho refused it (its queue or message ids are full)."""
        info = self._client.publish(topic, payload, qos=1, retain=retain)
        if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            return True
        if info.rc != mqtt.MQTT_ERR_QUEUE_SIZE:
            log.error("could not queue publish to %s: %s (it waits in the retry set)", topic,
                      mqtt.error_string(info.rc))
        return False

    def retrying(self) -> int:
        """Publishes paho refused that wait to be sent again."""
        return len(self._retry)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        """paho's thread, holding paho's queue lock: only signal the retrier."""
        if self._retry:
            self._room.set()

    def _retry_loop(self) -> None:
        """Send the retry set's publishes again while paho takes them: woken by acknowledgements (room) and
        reconnects, and at least every RETRY_POLL_S."""
        while not self._stopping.is_set():
            self._room.wait(RETRY_POLL_S)
            self._room.clear()
            try:
                self._flush_retries()
            except Exception:
                log.exception("sending refused publishes again failed; trying again")

    def _flush_retries(self) -> None:
        with self._retry_lock:
            for _ in range(len(self._retry)):
                if self.outstanding() >= MAX_OUTSTANDING or not self._retry:
                    return
                topic = next(iter(self._retry))
                payload, retain = self._retry[topic]
                if not self._publish_now(topic, payload, retain):
                    return  # still no room: the next acknowledgement wakes the retrier
                del self._retry[topic]
                self.republished += 1

    def outstanding(self) -> int:
        """QoS 1 messages paho holds unacknowledged (paho has no public count: its queue's length)."""
        return len(self._client._out_messages)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("MQTT broker %s:%s refused the fleet: %s", self.host, self.port, reason_code)
            return
        log.info("connected to MQTT broker %s:%s; subscribing", self.host, self.port)
        self.reconnects.reset()
        tele, reported = proto.subscription("telemetry"), proto.subscription("reported")
        if self.shared_group:  # each record and report to one replica (a new subscription still gets the retained)
            tele, reported = f"$share/{self.shared_group}/{tele}", f"$share/{self.shared_group}/{reported}"
        self._subscriptions = [proto.subscription("status"), reported, tele]
        self.refused_subscriptions = []
        # paho calls on_subscribe from this same thread, after this callback: the mid is known before its SUBACK
        rc, self._subscribe_mid = client.subscribe([(t, 1) for t in self._subscriptions])
        if rc != mqtt.MQTT_ERR_SUCCESS:
            log.error("could not subscribe to the fleet's topics: %s (reconnecting)", mqtt.error_string(rc))
        self._room.set()  # publishes refused before the connection go out again
        if self.on_connected:
            hook = self.on_connected

            def run() -> None:  # off paho's thread: republishing a fleet's desired states waits for acks it reads
                try:
                    hook()
                except Exception:
                    log.exception("on_connected hook failed")

            threading.Thread(target=run, name="mqtt-on-connected", daemon=True).start()

    def reread_reported(self, device_ids: list[str]) -> None:
        """Ask the broker for these devices' retained reports again (see :meth:`reread`)."""
        self.reread(device_ids, "reported")

    def reread_status(self, device_ids: list[str]) -> None:
        """Ask the broker for these devices' retained status messages again (see :meth:`reread`)."""
        self.reread(device_ids, "status")

    def reread(self, device_ids: list[str], kind: str) -> None:
        """Ask the broker for these devices' retained ``kind`` messages again: subscribe to each device's topic
        (the broker answers a new subscription with the retained message), and unsubscribe once the
        subscription is acknowledged (the retained messages are sent before anything that follows it)."""
        topics = [proto.topic(d, kind) for d in device_ids if proto.device_id_ok(d)]  # type: ignore[arg-type]
        if not topics:
            return
        with self._rereads_lock:
            rc, mid = self._client.subscribe([(t, 1) for t in topics])
            if rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
                self._rereads[mid] = topics
            else:
                log.warning("could not ask again for %d retained %s messages: %s", len(topics), kind,
                            mqtt.error_string(rc))

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        if mid != self._subscribe_mid:  # a read-back's: unsubscribe, its retained messages came before this SUBACK
            with self._rereads_lock:
                topics = self._rereads.pop(mid, None)
            if topics:
                client.unsubscribe(topics)
            return
        # the broker answered the fleet's own SUBSCRIBE: connected only if it granted every topic filter
        self._subscribe_mid = None
        refused = [t for t, code in zip(self._subscriptions, reason_codes, strict=False) if code.is_failure]
        refused += self._subscriptions[len(reason_codes):]  # a SUBACK with fewer codes than filters granted none
        self.refused_subscriptions = refused
        if refused:
            log.error("the MQTT broker %s:%s refused the fleet's subscriptions to %s: no status, report or telemetry "
                      "reaches it; give the fleet's MQTT user read access to them in the broker's ACL, then "
                      "restart the fleet", self.host, self.port, ", ".join(refused))
            return
        log.info("subscribed to the fleet's topics on %s:%s", self.host, self.port)
        self._connected_at = time.monotonic()
        self.connected.set()

    def connected_for(self) -> float:
        """Seconds the fleet has been connected to the broker without a break (0 when it is not)."""
        at = self._connected_at
        return time.monotonic() - at if at is not None and self.connected.is_set() else 0.0

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        self._connected_at = None
        self._subscribe_mid = None
        delay = paho_next_delay(client, self.reconnects)
        log.warning("lost the MQTT broker %s:%s (%s); reconnecting in %.1fs", self.host, self.port, reason_code,
                    delay)

    def _on_connect_fail(self, client, userdata) -> None:
        delay = paho_next_delay(client, self.reconnects)
        log.info("MQTT broker %s:%s not reachable; trying again in %.1fs", self.host, self.port, delay)

    def stored(self, kind: str, msgs: list) -> None:
        """Messages are in the database: count them, and ack telemetry (stored, or a duplicate of a stored
        record): the agent may delete it from its spool. One ack per device and stream in the batch, at
        QoS 0: a lost ack costs only a resend, which the fleet stores once (the key is device, stream, seq)
        and acks again."""
        self.handled["status" if kind == RETAINED_STATUS else kind] += len(msgs)
        seqs: dict[tuple[str, str], list[int]] = {}
        reports: dict[str, float] = {}
        for msg in msgs:
            if isinstance(msg, proto.Telemetry):
                seqs.setdefault((msg.device_id, msg.stream), []).append(msg.seq)
            elif isinstance(msg, proto.ReportedState):
                reports[msg.device_id] = max(msg.ts, reports.get(msg.device_id, msg.ts))
        now = time.time()
        for device_id, report_ts in reports.items():  # the device may stop resending its latest report
            ack = proto.TelemetryAck(device_id=device_id, ts=now, stream="", report_ts=report_ts)
            self._client.publish(proto.topic(device_id, "ack"), proto.encode(ack), qos=0)
        for (device_id, stream), got in seqs.items():
            for i in range(0, len(got), ACK_MAX_SEQS):
                ack = proto.TelemetryAck(device_id=device_id, ts=now, stream=stream,
                                         seqs=tuple(got[i:i + ACK_MAX_SEQS]))
                self._client.publish(proto.topic(device_id, "ack"), proto.encode(ack), qos=0)

    @staticmethod
    def _reject_telemetry(client, device_id: str, doc: dict[str, Any] | None, reason: str) -> None:
        """Tell the agent a record it will keep resending cannot be stored, if it is identifiable (``doc``: the
        record as decode parsed it, never parsed again)."""
        try:
            if doc is None:
                return
            stream, seq = doc["stream"], doc["seq"]
            if doc.get("device_id") != device_id or not isinstance(seq, int) or isinstance(seq, bool):
                return
            ack = proto.TelemetryAck(device_id=device_id, ts=time.time(), stream=stream, rejected=(seq,),
                                     reason=reason[:500])
        except (ValueError, KeyError, TypeError, AttributeError, ContractError):  # incl. pydantic's ValidationError
            return  # not even identifiable: nothing to tell
        client.publish(proto.topic(device_id, "ack"), proto.encode(ack), qos=1)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        """paho's callback: never lets an exception out (the loop would end with it)."""
        try:
            self._handle(client, message)
        except Exception as exc:
            self.rejected += 1
            log.exception("failed to handle a message on %r", message.topic[:200])
            if self.rejections is not None:
                self.rejections.add("ingest_error", message.topic[:200], f"could not handle a message: {exc!r}"[:500])

    def _handle(self, client, message: mqtt.MQTTMessage) -> None:
        parsed = proto.parse_topic(message.topic)
        if parsed is None:
            return
        device_id, kind = parsed
        kinds: dict[str, type[proto.StatusMessage | proto.ReportedState | proto.Telemetry]] = {
            "status": proto.StatusMessage, "reported": proto.ReportedState, "telemetry": proto.Telemetry}
        model = kinds.get(kind)
        if model is None:
            return
        try:
            msg: proto.StatusMessage | proto.ReportedState | proto.Telemetry = proto.decode(
                model, bytes(message.payload), source=message.topic)
            if msg.device_id != device_id:
                raise ContractError(f"{message.topic}: payload says device {msg.device_id!r}")
            if not message.retain:
                self.received[kind] += 1
            if self.ingest is not None:  # stored in a batch; acked by stored() after its commit
                self.ingest.put(RETAINED_STATUS if kind == "status" and message.retain else kind, msg)
                return
            handler = {"status": self.on_status, "reported": self.on_reported, "telemetry": self.on_telemetry}[kind]
            if handler is not None:
                handler(msg)  # type: ignore[operator,arg-type]
            self.stored(kind, [msg])
        except ContractError as exc:
            self.rejected += 1
            if self.rejections is not None:
                self.rejections.add(f"malformed_{kind}", device_id, f"dropped a malformed message: {exc}")
            else:
                log.warning("dropped a malformed message: %s", exc)
            if kind == "telemetry":
                self._reject_telemetry(client, device_id, getattr(exc, "document", None), str(exc)[:1000])
