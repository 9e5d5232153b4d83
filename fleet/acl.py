"""Who may publish and subscribe where on MQTT: one rule, enforced by Mosquitto and the embedded broker.

    the fleet (user ``edgefleet-fleet``)  read and write everything under edgefleet/v1/devices/
    device <id> (user <id>)               write its own reported, telemetry, status;
                                          read its own desired and ack
    anyone else                           nothing (anonymous clients are refused at connect)

One identity per device: a device's connection is bound to its account, so no one can take over
another device's session by sending its client id (:func:`client_id_allowed`). The embedded broker
refuses a device whose client id is not its own (``protocol.mqtt.client_id``) before it touches any
session. Mosquitto cannot refuse on a password file, so its device listeners set
``use_username_as_clientid true``: whatever a device sends, its client id becomes its username, and
the only session a device can replace is its own. The fleet's replicas share one account with
random client ids, so they connect on a listener of their own whose password file holds only the
fleet's account (:func:`mosquitto_conf` writes both listeners, as tested).

Mosquitto gets a password file (PBKDF2-SHA512, its ``$7$`` format) and an ACL file written
atomically from the device credentials; :func:`reload_mosquitto` sends SIGHUP so it rereads both
without dropping anyone. The embedded amqtt broker asks :func:`allowed` through the plugins in
``fleet.broker``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..protocol import mqtt as proto
from ..protocol.fsutil import atomic_write
from .broker_limits import BrokerLimits

__all__ = ["FLEET_USER", "LEGACY_AGENT_PREFIX", "MAX_DEVICE_CONNECTIONS", "MAX_PACKET_BYTES", "MAX_PAYLOAD_BYTES",
           "Account", "ActiveAccounts", "allowed", "client_id_allowed", "device_listener_limits", "flow_limits_conf",
           "hash_password", "mosquitto_conf", "reload_mosquitto", "verify_password", "write_mosquitto_files"]

FLEET_USER = "edgefleet-fleet"
# One message's size on the broker, from the protocol's: every receiver (fleet and agent) refuses a payload over
# proto.MAX_MESSAGE_BYTES (256 KiB) unread, so a broker has no reason to store or forward a bigger one. What the
# parts send is far below it (an ack of 1,000 seqs is about 20 KB; a report with every timing the protocol allows,
# a few KB). A packet adds to its payload a fixed header (5 bytes at most), the topic (2 + up to 90 bytes), a
# packet id (2) and MQTT 5 properties: MAX_PACKET_BYTES leaves 1 KiB for them. Both brokers disconnect a client
# that sends a bigger packet before they read its body (Mosquitto's max_packet_size; FleetBroker's reader).
MAX_PAYLOAD_BYTES = proto.MAX_MESSAGE_BYTES
MAX_PACKET_BYTES = MAX_PAYLOAD_BYTES + 1024
DEVICE_WRITES = ("reported", "telemetry", "status")
DEVICE_READS = ("desired", "ack")
LEGACY_AGENT_PREFIX = "edgefleet-agent-"  # agents before 2026-11 connected as edgefleet-agent-<device id>
# one Mosquitto process: at most this many device connections per listener (give its unit LimitNOFILE this + 1,000:
# one process here may hold 20,000 descriptors)
MAX_DEVICE_CONNECTIONS = 18_000
PBKDF2_ITERATIONS = 101  # Mosquitto 2.0's own default for $7$ hashes; the passwords are 32 random bytes


@dataclass(frozen=True)
class Account:
    username: str  # a device id, or FLEET_USER
    password_hash: str  # hash_password() output


def hash_password(password: str, salt: bytes | None = None) -> str:
    """Mosquitto's ``$7$`` hash (PBKDF2-HMAC-SHA512); also how the fleet stores device passwords."""
    salt = salt or secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    return f"$7${PBKDF2_ITERATIONS}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password(password: str, stored: str) -> bool:
    try:
        _, kind, iterations, salt, digest = stored.split("$")
        if kind != "7":
            return False
        got = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(salt), int(iterations))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(base64.b64encode(got).decode(), digest)


class ActiveAccounts:
    """The active MQTT accounts, as the embedded broker checks them (its ``fleet.broker.Authorizer``; the fleet
    server refreshes it on every change)."""

    def __init__(self) -> None:
        self._hashes: dict[str, str] = {}

    def update(self, accounts: list[Account]) -> None:
        self._hashes = {a.username: a.password_hash for a in accounts}

    def is_active(self, username: str | None) -> bool:
        return (username or "") in self._hashes

    def authenticate(self, username: str | None, password: str | None) -> bool:
        stored = self._hashes.get(username or "")
        return stored is not None and password is not None and verify_password(password, stored)


def allowed(username: str | None, topic: str, action: Literal["publish", "subscribe"]) -> bool:
    """The one rule. ``topic`` is a topic name (publish) or a topic filter (subscribe)."""
    if not username:
        return False
    if topic.startswith("$share/"):  # $share/<group>/<filter>: judged by the filter
        parts = topic.split("/", 2)
        if len(parts) < 3:
            return False
        topic = parts[2]
    if username == FLEET_USER:
        return topic.startswith(proto.PREFIX + "/") or topic == proto.PREFIX + "/#"
    if not proto.device_id_ok(username):
        return False
    kinds = DEVICE_WRITES if action == "publish" else DEVICE_READS
    # a device may subscribe to exactly its own topics: no wildcard can widen the filter
    if "+" in topic or "#" in topic:
        return False
    return any(topic == proto.topic(username, k) for k in kinds)  # type: ignore[arg-type]


def client_id_allowed(username: str | None, client_id: str | None) -> bool:
    """Whether ``username`` may connect as ``client_id``. A device only as its own: its device id
    (what agents send, and what Mosquitto's ``use_username_as_clientid`` makes it) or
    ``edgefleet-agent-<id>`` (what agents sent before), so it can never replace another device's
    session (``edgefleet-`` names are reserved for the fleet). The fleet's replicas share one account
    and each connects with a random id, so the fleet may use any."""
    if not username or not client_id:
        return False
    if username == FLEET_USER:
        return True
    return proto.device_id_ok(username) and client_id in (username, LEGACY_AGENT_PREFIX + username)


def acl_text() -> str:
    """The Mosquitto ACL file: the same rule as :func:`allowed` (``%u`` is the username)."""
    lines = [f"user {FLEET_USER}", f"topic readwrite {proto.PREFIX}/#", ""]
    lines += [f"pattern write {proto.PREFIX}/%u/{k}" for k in DEVICE_WRITES]
    lines += [f"pattern read {proto.PREFIX}/%u/{k}" for k in DEVICE_READS]
    return "\n".join(lines) + "\n"


def write_mosquitto_files(accounts: Iterable[Account], password_file: Path, acl_file: Path,
                          fleet_password_file: Path | None = None) -> int:
    """Write both files atomically (mode 0640: Mosquitto, which runs as its own user, reads them through
    their group; give the directory the mosquitto group with the setgid bit); returns how many accounts
    were written. ``fleet_password_file``, if given, gets the fleet's account alone: the password file
    of the fleet's own listener (see :func:`mosquitto_conf`)."""
    rows, fleet_rows = [], []
    for a in accounts:
        if a.username != FLEET_USER and not proto.device_id_ok(a.username):
            raise ValueError(f"username {a.username!r} is not a device id")
        if ":" in a.username or "\n" in a.password_hash:
            raise ValueError(f"account {a.username!r} cannot be written to a password file")
        rows.append(f"{a.username}:{a.password_hash}")
        if a.username == FLEET_USER:
            fleet_rows.append(rows[-1])
    files = [(password_file, "\n".join(rows) + "\n"), (acl_file, acl_text())]
    if fleet_password_file is not None:
        files.append((fleet_password_file, "\n".join(fleet_rows) + "\n"))
    for path, text in files:
        atomic_write(path, text.encode())
        os.chmod(path, 0o640)
    return len(rows)


def _expiry(seconds: int) -> str:
    """Mosquitto's persistent_client_expiration takes a count of h, d, w, m or y; rounded up to hours."""
    return f"{max(1, -(-seconds // 3600))}h"


def flow_limits_conf(limits: BrokerLimits | None = None, queued_messages: int | None = None,
                     queued_bytes: int | None = None) -> str:
    """Mosquitto's global flow limits, the embedded broker's (:class:`fleet.broker_limits.BrokerLimits`) as its
    options: per client, QoS 1 and 2 messages in flight (``max_inflight_messages``, ``max_inflight_bytes``: sent
    and not acknowledged; for MQTT 5 clients also the receive maximum) and queued beyond them
    (``max_queued_messages``, ``max_queued_bytes``: Mosquitto drops what is over). In 2.0 the queue limits bound
    what a client sends too: a QoS 2 publish it never releases stays in its incoming queue, which takes at most
    ``max_inflight_bytes + max_queued_bytes``. A saved session (clean session false) expires
    (``persistent_client_expiration``); an MQTT 5 client's keepalive is at most ``max_keepalive``.
    ``queued_messages``/``queued_bytes`` replace the queue limits (a bridge's broker: :mod:`fleet.cluster`)."""
    lim = limits or BrokerLimits()
    return (f"max_inflight_messages {lim.max_inflight_messages}\nmax_inflight_bytes {lim.max_inflight_bytes}\n"
            f"max_queued_messages {queued_messages or lim.max_queued_messages}\n"
            f"max_queued_bytes {queued_bytes or lim.max_queued_bytes}\n"
            f"persistent_client_expiration {_expiry(lim.session_expiry_s)}\nmax_keepalive {lim.max_keepalive_s}\n")


def device_listener_limits(max_connections: int = MAX_DEVICE_CONNECTIONS) -> str:
    """A device listener's own limits: devices publish and subscribe at QoS 1 only (``max_qos 1``: a QoS 2
    publish, which a client can leave unreleased, disconnects it; MQTT 5 clients are told in the CONNACK), and
    at most ``max_connections`` at once, below Mosquitto's descriptor limit."""
    return f"max_qos 1\nmax_connections {max_connections}\n"


def mosquitto_conf(password_file: Path, acl_file: Path, fleet_password_file: Path,
                   device_listeners: Iterable[str] = ("1883",), fleet_listener: str = "1884 127.0.0.1",
                   limits: BrokerLimits | None = None, max_connections: int = MAX_DEVICE_CONNECTIONS) -> str:
    """The authentication part of ``mosquitto.conf``: one identity per device.

    Each of ``device_listeners`` (``"<port> [<address>]"``, optionally followed by more lines for
    that listener, e.g. TLS settings) takes every account and sets ``use_username_as_clientid``, so a
    device's client id is its username whatever it sends: a device (or anyone) can never replace
    another device's session. ``fleet_listener`` is the fleet's: any client id (its replicas share one
    account), and a password file with the fleet's account alone, so no device can use it. Write
    the password files with :func:`write_mosquitto_files` (``fleet_password_file`` too).

    Message size: ``max_packet_size`` (:data:`MAX_PACKET_BYTES`) disconnects a client that sends a bigger packet
    before its body is read, and ``message_size_limit`` (:data:`MAX_PAYLOAD_BYTES`) keeps any payload over the
    protocol's limit from being stored or forwarded. Without them Mosquitto takes 256 MB a message, retained
    on every topic a device may write. Flow: :func:`flow_limits_conf` (``limits``) and, on device listeners,
    :func:`device_listener_limits` (``max_connections``). Nothing in the fleet relies on these for correctness:
    desired state is retained and reconciled, reports are read back from their retained copies."""
    def block(listener: str, passwords: Path, more: str) -> str:
        return (f"listener {listener}\nallow_anonymous false\npassword_file {passwords}\nacl_file {acl_file}\n"
                + more)

    device_more = "use_username_as_clientid true\n" + device_listener_limits(max_connections)
    blocks = [block(d, password_file, device_more) for d in device_listeners]
    blocks.append(block(fleet_listener, fleet_password_file, ""))
    return (f"per_listener_settings true\nmax_packet_size {MAX_PACKET_BYTES}\nmessage_size_limit {MAX_PAYLOAD_BYTES}\n"
            + flow_limits_conf(limits) + "".join(blocks))


def reload_mosquitto(pid: int) -> None:
    """Mosquitto rereads its password and ACL files on SIGHUP."""
    os.kill(pid, signal.SIGHUP)
