"""What the gRPC port's front costs (agent/transports/grpc_front.py; issue 45.1): digits infers over gRPC through
the public port (the front, spliced to gRPC core's Unix socket) and straight to that socket, same agent, same run.

    .venv/bin/python -m bench.grpc_front [--seconds 10] [--rounds 3] [--clients 4]

One agent (``edgefleet agent``, digits INT8 preinstalled, no fleet) serves; a load-generator process (grpc.aio,
``--clients`` closed loops, prebuilt ModelInferRequests, every answer's top-1 checked) drives one variant at a
time, the two taking turns for ``--rounds`` rounds of ``--seconds`` each. Per turn: requests/s, the client's p50
and p99, and the agent process's CPU milliseconds per request (utime + stime from /proc: steadier than wall-clock
figures on a shared box). Prints one JSON object; the medians over the rounds and the front's ratio to direct.
Loopback only; each loop is bounded by its seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def digits_agent_dir(data_dir: Path) -> None:
    """digits compiled for x86-cpu (static INT8, as the tests' digits_bundle) and installed in ``data_dir``."""
    from edgefleet.agent.install.store import ModelStore
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.protocol.bundle import sha256_file

    digits = REPO / "models" / "digits"
    bundle = compile_model(CompileOptions(
        model=digits / "model.onnx", profile="x86-cpu", calibration=digits / "calibration.npz",
        eval=digits / "test.npz", out_dir=data_dir.parent / "dist", name="digits", version="1.0.0",
        benchmark=False, precision="int8")).bundle
    store = ModelStore(data_dir / "store")
    store.recover()
    store.commit(store.stage(bundle, sha256_file(bundle)), rollout_id=None)


def inner_socket(pid: int) -> str:
    """The agent's private gRPC socket: the listening Unix socket of ``pid`` whose path is edgefleet-grpc-*."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and "/edgefleet-grpc-" in fields[7]:
            return fields[7]
    raise RuntimeError(f"no edgefleet-grpc socket among {pid}'s descriptors")


CLIENT = r"""
import asyncio, json, sys, time
import numpy as np, grpc
from tritonclient.grpc import service_pb2
target, seconds, clients = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
d = np.load(sys.argv[4])
images, labels = d["input"], d["labels"]
reqs = []
for img in images:
    r = service_pb2.ModelInferRequest(model_name="digits")
    r.inputs.add(name="input", datatype="FP32", shape=[1, *img.shape])
    r.raw_input_contents.append(np.ascontiguousarray(img[None], dtype=np.float32).tobytes())
    reqs.append(r.SerializeToString())
async def main():
    ch = grpc.aio.insecure_channel(target)
    infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                           response_deserializer=service_pb2.ModelInferResponse.FromString)
    lat, wrong = [], 0
    async def loop(k, stop, record):
        nonlocal wrong
        i = k * 7919 % len(reqs)
        while time.monotonic() < stop:
            t = time.perf_counter()
            r = await infer(reqs[i], timeout=30)
            if record:
                lat.append(time.perf_counter() - t)
                wrong += int(np.frombuffer(r.raw_output_contents[0], np.float32).argmax() != labels[i])
            i = (i + 1) % len(reqs)
    await asyncio.gather(*(loop(k, time.monotonic() + 1.0, False) for k in range(clients)))  # warm-up
    print("timed", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    await asyncio.gather(*(loop(k, time.monotonic() + seconds, True) for k in range(clients)))
    wall = time.perf_counter() - t0
    await ch.close()
    lat.sort()
    print(json.dumps({"requests": len(lat), "wall_s": wall, "wrong": wrong,
                      "p50_ms": lat[len(lat) // 2] * 1000, "p99_ms": lat[int(len(lat) * 0.99)] * 1000}), flush=True)
asyncio.run(main())
"""


def turn(target: str, agent_pid: int, seconds: float, clients: int) -> dict[str, float]:
    c = subprocess.Popen([PY, "-c", CLIENT, target, str(seconds), str(clients), str(REPO / "models/digits/test.npz")],
                         cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert c.stdin is not None and c.stdout is not None
        if c.stdout.readline().strip() != "timed":
            raise RuntimeError(f"the load generator for {target} failed")
        cpu0 = _cpu_s(agent_pid)
        c.stdin.write("go\n")
        c.stdin.flush()
        out = json.loads(c.stdout.readline())
        cpu = _cpu_s(agent_pid) - cpu0
    finally:
        c.wait(seconds + 60)
    n = out["requests"]
    return {"req_per_s": round(n / out["wall_s"], 1), "agent_cpu_ms_per_req": round(cpu * 1000 / max(1, n), 3),
            "p50_ms": round(out["p50_ms"], 2), "p99_ms": round(out["p99_ms"], 2), "requests": n, "wrong": out["wrong"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="each turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4, help="closed loops in the load generator")
    a = ap.parse_args(argv)
    from bench.http_limits import _free_port, _wait_port

    with tempfile.TemporaryDirectory(prefix="grpc-front-") as tmp:
        data = Path(tmp) / "agent"
        digits_agent_dir(data)
        http, grpc_port = _free_port(), _free_port()
        agent = subprocess.Popen([PY, "-m", "edgefleet", "agent", "--device-id", "bench", "--fleet",
                                  "http://127.0.0.1:9", "--data-dir", str(data), "--http-port", str(http),
                                  "--grpc-port", str(grpc_port), "--trust-on-first-use"], cwd=REPO,
                                 stderr=subprocess.DEVNULL)
        try:
            _wait_port(http)
            _wait_port(grpc_port)
            targets = {"front": f"127.0.0.1:{grpc_port}", "direct": f"unix:{inner_socket(agent.pid)}"}
            rows: dict[str, list[dict[str, float]]] = {k: [] for k in targets}
            load = [os.getloadavg()[0]]
            for r in range(a.rounds):
                for kind in (("front", "direct") if r % 2 == 0 else ("direct", "front")):
                    rows[kind].append(turn(targets[kind], agent.pid, a.seconds, a.clients))
                    print(json.dumps({kind: rows[kind][-1]}), file=sys.stderr, flush=True)
                load.append(os.getloadavg()[0])
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(30)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("req_per_s", "agent_cpu_ms_per_req", "p50_ms",
                                                              "p99_ms")} for k, v in rows.items()}
    print(json.dumps({"clients": a.clients, "seconds": a.seconds, "rounds": a.rounds, "turns": rows, "median": med,
                      "front_vs_direct": {"req_per_s": round(med["front"]["req_per_s"] / med["direct"]["req_per_s"], 3),
                                          "agent_cpu_per_req": round(med["front"]["agent_cpu_ms_per_req"]
                                                                     / med["direct"]["agent_cpu_ms_per_req"], 3)},
                      "loadavg_1m": [round(x, 2) for x in load], "cpus": os.cpu_count(), "at": time.strftime("%H:%M")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
