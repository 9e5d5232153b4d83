"""The fleet's scale-out MQTT path: Mosquitto bridges (device-facing edge brokers bridged to a core).

    python -m edgefleet.fleet.cluster write DIR --edges 6 --core-port 1883 --edge-port 1884 \\
        --device-passwords /etc/mosquitto/devices.passwd --device-acl /etc/mosquitto/devices.acl

One Mosquitto process holds at most one connection per descriptor it may open (20,000 here), so a fleet beyond
that spreads its devices over several **edge** brokers (a TCP load balancer in front, or DNS): each edge takes
devices with the fleet's own identity rules (``fleet.acl``: per-device accounts, topic ACLs,
``use_username_as_clientid``, the protocol's message size limit) and bridges their topics to one **core** broker,
which only the fleet's replicas and the bridges reach:

    device -> edge:  reported, telemetry, status   bridged out to the core (retained flags kept)
    core -> edge:    desired, ack                  bridged in to every edge (retained desired states are stored
                                                    on each edge, so a device gets its own wherever it connects)

The replicas subscribe on the core and split telemetry through an MQTT shared subscription (``$share/fleet/...``),
as on a single broker; reports and statuses the core's queue drops are read back from its retained copies
(``fleet.reconcile``). Why this engine and not NATS's or RabbitMQ's MQTT (measured: bench/mqtt_cluster.py): see the
README's "Fleet beyond one broker".

The bridges' own queues must not drop: a report an edge fails to forward never reaches the core, and so cannot be
read back from the core's retained copy either. Edges and core therefore set ``max_queued_messages`` to
``QUEUE_MESSAGES`` (bounded, not unlimited: ``max_queued_bytes`` too). A device can fill only its own queue (its own
desired and ack topics), a few messages; and since Mosquitto 2.0 holds a client's unreleased QoS 2 publishes within
the same queue limits, the edges' device listeners take QoS 1 only (``max_qos 1``, what agents send): a device
cannot park QoS 2 messages there (``fleet.acl.device_listener_limits``).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..protocol import mqtt as proto
from ..protocol.fsutil import atomic_write
from ..protocol.processes import stop_processes
from .acl import (
    FLEET_USER,
    MAX_PACKET_BYTES,
    MAX_PAYLOAD_BYTES,
    Account,
    device_listener_limits,
    flow_limits_conf,
    hash_password,
)

__all__ = ["BRIDGE_USER", "QUEUE_BYTES", "QUEUE_MESSAGES", "ClusterPlan", "core_conf", "edge_conf", "run_cluster",
           "write_cluster"]

BRIDGE_USER = "edgefleet-bridge"  # the edges' account on the core (not a device id: no device can be it)
QUEUE_MESSAGES = 1_000_000  # per client on edges and core: a 100,000-device wave's burst through one bridge
QUEUE_BYTES = 1024**3  # ... and at most this much of it (1 GiB)
DEVICE_WRITES = ("reported", "telemetry", "status")  # bridged out, edge -> core
DEVICE_READS = ("desired", "ack")  # bridged in, core -> edges
MAX_EDGES = 64


@dataclass(frozen=True)
class ClusterPlan:
    """Where each broker listens. ``edges``: each edge's device listener, ``"<port> [<address>]"``; ``core``: the
    core's listener (fleet replicas and bridges); ``core_address``: how edges reach the core."""

    edges: tuple[str, ...]
    core: str = "1883 127.0.0.1"
    core_address: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 1 <= len(self.edges) <= MAX_EDGES:
            raise ValueError(f"{len(self.edges)} edges: 1 to {MAX_EDGES}")
        for listener in (*self.edges, self.core):
            port = listener.split()[0] if listener.split() else ""
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"listener {listener!r} must be '<port> [<address>]' with a port 1-65535")

    @property
    def core_port(self) -> int:
        return int(self.core.split()[0])

    def edge_url(self, i: int) -> str:
        parts = self.edges[i].split()
        return f"mqtt://{parts[1] if len(parts) > 1 else '127.0.0.1'}:{parts[0]}"

    @property
    def core_url(self) -> str:
        return f"mqtt://{self.core_address}:{self.core_port}"


def _limits() -> str:
    return (f"max_packet_size {MAX_PACKET_BYTES}\nmessage_size_limit {MAX_PAYLOAD_BYTES}\n"
            + flow_limits_conf(queued_messages=QUEUE_MESSAGES, queued_bytes=QUEUE_BYTES))


def core_conf(plan: ClusterPlan, password_file: Path, acl_file: Path) -> str:
    """The core: one listener for the fleet's replicas and the edges' bridges, nobody else."""
    return (f"per_listener_settings true\n{_limits()}listener {plan.core}\nallow_anonymous false\n"
            f"password_file {password_file}\nacl_file {acl_file}\n")


def core_acl() -> str:
    return "".join(f"user {u}\ntopic readwrite {proto.PREFIX}/#\n\n" for u in (FLEET_USER, BRIDGE_USER))


def edge_conf(plan: ClusterPlan, i: int, device_password_file: Path, device_acl_file: Path,
              bridge_password: str) -> str:
    """Edge ``i``: the device listener as ``fleet.acl.mosquitto_conf`` writes it (the fleet keeps the device password
    and ACL files; every edge reads the same ones and is sent SIGHUP when they change), and a bridge to the core."""
    if "\n" in bridge_password or not bridge_password:
        raise ValueError("the bridge password must be one non-empty line")
    topics = [f"topic {proto.PREFIX}/+/{k} out 1" for k in DEVICE_WRITES]
    topics += [f"topic {proto.PREFIX}/+/{k} in 1" for k in DEVICE_READS]
    return (f"per_listener_settings true\n{_limits()}"
            f"listener {plan.edges[i]}\nallow_anonymous false\npassword_file {device_password_file}\n"
            f"acl_file {device_acl_file}\nuse_username_as_clientid true\n{device_listener_limits()}\n"
            f"connection edge-{i}\naddress {plan.core_address}:{plan.core_port}\n"
            f"remote_username {BRIDGE_USER}\nremote_password {bridge_password}\nremote_clientid edgefleet-edge-{i}\n"
            "bridge_protocol_version mqttv311\ntry_private true\ncleansession true\nnotifications false\n"
            "restart_timeout 1 10\nkeepalive_interval 30\n" + "\n".join(topics) + "\n")


def write_cluster(out: Path, plan: ClusterPlan, device_password_file: Path, device_acl_file: Path,
                  fleet_password: str, bridge_password: str, run_as: str | None = None) -> dict[str, Path]:
    """Write core.conf, core.passwd, core.acl and edge-<i>.conf into ``out``; returns their paths by name.
    ``run_as``: the user Mosquitto runs as when started as root (its ``user`` setting; default mosquitto)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"core.passwd": "".join(f"{a.username}:{a.password_hash}\n" for a in (
        Account(FLEET_USER, hash_password(fleet_password)), Account(BRIDGE_USER, hash_password(bridge_password)))),
        "core.acl": core_acl()}
    files["core.conf"] = core_conf(plan, out / "core.passwd", out / "core.acl")
    for i in range(len(plan.edges)):
        files[f"edge-{i}.conf"] = edge_conf(plan, i, device_password_file, device_acl_file, bridge_password)
    if run_as is not None:
        if not run_as.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"run_as {run_as!r} is not a user name")
        files = {n: (f"user {run_as}\n" + t if n.endswith(".conf") else t) for n, t in files.items()}
    paths = {}
    for name, text in files.items():
        atomic_write(out / name, text.encode())
        (out / name).chmod(0o640)  # passwords inside: the broker's group reads them
        paths[name] = out / name
    return paths


@contextmanager
def run_cluster(confs: Sequence[Path], ports: Sequence[int], log_dir: Path,
                timeout_s: float = 20.0) -> Iterator[list[subprocess.Popen]]:
    """Start one Mosquitto per config (core first), wait until each listens on its port, stop them all after."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    procs: list[subprocess.Popen] = []
    try:
        for conf, port in zip(confs, ports, strict=True):
            log = (log_dir / f"{conf.stem}.log").open("w")
            procs.append(subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            while True:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mosquitto -c {conf} did not start listening on {port} (see {log.name})")
                time.sleep(0.05)
        yield procs
    finally:
        stop_processes(procs, grace_s=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgefleet.fleet.cluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write the core's and the edges' Mosquitto configs")
    w.add_argument("out", type=Path)
    w.add_argument("--edges", type=int, required=True, help=f"edge brokers (1-{MAX_EDGES}); each holds < 20,000 "
                   "devices where a process may open 20,000 files")
    w.add_argument("--core", default="1883 127.0.0.1", help="the core's listener: '<port> [<address>]'")
    w.add_argument("--core-address", default="127.0.0.1", help="how the edges reach the core")
    w.add_argument("--edge-port", type=int, default=1884, help="edge i listens on this port + i")
    w.add_argument("--edge-address", default="0.0.0.0", help="the address the edges listen on")
    w.add_argument("--device-passwords", type=Path, required=True, help="the fleet's --mosquitto-password-file")
    w.add_argument("--device-acl", type=Path, required=True, help="the fleet's --mosquitto-acl-file")
    a = ap.parse_args(argv)
    import os
    import secrets

    fleet_password = os.environ.get("EDGEFLEET_MQTT_PASSWORD")
    if not fleet_password:
        print("error: set EDGEFLEET_MQTT_PASSWORD to the fleet's MQTT password (the replicas' account on the core)",
              file=sys.stderr)
        return 4
    try:
        plan = ClusterPlan(tuple(f"{a.edge_port + i} {a.edge_address}" for i in range(a.edges)), a.core,
                           a.core_address)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 4
    paths = write_cluster(a.out, plan, a.device_passwords, a.device_acl, fleet_password, secrets.token_urlsafe(24))
    print("\n".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
