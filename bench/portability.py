"""Does a digits bundle built here hold on every CPU its profile admits? Prints the README's figures.

    .venv/bin/python bench/portability.py            # about 1-2 minutes; needs qemu-user (make system-deps)
    .venv/bin/python bench/portability.py --json

Builds digits for x86-cpu (``--precision auto`` and ``int8``) and for x86-cpu-vnni (int8; only on a
build host where full-range int8 is exact, else it says why not), then runs each bundle with
``edgefleet verify`` natively, on an emulated AVX2-only CPU (qemu ``Haswell``) and on an emulated
SSE-only CPU (``Nehalem``, whose integer kernels are exact like VNNI's). Everything runs on this
machine; nothing is sent anywhere.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "models" / "digits"
CLI = [sys.executable, "-m", "edgefleet.cli"]


def _run(argv: list[str], cpu: str | None = None) -> tuple[int, dict]:
    qemu = shutil.which("qemu-x86_64")
    if cpu is not None:
        if qemu is None:
            return -1, {"error": "qemu-user is not installed (make system-deps)"}
        argv = [qemu, "-cpu", cpu, *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=REPO)
    try:
        return r.returncode, json.loads(r.stdout)
    except json.JSONDecodeError:
        return r.returncode, {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "no output"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="edgefleet-portability-"))
    rows, builds = [], {}
    try:
        for profile, precision in (("x86-cpu", "auto"), ("x86-cpu", "int8"), ("x86-cpu-vnni", "int8")):
            key = f"{profile} {precision}"
            print(f"compiling digits for {key}...", file=sys.stderr, flush=True)
            rc, doc = _run([*CLI, "compile", str(DIGITS / "model.onnx"), "--profile", profile, "--precision",
                            precision, "--calibration", str(DIGITS / "calibration.npz"), "--eval",
                            str(DIGITS / "test.npz"), "--name", "digits", "--out", str(out / key.replace(" ", "-")),
                            "--json"])
            if rc != 0:
                rows.append({"build": key, "error": doc.get("error")})
                continue
            m = doc["manifest"]
            builds[key] = m
            for where, cpu, extra in (("native", None, []), ("Haswell (AVX2)", "Haswell", []),
                                      ("Haswell, CPU check skipped", "Haswell", ["--skip-cpu-check"]),
                                      ("Nehalem (SSE4.2), CPU check skipped", "Nehalem", ["--skip-cpu-check"])):
                if profile == "x86-cpu" and extra:
                    continue
                vrc, v = _run([*CLI, "verify", doc["bundle"], "--eval", str(DIGITS / "test.npz"), "--json", *extra],
                              cpu)
                rows.append({"build": key, "precision": m["precision"], "recorded_top1": m["accuracy"]["candidate"],
                             "fp32_top1": m["accuracy"]["reference"], "cpu": where, "exit": vrc,
                             "cpu_ok": v.get("cpu_ok"), "top1": v.get("top1"),
                             "drift": (v.get("selftest") or {}).get("drift"), "holds": v.get("computes_as_gated"),
                             "note": v.get("selftest_error") or ("" if v.get("cpu_ok") else v.get("cpu_reason"))
                             or v.get("error")})
    finally:
        shutil.rmtree(out, ignore_errors=True)
    auto = builds.get("x86-cpu auto")
    summary = {"build_host_cpu_features": auto["build_host"]["cpu_features"] if auto else None,
               "auto_choice": auto["precision_choice"]["reason"] if auto else None, "rows": rows}
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"build host: {', '.join(summary['build_host_cpu_features'] or [])}")
    print(f"x86-cpu --precision auto chose {summary['auto_choice']}\n")
    print("| build | runs on | profile admits it | top-1 there | recorded | fp32 | self-test drift | as gated |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r and "cpu" not in r:
            print(f"| {r['build']} | – | – | not built: {r['error']} | | | | |")
            continue
        top1 = "–" if r["top1"] is None else f"{r['top1']:.4f}"
        drift = "–" if r["drift"] is None else f"{r['drift']:.2f}x"
        holds = "yes" if r["holds"] else ("refused" if r["cpu_ok"] is False and r["top1"] is None else "NO")
        print(f"| {r['build']} ({r['precision']}) | {r['cpu']} | {'yes' if r['cpu_ok'] else 'no'} | {top1} | "
              f"{r['recorded_top1']:.4f} | {r['fp32_top1']:.4f} | {drift} | {holds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
