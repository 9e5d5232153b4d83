"""A/B of agent code in one run: several agents (each from its own source tree, e.g. a commit checked out with
``git archive``) started in alternation against the same closed-loop binary-OIP load and the same runtime limit.

    mkdir -p /tmp/ab/old && git archive HEAD~1 agent edgefleet engines protocol compiler | tar -x -C /tmp/ab/old
    ln -s "$PWD/hw-profiles" /tmp/ab/old/hw-profiles
    .venv/bin/python bench/serve_ab.py --models mobilenetv2-fp32 --variants old=/tmp/ab/old:16,new=.:16 \\
        --clients 8,32 --rounds 4 --pin

A variant is LABEL=TREE:MAXBATCH[:LAYOUT]: MAXBATCH ``auto`` lets the agent choose (else an operator's
setting), LAYOUT INSTANCESxTHREADS (default 1x1 pinned, 1x2 unpinned) or ``agent`` (it chooses). Each round runs
every variant once (the order reversed every other round); ratios are against the mean of the limit measured
before and after (bench/serve.py's, in this process).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve
import serve_bench
import serve_limit
import serve_load

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mobilenetv2-fp32")
    p.add_argument("--variants", required=True, help="LABEL=TREE:MAXBATCH[:LAYOUT], comma-separated")
    p.add_argument("--clients", default="8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=300, help="timed requests per level")
    p.add_argument("--pin", action="store_true", help="inference on the last CPU, the rest on the others")
    p.add_argument("--kind", default="binary", choices=("binary", "local", "local-inline"),
                   help="the load: binary OIP over HTTP, or the on-box socket (digits) with shared memory or inline")
    p.add_argument("--socket-timeouts", default="client",
                   help="local kinds: the load generator's timeouts, comma-separated of client (the client's "
                        "timeout_s) and wait_for (asyncio.wait_for, a task per request): each a variant of its own")
    args = p.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    if args.pin:
        serve_limit.PIN = (frozenset(allowed[-1:]), frozenset(allowed[:-1]))
    threads = 1 if args.pin else 2
    variants = []
    for v in args.variants.split(","):
        label, _, rest = v.partition("=")
        tree, mb, *lay = rest.split(":")
        variants.append((label, Path(tree).resolve(), mb, lay[0] if lay else f"1x{threads}"))
    clients = [int(c) for c in args.clients.split(",")]
    work = Path(tempfile.mkdtemp(prefix="serve-ab-"))
    for name in args.models.split(","):
        m = serve.prepare(name, work)
        lim0 = serve_limit.the_limit(m["engine"], m["images"], threads, 1.5)
        path, reqs, _ = serve_load.bodies(args.kind, m["model"], m["images"])
        modes = args.socket_timeouts.split(",") if args.kind != "binary" else ["-"]
        res: dict[str, list[tuple[float, float, int, int]]] = {}
        for r in range(args.rounds):
            for label, tree, mb, lay in variants if r % 2 == 0 else list(reversed(variants)):
                serve_bench.REPO = tree  # the agent runs from this tree (python -m edgefleet.cli, cwd first)
                inst, per = (None, None) if lay == "agent" else (int(x) for x in lay.split("x"))
                sock = m["data_dir"] / "local.sock"
                extra = (("--inference-cpus", str(allowed[-1])) if args.pin else ()) + (
                    ("--local-socket", str(sock)) if args.kind != "binary" else ())
                agent = serve_bench.AgentProcess(
                    m["data_dir"], work / f"{name}-{label}.log", 0, None if mb == "auto" else int(mb), per, 120,
                    instances=inst, extra_args=extra)
                with agent:
                    assert agent.proc is not None
                    choice, _ = serve.agent_choice(agent.url, m["model"])
                    for c in clients:
                        for mode in modes if c % 2 == 0 else list(reversed(modes)):
                            os.environ["EDGEFLEET_BENCH_SOCKET_WAIT_FOR"] = "1" if mode == "wait_for" else "0"
                            x = serve_load.run_level(agent.url if args.kind == "binary" else str(sock), args.kind, path,
                                                reqs, m["labels"], c, args.requests, 5, server_pid=agent.proc.pid)
                            key = f"{label}:{mb}:{lay}:{c}" + ("" if mode == "-" else f":{mode}")
                            res.setdefault(key, []).append((x["req_per_s"], x["p99_ms"], x["errors"], x["wrong"]))
                            print(f"{name} {key}: {x['req_per_s']:.1f} req/s p99 {x['p99_ms']:.1f} ms inference "
                                  f"cores {x.get('server_other_cores', 0):.2f}; {choice}", file=sys.stderr, flush=True)
        lim1 = serve_limit.the_limit(m["engine"], m["images"], threads, 1.5)
        limit = (lim0["images_per_s"] + lim1["images_per_s"]) / 2
        print(f"\n{name}: limit {limit:.1f} img/s ({'pinned' if args.pin else 'unpinned'}; before "
              f"{lim0['images_per_s']:.1f} {lim0['by_layout']}, after {lim1['images_per_s']:.1f})")
        for k, v in res.items():
            print(f"  {k:>24}: " + ", ".join(f"{q:.1f} req/s {q / limit:.1%} p99 {p99:.0f} ms errors {e} wrong {w}"
                                            for q, p99, e, w in v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
