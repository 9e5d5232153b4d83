"""Which clustered MQTT engine carries the fleet beyond one broker process: measured side by side.

    .venv/bin/python bench/mqtt_cluster.py                     # 4,000 devices over 2 nodes of each engine
    .venv/bin/python bench/mqtt_cluster.py --devices 10000 --engines mosquitto-bridge,nats

Engines, each with 2 device-facing nodes (the simulator split over them, one process per node):

- ``mosquitto``: one Mosquitto (the baseline; both simulator processes on it; the queue limit lifted);
- ``mosquitto-bridge``: 2 edge Mosquittos bridged to a core, configs from ``fleet.cluster``;
- ``nats``: a 2-node nats-server cluster with JetStream and MQTT on each node (retained messages and QoS 1
  sessions in JetStream).

Per engine, a "fleet" client on the core (node 0 for NATS) does what the fleet does on the wire: it subscribes to
every device's status and reports, publishes a retained desired state to every device (the devices answer with a
retained report), and counts. Figures: seconds until every device is connected and its status reached the fleet,
seconds from the first desired state until every report reached the fleet, the brokers' CPU seconds for the whole
run (ratio to the baseline's), and checks: a shared subscription ($share/g/...) splits messages between two
consumers; a retained desired state published on the core reaches a device on another node.
RabbitMQ 3.10's MQTT plugin is not run: its retained messages are stored per node (a desired state published through
one node is not seen by a device on another), and it has no shared subscriptions before 3.13 (MQTT 5).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil

from edgefleet.protocol.processes import stop_processes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.fleet_scale import _raise_nofile, free_port, wait  # noqa: E402

PREFIX = "edgefleet/v1/devices"


@contextmanager
def procs(cmds: list[tuple[list[str], Path]]):
    started = []
    try:
        for cmd, log in cmds:
            started.append(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT))
        yield started
    finally:
        stop_processes(started, grace_s=20)


def listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def engine(name: str, work: Path, devices: int):
    """-> (fleet-side port, [device-side port of each node], [broker pids])"""
    _raise_nofile(devices + 2000)
    mosq = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    user = "user root\n" if os.geteuid() == 0 else ""
    if name == "mosquitto":
        port = free_port()
        # the queue limit lifted (as fleet.cluster does on its brokers): what is measured is throughput, not drops
        (work / "m.conf").write_text(f"{user}listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                                     "max_queued_messages 1000000\n")
        with procs([([mosq, "-c", str(work / "m.conf")], work / "m.log")]) as ps:
            wait(lambda: listening(port), 10, "mosquitto up")
            yield port, [port, port], [p.pid for p in ps]
    elif name == "mosquitto-bridge":
        from edgefleet.fleet.acl import FLEET_USER, Account, hash_password, write_mosquitto_files
        from edgefleet.fleet.cluster import ClusterPlan, run_cluster, write_cluster

        # device accounts are not what is measured here: anonymous devices on the edges (tests/test_cluster.py
        # checks the identity rules); the bridges and the fleet authenticate on the core
        pw = secrets.token_urlsafe(12)
        write_mosquitto_files([Account(FLEET_USER, hash_password(pw))], work / "d.passwd", work / "d.acl")
        ports = [free_port() for _ in range(3)]
        plan = ClusterPlan(edges=(f"{ports[1]} 127.0.0.1", f"{ports[2]} 127.0.0.1"), core=f"{ports[0]} 127.0.0.1")
        files = write_cluster(work, plan, work / "d.passwd", work / "d.acl", pw, secrets.token_urlsafe(12),
                              run_as="root" if os.geteuid() == 0 else None)
        for i in (0, 1):  # anonymous devices on the edges for this measurement
            p = files[f"edge-{i}.conf"]
            lines = [ln for ln in p.read_text().splitlines() if not ln.startswith(
                ("password_file", "acl_file", "use_username_as_clientid"))]
            p.write_text("\n".join(lines).replace("allow_anonymous false", "allow_anonymous true", 1) + "\n")
        with run_cluster([files["core.conf"], files["edge-0.conf"], files["edge-1.conf"]], ports, work) as ps:
            engine.fleet_auth = (FLEET_USER, pw)  # type: ignore[attr-defined]
            yield ports[0], ports[1:], [p.pid for p in ps]
            engine.fleet_auth = None  # type: ignore[attr-defined]
    elif name == "nats":
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        client = [free_port(), free_port()]
        routes = [free_port(), free_port()]
        mqtt_ports = [free_port(), free_port()]
        cmds = []
        for i in (0, 1):
            conf = work / f"n{i}.conf"
            conf.write_text(
                f"server_name: n{i}\nlisten: 127.0.0.1:{client[i]}\nmax_payload: 263168\n"
                f"jetstream {{ store_dir: {work / f'js{i}'}, max_memory_store: 1G, max_file_store: 8G }}\n"
                f"cluster {{ name: bench, listen: 127.0.0.1:{routes[i]}, routes: "
                f"[nats-route://127.0.0.1:{routes[0]}, nats-route://127.0.0.1:{routes[1]}] }}\n"
                f"mqtt {{ listen: 127.0.0.1:{mqtt_ports[i]} }}\n")
            cmds.append(([binary, "-c", str(conf)], work / f"n{i}.log"))
        with procs(cmds) as ps:
            wait(lambda: all(listening(p) for p in mqtt_ports), 30, "nats up")
            time.sleep(3)  # the JetStream meta leader
            yield mqtt_ports[0], mqtt_ports, [p.pid for p in ps]
    else:
        raise SystemExit(f"unknown engine {name!r}")


engine.fleet_auth = None  # type: ignore[attr-defined]


class FleetSide:
    """What the fleet does on the wire, counted."""

    def __init__(self, port: int, auth: tuple[str, str] | None, client_id: str = "bench-fleet"):
        self.status: set[str] = set()
        self.reported: set[str] = set()
        self.lock = threading.Lock()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        self.c.max_inflight_messages_set(1000)
        self.c.max_queued_messages_set(0)
        if auth:
            self.c.username_pw_set(*auth)
        self.c.on_message = self._on_message
        self.subscribed = threading.Event()
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self.c.connect("127.0.0.1", port, keepalive=60)
        self.c.loop_start()
        self.c.subscribe([(f"{PREFIX}/+/status", 1), (f"{PREFIX}/+/reported", 1)])
        wait(self.subscribed.is_set, 30, "fleet subscribed")

    def _on_message(self, c, u, m) -> None:
        parts = m.topic.split("/")
        with self.lock:
            (self.status if parts[-1] == "status" else self.reported).add(parts[-2])

    def stop(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def desired(device_id: str) -> bytes:
    from edgefleet.protocol import mqtt as proto

    return proto.encode(proto.DesiredState(device_id=device_id, ts=time.time(), rollout_id=1, model="digits",
                                           version="1.0.0", target="digits/1.0.0/digits-1.0.0-x86-cpu.tar",
                                           sha256="0" * 64, size_bytes=1))


def shared_check(port: int, auth) -> str:
    """Two consumers of $share/g/...: do 20 messages reach them, split?"""
    got = [0, 0]
    cs = []
    for i in (0, 1):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"share-{i}", protocol=mqtt.MQTTv311)
        if auth:
            c.username_pw_set(*auth)
        c.on_message = (lambda k: (lambda cl, u, m: got.__setitem__(k, got[k] + 1)))(i)
        c.connect("127.0.0.1", port)
        c.loop_start()
        c.subscribe(f"$share/g/{PREFIX}/+/telemetry", 1)
        cs.append(c)
    time.sleep(1)
    for i in range(20):
        cs[0].publish(f"{PREFIX}/share-probe-{i}/telemetry", b"{}", qos=1)
    time.sleep(2)
    for c in cs:
        c.loop_stop()
        c.disconnect()
    return f"{got[0]}+{got[1]} of 20"


def run(name: str, base: Path, devices: int, max_wait_s: float) -> dict:
    work = base / name
    work.mkdir()
    with engine(name, work, devices) as (fleet_port, node_ports, pids), ExitStack() as stack:
        auth = engine.fleet_auth  # type: ignore[attr-defined]
        brokers = [psutil.Process(p) for p in pids]
        cpu0 = sum(b.cpu_times().user + b.cpu_times().system for b in brokers)
        fleet = FleetSide(fleet_port, auth)
        stack.callback(fleet.stop)
        half = devices // 2
        t0 = time.monotonic()
        stack.enter_context(procs([(
            [sys.executable, "-m", "edgefleet.cli", "simulate", "--devices", str(half if i == 0 else devices - half),
             "--first-index", str(0 if i == 0 else half), "--mqtt-url", f"mqtt://127.0.0.1:{node_ports[i]}",
             "--install-s", "0", "--stats-file", str(work / f"sim-{i}.json")], work / f"sim-{i}.log")
            for i in (0, 1)]))
        wait(lambda: len(fleet.status) >= devices, 600, f"{name}: every device's status at the fleet", 0.2)
        online_s = time.monotonic() - t0
        ids = [f"sim-{i:05d}" for i in range(devices)]
        t1 = time.monotonic()
        for d in ids:
            fleet.c.publish(f"{PREFIX}/{d}/desired", desired(d), qos=1, retain=True)
        try:
            wait(lambda: len(fleet.reported) >= devices, max_wait_s, f"{name}: every report at the fleet", 0.2)
            rollout_s: float | None = time.monotonic() - t1
        except TimeoutError:
            rollout_s = None  # what arrived by then is reported
        got_reports = len(fleet.reported)
        got_desired = 0
        for i in (0, 1):
            try:
                got_desired += json.loads((work / f"sim-{i}.json").read_text())["desired"]
            except (OSError, ValueError, KeyError):
                pass
        cpu = sum(b.cpu_times().user + b.cpu_times().system for b in brokers) - cpu0
        rss = sum(b.memory_info().rss for b in brokers)
        share = shared_check(fleet_port, auth)
    return {"engine": name, "devices": devices, "online_s": round(online_s, 1),
            "desired_to_reports_s": None if rollout_s is None else round(rollout_s, 1), "reports": got_reports,
            "desired_received": got_desired, "waited_s": max_wait_s,
            "broker_cpu_s": round(cpu, 1), "broker_rss_mb": round(rss / 2**20), "shared_subscription": share}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=4000)
    ap.add_argument("--engines", default="mosquitto,mosquitto-bridge,nats")
    ap.add_argument("--max-wait-s", type=float, default=120.0, help="give up on an engine's reports after this")
    a = ap.parse_args()
    os.environ["PYTHONPATH"] = str(REPO)
    base = Path(tempfile.mkdtemp(prefix="mqtt-cluster-"))
    out = []
    try:
        for name in a.engines.split(","):
            res = run(name, base, a.devices, a.max_wait_s)
            out.append(res)
            ratio = ""
            if out[0]["engine"] == "mosquitto" and out[0]["broker_cpu_s"]:
                ratio = f" ({res['broker_cpu_s'] / out[0]['broker_cpu_s']:.1f}x the single broker's)"
            print(f"{name:>17}: {res['devices']} devices online at the fleet after {res['online_s']} s; desired -> "
                  f"every report {res['desired_to_reports_s']} s ({res['desired_received']} desired states received, "
                  f"{res['reports']} reports at the fleet); brokers' CPU "
                  f"{res['broker_cpu_s']} s{ratio}, RSS {res['broker_rss_mb']} MB; shared subscription: "
                  f"{res['shared_subscription']}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
