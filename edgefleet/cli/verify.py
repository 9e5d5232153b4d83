"""``edgefleet verify`` and ``edgefleet bench``: run a bundle on this machine through the agent's backend, as an
agent would, and say whether it computes as gated (verify) or how fast it runs here (bench)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edgefleet.cli.command import Command, Formatter, UsageError, bundle_file, command, show
from edgefleet.protocol.exits import ExitCode


# -- verify -----------------------------------------------------------------------------------------
@command("agent", imports=("edgefleet.agent.install.verify",),
         json_error=lambda a, line, code: {"ok": False, "error": line})
def cmd_verify(a: argparse.Namespace) -> int:
    from edgefleet.agent.install.verify import verify_bundle

    bundle_file(a.bundle)
    r = verify_bundle(a.bundle, a.eval, threads=a.threads, skip_cpu_check=a.skip_cpu_check,
                      precision=a.precision, reference=a.reference)
    m = r.manifest
    lines = [f"bundle    {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision}",
             f"this CPU  {r.arch} with {', '.join(r.cpu_features)}"]
    if not r.cpu_ok:
        lines.append(f"REFUSED   {r.cpu_reason}" + (" (running anyway: --skip-cpu-check)" if a.skip_cpu_check else ""))
    if r.selftest is None and r.selftest_error:
        lines.append(f"FAILED    {r.selftest_error}")
    elif r.selftest is not None:
        st = r.selftest
        top = f", top-1 {st.top1:.4f}" if st.top1 is not None else ""
        lines.append(f"self-test {st.samples} samples: drift {st.drift:.2f}x tolerance{top}"
                     + (f" (build: {m.selftest_summary.top1:.4f})" if m.selftest_summary
                        and m.selftest_summary.top1 is not None else ""))
    if r.top1 is not None and r.drop_vs_fp32 is not None:
        lines.append(f"top-1     {r.top1:.4f} on {r.eval_samples} samples here; recorded {r.recorded_top1:.4f}, "
                     f"fp32 {m.accuracy.reference:.4f} (drop {r.drop_vs_fp32:+.4f}, allowed {m.accuracy.max_drop:.4f})")
    elif r.top1 is not None:
        lines.append(f"top-1     {r.top1:.4f} on {r.eval_samples} samples here (the build was gated by agreement "
                     f"with fp32, worst output {m.accuracy.candidate:.4f}: no labelled figure to compare)")
    if r.gate is not None:
        g = r.gate
        what = (f"{g.task.task}: {', '.join(f'{c.name} {c.value:.4f}' for c in g.task.criteria)}" if g.task
                else f"agreement {g.candidate:.4f} (needs {1 - g.max_drop:.4f})")
        note = f"; {r.gate_note}" if r.gate_note else ""
        lines.append(f"gate      {what} on {g.eval_samples} samples of {a.eval} (no labels), this CPU against "
                     f"{r.gate_reference}{note}: {'holds' if g.passed else 'FAILS'}")
    if m.accuracy.not_judged:
        lines.append(f"not judged {', '.join(m.accuracy.not_judged)}: no task reads these outputs (the build measured "
                     "only how far they moved from fp32)")
    if r.selftest is not None or r.selftest_error:
        lines.append("computes  " + ("as gated: the same answers the compiler measured" if r.computes_as_gated
                                     else "NOT as gated: this CPU gives other answers than the ones gated"))
    show(r.to_json(), a.json, "\n".join(lines))
    if not r.cpu_ok and not a.skip_cpu_check:
        return ExitCode.INPUT
    return ExitCode.OK if r.computes_as_gated else ExitCode.GATE


@command("agent", imports=("edgefleet.agent.install.bench",))
def cmd_bench(a: argparse.Namespace) -> int:
    from edgefleet.agent.install.bench import bench_bundle

    bundle_file(a.bundle)
    try:
        sizes = tuple(int(x) for x in a.batch_sizes.split(",")) if a.batch_sizes else None
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError("batch sizes must be positive")
    except ValueError as exc:
        raise UsageError(f"--batch-sizes {a.batch_sizes!r}: {exc} (e.g. --batch-sizes 1,16)") from None
    m, points, feats = bench_bundle(a.bundle, sizes, a.iterations, threads=a.threads)
    host = m.build_host
    doc = {"bundle": f"{m.name} {m.version} {m.profile}", "precision": m.precision, "cpu_features": list(feats),
           "build_host_cpu_features": list(host.cpu_features) if host else None,
           "points": [p.to_json() for p in points]}
    lines = [f"bundle  {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision}",
             f"here    {', '.join(feats)}",
             f"build   {', '.join(host.cpu_features) if host else 'not recorded'}",
             f"{'batch':>6} {'p50 ms':>9} {'p99 ms':>9} {'items/s':>10} {'build p50':>10} {'here vs build':>13}"]
    for p in points:
        j = p.to_json()
        build = f"{p.build_ms_p50:.3f}" if p.build_ms_p50 else "–"
        ratio = f"{j['vs_build']:.2f}x" if j["vs_build"] else "–"
        lines.append(f"{p.batch_size:>6} {p.ms_p50:>9.3f} {p.ms_p99:>9.3f} {p.items_per_s:>10.1f} {build:>10} "
                     f"{ratio:>13}")
    show(doc, a.json, "\n".join(lines))
    return ExitCode.OK


def _bundle_command(sub: Any, name: str, fn: Command, help_: str, description: str) -> argparse.ArgumentParser:
    """A command that runs a bundle on this machine: the bundle, its inference threads, --json."""
    p = sub.add_parser(name, formatter_class=Formatter, help=help_, description=description)
    p.add_argument("bundle", type=Path, help="bundle archive from 'edgefleet compile'")
    p.add_argument("--threads", type=int, default=2, help="inference threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (for CI)")
    p.set_defaults(fn=fn)
    return p


BENCH = ("Run a bundle's engine through the agent's backend on this machine at the batch sizes the compiler "
         "benchmarked (or --batch-sizes), and print latency p50/p99 and throughput next to the build host's figures "
         "from the manifest (here vs build > 1 means faster here). Fixed iteration counts; nothing leaves the machine.")
VERIFY = ("Load a bundle through the agent's backend on this machine's CPU, run its self-test and, with --eval, "
          "measure top-1 against the figure the compiler recorded (without labels in --eval: the gate's own metric "
          "on those inputs against an fp32 engine run on the same inputs: the bundle's own, or --reference; refused "
          "when there is none). Exit 0 if it holds, 3 if this CPU computes something else, 4 if this CPU lacks the "
          "instruction sets the bundle needs or the data cannot be judged. Try it on an emulated AVX2-only CPU: "
          "qemu-x86_64 -cpu Haswell .venv/bin/python -m edgefleet.cli verify")


def add_parsers(sub: Any) -> None:
    b = _bundle_command(sub, "bench", cmd_bench, "benchmark a bundle on this box", BENCH)
    b.add_argument("--batch-sizes", help="comma list, e.g. 1,16 (default: those in the manifest's benchmark)")
    b.add_argument("--iterations", type=int, default=30, help="timed runs per batch size")
    v = _bundle_command(sub, "verify", cmd_verify, "run a bundle on this CPU as an agent would", VERIFY)
    v.add_argument("--eval", type=Path, help=".npz with input(s) and 'labels' (e.g. models/digits/test.npz); "
                   "without labels, the gate's own metric on its inputs against fp32 (the bundle's fp32 engine, or "
                   "--reference)")
    v.add_argument("--reference", type=Path, metavar="MODEL.onnx",
                   help="the fp32 model the bundle was compiled from: what a label-free --eval set is judged against "
                        "when the bundle carries no fp32 engine (checked against the fp32 outputs the bundle recorded)")
    v.add_argument("--precision", metavar="P",
                   help="verify this precision's engine: a bundle compiled where its devices' CPU could not be timed "
                        "carries every precision that passed the gate, and the device picks one (default: the "
                        "bundle's own engine, the one an agent serves before it times them)")
    v.add_argument("--skip-cpu-check", action="store_true",
                   help="run even if this CPU lacks the features the bundle's profile promises (diagnostics)")
