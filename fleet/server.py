"""Assembling and running a fleet server: keys, TUF repository, database, broker, bridge, HTTP."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from fleet.auth import TokenStore
from fleet.bridge import MqttBridge
from fleet.broker import EmbeddedBroker
from fleet.db import make_engine
from fleet.keys import KeyStore
from fleet.service import FleetService
from fleet.tuf_repo import Repository

__all__ = ["FleetConfig", "FleetServer"]

log = logging.getLogger("edgefleet.fleet")


@dataclass(frozen=True)
class FleetConfig:
    data_dir: Path
    keys_dir: Path
    host: str = "127.0.0.1"
    port: int = 8700
    db_url: str | None = None  # default: sqlite in data_dir
    mqtt_url: str | None = None  # None: start the embedded broker
    embedded_mqtt_host: str = "127.0.0.1"
    embedded_mqtt_port: int = 1884
    agent_mqtt_url: str | None = None  # what agents should dial, if it differs from mqtt_url
    public_url: str | None = None  # what agents should dial for HTTP; default http://host:port
    shared_subscription_group: str | None = None
    resign_interval_s: float = 600.0
    max_upload_bytes: int = 1024**3  # bigger bundle uploads get 413
    rollout_tick_s: float = 0.25  # how often the rollout engine looks at waves (soaks, gates, next wave)
    accept_unknown_devices: bool = True  # False: MQTT from unregistered devices is counted and dropped
    replica_id: str | None = None  # names this replica in rollout leases; default random


class FleetServer:
    def __init__(self, config: FleetConfig):
        self.config = config
        self.broker: EmbeddedBroker | None = None
        self._stop = threading.Event()
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.repo = Repository(config.data_dir / "tuf", KeyStore(config.keys_dir))
        self.repo.init()
        db_url = config.db_url or f"sqlite:///{(config.data_dir / 'fleet.db').resolve()}"
        self.engine, self.sessions = make_engine(db_url)
        if config.mqtt_url is None:
            self.broker = EmbeddedBroker(config.embedded_mqtt_host, config.embedded_mqtt_port)
            self.mqtt_url = self.broker.url
        else:
            self.mqtt_url = config.mqtt_url
        self.bridge = MqttBridge(self.mqtt_url, shared_group=config.shared_subscription_group)
        self.service = FleetService(self.sessions, self.repo, self.bridge, config.accept_unknown_devices,
                                    config.replica_id)
        self.tokens = TokenStore(self.sessions)
        self.tokens.bootstrap_admin(config.data_dir / "admin-token")
        self.bridge.rejections = self.service.rejections
        self.bridge.on_status = self.service.handle_status
        self.bridge.on_reported = self.service.handle_reported
        self.bridge.on_telemetry = self.service.handle_telemetry
        self.bridge.on_connected = self.service.republish_desired
        public = config.public_url or f"http://{config.host}:{config.port}"
        self.bootstrap = {
            "mqtt_url": config.agent_mqtt_url or self.mqtt_url,
            "tuf_metadata_url": f"{public}/tuf/metadata/",
            "tuf_targets_url": f"{public}/tuf/targets/",
        }

    def app(self):
        from fleet.api import create_app

        return create_app(self.service, self.repo, self.bootstrap, self.bridge.connected.is_set,
                          self.config.max_upload_bytes, self.tokens)

    def _resign_loop(self) -> None:
        while not self._stop.wait(self.config.resign_interval_s):
            try:
                if self.repo.refresh_expiring():
                    log.info("re-signed TUF metadata close to expiry")
            except Exception:
                log.exception("re-signing TUF metadata failed")

    def _rollout_loop(self) -> None:
        """The rollout engine: every tick, advance the rollouts this replica holds the lease of."""
        while not self._stop.wait(self.config.rollout_tick_s):
            try:
                self.service.rollouts.tick()
            except Exception:
                log.exception("rollout tick failed; trying again at the next one")

    def start_background(self) -> None:
        if self.broker is not None:
            self.broker.start()
        self.bridge.start()
        self.repo.refresh_expiring()
        threading.Thread(target=self._resign_loop, name="tuf-resign", daemon=True).start()
        self._ticker = threading.Thread(target=self._rollout_loop, name="rollout-engine", daemon=True)
        self._ticker.start()

    def stop_background(self) -> None:
        self._stop.set()
        if getattr(self, "_ticker", None) is not None:
            self._ticker.join(10)
        try:
            self.service.rollouts.release_leases()
        except Exception:
            log.exception("could not release rollout leases (they expire by themselves)")
        self.bridge.stop()
        if self.broker is not None:
            self.broker.stop()
        self.engine.dispose()

    def serve(self) -> None:
        """Run until SIGINT/SIGTERM."""
        import uvicorn

        self.start_background()
        try:
            uvicorn.run(self.app(), host=self.config.host, port=self.config.port, log_level="warning",
                        access_log=False)
        finally:
            self.stop_background()
