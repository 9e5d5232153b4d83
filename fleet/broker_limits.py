"""What the embedded broker (:mod:`fleet.broker`) lets one connection hold: time, descriptors, messages, bytes.

amqtt 0.12 bounds none of it: a connection that ends before its CONNECT kept its descriptor until a cyclic
GC ran (the fleet freezes its heap and runs one rarely), nothing waited for a CONNECT or a keepalive, one
peer could open connections until the process ran out of descriptors, a QoS 2 publish to a forbidden topic
was stored (topics were checked at delivery) and held until its PUBREL came, and saved sessions lived
forever. Each limit here is what Mosquitto calls it where it has one (:func:`fleet.acl.mosquitto_conf` sets
the same there):

- ``connect_timeout_s``: the whole CONNECT must arrive within it, from the moment the connection is accepted;
- the idle timeout: 1.5 x the client's keepalive, never more than 1.5 x ``max_keepalive_s`` (a keepalive of
  0, "never", gets ``max_keepalive_s``); ``packet_timeout_s``: a packet, once its first byte came, must be
  whole within it; a write the client does not read within ``write_timeout_s`` ends the connection;
- ``max_connections``: all connections, below the descriptor limit (default: half of what is left of
  ``RLIMIT_NOFILE`` after ``FD_HEADROOM`` descriptors for the fleet's own work: HTTP, database, files);
  ``max_connections_per_peer``: from one address; ``max_handshakes_per_peer``: from one address before their
  CONNECT was accepted. A connection over a cap is closed at once, before a byte is read;
- ``max_inflight_messages`` / ``max_inflight_bytes``: QoS 2 publishes received and not yet released
  (PUBREL) per connection; ``max_queued_messages`` / ``max_queued_bytes``: QoS 1 and 2 messages waiting
  for one client (received and not yet handled, or on their way out, or saved for it while it is away).
  A publish to a topic its ACL forbids is checked when it is received and acknowledged and dropped unread
  (as Mosquitto does for MQTT 3.1.1; amqtt speaks nothing newer and refuses an MQTT 5 CONNECT), a QoS 2 one
  keeping only its packet id until its PUBREL, within the in-flight cap. A client past its in-flight limits is
  disconnected (MQTT 3.1.1, section 3.3.5, lets a server close the connection); what it had in flight is
  dropped with its connection. A message for a client whose
  queue is full is dropped, as Mosquitto drops it: nothing in the fleet relies on a broker queue (desired
  state is retained and reconciled);
- ``session_expiry_s``: a saved session (clean session false) is removed this long after its client left.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

__all__ = ["FD_HEADROOM", "BrokerLimits", "ConnectionGate", "default_max_connections"]

FD_HEADROOM = 256  # descriptors the fleet keeps for itself (HTTP, database, files, TUF downloads)


def default_max_connections(soft_limit: int | None = None) -> int:
    """Half of the descriptors left after :data:`FD_HEADROOM` (the other half is the HTTP listener's)."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_limit == resource.RLIM_INFINITY:
            soft_limit = 1 << 20
    return max(16, (soft_limit - FD_HEADROOM) // 2)


def _positive(name: str, value: float, most: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= most:
        raise ValueError(f"{name} must be a number in (0, {most}], not {value!r}")


@dataclass(frozen=True)
class BrokerLimits:
    connect_timeout_s: float = 10.0
    max_keepalive_s: int = 120  # agents send 15 s, the fleet 30 s
    packet_timeout_s: float = 60.0  # a 256 KiB packet at 5 KB/s
    write_timeout_s: float = 30.0
    max_connections: int = 0  # 0: default_max_connections()
    max_connections_per_peer: int = 256  # a site's devices behind one NAT address share it
    max_handshakes_per_peer: int = 32
    max_inflight_messages: int = 20  # Mosquitto's default
    max_inflight_bytes: int = 4 * 1024 * 1024
    max_queued_messages: int = 1000  # Mosquitto's default
    max_queued_bytes: int = 32 * 1024 * 1024
    session_expiry_s: int = 3600

    def __post_init__(self) -> None:
        for name, most in (("connect_timeout_s", 3600), ("packet_timeout_s", 3600), ("write_timeout_s", 3600)):
            _positive(name, getattr(self, name), most)
        for name, most in (("max_keepalive_s", 65535), ("max_connections_per_peer", 1 << 20),
                           ("max_handshakes_per_peer", 1 << 20), ("max_inflight_messages", 65535),
                           ("max_inflight_bytes", 1 << 40), ("max_queued_messages", 1 << 30),
                           ("max_queued_bytes", 1 << 40), ("session_expiry_s", 1 << 31)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, not {value!r}")
            _positive(name, value, most)
        if not isinstance(self.max_connections, int) or not 0 <= self.max_connections <= 1 << 20:
            raise ValueError(f"max_connections must be an integer in [0, {1 << 20}] (0: from RLIMIT_NOFILE)")

    @property
    def total_connections(self) -> int:
        return self.max_connections or default_max_connections()

    def idle_timeout_s(self, keepalive_s: int) -> float:
        """How long a connected client may send nothing (MQTT: 1.5 x its keepalive)."""
        keepalive_s = keepalive_s if 0 < keepalive_s <= self.max_keepalive_s else self.max_keepalive_s
        return 1.5 * keepalive_s


class ConnectionGate:
    """Counts connections, all and per peer address, and those still before their CONNECT (one event loop)."""

    def __init__(self, limits: BrokerLimits):
        self.limits = limits
        self.total = 0
        self._per_peer: dict[str, int] = {}
        self._handshakes: dict[str, int] = {}
        self.refused = 0

    def admit(self, peer: str) -> str | None:
        """Count a new connection from ``peer``; None, or why it is refused (then nothing is counted)."""
        lim = self.limits
        if self.total >= lim.total_connections:
            why = f"{self.total} connections, the limit"
        elif self._per_peer.get(peer, 0) >= lim.max_connections_per_peer:
            why = f"{lim.max_connections_per_peer} connections from {peer}, its limit"
        elif self._handshakes.get(peer, 0) >= lim.max_handshakes_per_peer:
            why = f"{lim.max_handshakes_per_peer} connections from {peer} waiting for their CONNECT, its limit"
        else:
            self.total += 1
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            self._handshakes[peer] = self._handshakes.get(peer, 0) + 1
            return None
        self.refused += 1
        return why

    def connected(self, peer: str) -> None:
        """The connection's CONNECT is done (accepted or not)."""
        self._drop(self._handshakes, peer)

    def closed(self, peer: str, handshaking: bool) -> None:
        self.total -= 1
        self._drop(self._per_peer, peer)
        if handshaking:
            self._drop(self._handshakes, peer)

    @staticmethod
    def _drop(counts: dict[str, int], peer: str) -> None:
        n = counts.get(peer, 0) - 1
        if n > 0:
            counts[peer] = n
        else:
            counts.pop(peer, None)
