"""The agent's memory after install under each ``runtime`` setting: what choosing the runtime on the device costs.

With ``runtime: auto`` and OpenVINO installed, the agent loads the bundle on every runtime that runs it, self-tests
and times each, and serves the fastest (agent/install/runtime_choice.py); pinned (``runtime: onnxruntime`` or
``openvino``) it loads only that one. This script starts the agent (``python -m edgefleet.cli agent``, no fleet: it
serves the bundle installed in its data dir) under each setting in turn, ``--rounds`` times in alternating order, each
on a fresh copy of the same data dir (and from each ``--trees`` checkout: the same run can hold an older commit's agent,
e.g. ``git archive COMMIT | tar -x -C /tmp/old``, beside this one's), and reads its resident memory once it is
ready and has settled (VmRSS after ``--settle-s``) and its peak (VmHWM), with the runtime it chose
(``/v2/models/{m}/config``).

The bundles: bench/serve.py's (``prepare``: MobileNetV2-like from models/zoo, compiled for x86-cpu), FP32 and INT8.

Run from the repository root:
  .venv/bin/python bench/runtime_memory.py [--models mobilenetv2-fp32,mobilenetv2-int8] [--rounds 2] [--work-dir D]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench
from _common import say
from serve import prepare
from serve_bench import AgentProcess
from serve_limit import _rss_mb

SETTINGS = ("auto", "onnxruntime", "openvino")


def one(data_dir: Path, work: Path, setting: str, model: str, settle_s: float, tag: str,
        threads: int | None, tree: Path) -> dict[str, Any]:
    """The agent of checkout ``tree`` (``python -m edgefleet.cli`` run there: its edgefleet/ links come first on the
    path) on a copy of ``data_dir`` with ``runtime: setting``: its RSS once ready and settled, its peak."""
    copy = work / f"run-{tag}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(data_dir, copy)
    cfg = work / f"runtime-{setting}.yaml"
    cfg.write_text(f"runtime: {setting}\n")
    t0 = time.monotonic()
    serve_bench.REPO = tree  # AgentProcess starts the agent there
    with AgentProcess(copy, work / "logs" / f"{tag}.log", 0, None, threads, 300, instances=None,
                      extra_args=("--config", str(cfg))) as agent:
        ready_s = time.monotonic() - t0
        assert agent.proc is not None
        time.sleep(settle_s)
        rss, peak = _rss_mb(agent.proc.pid), _rss_mb(agent.proc.pid, "VmHWM")
        with urllib.request.urlopen(f"{agent.url}/v2/models/{model}/config", timeout=30) as r:  # loopback
            cfg_doc = json.loads(r.read())
    shutil.rmtree(copy, ignore_errors=True)
    rc = cfg_doc.get("runtime_choice") or {}
    return {"setting": setting, "rss_mb": round(rss, 1), "peak_mb": round(peak, 1), "ready_s": round(ready_s, 2),
            "runtime": rc.get("runtime"), "source": rc.get("source"), "items_per_second": rc.get("items_per_second")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mobilenetv2-fp32,mobilenetv2-int8")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=2.0, help="after ready, before RSS is read")
    ap.add_argument("--threads", type=int, help="the agent's --threads (default: its own layout trial)")
    ap.add_argument("--trees", default="this",
                    help="NAME=DIR,... checkouts whose agent to run (this: the one this script is in)")
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    settings = [s for s in a.settings.split(",") if s]
    trees = {name: Path(d).resolve() if d else Path(__file__).resolve().parent.parent
             for name, _, d in (t.partition("=") for t in a.trees.split(",") if t)}
    missing = [str(d) for d in trees.values() if not (d / "edgefleet" / "__main__.py").exists()]
    if missing:
        ap.error(f"not a checkout: {', '.join(missing)}")
    if not set(settings) <= set(SETTINGS) or not 1 <= a.rounds <= 10:
        ap.error(f"settings of {SETTINGS}; rounds 1-10")
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        work = a.work_dir.resolve() if a.work_dir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="edgefleet-runtime-memory-")))
        for name in [m for m in a.models.split(",") if m]:
            say(f"{name}: compiling for x86-cpu and installing")
            m = prepare(name, work)
            runs = [(t, s) for t in trees for s in settings]
            for r in range(a.rounds):
                for t, s in runs if r % 2 == 0 else list(reversed(runs)):
                    row = {"model": name, "round": r + 1, "tree": t,
                           **one(m["data_dir"], work, s, m["model"], a.settle_s, f"{name}-{t}-{s}-{r}", a.threads,
                                 trees[t])}
                    rows.append(row)
                    say(f"  {name} round {r + 1} {t} runtime: {s:11s} -> serves on {row['runtime']} "
                        f"({row['source']}): RSS {row['rss_mb']:.0f} MB, peak {row['peak_mb']:.0f} MB, ready in "
                        f"{row['ready_s']:.1f} s")
    print("\n| model | agent | runtime setting | serves on | RSS after install, MB (median; each round) | "
          "peak MB (median) | ready s (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, t, s in ((n, t, s) for n in dict.fromkeys(r["model"] for r in rows) for t in trees for s in settings):
        mine = [r for r in rows if r["model"] == name and r["setting"] == s and r["tree"] == t]
        if mine:
            each = ", ".join(f"{r['rss_mb']:.0f}" for r in mine)
            print(f"| {name} | {t} | {s} | {', '.join(sorted({str(r['runtime']) for r in mine}))} | "
                  f"{statistics.median(r['rss_mb'] for r in mine):.0f} ({each}) | "
                  f"{statistics.median(r['peak_mb'] for r in mine):.0f} | "
                  f"{statistics.median(r['ready_s'] for r in mine):.1f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
