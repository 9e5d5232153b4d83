"""The embedded MQTT broker (amqtt), for a demo or a small site with nothing to set up.

It runs on its own event loop in a daemon thread and binds 127.0.0.1 unless told otherwise.
Production fleets use Mosquitto (or a clustered broker) through ``--mqtt-url``.

It enforces the same rule as Mosquitto's password and ACL files (:mod:`fleet.acl`): a client connects
only with an active account (the fleet's, or a device's from enrollment), a device publishes only its
own reports, telemetry and status and reads only its own desired state and acks, and a will message
may only name a topic its client could publish to (amqtt does not check wills itself). Anonymous
clients are refused at connect, and so is a device whose client id is not its own
(:func:`fleet.acl.client_id_allowed`): one identity per device.

amqtt (0.12) alone is not a security boundary, so :class:`FleetBroker` overrides three of its methods:

- amqtt handles a CONNECT's session before it authenticates: a clean session wipes the stored
  session and subscriptions of that client id, a persistent one takes its credentials over. Anyone
  could silence a device by connecting, even anonymously, with its client id. Here the
  authentication (client id included) comes first, and a refused CONNECT touches no session.
- after every connect amqtt sends the retained messages matching every subscription of every
  client, unchecked: a device that subscribed to nothing got every device's retained desired,
  reported and status. Here retained messages go only for the session's own subscriptions.
- retained messages sent for a subscription skip the topic check (only live messages are checked):
  here each one must pass the same ``RECEIVE`` check.

A fourth guard is for size: amqtt reads any packet whole (up to MQTT's 256 MB), so a device could park 50 MB
retained messages on each of its topics. :class:`_BoundedReader` reads each packet's fixed header as amqtt does
and closes the connection when the packet it announces is over :data:`fleet.acl.MAX_PACKET_BYTES` (the
protocol's message limit plus headers), before a byte of its body is read: what Mosquitto's
``max_packet_size`` does.

Mosquitto needs none of this (see :func:`fleet.acl.mosquitto_conf`). tests/test_broker_identity.py
tries each hole on both brokers.

Time, descriptors and memory are bounded as :mod:`fleet.broker_limits` says: every connection is closed
by the broker when it ends, whatever state it ended in (amqtt left one that ended before its CONNECT to the
garbage collector), each waits at most ``connect_timeout_s`` for its CONNECT and an idle timeout after it,
connections are capped in all and per peer address, and a publish is checked against the ACL when it is
received (a forbidden one is acknowledged and dropped unread, as Mosquitto does).
tests/test_trust_broker_conn.py tries each shape through a real listener. What a hostile client can make it
log by the thousand (refusals, deadlines) is one line per kind and interval with a count, by the fleet's log
filter (:mod:`protocol.lograte`, installed by ``edgefleet fleet serve``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.errors import AMQTTError
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import OutgoingApplicationMessage
from amqtt.utils import gen_client_id

from ..protocol.errors import ConfigError
from .acl import MAX_PACKET_BYTES, allowed, client_id_allowed
from .broker_limits import BrokerLimits, ConnectionGate

__all__ = ["Authorizer", "EmbeddedBroker", "FleetBroker"]


class Authorizer(Protocol):
    def authenticate(self, username: str | None, password: str | None) -> bool: ...

    def is_active(self, username: str | None) -> bool: ...


# amqtt builds plugins from dotted paths and plain config; a key in the config finds the broker's authorizer
_AUTHORIZERS: dict[str, Authorizer] = {}
_ACTIONS: dict[Action, Literal["publish", "subscribe"]] = {
    Action.PUBLISH: "publish", Action.SUBSCRIBE: "subscribe", Action.RECEIVE: "subscribe"}
log = logging.getLogger("edgefleet.fleet.broker")


class AclAuthPlugin(BaseAuthPlugin):
    """Connect only with an active account; a will only on a topic the client may publish to."""

    @dataclass
    class Config:
        key: str = ""

    async def authenticate(self, *, session: Any) -> bool | None:
        auth = _AUTHORIZERS.get(self.config.key)
        user = session.username
        if auth is None or not auth.authenticate(user, session.password):
            log.info("MQTT connect refused: %s (client id %r)", "anonymous" if not user else f"user {user!r}",
                     session.client_id)
            return False
        if not client_id_allowed(user, session.client_id):
            log.info("MQTT connect refused: user %r with client id %r, not its own", user, session.client_id)
            return False
        if session.will_flag and not allowed(user, session.will_topic or "", "publish"):
            log.info("MQTT connect refused: user %r asked for a will on %r", user, session.will_topic)
            return False
        return True


class AclTopicPlugin(BaseTopicPlugin):
    """fleet.acl.allowed for every publish, subscribe and delivery."""

    @dataclass
    class Config:
        key: str = ""

    async def topic_filtering(self, *, session: Any = None, topic: str | None = None,
                              action: Action | None = None) -> bool | None:
        if session is None or topic is None or action is None:
            return False
        auth = _AUTHORIZERS.get(self.config.key)
        # a device decommissioned while connected can no longer publish, subscribe or receive
        return auth is not None and auth.is_active(session.username) and allowed(session.username, topic,
                                                                                 _ACTIONS[action])


class PacketTooLarge(Exception):  # amqtt's reader loop ends a connection on any Exception but its own
    """A client announced a packet over the limit: its connection ends before the body is read."""


class _BoundedReader(StreamReaderAdapter):
    """amqtt's reader for one connection, which follows the MQTT framing as amqtt 0.12 reads it (the fixed
    header a byte at a time, then the body in reads that add up to its remaining length) and refuses a packet
    whose remaining length is over ``limit`` as soon as that length is read.

    It also keeps the connection's deadlines, one timer at a time, which closes the socket when it fires (a
    timer, not ``asyncio.wait_for``: on Python 3.10-3.11 that can swallow the cancellation of a read that is
    completing, and amqtt's reader loop treats a TimeoutError as nothing): the CONNECT's (:meth:`arm` at
    accept), then once ``idle_timeout_s`` is set, the idle timeout while it waits for a packet and
    ``packet_timeout_s`` from a packet's first byte to its last."""

    def __init__(self, reader: asyncio.StreamReader, transport: asyncio.WriteTransport, peer: str,
                 limit: int = MAX_PACKET_BYTES, packet_timeout_s: float = 60.0):
        super().__init__(reader)
        self.peer, self.limit, self.packet_timeout_s = peer, limit, packet_timeout_s
        self._transport = transport
        self._left = 0  # body bytes of the current packet still to come; 0: a fixed header comes next
        self._header: list[int] = []  # the fixed header's bytes read so far
        self.handshaking = True  # until the CONNECT is read (the connect deadline covers it as a whole)
        self.idle_timeout_s: float | None = None  # set once the CONNECT is read, from its keepalive
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, timeout_s: float, why: str) -> None:
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, why)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, why: str) -> None:
        self._timer = None
        log.warning("MQTT connection from %s closed: %s", self.peer, why)
        self._transport.abort()  # the read waiting on it ends; the descriptor is free on the next turn

    async def read(self, n: int = -1) -> bytes:
        if n < 0:  # amqtt's MQTT parser never reads to the end of the stream
            raise PacketTooLarge(f"{self.peer}: an unbounded read")
        if self._left:
            if n > self._left:
                raise PacketTooLarge(f"{self.peer}: a read of {n} bytes past the packet's end")
            data = await super().read(n)
            self._left -= len(data)
            if not self._left and self.idle_timeout_s is not None:
                self.disarm()
            return data
        if self.idle_timeout_s is not None and self._timer is None and not self._header:
            self.arm(self.idle_timeout_s, f"nothing for {self.idle_timeout_s:.0f} s (its idle timeout)")
        data = await super().read(n)
        for byte in data:
            self._header_byte(byte)
        return data

    def _header_byte(self, byte: int) -> None:
        self._header.append(byte)
        if len(self._header) == 1 and self.idle_timeout_s is not None:
            self.arm(self.packet_timeout_s, f"a packet not whole within {self.packet_timeout_s:.0f} s")
        if len(self._header) == 1 or byte & 0x80:
            if len(self._header) > 5:
                raise PacketTooLarge(f"{self.peer}: a remaining length of more than 4 bytes")
            return
        length = sum((b & 0x7F) << (7 * i) for i, b in enumerate(self._header[1:]))
        self._header = []
        if length > self.limit:
            log.warning("MQTT client %s announced a %d-byte packet, over the %d-byte limit: disconnected", self.peer,
                        length, self.limit)
            raise PacketTooLarge(f"{self.peer}: a {length}-byte packet, over the {self.limit}-byte limit")
        self._left = length
        if not length and self.idle_timeout_s is not None:
            self.disarm()


class _GuardedWriter(StreamWriterAdapter):
    """amqtt's writer for one connection, with a deadline on every wait for the client to read, and a close
    that always releases the socket (amqtt's waits for a drain first, forever if the client reads nothing, and
    not at all if the drain fails)."""

    is_closed: bool

    def __init__(self, writer: asyncio.StreamWriter, write_timeout_s: float):
        super().__init__(writer)
        self.write_timeout_s = write_timeout_s

    async def _drain(self) -> None:
        timer = asyncio.get_running_loop().call_later(self.write_timeout_s, self.abort)
        try:
            await self._writer.drain()  # raises ConnectionResetError once aborted
        finally:
            timer.cancel()

    async def drain(self) -> None:
        if not self.is_closed:
            await self._drain()

    def abort(self) -> None:
        self.is_closed = True
        self._writer.transport.abort()

    async def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        transport = self._writer.transport
        try:
            if transport.get_write_buffer_size():
                await self._drain()
            transport.close()  # the socket is closed on the next turn of the loop, without the GC
        except Exception:  # a client gone, or not reading: nothing more is owed to it
            transport.abort()


class _FleetHandler(BrokerProtocolHandler):
    """amqtt's handler for one connection, with a publish's topic and the connection's in-flight and queued
    messages checked when the publish is received (:mod:`fleet.broker_limits`). A publish to a topic the ACL
    forbids is acknowledged and dropped unread, as Mosquitto does for MQTT 3.1.1 (amqtt stored it first and checked
    at delivery); a QoS 2 one keeps only its packet id until its PUBREL, within the in-flight cap."""

    limits = BrokerLimits()
    may_publish: Callable[[Any, str], Awaitable[bool]] | None = None
    _out_count = 0
    _out_bytes = 0
    _refused_ids: set[int] | None = None  # forbidden QoS 2 publishes waiting for their PUBREL (no payload kept)

    async def handle_publish(self, publish_packet: Any) -> None:
        session, lim = self.session, self.limits
        if session is None:
            return
        topic, qos, size = publish_packet.topic_name or "", publish_packet.qos or 0, len(publish_packet.data or b"")
        packet_id = publish_packet.packet_id
        refused = self._refused_ids = self._refused_ids if self._refused_ids is not None else set()
        forbidden = self.may_publish is not None and not await self.may_publish(session, topic)
        why = None
        if qos == 2 and packet_id not in session.inflight_in and packet_id not in refused and (
                len(session.inflight_in) + len(refused) >= lim.max_inflight_messages
                or size + sum(len(m.data or b"") for m in session.inflight_in.values()) > lim.max_inflight_bytes):
            why = (f"over {lim.max_inflight_messages} QoS 2 messages or {lim.max_inflight_bytes} bytes received "
                   "and not released")
        elif qos and not forbidden and session.delivered_message_queue.qsize() >= lim.max_queued_messages:
            why = f"{lim.max_queued_messages} messages received and not yet handled"
        if why is not None:
            log.warning("MQTT client %r (%s:%s) disconnected: %s", session.client_id, session.remote_address,
                        session.remote_port, why)
            if isinstance(self.writer, _GuardedWriter):
                self.writer.abort()  # reads stop now; the reader loop ends and amqtt cleans up
            await self.handle_connection_closed()
        elif forbidden:
            log.warning("MQTT client %r may not publish to %r: dropped", session.client_id, topic)
            if qos == 1:
                await self._send_packet(PubackPacket.build(packet_id))
            elif qos == 2:
                refused.add(packet_id)
                await self._send_packet(PubrecPacket.build(packet_id))
        else:
            await super().handle_publish(publish_packet)

    async def handle_pubrel(self, pubrel: Any) -> None:
        if self._refused_ids and pubrel.packet_id in self._refused_ids:
            self._refused_ids.discard(pubrel.packet_id)
            await self._send_packet(PubcompPacket.build(pubrel.packet_id))
            return
        await super().handle_pubrel(pubrel)

    async def mqtt_publish(self, topic: str, data: bytes | bytearray, qos: int | None, retain: bool,
                           ack_timeout: int | None = None) -> OutgoingApplicationMessage:
        lim, size = self.limits, len(data or b"")
        if qos and (self._out_count >= lim.max_queued_messages or self._out_bytes + size > lim.max_queued_bytes):
            log.warning("MQTT client %r is %d messages (%d bytes) behind: a message on %r dropped",
                        self.session.client_id if self.session else None, self._out_count, self._out_bytes, topic)
            return OutgoingApplicationMessage(None, topic, qos, data, retain)
        self._out_count += 1
        self._out_bytes += size
        try:
            return await super().mqtt_publish(topic, data, qos, retain, ack_timeout)
        finally:
            self._out_count -= 1
            self._out_bytes -= size

    async def stop(self) -> None:
        session = self.session
        try:
            await super().stop()
        finally:
            if session is not None:  # QoS 2 messages never released go with their connection
                session.inflight_in.clear()
                while not session.delivered_message_queue.empty():
                    session.delivered_message_queue.get_nowait()


class FleetBroker(Broker):
    """amqtt's broker, authenticating before it touches a session and checking every retained message
    it sends (see the module's docstring), within :class:`BrokerLimits`."""

    def __init__(self, config: dict[str, Any], limits: BrokerLimits | None = None):
        self.limits = limits or BrokerLimits()
        super().__init__({**config, "session_expiry_interval": self.limits.session_expiry_s})
        self.gate = ConnectionGate(self.limits)

    async def stream_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               listener_name: str) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
        why = self.gate.admit(host)
        if why is not None:
            writer.transport.abort()  # at once, before a byte is read: the descriptor is free on the next turn
            log.warning("MQTT connection from %s refused: %s", where, why)
            return
        bounded = _BoundedReader(reader, writer.transport, where, packet_timeout_s=self.limits.packet_timeout_s)
        guarded = _GuardedWriter(writer, self.limits.write_timeout_s)
        bounded.arm(self.limits.connect_timeout_s, f"no CONNECT within {self.limits.connect_timeout_s:.0f} s")
        try:
            await self._client_connected(listener_name, bounded, guarded)
        except Exception as exc:  # one connection's failure is its own: a line (throttled), never a traceback
            log.warning("MQTT connection from %s ended: %r", where, exc)
        finally:
            bounded.disarm()
            self.gate.closed(host, bounded.handshaking)
            await guarded.close()

    async def _initialize_client_session(self, reader: Any, writer: Any, remote_address: str,
                                         remote_port: int) -> tuple[Any, Any]:
        try:
            handler, session = await _FleetHandler.init_from_connect(reader, writer, self.plugins_manager)
            if isinstance(reader, _BoundedReader):
                reader.disarm()  # the CONNECT came in time
                reader.handshaking = False
                self.gate.connected(str(remote_address))
                reader.idle_timeout_s = self.limits.idle_timeout_s(session.keep_alive)
            session.keep_alive = 0  # the reader above enforces it; amqtt's own timeout only logs
            handler.limits = self.limits
            handler.may_publish = self._may_publish
            authenticated = await self._authenticate(session, None)  # before any stored session is looked at
            if not authenticated:
                session.parent = 0
                handler.attach(session, reader, writer)
                await handler.mqtt_connack_authorize(False)
        except Exception as exc:  # a CONNECT cut short, garbage, a client gone: its socket is closed here
            await writer.close()
            if isinstance(exc, AMQTTError):
                raise
            raise AMQTTError(exc) from exc
        if not authenticated:
            await writer.close()
            raise AMQTTError(f"refused {remote_address}:{remote_port} (client id {session.client_id!r})")
        # from here on, amqtt 0.12.1's own handling of the session
        if session.clean_session:
            if session.client_id:
                await self._delete_session(session.client_id)
            else:
                session.client_id = gen_client_id()
            session.parent = 0
        elif session.client_id in self._sessions:
            existing, _ = self._sessions[session.client_id]
            for attr in ("will_flag", "will_retain", "will_message", "will_topic", "will_qos", "keep_alive",
                         "username", "password"):
                setattr(existing, attr, getattr(session, attr))
            session = existing
            session.parent = 1
        else:
            session.parent = 0
        return handler, session

    async def _may_publish(self, session: Any, topic: str) -> bool:
        return await self._topic_filtering(session, topic, Action.PUBLISH)

    async def _retain_broadcast_message(self, broadcast: dict[str, Any], qos: int, target_session: Any) -> None:
        """A message saved for a client that is away, within its queue's limits (over them, it is dropped)."""
        held = list(getattr(target_session.retained_messages, "_queue", ()))
        size = len(broadcast.get("data") or b"")
        if (len(held) >= self.limits.max_queued_messages
                or size + sum(len(m.data or b"") for m in held) > self.limits.max_queued_bytes):
            log.warning("MQTT client %r is away with a full queue (%d messages): a message on %r dropped",
                        target_session.client_id, len(held), broadcast.get("topic"))
            return
        await super()._retain_broadcast_message(broadcast, qos, target_session)

    def held(self) -> dict[str, int]:
        """What the broker holds now (on its loop): connections, sessions, messages and bytes per kind."""
        sessions = [s for s, _ in self._sessions.values()]
        inflight = [m for s in sessions for m in s.inflight_in.values()]
        saved = [m for s in sessions for m in getattr(s.retained_messages, "_queue", ())]
        return {"connections": self.gate.total, "refused": self.gate.refused, "sessions": len(sessions),
                "inflight_in": len(inflight), "inflight_in_bytes": sum(len(m.data or b"") for m in inflight),
                "saved": len(saved), "saved_bytes": sum(len(m.data or b"") for m in saved),
                "queued_in": sum(s.delivered_message_queue.qsize() for s in sessions)}

    async def _publish_retained_messages_for_subscription(self, subscription: tuple[str, int],
                                                          session: Any) -> None:
        topic_filter, qos = subscription
        if not any(s.client_id == session.client_id for s, _ in self._subscriptions.get(topic_filter, ())):
            return  # after a connect amqtt offers every client's subscriptions: only the session's own count
        handler = self._get_handler(session)
        if handler is None:
            return
        tasks = []
        for topic, retained in list(self._retained_messages.items()):
            if self._matches(topic, topic_filter) and await self._topic_filtering(session, topic, Action.RECEIVE):
                tasks.append(asyncio.ensure_future(
                    handler.mqtt_publish(retained.topic, retained.data, min(qos, retained.qos or qos), retain=True)))
        if tasks:
            await asyncio.wait(tasks)


def _check_amqtt() -> None:
    """FleetBroker replaces private methods of amqtt 0.12 (and copies a part of one): another amqtt
    could route around them, so the embedded broker refuses to start on it."""
    from importlib.metadata import version

    v = version("amqtt")
    if not v.startswith("0.12."):
        raise ConfigError(f"the embedded MQTT broker's identity and ACL checks are made for amqtt 0.12, not {v}: "
                          "install amqtt 0.12 or use Mosquitto (--mqtt-url)")


class EmbeddedBroker:
    def __init__(self, host: str = "127.0.0.1", port: int = 1884, authorizer: Authorizer | None = None,
                 anonymous: bool = False, limits: BrokerLimits | None = None):
        """``authorizer`` checks usernames and passwords; ``anonymous=True`` (tests of other things only)
        lets any client in and does no topic checks. ``limits``: :class:`BrokerLimits` (defaults: its own)."""
        if authorizer is None and not anonymous:
            raise ValueError("the embedded broker needs an authorizer (or anonymous=True)")
        self.host = host
        self.port = port
        self._key = uuid.uuid4().hex
        self.anonymous = anonymous
        self.limits = limits or BrokerLimits()
        self._broker: FleetBroker | None = None
        if authorizer is not None:
            _AUTHORIZERS[self._key] = authorizer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        _check_amqtt()
        ready = threading.Event()
        logging.getLogger("transitions").setLevel(logging.WARNING)
        logging.getLogger("amqtt").setLevel(logging.CRITICAL)  # start-up failures are reported below, once

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)

            async def main() -> None:
                plugins: dict[str, Any] = (
                    {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
                    if self.anonymous else
                    {"edgefleet.fleet.broker.AclAuthPlugin": {"key": self._key},
                     "edgefleet.fleet.broker.AclTopicPlugin": {"key": self._key}})
                cfg = {"listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                       "plugins": plugins}
                broker = self._broker = FleetBroker(cfg, self.limits)
                self._stop = asyncio.Event()
                try:
                    await broker.start()
                except BaseException as exc:
                    self._error = exc
                    ready.set()
                    return
                ready.set()
                await self._stop.wait()
                await broker.shutdown()

            try:
                loop.run_until_complete(main())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="embedded-mqtt", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise ConfigError(f"the embedded MQTT broker did not start on {self.host}:{self.port} in {timeout_s}s")
        if self._error is not None:
            raise ConfigError(f"the embedded MQTT broker could not listen on {self.host}:{self.port} "
                              f"({self._error}); pick another --embedded-mqtt-port or use --mqtt-url") from self._error

    def held(self, timeout_s: float = 10.0) -> dict[str, int]:
        """:meth:`FleetBroker.held`, read on the broker's own loop."""
        if self._loop is None or self._broker is None:
            raise RuntimeError("the embedded broker is not running")

        async def read(broker: FleetBroker) -> dict[str, int]:
            return broker.held()

        return asyncio.run_coroutine_threadsafe(read(self._broker), self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        _AUTHORIZERS.pop(self._key, None)
