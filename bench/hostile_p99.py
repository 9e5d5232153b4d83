"""The goal of issue 45, measured: while one hostile client runs a shape, a healthy client's p99 at the fleet and
the agent, their descriptors, and their RSS.

    .venv/bin/python -m bench.hostile_p99 [--seconds 15] [--only idle_to_cap,half_heads]
    .venv/bin/python -m bench.hostile_p99 --quick       # 3 s a shape: proves it runs, its figures are not the goal's

One fleet (``edgefleet fleet serve``, embedded broker) and one agent (``edgefleet agent``, digits INT8
preinstalled, gRPC on, no fleet to follow), their default limits, on 127.0.0.1. For each shape:

1. quiet (``--quiet-seconds``): the healthy client alone, its p99 per target: the baseline of this shape's ratio;
2. the hostile client (a process of its own, on 127.0.0.1 and 127.0.0.10-29) runs the shape for ``--seconds``
   while the healthy client (this process, from 127.0.0.2, a new connection per request, about 20 rounds a
   second) asks: the agent's health (GET /v2/health/live), one digits infer over HTTP (JSON), one over gRPC
   (ServerLive on a kept channel), the fleet's health (GET /api/v1/health) and one API GET (GET
   /api/v1/devices, admin token); each answer not a 200 within 5 s is a failure;
3. the hostile client leaves; the descriptors are read until back within 2 of where they were (at most
   ``--settle-seconds``: the head, CONNECT and handshake deadlines are 10 s).

Shapes: ``pre_connect`` (connections that close before their CONNECT or request: nothing, half a CONNECT, 4 bytes
of garbage, to the broker, both HTTP ports and gRPC), ``half_heads`` (half-sent request heads kept open, agent
and fleet HTTP), ``idle_to_cap`` (connections that send nothing, from 20 addresses, 1,100 per listener: both HTTP
ports, the broker, gRPC), ``big_headers`` (60 MB of small header lines per connection, agent and fleet HTTP),
``qos2`` (an enrolled device's QoS 2 publishes of 250 KiB never released, to a forbidden topic and its own),
``drip_reads`` (2,000 pipelined requests per connection, answers read 100 bytes every 0.2 s, agent and fleet
HTTP), ``grpc_half_calls`` (ModelInfer calls begun and never sent, 50 per connection, 4 connections from
127.0.0.3). The healthy gRPC channel is 127.0.0.1's (gRPC's client picks no source address).

Per shape and target it prints p99 ms during, the quiet p99 and their ratio, failures; per process the
descriptors before / the most during / after (and how long that took) and the RSS growth (the most during, and
after, against before). Every loop is bounded by its seconds; loopback only. Prints one JSON object at the end
(a line per shape on stderr as it goes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.http_limits import _ask, _free_port, _wait_port
from bench.mqtt_probe import connect_packet, fd_count, publish_packet, raw_connect, rss_kib
from tests.test_trust_grpc_local_conn import closed_by_server

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
SHAPES = ("pre_connect", "half_heads", "idle_to_cap", "big_headers", "qos2", "drip_reads", "grpc_half_calls")
HEALTHY_SRC = "127.0.0.2"
ANSWER_TIMEOUT_S = 5.0
ROUND_S = 0.05  # the healthy client's pace: a round of every target, then this pause


# -- the healthy client -------------------------------------------------------------------------------------------
def _http(port: int, head: str, body: bytes = b"") -> tuple[bool, float]:
    """One request on a new connection from HEALTHY_SRC -> (a 200 within ANSWER_TIMEOUT_S, milliseconds)."""
    request = f"{head}\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    code, ms = _ask(port, request, HEALTHY_SRC, ANSWER_TIMEOUT_S)
    return code == 200, ms


class Healthy:
    """The healthy client's targets, each one call -> (ok, ms)."""

    def __init__(self, agent_http: int, agent_grpc: int, fleet_http: int, admin_token: str):
        import grpc  # type: ignore[import-untyped]
        from tritonclient.grpc import service_pb2, service_pb2_grpc  # type: ignore[import-untyped]

        img = [0.0] * 64
        infer = json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                        "data": img}]}).encode()
        # gRPC can pick no source address: this channel is 127.0.0.1's, the hostile gRPC shapes' own address
        self.channel = grpc.insecure_channel(f"127.0.0.1:{agent_grpc}")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

        def grpc_live() -> tuple[bool, float]:
            t = time.perf_counter()
            try:
                ok = stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=ANSWER_TIMEOUT_S).live
            except grpc.RpcError:
                ok = False
            return ok, (time.perf_counter() - t) * 1000

        self.targets = {
            "agent_health": lambda: _http(agent_http, "GET /v2/health/live HTTP/1.1"),
            "agent_infer": lambda: _http(agent_http, "POST /v2/models/digits/infer HTTP/1.1\r\n"
                                                     "Content-Type: application/json", infer),
            "agent_grpc_live": grpc_live,
            "fleet_health": lambda: _http(fleet_http, "GET /api/v1/health HTTP/1.1"),
            "fleet_devices": lambda: _http(fleet_http, f"GET /api/v1/devices HTTP/1.1\r\n"
                                                       f"Authorization: Bearer {admin_token}"),
        }

    def window(self, seconds: float, pids: dict[str, int]) -> tuple[dict[str, list[float]], dict[str, int],
                                                                      dict[str, tuple[int, int]]]:
        """Ask every target, round after round, for ``seconds`` -> (milliseconds per target, failures per target,
        per process the most descriptors and RSS KiB seen)."""
        lat: dict[str, list[float]] = {k: [] for k in self.targets}
        failed = dict.fromkeys(self.targets, 0)
        peak = {k: (fd_count(p), rss_kib(p)) for k, p in pids.items()}
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for name, call in self.targets.items():
                ok, ms = call()
                lat[name].append(ms)
                failed[name] += not ok
            peak = {k: (max(peak[k][0], fd_count(p)), max(peak[k][1], rss_kib(p))) for k, p in pids.items()}
            time.sleep(ROUND_S)
        return lat, failed, peak


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * 0.99))] if s else float("nan")


# -- the hostile client (its own process: python -m bench.hostile_p99 --hostile SHAPE ...) ------------------------
def _sock(src: str, port: int, blocking: bool = False) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind((src, 0))
        s.settimeout(2)
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    s.setblocking(blocking)
    return s


def _keep_open(end: float, want: int, opener, ports: list[int]) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Hold ``want`` connections per port made by ``opener(i, port)``, replacing those the server closes, until
    ``end`` -> how many were opened and found closed."""
    held: dict[int, list[socket.socket]] = {p: [] for p in ports}
    opened = closed = 0
    i = 0
    while time.monotonic() < end:
        for port in ports:
            alive = []
            for s in held[port]:
                if closed_by_server(s):
                    s.close()
                    closed += 1
                else:
                    alive.append(s)
            held[port] = alive
            while len(alive) < want and time.monotonic() < end:
                s = opener(i, port)
                i += 1
                if s is None:
                    break
                alive.append(s)
                opened += 1
        time.sleep(0.2)
    for socks in held.values():
        for s in socks:
            s.close()
    return {"opened": opened, "closed_by_servers": closed}


def hostile(shape: str, end: float, ports: dict[str, int], device: tuple[str, str], scale: float) -> dict[str, int]:
    http = [ports["agent_http"], ports["fleet_http"]]
    if shape == "pre_connect":
        half = connect_packet("someone", "someone", "x" * 40)[:20]
        n = 0
        while time.monotonic() < end:
            for port in (ports["mqtt"], *http, ports["agent_grpc"]):
                s = _sock("127.0.0.1", port, blocking=True)
                if s is not None:
                    with contextlib.suppress(OSError), s:
                        s.sendall((b"", half, b"\xde\xad\xbe\xef")[n % 3])
                n += 1
        return {"cycles": n}
    if shape == "half_heads":
        def half_head(i: int, port: int) -> socket.socket | None:
            s = _sock("127.0.0.1", port)
            if s is not None:
                with contextlib.suppress(OSError):
                    s.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            return s
        return _keep_open(end, int(1000 * scale), half_head, http)
    if shape == "idle_to_cap":
        return _keep_open(end, int(1100 * scale), lambda i, port: _sock(f"127.0.0.{10 + i % 20}", port),
                          [*http, ports["mqtt"], ports["agent_grpc"]])
    if shape == "big_headers":
        return _big_headers(end, http, int(60e6 * scale))
    if shape == "qos2":
        return _qos2(end, ports["mqtt"], *device)
    if shape == "drip_reads":
        return _drip_reads(end, ports)
    if shape == "grpc_half_calls":
        from tests.test_trust_grpc_peer_cap import half_sent_calls

        def calls(i: int, port: int) -> socket.socket | None:
            try:
                return half_sent_calls("127.0.0.3", port, 50)
            except OSError:
                return None
        return _keep_open(end, 4, calls, [ports["agent_grpc"]])
    raise ValueError(shape)


def _big_headers(end: float, ports: list[int], total: int) -> dict[str, int]:
    """One connection per port at a time streams small header lines (64 KiB a send) until ``total`` bytes or the
    server closes it; then the next one."""
    chunk = b"X-a: " + b"b" * 90 + b"\r\n"
    block = chunk * (65536 // len(chunk))
    sent = dict.fromkeys(ports, 0)
    conns: dict[int, socket.socket | None] = dict.fromkeys(ports)
    bytes_sent = refused = 0
    while time.monotonic() < end:
        for port in ports:
            s = conns[port]
            if s is None:
                s = conns[port] = _sock("127.0.0.1", port, blocking=True)
                if s is None:
                    continue
                s.settimeout(1)
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
                sent[port] = 0
            try:
                s.sendall(block)
                sent[port] += len(block)
                bytes_sent += len(block)
                if sent[port] >= total:
                    raise OSError("all sent")
            except OSError:
                refused += 1
                s.close()
                conns[port] = None
    for s in conns.values():
        if s is not None:
            s.close()
    return {"bytes_written": bytes_sent, "connections_ended": refused}  # written: handed to the kernel


def _qos2(end: float, port: int, username: str, password: str) -> dict[str, int]:
    from edgefleet.protocol import mqtt as proto

    payload = b"x" * (250 * 1024)
    topics = [proto.topic("edge-other", "desired"), proto.topic(username, "telemetry")]
    sent = sessions = 0
    while time.monotonic() < end:
        try:
            s = raw_connect(port, username, username, password, clean=False, timeout_s=2)
        except OSError:
            time.sleep(0.2)
            continue
        sessions += 1
        try:
            i = 0
            while time.monotonic() < end:
                s.sendall(publish_packet(topics[sessions % 2], payload, qos=2, packet_id=i % 65535 + 1))
                sent += 1
                i += 1
        except OSError:
            pass
        finally:
            s.close()
    return {"publishes": sent, "sessions": sessions}


def _drip_reads(end: float, ports: dict[str, int]) -> dict[str, int]:
    """20 connections per HTTP port, each 2,000 pipelined GETs sent at once, the answers read 100 bytes a socket
    every 0.2 s."""
    reqs = {ports["agent_http"]: b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * 2000,
            ports["fleet_http"]: b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n\r\n" * 2000}

    def opener(i: int, port: int) -> socket.socket | None:
        s = _sock("127.0.0.1", port, blocking=True)
        if s is None:
            return None
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(1)
        with contextlib.suppress(OSError):
            s.sendall(reqs[port])
        s.setblocking(False)
        return s

    held: list[tuple[int, socket.socket]] = []
    opened = ended = 0
    while time.monotonic() < end:
        for port in reqs:
            while sum(1 for p, _ in held if p == port) < 20 and time.monotonic() < end:
                s = opener(opened, port)
                if s is None:
                    break
                held.append((port, s))
                opened += 1
        keep = []
        for port, s in held:
            try:
                if s.recv(100) == b"":
                    raise OSError("closed")
                keep.append((port, s))
            except BlockingIOError:
                keep.append((port, s))
            except OSError:
                ended += 1
                s.close()
        held = keep
        time.sleep(0.2)
    for _, s in held:
        s.close()
    return {"opened": opened, "closed_by_servers": ended}


# -- the run ------------------------------------------------------------------------------------------------------
def _start(tmp: Path) -> tuple[dict[str, subprocess.Popen], dict[str, int], str, tuple[str, str]]:
    import httpx

    from bench.grpc_front import digits_agent_dir

    ports = {"agent_http": _free_port(), "agent_grpc": _free_port(), "fleet_http": _free_port(), "mqtt": _free_port()}
    subprocess.run([PY, "-m", "edgefleet", "keys", "init", str(tmp / "keys")], cwd=REPO, check=True,
                   capture_output=True)
    digits_agent_dir(tmp / "agent")
    logs = (tmp / "fleet.log").open("w"), (tmp / "agent.log").open("w")
    procs = {
        "fleet": subprocess.Popen([PY, "-m", "edgefleet", "fleet", "serve", "--keys", str(tmp / "keys"), "--data-dir",
                                   str(tmp / "fleet"), "--port", str(ports["fleet_http"]), "--embedded-mqtt-port",
                                   str(ports["mqtt"])], cwd=REPO, stdout=subprocess.DEVNULL, stderr=logs[0]),
        "agent": subprocess.Popen([PY, "-m", "edgefleet", "agent", "--device-id", "bench", "--fleet",
                                   "http://127.0.0.1:9", "--data-dir", str(tmp / "agent"), "--http-port",
                                   str(ports["agent_http"]), "--grpc-port", str(ports["agent_grpc"]),
                                   "--trust-on-first-use"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=logs[1])}
    for p in ports.values():
        _wait_port(p, 90)
    token = (tmp / "fleet" / "admin-token").read_text().strip()
    base = f"http://127.0.0.1:{ports['fleet_http']}/api/v1"
    auth = {"Authorization": f"Bearer {token}"}
    enroll = httpx.post(f"{base}/devices/edge-probe/enrollment-token", headers=auth, json={}, timeout=30).json()
    creds = httpx.post(f"{base}/enroll", json={"token": enroll["token"]}, timeout=30).json()
    return procs, ports, token, (creds["mqtt_username"], creds["mqtt_password"])


def _settle(pids: dict[str, int], before: dict[str, int], limit_s: float) -> tuple[dict[str, int], float]:
    t = time.monotonic()
    while True:
        now = {k: fd_count(p) for k, p in pids.items()}
        if all(now[k] <= before[k] + 2 for k in pids) or time.monotonic() - t > limit_s:
            return now, round(time.monotonic() - t, 1)
        time.sleep(0.25)


def run_shape(shape: str, a: argparse.Namespace, healthy: Healthy, pids: dict[str, int], ports: dict[str, int],
              device: tuple[str, str]) -> dict[str, object]:
    quiet, _qf, _ = healthy.window(a.quiet_seconds, pids)
    fds0 = {k: fd_count(p) for k, p in pids.items()}
    rss0 = {k: rss_kib(p) for k, p in pids.items()}
    load = os.getloadavg()[0]
    h = subprocess.Popen([PY, "-m", "bench.hostile_p99", "--hostile", shape, "--seconds", str(a.seconds),
                          "--ports", json.dumps(ports), "--device", json.dumps(device), "--scale", str(a.scale)],
                         cwd=REPO, stdout=subprocess.PIPE, text=True)
    time.sleep(min(1.0, a.seconds / 4))  # the shape under way before the window opens
    lat, failed, peak = healthy.window(a.seconds - min(1.0, a.seconds / 4), pids)
    out, _ = h.communicate(timeout=a.seconds + 60)
    fds_after, settle_s = _settle(pids, fds0, a.settle_seconds)
    rss_after = {k: rss_kib(p) for k, p in pids.items()}
    targets = {k: {"p99_ms": round(p99(v), 1), "quiet_p99_ms": round(p99(quiet[k]), 1),
                   "ratio": round(p99(v) / max(0.001, p99(quiet[k])), 2), "failed": failed[k], "asked": len(v)}
               for k, v in lat.items()}
    procs = {k: {"fds": [fds0[k], peak[k][0], fds_after[k]], "rss_growth_mb": round((peak[k][1] - rss0[k]) / 1024, 1),
                 "rss_after_mb": round((rss_after[k] - rss0[k]) / 1024, 1)} for k in pids}
    return {"shape": shape, "hostile": json.loads(out.strip().splitlines()[-1]) if out.strip() else None,
            "targets": targets, "processes": procs, "settled_s": settle_s, "load_1m": round(load, 2)}


def table(rows: list[dict]) -> str:  # type: ignore[type-arg]
    lines = ["| shape | target | p99 ms (quiet, ratio) | failed | agent fds before/during/after | fleet fds | "
             "RSS growth agent / fleet MB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        pr = r["processes"]
        for i, (name, t) in enumerate(r["targets"].items()):
            tail = (f"{'/'.join(map(str, pr['agent']['fds']))} | {'/'.join(map(str, pr['fleet']['fds']))} | "
                    f"{pr['agent']['rss_growth_mb']} / {pr['fleet']['rss_growth_mb']}") if i == 0 else " | | "
            lines.append(f"| {r['shape'] if i == 0 else ''} | {name} | {t['p99_ms']} ({t['quiet_p99_ms']}, "
                         f"x{t['ratio']}) | {t['failed']}/{t['asked']} | {tail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="each shape's hostile phase")
    ap.add_argument("--quiet-seconds", type=float, default=5.0, help="each shape's baseline window before it")
    ap.add_argument("--settle-seconds", type=float, default=30.0, help="at most, for the descriptors to come back")
    ap.add_argument("--scale", type=float, default=1.0, help="connection counts and bytes, times this")
    ap.add_argument("--quick", action="store_true", help="3 s a shape, 2 s quiet, a quarter of the counts")
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--hostile", choices=SHAPES, help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the hostile side holds thousands of sockets
    if a.hostile:
        result = hostile(a.hostile, time.monotonic() + a.seconds, json.loads(a.ports), tuple(json.loads(a.device)),
                         a.scale)
        print(json.dumps(result), flush=True)
        return 0
    if a.quick:
        a.seconds, a.quiet_seconds, a.settle_seconds, a.scale = 3.0, 2.0, 15.0, 0.25
    shapes = [s for s in a.only.split(",") if s]
    if unknown := set(shapes) - set(SHAPES):
        ap.error(f"unknown shapes: {sorted(unknown)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostile-p99-") as work:
        procs, ports, token, device = _start(Path(work))
        try:
            pids = {k: p.pid for k, p in procs.items()}
            healthy = Healthy(ports["agent_http"], ports["agent_grpc"], ports["fleet_http"], token)
            healthy.window(1.0, pids)  # warm: the first infer, the gRPC channel
            for shape in shapes:
                rows.append(run_shape(shape, a, healthy, pids, ports, device))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            healthy.channel.close()
        finally:
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    print(table(rows))
    print(json.dumps({"seconds": a.seconds, "quiet_seconds": a.quiet_seconds, "scale": a.scale, "quick": a.quick,
                      "cpus": os.cpu_count(), "at": time.strftime("%Y-%m-%d %H:%M"), "shapes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
