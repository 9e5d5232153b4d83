"""Assembling and running a fleet server: keys, TUF repository, database, broker, bridge, HTTP."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..protocol.errors import ConfigError
from ..protocol.httpguard import HttpLimits, guarded
from .acl import FLEET_USER, Account, ActiveAccounts, reload_mosquitto, write_mosquitto_files
from .auth import TokenStore
from .bridge import RETAINED_STATUS, MqttBridge
from .broker_limits import BrokerLimits
from .db import make_engine
from .enroll import Enrollment
from .ingest import IngestWorker
from .keys import KeyStore
from .presence import PresenceSweeper
from .reconcile import Reconciler
from .service import FleetService
from .tuf_repo import Repository
from .tuf_store import DirStore, SqlStore

if TYPE_CHECKING:
    from .broker import EmbeddedBroker

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
    # the embedded broker's deadlines, connection caps and flow limits (fleet.broker_limits); None: its defaults
    embedded_mqtt_limits: BrokerLimits | None = None
    agent_mqtt_url: str | None = None  # what agents should dial, if it differs from mqtt_url
    public_url: str | None = None  # what agents should dial for HTTP; default http://host:port
    shared_subscription_group: str | None = None
    resign_interval_s: float = 600.0
    max_upload_bytes: int = 1024**3  # bigger bundle uploads get 413
    # HTTP connections (protocol/httpguard.py): at most this many at once (and, with the embedded broker, half of
    # the descriptors RLIMIT_NOFILE leaves past 128 kept; the broker has the other half), of them at most
    # http_max_connections_per_peer from one address; a request head must arrive within http_head_timeout_s, a
    # keep-alive connection idle for http_idle_timeout_s is closed
    http_max_connections: int = 1024
    http_max_connections_per_peer: int = 128
    http_head_timeout_s: float = 10.0
    http_idle_timeout_s: float = 5.0
    rollout_tick_s: float = 0.25  # how often the rollout driver looks at waves (soaks, gates, next wave)
    accept_unknown_devices: bool = True  # False: MQTT from unregistered devices is counted and dropped
    replica_id: str | None = None  # names this replica in rollout leases; default random
    # MQTT identity. The embedded broker always enforces per-device accounts and topic ACLs (fleet.acl);
    # the fleet's own account gets a fresh random password at each start. With an external broker:
    mqtt_username: str | None = None  # the fleet's account there (e.g. edgefleet-fleet); None: anonymous
    mqtt_password: str | None = None  # default: $EDGEFLEET_MQTT_PASSWORD
    mosquitto_password_file: Path | None = None  # written (with the ACL file) whenever credentials change
    # the fleet's own listener's password file (the fleet's account alone: fleet.acl.mosquitto_conf), likewise
    mosquitto_fleet_password_file: Path | None = None
    mosquitto_acl_file: Path | None = None
    mosquitto_pid_file: Path | None = None  # Mosquitto's pid file: SIGHUP makes it reread both files
    mqtt_auth: bool | None = None  # do agents need credentials? default: yes unless an anonymous external broker
    mqtt_ca_file: Path | None = None  # mqtts:// brokers: the CA that signed the broker's certificate
    mqtt_cert_file: Path | None = None  # mutual TLS: the fleet's client certificate and key
    mqtt_key_file: Path | None = None
    # a target still waiting for a report this long has its device's retained report read again (the broker
    # may have dropped the fleet's copy: fleet.reconcile); 0 turns it off
    report_reconcile_after_s: float = 5.0
    # fleet.presence: a device not heard from within max(presence_min_s, presence_intervals x its telemetry interval)
    # is offline, whether or not its will arrived; presence_min_s 0: its will alone takes it offline
    presence_min_s: float = 30.0
    presence_intervals: float = 3.0
    # where the TUF repository lives: "db" (the fleet's database: replicas share nothing else), "dir" (data_dir/tuf),
    # "auto": db on PostgreSQL, dir on SQLite
    tuf_store: str = "auto"


class FleetServer:
    def __init__(self, config: FleetConfig):
        self.config = config
        self.broker: EmbeddedBroker | None = None
        self._stop = threading.Event()
        config.data_dir.mkdir(parents=True, exist_ok=True)
        db_url = config.db_url or f"sqlite:///{(config.data_dir / 'fleet.db').resolve()}"
        self.engine, self.sessions = make_engine(db_url)
        tuf_store = config.tuf_store if config.tuf_store != "auto" else (
            "db" if self.engine.dialect.name == "postgresql" else "dir")
        store = SqlStore(self.engine) if tuf_store == "db" else DirStore(config.data_dir / "tuf")
        self.repo = Repository(store, KeyStore(config.keys_dir), upload_dir=config.data_dir / "tuf")
        self.repo.init()
        self.accounts = ActiveAccounts()
        self.enrollment = Enrollment(self.engine, self._credentials_changed)
        mqtt_user, mqtt_password = config.mqtt_username, config.mqtt_password or os.environ.get(
            "EDGEFLEET_MQTT_PASSWORD")
        if config.mqtt_url is None:
            try:  # amqtt is edgefleet[broker]: a fleet on Mosquitto never imports it
                from .broker import EmbeddedBroker
            except ImportError as exc:
                raise ConfigError(f"the embedded MQTT broker needs edgefleet[broker] ({exc.name} is not installed): "
                                  "pip install 'edgefleet[broker]', or set mqtt_url to an external broker") from exc
            self.broker = EmbeddedBroker(config.embedded_mqtt_host, config.embedded_mqtt_port, self.accounts,
                                         limits=config.embedded_mqtt_limits)
            self.mqtt_url = self.broker.url
            mqtt_user, mqtt_password = FLEET_USER, secrets.token_urlsafe(24)
            self.enrollment.set_fleet_password(mqtt_password)
        else:
            self.mqtt_url = config.mqtt_url
            if config.mosquitto_password_file is not None and mqtt_user and mqtt_password:
                self.enrollment.set_fleet_password(mqtt_password)  # its hash goes into Mosquitto's file
        self._credentials_changed(self.enrollment.accounts())
        self.mqtt_auth = config.mqtt_auth if config.mqtt_auth is not None else (
            config.mqtt_url is None or mqtt_user is not None)
        self.bridge = MqttBridge(self.mqtt_url, shared_group=config.shared_subscription_group,
                                 username=mqtt_user, password=mqtt_password, ca_file=config.mqtt_ca_file,
                                 cert_file=config.mqtt_cert_file, key_file=config.mqtt_key_file)
        self.service = FleetService(self.sessions, self.repo, self.bridge, config.accept_unknown_devices,
                                    config.replica_id)
        self.tokens = TokenStore(self.sessions)
        self.tokens.bootstrap_admin(config.data_dir / "admin-token")
        self.bridge.rejections = self.service.rejections
        ingest = self.service.ingest
        self.bridge.on_status = ingest.handle_status
        self.bridge.on_reported = ingest.handle_reported
        self.bridge.on_telemetry = ingest.handle_telemetry
        # retained copies first: in one batch, a device's live status wins over what the broker had kept
        self.ingest = IngestWorker({RETAINED_STATUS: ingest.handle_retained_statuses,
                                    "status": ingest.handle_statuses, "reported": ingest.handle_reports,
                                    "telemetry": ingest.store_telemetry}, self.service.rejections,
                                   self.bridge.stored)
        ingest.presence_min_s = config.presence_min_s
        ingest.presence_intervals = config.presence_intervals
        self.presence = PresenceSweeper(self.sessions, self.bridge.connected_for, backlog=self.ingest.backlog)
        self.bridge.ingest = self.ingest
        self.bridge.on_connected = self.service.rollouts.republish_desired
        self.reconciler = Reconciler(self.sessions, self.bridge.reread_reported,
                                     config.report_reconcile_after_s or 5.0, reread_status=self.bridge.reread_status,
                                     backlog=self.ingest.backlog, intake=self.bridge.received.__getitem__)
        public = config.public_url or f"http://{config.host}:{config.port}"
        self.bootstrap = {
            "mqtt_url": config.agent_mqtt_url or self.mqtt_url,
            "tuf_metadata_url": f"{public}/tuf/metadata/",
            "tuf_targets_url": f"{public}/tuf/targets/",
            "mqtt_auth": self.mqtt_auth,  # True: agents need credentials (POST /api/v1/enroll with a token)
        }

    def _credentials_changed(self, accounts: list[Account]) -> None:
        """Every broker learns the new set of accounts: the embedded one at once, Mosquitto through its
        password and ACL files and a SIGHUP."""
        self.accounts.update(accounts)
        cfg = self.config
        if cfg.mosquitto_password_file is None or cfg.mosquitto_acl_file is None:
            return
        n = write_mosquitto_files(accounts, cfg.mosquitto_password_file, cfg.mosquitto_acl_file,
                                  cfg.mosquitto_fleet_password_file)
        if cfg.mosquitto_pid_file is not None:
            try:
                reload_mosquitto(int(cfg.mosquitto_pid_file.read_text().strip()))
            except (OSError, ValueError) as exc:
                log.error("wrote %d MQTT accounts but could not signal Mosquitto (pid file %s): %s; it keeps "
                          "the old accounts until it is reloaded", n, cfg.mosquitto_pid_file, exc)

    def app(self):
        from .api import create_app

        return create_app(self.service, self.repo, self.bootstrap, self.health,
                          self.config.max_upload_bytes, self.tokens, self.enrollment, self._replica_stats)

    def http_server(self) -> Any:
        """The fleet's uvicorn server (not yet serving): the app on uvicorn's httptools protocol, held to the
        connection limits (protocol/httpguard.py)."""
        import uvicorn
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        c = self.config
        limits = HttpLimits(head_timeout_s=c.http_head_timeout_s, idle_timeout_s=c.http_idle_timeout_s,
                            body_grace_s=c.http_head_timeout_s, max_connections=c.http_max_connections,
                            max_connections_per_peer=c.http_max_connections_per_peer,
                            fd_share=0.5 if self.broker is not None else 1.0)
        return uvicorn.Server(uvicorn.Config(self.app(), host=c.host, port=c.port, log_level="warning",
                                             access_log=False, lifespan="off", http=guarded(HttpToolsProtocol, limits),
                                             timeout_keep_alive=c.http_idle_timeout_s))  # type: ignore[arg-type]

    RECENT_FAILURE_S = 300.0  # a loop restarted this recently keeps health "degraded"

    def health(self) -> dict[str, Any]:
        """What ``/api/v1/health`` says: "ok" only while MQTT messages can reach the database."""
        problems = []
        connected = self.bridge.connected.is_set() and self.bridge.alive()
        if not self.bridge.alive():
            problems.append("the MQTT network loop is not running")
        elif not connected and self.bridge.refused_subscriptions:
            problems.append(f"the MQTT broker {self.bridge.host}:{self.bridge.port} refused the fleet's subscriptions "
                            f"to {', '.join(self.bridge.refused_subscriptions)}: give the fleet's MQTT user read "
                            "access to them in the broker's ACL, then restart the fleet")
        elif not connected:
            problems.append(f"not connected to the MQTT broker {self.bridge.host}:{self.bridge.port}")
        if not self.ingest.alive():
            problems.append("the ingest loop is not running")
        now = time.time()
        for what, failure in (("MQTT network loop", self.bridge.last_failure),
                              ("ingest loop", self.ingest.last_failure)):
            if failure is not None and now - failure[0] < self.RECENT_FAILURE_S:
                problems.append(f"the {what} died {now - failure[0]:.0f}s ago and was restarted: {failure[1]}")
        if self.ingest.dropped:
            problems.append(f"{self.ingest.dropped} MQTT messages dropped: the database fell behind")
        return {"status": "degraded" if problems else "ok", "mqtt_connected": connected,
                "mqtt_restarts": self.bridge.restarts, "ingest_restarts": self.ingest.restarts,
                "ingest_backlog": self.ingest.backlog(), "problems": problems}

    def _replica_stats(self) -> dict[str, Any]:
        return {"id": self.service.driver.owner, "mqtt_handled": dict(self.bridge.handled),
                "mqtt_rejected": self.bridge.rejected, "ingest_backlog": self.ingest.backlog(),
                "ingest_batches": self.ingest.batches, "ingest_messages": self.ingest.batched,
                "reports_reread": self.reconciler.requested, "statuses_reread": self.reconciler.status_requested,
                # reconciler ticks that read back no reports / statuses because their live stream flowed
                "reread_deferred": dict(self.reconciler.deferred),
                "presence_expired": self.presence.expired,
                # desired states paho refused (its queue full) that wait to go out again / that went out again
                "publishes_retrying": self.bridge.retrying(), "publishes_resent": self.bridge.republished}

    def _resign_loop(self) -> None:
        while not self._stop.wait(self.config.resign_interval_s):
            try:
                if self.repo.refresh_expiring():
                    log.info("re-signed TUF metadata close to expiry")
            except Exception:
                log.exception("re-signing TUF metadata failed")

    def _rollout_loop(self) -> None:
        """The rollout driver: every tick, advance the rollouts this replica holds the lease of."""
        while not self._stop.wait(self.config.rollout_tick_s):
            try:
                self.service.driver.tick()
            except Exception:
                log.exception("rollout tick failed; trying again at the next one")

    def start_background(self) -> None:
        if self.broker is not None:
            self.broker.start()
        self.ingest.start()
        self.bridge.start()
        self.repo.refresh_expiring()
        threading.Thread(target=self._resign_loop, name="tuf-resign", daemon=True).start()
        self._ticker = threading.Thread(target=self._rollout_loop, name="rollout-driver", daemon=True)
        self._ticker.start()
        if self.config.report_reconcile_after_s > 0:
            threading.Thread(target=self.reconciler.run, args=(self._stop,), name="report-reconcile",
                             daemon=True).start()
        if self.config.presence_min_s > 0:  # a sweep each third of the shortest bound, at most every 5 s
            threading.Thread(target=self.presence.run, args=(self._stop, min(5.0, self.config.presence_min_s / 3)),
                             name="presence", daemon=True).start()

    def stop_background(self) -> None:
        self._stop.set()
        if getattr(self, "_ticker", None) is not None:
            self._ticker.join(10)
        try:
            self.service.driver.release_leases()
        except Exception:
            log.exception("could not release rollout leases (they expire by themselves)")
        self.bridge.stop()
        self.ingest.stop()
        if self.broker is not None:
            self.broker.stop()
        self.engine.dispose()

    def serve(self) -> None:
        """Run until SIGINT/SIGTERM."""
        import gc

        self.start_background()
        # A long-lived server that decodes thousands of small messages a second: the startup objects move out
        # of the collector's way, and young-generation collections run every 50,000 allocations instead of
        # every 700 (telemetry decode 2x, store 15% cheaper in the ingest microbenchmark); memory held by
        # cyclic garbage grows by at most that many objects.
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        try:
            self.http_server().run()
        finally:
            self.stop_background()
