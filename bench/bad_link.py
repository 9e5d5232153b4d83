"""A rollout over a bad link (issue 43): how much a cut, slow link costs a bundle download, and whether it installs.

A real fleet, a real Mosquitto and a real agent on this machine; the agent's HTTP to the fleet crosses a veth pair
into a network namespace and back (tests/bad_link.py: netem where the kernel has it, else tbf for the rate, a
relay's queue for the delay and nftables dropping packets at random for the loss). During the bundle's download the
link is set down ``--cuts`` times for ``--down-s`` seconds, evenly spread over the download's expected time, and the
relay cuts each connection after 1/``--cuts`` of the bundle. Reported: the bundle's size, the bytes the link carried
from the fleet (bundle and metadata, all tries), their ratio, the agent's retried cuts, the packets lost, the wall
time, and what the link really was.

Needs root and network namespaces. Run from the repository root:
    .venv/bin/python bench/bad_link.py [--bundle-mb 20] [--rate 1mbit] [--delay-ms 150] [--loss-pct 5] [--cuts 10]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import say

from tests.bad_link import agent_behind_bad_link, namespaces_allowed


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise SystemExit(f"--rate {rate!r}: NUMBER followed by kbit, mbit or gbit")


def run(args: argparse.Namespace) -> dict[str, object]:
    try:
        from edgefleet.compiler.compile import CompileOptions, compile_model
    except ImportError:  # before the compiler's split into compiler/compile/
        from edgefleet.compiler.pipeline import CompileOptions, compile_model  # type: ignore[no-redef]
    from tests.agent_harness import served_version
    from tests.conftest import DIGITS
    from tests.test_tuf_bundles import rebundle
    from tests.waiting import wait_for

    lines = _Lines()
    logging.getLogger("edgefleet.agent").addHandler(lines)
    tmp = Path(tempfile.mkdtemp(prefix="bad-link-"))
    say("compiling digits ...")
    base = compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="x86-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=tmp / "dist", name="digits", version="1.0.0", benchmark=False,
        precision="int8")).bundle
    big = rebundle(base, tmp / "v110.tar", pad_bytes=int(args.bundle_mb * 1e6), version="1.1.0")
    size = big.stat().st_size
    expected_s = size * 8 / _rate_bits(args.rate)
    device = "edge-bench"
    with agent_behind_bad_link(tmp, base, big, device, 50, 120, rate=args.rate, delay_ms=args.delay_ms,
                           loss_pct=args.loss_pct, cut_every=size // args.cuts + 1) as (fs, _url, link, agent_url):
        before = link.proxy.down_bytes
        say(f"rolling out {size} B over {link.emulation}; ~{expected_s:.0f}s at the link's rate")
        started = time.monotonic()
        fs.service.rollouts.create_rollout("digits", "1.1.0", [device])
        gap = expected_s / (args.cuts + 1)

        def cutter() -> None:
            for _ in range(args.cuts):
                time.sleep(gap)
                link.cut(args.down_s)

        t = threading.Thread(target=cutter, daemon=True)
        t.start()
        wait_for(lambda: served_version(agent_url) == "1.1.0", args.timeout_s, "1.1.0 installed")
        took = time.monotonic() - started
        t.join(args.timeout_s)
        dropped = link.dropped()
    retried = [s for s in lines.lines if "fetch attempt" in s]
    carried = link.proxy.down_bytes - before
    return {"bundle_bytes": size, "carried_bytes": carried, "ratio": round(carried / size, 4),
            "link_downs": args.cuts, "relay_cuts": link.proxy.cuts, "retried_fetches": len(retried),
            "verification_failures": sum("verification" in s for s in lines.lines), "install_s": round(took, 1),
            "packets_dropped": dropped, "link": link.emulation}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle-mb", type=float, default=20.0)
    p.add_argument("--rate", default="1mbit")
    p.add_argument("--delay-ms", type=int, default=150, help="each way (the round trip is twice this)")
    p.add_argument("--loss-pct", type=float, default=5.0)
    p.add_argument("--cuts", type=int, default=10)
    p.add_argument("--down-s", type=float, default=3.0)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args()
    why = namespaces_allowed()
    if why is not None:
        raise SystemExit(f"bench/bad_link.py needs network namespaces: {why}")
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
