"""How long an agent takes to serve an installed model: the restart, beside the bare runtime's session load.

For each model (digits INT8, MobileNetV2-like FP32 from models/zoo/make_zoo.py), on 127.0.0.1, no fleet:

1. compile it for x86-cpu and install the bundle into an agent data dir (as bench/serve.py does);
2. **bare**: a fresh Python process that imports onnxruntime, creates the session and answers one call (its
   session load and its process start to first answer), the floor any server pays;
3. **first start** (the install's trials): ``edgefleet agent`` started over the data dir with no trial record, as
   after an install, so the agent times the precision, runtime, layout and batch trials before serving; process
   start to the model's ``/ready`` answering 200, and to the first inference answer; the trials' share is the
   agent's own log line ("trials ... took X s");
4. **restart**: the same agent stopped and started again, nothing changed: the trial record kept with the installed
   version serves at once (agent/install/trials.py); the same two times.

Ratios are against the bare session load measured in the same run. The agent runs with its own choices (runtime
auto, layout and batch auto), as a device runs by default. Beside each agent's CPU seconds to the first answer (the
whole process) stand its main thread's (the serving start: imports, the store's check, the load, the listening; the
fleet link, installer and telemetry threads start once it listens). ``--bytecode-cache`` runs every measured process
with compiled bytecode kept in the work dir (``PYTHONPYCACHEPREFIX``), as a wheel pip installed has it; without it a
checkout run with ``PYTHONDONTWRITEBYTECODE=1`` compiles the project's modules at every start.

Run from the repository root:  .venv/bin/python bench/restart.py [--models digits,mobilenetv2-fp32] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import serve
from _common import REPO, say
from serve_bench import UNREACHABLE_FLEET, _die_with_parent, _free_port

from edgefleet.protocol.processes import stop_processes

DEADLINE_S = 180.0  # an agent not answering after this is a failed run
TRIALS_LINE = re.compile(r"trials \(([^)]*)\) took ([0-9.]+) s")

BARE = """
import sys, time
t0 = time.monotonic()
import numpy as np, onnxruntime as ort
t1 = time.monotonic()
o = ort.SessionOptions(); o.intra_op_num_threads = int(sys.argv[3])
s = ort.InferenceSession(sys.argv[1], o, providers=["CPUExecutionProvider"])
t2 = time.monotonic()
x = np.load(sys.argv[2])
s.run(None, {s.get_inputs()[0].name: x})
t3 = time.monotonic()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def prepare(name: str, work: Path) -> dict[str, Any]:
    """Compile and install one model as bench/serve.py does (into ``work/name/agent``); -> its data dir, engine,
    model name and one input (also saved for the bare process)."""
    m = serve.prepare(name, work)
    m["image"] = np.ascontiguousarray(m["images"][:1], np.float32)
    m["input"] = work / name / "input.npy"
    np.save(m["input"], m["image"])
    return m


def bare(m: dict[str, Any], threads: int) -> dict[str, float]:
    """A fresh process: import onnxruntime, load the session, answer one call."""
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", BARE, str(m["engine"]), str(m["input"]), str(threads)],
                         capture_output=True, check=True, timeout=DEADLINE_S)
    total = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    imp, load, call = (float(v) for v in out.stdout.split())
    return {"import_s": imp, "session_load_s": load, "first_call_s": call, "process_to_answer_s": total,
            "cpu_s": cpu}


def _status(url: str, body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, urllib.error.URLError):
        return 0


def _thread_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``'s main thread so far (Linux /proc): the agent's serving start."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:13]) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` and its waited-for children so far (Linux /proc): on a box other work loads,
    close to what the wall time would be on a quiet one where the work is one thread at a time (imports, loads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def agent_start(m: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """Start ``edgefleet agent`` over the data dir; -> seconds from process start to /ready 200 and to the first
    answer, and the trials the agent's log reports."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    img = m["image"]
    body = json.dumps({"inputs": [{"name": "input", "shape": list(img.shape), "datatype": "FP32",
                                   "data": img.reshape(-1).tolist()}]}).encode()
    args = [sys.executable, "-m", "edgefleet.cli", "agent", "--device-id", "bench", "--fleet", UNREACHABLE_FLEET,
            "--data-dir", str(m["data_dir"]), "--http-port", str(port), "--trust-on-first-use", "-v"]
    with log_path.open("wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                preexec_fn=_die_with_parent)
    ready = answer = cpu = main_cpu = None
    try:
        while time.monotonic() - t0 < DEADLINE_S and answer is None:
            if proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            if ready is None and _status(f"{url}/v2/models/{m['model']}/ready") == 200:
                ready = time.monotonic() - t0
            if ready is not None and _status(f"{url}/v2/models/{m['model']}/infer", body) == 200:
                answer = time.monotonic() - t0
                cpu, main_cpu = _cpu_s(proc.pid), _thread_cpu_s(proc.pid)
            else:
                time.sleep(0.02)
    finally:
        stop_processes([proc], grace_s=10)
    if answer is None:
        raise RuntimeError(f"no answer after {DEADLINE_S:g} s: {log_path.read_text()[-2000:]}")
    trials = [(what, float(s)) for what, s in TRIALS_LINE.findall(log_path.read_text(errors="replace"))]
    return {"ready_s": ready, "answer_s": answer, "cpu_s": cpu, "main_cpu_s": main_cpu,
            "trials_s": sum(s for _, s in trials),
            "trials": [w for w, _ in trials]}


def bench_model(m: dict[str, Any], runs: int, work: Path, warm: bool = False) -> dict[str, Any]:
    if warm:  # one unmeasured bare process writes the bytecode cache (the first start writes the agent's)
        bare(m, 2)
    bares = [bare(m, 2) for _ in range(runs)]
    firsts, restarts = [], []
    for i in range(runs):
        shutil.rmtree(m["data_dir"] / "store" / "trials", ignore_errors=True)  # as after an install: no record
        firsts.append(agent_start(m, work / f"{m['name']}-first-{i}.log"))
        restarts.append(agent_start(m, work / f"{m['name']}-restart-{i}.log"))
    med = {k: statistics.median(b[k] for b in bares) for k in bares[0]}
    keys = ("ready_s", "answer_s", "cpu_s", "main_cpu_s", "trials_s")
    return {"model": m["name"], "runs": runs, "bare": med,
            "first_start": {k: statistics.median(r[k] for r in firsts) for k in keys},
            "restart": {k: statistics.median(r[k] for r in restarts) for k in keys},
            "restart_trials_run": sum(len(r["trials"]) for r in restarts)}


def print_report(docs: list[dict[str, Any]]) -> None:
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':17} {'bare: load':>10} {'proc':>6} {'cpu':>5} | {'first: answer':>13} {'trials':>6} | "
          f"{'restart: ready':>14} {'answer':>6} {'cpu':>5} {'main':>5} | {'answer/proc':>11} {'cpu/cpu':>7}")
    for d in docs:
        b, f, r = d["bare"], d["first_start"], d["restart"]
        print(f"{d['model']:17} {b['session_load_s']:9.3f}s {b['process_to_answer_s']:5.2f}s {b['cpu_s']:4.2f}s | "
              f"{f['answer_s']:12.2f}s {f['trials_s']:5.2f}s | "
              f"{r['ready_s']:13.2f}s {r['answer_s']:5.2f}s {r['cpu_s']:4.2f}s {r['main_cpu_s']:4.2f}s | "
              f"{r['answer_s'] / b['process_to_answer_s']:10.2f}x {r['cpu_s'] / b['cpu_s']:6.2f}x")
    print("bare: a python process importing onnxruntime, loading the session (load) and answering once (proc, its CPU "
          "seconds: cpu). first: the agent started with no trial record (the install's trials run; trials: their "
          "time, from the agent's log). restart: started again, nothing changed (no trial runs); cpu: the process's "
          "CPU seconds to the answer, main: its main thread's (the serving start). Medians of --runs.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="digits,mobilenetv2-fp32")
    p.add_argument("--runs", type=int, default=3, choices=range(1, 21), metavar="N (1-20)")
    p.add_argument("--json", action="store_true", help="print the JSON document too")
    p.add_argument("--bytecode-cache", action="store_true",
                   help="measured processes keep compiled bytecode in the work dir, as an installed wheel has it")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ef-restart-") as tmp:
        work = Path(tmp)
        if args.bytecode_cache:  # inherited by the bare process and the agents (the first start writes it)
            os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
            os.environ["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        docs = []
        for name in args.models.split(","):
            (work / name).mkdir(parents=True)
            say(f"{name}: compiling and installing")
            m = prepare(name, work)
            say(f"{name}: timing {args.runs} bare loads, first starts and restarts")
            docs.append(bench_model(m, args.runs, work, warm=args.bytecode_cache))
    print_report(docs)
    if args.json:
        print(json.dumps(docs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
