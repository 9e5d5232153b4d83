"""The HTTP listeners under connection floods, and what the guard costs (protocol/httpguard.py; issue 45).

    .venv/bin/python bench/http_limits.py [--seconds 5] [--only rps,agent,fleet]

1. ``rps``: requests/s of a small GET on one keep-alive connection per client (8 clients, one process), a
   trivial ASGI app on uvicorn with httptools as uvicorn ships it, with the guard, and with h11; the variants
   take turns twice, each for ``--seconds``.
2. ``agent``: a real agent (``edgefleet agent``, default limits) while 2,000 connections from 127.0.0.1 send half a
   request head and stop: how many are closed, by when, and what a healthy client on 127.0.0.2 sees meanwhile
   (health latency), and the agent's descriptors before, during and after.
3. ``fleet``: a real fleet (``edgefleet fleet serve``, embedded broker) run with RLIMIT_NOFILE 1024 while 1,100
   connections from 20 addresses sit idle: its descriptors, health latency from another address, and whether an
   MQTT client still gets its CONNACK from the embedded broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s}s")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _ask(port: int, request: bytes, src: str = "127.0.0.2", timeout_s: float = 5.0) -> tuple[int, float]:
    """``request`` (with Connection: close) on a new connection from ``src`` -> (its status, 0 for none; ms to the
    whole answer, at most 1 MiB of it)."""
    t = time.perf_counter()
    try:
        with socket.socket() as s:
            s.settimeout(timeout_s)
            s.bind((src, 0))
            s.connect(("127.0.0.1", port))
            s.sendall(request)
            got = b""
            while len(got) <= 1 << 20 and (chunk := s.recv(65536)):
                got += chunk
        return int(got.split(b" ")[1]), (time.perf_counter() - t) * 1000
    except (OSError, IndexError, ValueError):
        return 0, (time.perf_counter() - t) * 1000


def _get(port: int, path: str, src: str = "127.0.0.2", timeout_s: float = 5.0) -> tuple[int, float]:
    return _ask(port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(), src, timeout_s)


# -- 1. requests/s ------------------------------------------------------------------------------------------
SERVER = r"""
import sys, socket, uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.http.h11_impl import H11Protocol
from edgefleet.protocol.httpguard import HttpLimits, guarded
async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
                                                                   (b"content-length", b"13")]})
    await send({"type": "http.response.body", "body": b'{"live":true}'})
http = {"httptools": HttpToolsProtocol, "guarded": guarded(HttpToolsProtocol, HttpLimits()), "h11": H11Protocol}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False, lifespan="off",
            http=http[sys.argv[1]])
"""


async def _load(port: int, seconds: float, clients: int = 8) -> int:
    done = 0
    stop = time.monotonic() + seconds
    req = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"

    async def one() -> None:
        nonlocal done
        r, w = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < stop:
            w.write(req)
            head = await r.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await r.readexactly(length)
            done += 1
        w.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return done


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rps(seconds: float, rounds: int = 3) -> dict[str, list[tuple[float, float]]]:
    """Per variant and turn: (requests/s, requests per CPU-second of the server: steadier on a shared machine)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for _round in range(rounds):
        for variant in ("httptools", "guarded", "h11"):
            port = _free_port()
            p = subprocess.Popen([PY, "-c", SERVER, variant, str(port)], cwd=REPO)
            try:
                _wait_port(port)
                cpu = _cpu_s(p.pid)
                n = asyncio.run(_load(port, seconds))
                out.setdefault(variant, []).append((n / seconds, n / max(1e-9, _cpu_s(p.pid) - cpu)))
            finally:
                p.send_signal(signal.SIGINT)
                p.wait(20)
    return out


# -- 2. the agent and 2,000 half-sent heads -------------------------------------------------------------------
def agent_half_heads(n: int = 2000) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        p = subprocess.Popen([PY, "-m", "edgefleet", "agent", "--device-id", "bench", "--fleet", "http://127.0.0.1:9",
                              "--data-dir", tmp, "--http-port", str(port), "--trust-on-first-use"], cwd=REPO,
                             stderr=subprocess.DEVNULL)
        try:
            _wait_port(port)
            base = _fds(p.pid)
            socks, t0, opened = [], time.monotonic(), []
            for _ in range(n):
                opened.append(time.monotonic())
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                s.setblocking(False)
                socks.append(s)
            during = _fds(p.pid)
            lat, codes, closed_at, kinds = [], [], {}, {}
            while len(closed_at) < n and time.monotonic() - t0 < 40:
                code, ms = _get(port, "/v2/health/live")
                codes.append(code)
                lat.append(ms)
                for i, s in enumerate(socks):
                    if i in closed_at:
                        continue
                    try:
                        kinds[i] = s.recv(12)[9:12] or b"EOF"  # an answer (408 or 503, then the close) or the close
                        closed_at[i] = time.monotonic() - opened[i]
                    except BlockingIOError:
                        pass
                    except OSError:
                        closed_at[i] = time.monotonic() - opened[i]
                time.sleep(0.1)
            peak = _fds(p.pid)
            for s in socks:
                s.close()
            time.sleep(1)
            answers = [k.decode() for k in kinds.values()]
            return {"connections": n, "closed": len(closed_at),
                    "answers": {k: answers.count(k) for k in sorted(set(answers))},
                    "longest_open_s": round(max(closed_at.values()), 1), "fds_before": base,
                    "fds_during": during, "fds_at_end": peak, "fds_after": _fds(p.pid),
                    "health_ok": f"{codes.count(200)}/{len(codes)}",
                    "health_p99_ms": round(sorted(lat)[int(len(lat) * 0.99) - 1], 1) if lat else None}
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)


# -- 3. the fleet at 1,024 descriptors and 1,100 idle connections ---------------------------------------------
FLEET = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
from edgefleet.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _mqtt_connack(port: int) -> bool:
    """An MQTT 3.1.1 CONNECT (anonymous: refused, but answered): whether a CONNACK comes back within 5 s."""
    try:
        with socket.create_connection(("127.0.0.1", port), 5) as s:
            s.settimeout(5)
            s.sendall(bytes([0x10, 18, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 30, 0, 6]) + b"bench1")
            return s.recv(4)[:1] == b"\x20"
    except OSError:
        return False


def fleet_idle(n: int = 1100, addresses: int = 20) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port, mqtt = _free_port(), _free_port()
        subprocess.run([PY, "-m", "edgefleet", "keys", "init", f"{tmp}/keys"], cwd=REPO, check=True,
                       capture_output=True)
        p = subprocess.Popen([PY, "-c", FLEET, "fleet", "serve", "--keys", f"{tmp}/keys", "--data-dir", f"{tmp}/d",
                              "--port", str(port), "--embedded-mqtt-port", str(mqtt)], cwd=REPO,
                             stderr=subprocess.DEVNULL)
        try:
            _wait_port(port)
            _wait_port(mqtt)
            base = _fds(p.pid)
            socks, refused = [], 0
            for i in range(n):
                s = socket.socket()
                s.bind((f"127.0.0.{1 + i % addresses}", 0))
                try:
                    s.connect(("127.0.0.1", port))
                    socks.append(s)
                except OSError:
                    refused += 1
                    s.close()
            time.sleep(0.5)
            during = _fds(p.pid)
            lat, codes = [], []
            mqtt_ok = 0
            for i in range(20):
                code, ms = _get(port, "/api/v1/health", src=f"127.0.1.{1 + i}")
                codes.append(code)
                lat.append(ms)
                mqtt_ok += _mqtt_connack(mqtt)
            for s in socks:
                s.close()
            time.sleep(1)
            return {"connections": n, "addresses": addresses, "connect_refused": refused, "fds_before": base,
                    "fds_during": during, "fds_after": _fds(p.pid), "health_ok": f"{codes.count(200)}/{len(codes)}",
                    "health_median_ms": round(statistics.median(lat), 1), "health_max_ms": round(max(lat), 1),
                    "mqtt_connack": f"{mqtt_ok}/20"}
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="each requests/s turn")
    ap.add_argument("--only", default="rps,agent,fleet")
    a = ap.parse_args()
    parts = a.only.split(",")
    if "rps" in parts:
        r = rps(a.seconds)
        print(json.dumps({"requests_per_s": {k: [round(x) for x, _ in v] for k, v in r.items()},
                          "requests_per_server_cpu_s": {k: [round(y) for _, y in v] for k, v in r.items()},
                          "median_per_cpu_s": {k: round(statistics.median(y for _, y in v)) for k, v in r.items()}}),
              flush=True)
    if "agent" in parts:
        print(json.dumps({"agent_half_heads": agent_half_heads()}), flush=True)
    if "fleet" in parts:
        print(json.dumps({"fleet_idle_at_1024_fds": fleet_idle()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
