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
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.utils import gen_client_id

from edgefleet.fleet.acl import MAX_PACKET_BYTES, allowed, client_id_allowed
from edgefleet.protocol.errors import ConfigError

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
    whose remaining length is over ``limit`` as soon as that length is read."""

    def __init__(self, reader: asyncio.StreamReader, peer: str, limit: int = MAX_PACKET_BYTES):
        super().__init__(reader)
        self.peer, self.limit = peer, limit
        self._left = 0  # body bytes of the current packet still to come; 0: a fixed header comes next
        self._header: list[int] = []  # the fixed header's bytes read so far

    async def read(self, n: int = -1) -> bytes:
        if n < 0:  # amqtt's MQTT parser never reads to the end of the stream
            raise PacketTooLarge(f"{self.peer}: an unbounded read")
        if self._left:
            if n > self._left:
                raise PacketTooLarge(f"{self.peer}: a read of {n} bytes past the packet's end")
            data = await super().read(n)
            self._left -= len(data)
            return data
        data = await super().read(n)
        for byte in data:
            self._header_byte(byte)
        return data

    def _header_byte(self, byte: int) -> None:
        self._header.append(byte)
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


class FleetBroker(Broker):
    """amqtt's broker, authenticating before it touches a session and checking every retained message
    it sends (see the module's docstring)."""

    async def stream_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               listener_name: str) -> None:
        peer = writer.get_extra_info("peername")
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
        await self._client_connected(listener_name, _BoundedReader(reader, where), StreamWriterAdapter(writer))

    async def _initialize_client_session(self, reader: Any, writer: Any, remote_address: str,
                                         remote_port: int) -> tuple[Any, Any]:
        try:
            handler, session = await BrokerProtocolHandler.init_from_connect(reader, writer, self.plugins_manager)
        except MQTTError:
            await writer.close()
            raise
        except (AMQTTError, NoDataError) as exc:
            raise AMQTTError(exc) from exc
        if not await self._authenticate(session, None):  # before any stored session is looked at
            session.parent = 0
            handler.attach(session, reader, writer)
            await handler.mqtt_connack_authorize(False)
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
        delay = self.config.get("timeout-disconnect-delay", 0)
        if session.keep_alive > 0 and isinstance(delay, int):
            session.keep_alive += delay
        return handler, session

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
                 anonymous: bool = False):
        """``authorizer`` checks usernames and passwords; ``anonymous=True`` (tests of other things only)
        lets any client in and does no topic checks."""
        if authorizer is None and not anonymous:
            raise ValueError("the embedded broker needs an authorizer (or anonymous=True)")
        self.host = host
        self.port = port
        self._key = uuid.uuid4().hex
        self.anonymous = anonymous
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
                broker = FleetBroker(cfg)
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

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        _AUTHORIZERS.pop(self._key, None)
