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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from edgefleet.agent.config import AgentConfig
from edgefleet.agent.link import MqttSecurity
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.fsutil import atomic_write

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


def _enroll(config: AgentConfig, token: str, timeout_s: float) -> tuple[str, str]:
    req = urllib.request.Request(f"{config.fleet_url}/api/v1/enroll", data=json.dumps({"token": token}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            doc: dict[str, Any] = json.loads(r.read(64 * 1024))
    except urllib.error.HTTPError as exc:
        if exc.code in (400, 401, 403, 404, 422):
            try:
                msg = json.loads(exc.read(64 * 1024)).get("error", "")
            except ValueError:
                msg = ""
            raise EnrollmentRefused(f"the fleet refused the enrollment token (HTTP {exc.code}: {msg}); ask an "
                                    f"operator for a new one: edgefleet fleet enroll {config.device_id}") from exc
        raise  # a server error: the caller retries
    if doc.get("device_id") != config.device_id:
        raise EnrollmentRefused(f"the enrollment token was issued for device {doc.get('device_id')!r}, not "
                                f"{config.device_id!r}; its credentials are not used")
    return str(doc["mqtt_username"]), str(doc["mqtt_password"])


def mqtt_security(config: AgentConfig, mqtt_auth: bool, timeout_s: float = 10.0) -> MqttSecurity:
    """Resolve the credentials (enrolling once if needed). Raises EnrollmentRefused or ConfigError for
    what only a person can fix, and OSError/URLError for what a retry may fix."""
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
        stored = _enroll(config, config.enroll_token, timeout_s)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"username": stored[0], "password": stored[1]}).encode())
        os.chmod(path, 0o600)
        log.info("enrolled as %s; credentials kept in %s", stored[0], path)
    return security(None, None) if stored is None else security(*stored)
