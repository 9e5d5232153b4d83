"""The device's MQTT identity: configured credentials, or ones it got once by enrolling.

    1. ``mqtt_username``/``mqtt_password`` in the config win;
    2. else the credentials an earlier enrollment stored in ``<data_dir>/mqtt-credentials.json`` (0600);
    3. else, if the fleet says its broker needs credentials, trade ``enroll_token`` (a one-time token
       from ``edgefleet fleet enroll DEVICE``) for them with ``POST /api/v1/enroll`` and store them;
    4. else anonymous (a broker that takes anyone, e.g. a lab Mosquitto).

A token is spent on the first successful call, so the credentials are written before they are used,
atomically: a crash between the two costs nothing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ...protocol.errors import ConfigError
from ...protocol.fsutil import atomic_write
from ..config import AgentConfig
from ..errors import FetchError
from .fetch import FleetHttp
from .mqtt import MqttSecurity

__all__ = ["CREDENTIALS_FILE", "EnrollmentRefused", "mqtt_security"]

log = logging.getLogger("edgefleet.agent.enroll")
CREDENTIALS_FILE = "mqtt-credentials.json"


class EnrollmentRefused(ConfigError):
    """The fleet refused the enrollment token (unknown, used, expired, or for another device)."""


def _stored(path: Path) -> tuple[str, str] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return str(doc["username"]), str(doc["password"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); delete it and enroll again with a new token") from exc


def _enroll(config: AgentConfig, token: str, http: FleetHttp) -> tuple[str, str]:
    url = f"{config.fleet_url}/api/v1/enroll"
    status, data = http.get(url, method="POST", body=json.dumps({"token": token}).encode(),
                            headers={"Content-Type": "application/json"})
    if status in (400, 401, 403, 404, 422):
        try:
            msg = json.loads(data).get("error", "")
        except (ValueError, AttributeError):
            msg = ""
        raise EnrollmentRefused(f"the fleet refused the enrollment token (HTTP {status}: {msg}); ask an "
                                f"operator for a new one: edgefleet fleet enroll {config.device_id}")
    if status != 200:  # a server error: the caller retries
        raise FetchError(f"POST {url}: HTTP {status}")
    try:
        doc: dict[str, Any] = json.loads(data)
        if doc.get("device_id") != config.device_id:
            raise EnrollmentRefused(f"the enrollment token was issued for device {doc.get('device_id')!r}, not "
                                    f"{config.device_id!r}; its credentials are not used")
        return str(doc["mqtt_username"]), str(doc["mqtt_password"])
    except (ValueError, AttributeError, KeyError) as exc:
        raise FetchError(f"POST {url}: an answer without credentials ({exc!r})") from exc


def mqtt_security(config: AgentConfig, mqtt_auth: bool, http: FleetHttp | None = None) -> MqttSecurity:
    """Resolve the credentials (enrolling once if needed; ``http``: how, bounded as agent/link/fetch.py says).
    Raises EnrollmentRefused or ConfigError for what only a person can fix, and FetchError for what a retry
    may fix."""
    def security(username: str | None, password: str | None) -> MqttSecurity:
        return MqttSecurity(username, password, ca_file=config.mqtt_ca_file, cert_file=config.mqtt_cert_file,
                            key_file=config.mqtt_key_file)

    if config.mqtt_username is not None:
        return security(config.mqtt_username, config.mqtt_password)
    path = config.data_dir / CREDENTIALS_FILE
    stored = _stored(path)
    if stored is None and mqtt_auth:
        if not config.enroll_token:
            raise ConfigError("the fleet's MQTT broker needs this device's credentials: start the agent with "
                              f"--enroll-token (from 'edgefleet fleet enroll {config.device_id}'), or set "
                              "mqtt_username and mqtt_password")
        stored = _enroll(config, config.enroll_token, http or FleetHttp())
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"username": stored[0], "password": stored[1]}).encode())
        os.chmod(path, 0o600)
        log.info("enrolled as %s; credentials kept in %s", stored[0], path)
    return security(None, None) if stored is None else security(*stored)
