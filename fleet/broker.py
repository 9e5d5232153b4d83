"""The embedded MQTT broker (amqtt), for a demo or a small site with nothing to set up.

It runs on its own event loop in a daemon thread and binds 127.0.0.1 unless told otherwise.
Production fleets use Mosquitto (or a clustered broker) through ``--mqtt-url``.

It enforces the same rule as Mosquitto's password and ACL files (:mod:`fleet.acl`): a client connects
only with an active account (the fleet's, or a device's from enrollment), a device publishes only its
own reports, telemetry and status and reads only its own desired state and acks, and a will message
may only name a topic its client could publish to (amqtt does not check wills itself). Anonymous
clients are refused at connect.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin

from fleet.acl import allowed
from protocol.errors import ConfigError

__all__ = ["Authorizer", "EmbeddedBroker"]


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
        ready = threading.Event()
        logging.getLogger("transitions").setLevel(logging.WARNING)
        logging.getLogger("amqtt").setLevel(logging.CRITICAL)  # start-up failures are reported below, once

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)

            async def main() -> None:
                from amqtt.broker import Broker

                plugins: dict[str, Any] = (
                    {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
                    if self.anonymous else
                    {"fleet.broker.AclAuthPlugin": {"key": self._key},
                     "fleet.broker.AclTopicPlugin": {"key": self._key}})
                cfg = {"listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                       "plugins": plugins}
                broker = Broker(cfg)
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
