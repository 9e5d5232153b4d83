"""A hostile MQTT client, byte by byte, for the broker's connection limits (issue 45): what an outside probe
does to the embedded broker or a Mosquitto, and what it costs the broker's process.

    python -m bench.mqtt_probe [--cycles 2000] [--qos2 3000] [--kib 250]

Runs, against a fresh embedded broker in this process (as the fleet embeds it, gc.freeze() and a 50,000
threshold as the fleet sets them) and against Debian's Mosquitto with the generated config:

- ``cycles`` connections that end before their CONNECT (nothing, half a CONNECT, 4 bytes of garbage, a third
  each): the broker process's descriptors before, right after and once settled;
- one enrolled device sending ``qos2`` QoS 2 publishes of ``kib`` KiB that it never releases (no PUBREL), to a
  topic its ACL forbids and to its own telemetry topic (MQTT 3.1.1; MQTT 5 for Mosquitto): the broker's RSS
  before, at the end, and after the device left.

and a real fleet (``edgefleet fleet serve``, embedded broker, RLIMIT_NOFILE 1,400 as in the issue): ``cycles`` + 300
pre-CONNECT closes, then 1,500 connections from 20 addresses that send nothing; its descriptors, health and a
healthy MQTT CONNACK meanwhile.

Prints one JSON object. The packets are built here (paho answers every PUBREC with a PUBREL by itself).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import struct
import time
from pathlib import Path

__all__ = ["connect_packet", "fd_count", "publish_packet", "raw_connect", "rss_kib", "subscribe_packet"]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("!H", len(b)) + b


def connect_packet(client_id: str, username: str | None = None, password: str | None = None, keepalive: int = 30,
                   clean: bool = True, version: int = 4) -> bytes:
    """A CONNECT (``version`` 4: MQTT 3.1.1, 5: MQTT 5 with no properties)."""
    flags = (0x02 if clean else 0) | (0x80 if username is not None else 0) | (0x40 if password is not None else 0)
    body = _str("MQTT") + bytes([version, flags]) + struct.pack("!H", keepalive)
    if version == 5:
        body += b"\x00"  # no properties
    body += _str(client_id)
    if username is not None:
        body += _str(username)
    if password is not None:
        body += _str(password)
    return b"\x10" + _varint(len(body)) + body


def publish_packet(topic: str, payload: bytes, qos: int = 0, packet_id: int = 1, version: int = 4,
                   retain: bool = False) -> bytes:
    body = _str(topic) + (struct.pack("!H", packet_id) if qos else b"") + (b"\x00" if version == 5 else b"") + payload
    return bytes([0x30 | (qos << 1) | int(retain)]) + _varint(len(body)) + body


def subscribe_packet(topic_filter: str, qos: int = 1, packet_id: int = 1) -> bytes:
    body = struct.pack("!H", packet_id) + _str(topic_filter) + bytes([qos])
    return b"\x82" + _varint(len(body)) + body


def raw_connect(port: int, client_id: str, username: str | None, password: str | None, version: int = 4,
                clean: bool = True, timeout_s: float = 10.0, source: str = "127.0.0.1") -> socket.socket:
    """A connected socket whose CONNECT was accepted (raises otherwise)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0))
    s.sendall(connect_packet(client_id, username, password, clean=clean, version=version))
    head = s.recv(2)
    rest = s.recv(head[1]) if len(head) == 2 else b""
    code = rest[1] if len(rest) >= 2 else None
    if head[:1] != b"\x20" or code != 0:
        s.close()
        raise ConnectionRefusedError(f"CONNECT refused: {head + rest!r}")
    return s


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def pre_connect_cycles(port: int, cycles: int) -> int:
    """Connections that end before their CONNECT: nothing, half a CONNECT, 4 bytes of garbage. Returns how many
    were made (it stops at the first the broker does not accept within 10 s)."""
    half = connect_packet("someone", "someone", "x" * 40)[:20]
    for i in range(cycles):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:
            return i
        with s:
            if i % 3 == 1:
                s.sendall(half)
            elif i % 3 == 2:
                s.sendall(b"\xde\xad\xbe\xef")
    return cycles


def qos2_never_released(port: int, device: str, password: str, topic: str, count: int, size: int,
                        version: int = 4) -> str:
    """One device publishes ``count`` QoS 2 messages and never sends a PUBREL; how it ended."""
    s = raw_connect(port, device, device, password, version=version)
    payload = b"x" * size
    how = f"sent all {count}"
    try:
        for i in range(count):
            s.sendall(publish_packet(topic, payload, qos=2, packet_id=i % 65535 + 1, version=version))
    except OSError as exc:
        how = f"disconnected after {i} ({type(exc).__name__})"
    finally:
        s.close()
    return how


def _settle(read, want_at_most: int, timeout_s: float) -> int:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    value = read()
    while value > want_at_most and time.monotonic() < deadline:
        time.sleep(0.2)
        value = read()
    return int(value)


def probe_mosquitto(qos2: int, kib: int, work: Path) -> dict[str, object]:
    """Debian's Mosquitto with the generated config (fleet.acl.mosquitto_conf): one device's QoS 2 publishes
    never released, over MQTT 5 and 3.1.1, to a forbidden topic and to its own telemetry; its RSS."""
    import shutil
    import subprocess

    from edgefleet.fleet.acl import Account, hash_password, mosquitto_conf, write_mosquitto_files
    from edgefleet.protocol import mqtt as proto
    from tests.conftest import free_port, wait_port

    port, fleet_port = free_port(), free_port()
    passwd, acl, fleet_passwd = work / "passwd", work / "acl", work / "fleet.passwd"
    write_mosquitto_files([Account("edge-probe", hash_password("probe-secret"))], passwd, acl, fleet_passwd)
    conf = work / "mosquitto.conf"
    conf.write_text(("user root\n" if os.geteuid() == 0 else "") + "persistence false\n" + mosquitto_conf(
        passwd, acl, fleet_passwd, device_listeners=[f"{port} 127.0.0.1"], fleet_listener=f"{fleet_port} 127.0.0.1"))
    proc = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, object] = {}
    try:
        wait_port(port)
        for version in (5, 4):
            for where, topic in (("forbidden", proto.topic("edge-other", "desired")),
                                 ("own telemetry", proto.topic("edge-probe", "telemetry"))):
                rss0 = rss_kib(proc.pid)
                s = raw_connect(port, "edge-probe", "edge-probe", "probe-secret", version=version)
                payload, sent = b"x" * (kib * 1024), 0
                try:
                    for i in range(qos2):
                        s.sendall(publish_packet(topic, payload, qos=2, packet_id=i % 65535 + 1, version=version))
                        sent += 1
                except OSError:
                    pass
                time.sleep(1)
                rss1 = rss_kib(proc.pid)
                s.close()
                time.sleep(1)
                out[f"mqtt{version}_{where}"] = {"sent": sent, "rss_mb_before": rss0 // 1024, "rss_mb_connected":
                                                 rss1 // 1024, "rss_mb_after_leaving": rss_kib(proc.pid) // 1024}
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def probe_embedded(cycles: int, qos2: int, kib: int, per_peer: int = 0) -> dict[str, object]:
    from edgefleet.fleet.acl import Account, ActiveAccounts, hash_password
    from edgefleet.fleet.broker import EmbeddedBroker
    from edgefleet.protocol import mqtt as proto
    from tests.conftest import free_port

    gc.freeze()
    gc.set_threshold(50_000)  # as the fleet runs (edgefleet.cli)
    accounts = ActiveAccounts()
    accounts.update([Account("edge-probe", hash_password("probe-secret"))])
    port = free_port()
    if per_peer:  # a cap per address so high that every cycle is taken in and must be closed by the broker
        from edgefleet.fleet.broker_limits import BrokerLimits

        broker = EmbeddedBroker("127.0.0.1", port, accounts, limits=BrokerLimits(max_handshakes_per_peer=per_peer,
                                                                                 max_connections_per_peer=per_peer))
    else:
        broker = EmbeddedBroker("127.0.0.1", port, accounts)
    broker.start()
    pid = os.getpid()
    out: dict[str, object] = {}
    try:
        before = fd_count(pid)
        t = time.monotonic()
        pre_connect_cycles(port, cycles)
        out["pre_connect"] = {"cycles": cycles, "seconds": round(time.monotonic() - t, 1), "fds_before": before,
                              "fds_after": fd_count(pid), "fds_settled_5s": _settle(lambda: fd_count(pid), before, 5)}
        for where, topic in (("forbidden", proto.topic("edge-other", "desired")),
                             ("own telemetry", proto.topic("edge-probe", "telemetry"))):
            gc.collect()
            rss0 = rss_kib(pid)
            how = qos2_never_released(port, "edge-probe", "probe-secret", topic, qos2, kib * 1024)
            rss1 = rss_kib(pid)
            time.sleep(2)
            out[f"qos2_{where}"] = {"messages": qos2, "kib": kib, "how": how, "rss_mb_before": rss0 // 1024,
                                    "rss_mb_end": rss1 // 1024, "rss_mb_after_leaving": rss_kib(pid) // 1024,
                                    "held": broker.held() if hasattr(broker, "held") else None}
    finally:
        broker.stop()
    return out


FLEET = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[1])))
from edgefleet.cli import main
sys.exit(main(sys.argv[2:]))
"""


def probe_fleet(cycles: int, silent: int = 1500, nofile: int = 1400, addresses: int = 20) -> dict[str, object]:
    """A real fleet (``edgefleet fleet serve``, embedded broker) at RLIMIT_NOFILE ``nofile``: ``cycles`` + 300
    connections that end before their CONNECT, then ``silent`` that send nothing from ``addresses`` addresses; its
    descriptors, and whether health and a healthy MQTT client from another address are answered meanwhile."""
    import signal
    import subprocess
    import sys
    import tempfile

    from bench.http_limits import _get, _mqtt_connack
    from tests.conftest import free_port, wait_port

    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        port, mqtt = free_port(), free_port()
        subprocess.run([sys.executable, "-m", "edgefleet", "keys", "init", f"{tmp}/keys"], cwd=repo, check=True,
                       capture_output=True)
        log = Path(tmp) / "fleet.log"
        with log.open("w") as err:
            p = subprocess.Popen([sys.executable, "-c", FLEET, str(nofile), "fleet", "serve", "--keys", f"{tmp}/keys",
                                  "--data-dir", f"{tmp}/d", "--port", str(port), "--embedded-mqtt-port", str(mqtt)],
                                 cwd=repo, stderr=err, stdout=subprocess.DEVNULL)
        out: dict[str, object] = {"rlimit_nofile": nofile}
        try:
            wait_port(port, 60)
            wait_port(mqtt, 60)
            base = fd_count(p.pid)
            made = pre_connect_cycles(mqtt, cycles + 300)
            right_after = fd_count(p.pid)
            settled = _settle(lambda: fd_count(p.pid), base, 10)
            out["pre_connect"] = {"cycles": cycles + 300, "made": made, "fds_before": base,
                                  "fds_right_after": right_after, "fds_settled": settled,
                                  "health": _get(port, "/api/v1/health", src="127.0.1.1")[0],
                                  "mqtt_connack": _mqtt_connack(mqtt)}
            socks, refused_at_connect = [], 0
            rss0 = rss_kib(p.pid)
            for i in range(silent):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", mqtt), timeout=5,
                                                          source_address=(f"127.0.0.{2 + i % addresses}", 0)))
                except OSError:
                    refused_at_connect += 1
            time.sleep(1)
            during = fd_count(p.pid)
            health = [_get(port, "/api/v1/health", src=f"127.0.1.{1 + i}") for i in range(20)]
            connacks = sum(_mqtt_connack(mqtt) for _ in range(20))
            t = time.monotonic()
            settled = _settle(lambda: fd_count(p.pid), base + 5, 20)
            closed = 0
            for s in socks:
                s.setblocking(False)
                try:
                    closed += s.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
                s.close()
            out["silent"] = {"connections": silent, "addresses": addresses, "refused_at_connect": refused_at_connect,
                             "fds_before": base, "fds_during": during, "fds_settled": settled,
                             "settled_after_s": round(time.monotonic() - t + 1, 1),
                             "closed_by_the_fleet": closed, "rss_mb_growth": (rss_kib(p.pid) - rss0) // 1024,
                             "health_ok": sum(c == 200 for c, _ in health),
                             "health_max_ms": round(max(ms for _, ms in health), 1), "mqtt_connack": f"{connacks}/20"}
            out["qos2"] = _fleet_qos2(port, mqtt, p.pid, Path(tmp) / "d" / "admin-token")
            out["log_lines"] = len(log.read_text().splitlines())
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
    return out


def _fleet_qos2(port: int, mqtt: int, pid: int, admin_token: Path, count: int = 3000) -> dict[str, object]:
    """One device enrolled at the fleet sends ``count`` x 250 KiB QoS 2 never released, to a forbidden topic and
    to its own telemetry: the fleet's RSS before, at the end and after the device left."""
    import httpx

    from edgefleet.protocol import mqtt as proto

    auth = {"Authorization": f"Bearer {admin_token.read_text().strip()}"}
    base = f"http://127.0.0.1:{port}/api/v1"
    token = httpx.post(f"{base}/devices/edge-probe/enrollment-token", headers=auth, json={}).json()["token"]
    creds = httpx.post(f"{base}/enroll", json={"token": token}).json()
    out: dict[str, object] = {}
    for where, topic in (("forbidden", proto.topic("edge-other", "desired")),
                         ("own telemetry", proto.topic("edge-probe", "telemetry"))):
        rss0 = rss_kib(pid)
        how = qos2_never_released(mqtt, creds["mqtt_username"], creds["mqtt_password"], topic, count, 250 * 1024)
        rss1 = rss_kib(pid)
        time.sleep(2)
        out[where] = {"messages": count, "how": how, "rss_mb_before": rss0 // 1024, "rss_mb_end": rss1 // 1024,
                      "rss_mb_after_leaving": rss_kib(pid) // 1024}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--qos2", type=int, default=3000)
    ap.add_argument("--kib", type=int, default=250)
    ap.add_argument("--per-peer", type=int, default=0, help="the embedded broker's per-address caps (0: its own)")
    ap.add_argument("--only", choices=["embedded", "mosquitto", "fleet"])
    a = ap.parse_args(argv)
    out: dict[str, object] = {}
    if a.only in (None, "fleet"):
        out["fleet"] = probe_fleet(a.cycles)
    if a.only in (None, "embedded"):
        out["embedded"] = probe_embedded(a.cycles, a.qos2, a.kib, a.per_peer)
    if a.only in (None, "mosquitto"):
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            out["mosquitto"] = probe_mosquitto(a.qos2, a.kib, Path(work))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
