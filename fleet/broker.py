"""The embedded MQTT broker (amqtt), for a demo or a small site with nothing to set up.

It runs on its own event loop in a daemon thread and binds 127.0.0.1 unless told otherwise.
Production fleets use Mosquitto (or a clustered broker) through ``--mqtt-url``.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from protocol.errors import ConfigError

__all__ = ["EmbeddedBroker"]


class EmbeddedBroker:
    def __init__(self, host: str = "127.0.0.1", port: int = 1884):
        self.host = host
        self.port = port
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

                cfg = {
                    "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                    "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
                }
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
