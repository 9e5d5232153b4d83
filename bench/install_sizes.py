"""What each extra installs on a 64-bit ARM box: a fresh emulated aarch64 venv per extra set, sizes from pip's RECORDs.

    .venv/bin/python bench/install_sizes.py agent agent,image fleet fleet,broker,postgres

Uses ../shared/tools/as-arm64's sysroot (Debian 12's aarch64 Python 3.11.2 under qemu; run ``as-arm64 init`` once),
builds this checkout's wheel, and in a new venv per argument runs ``pip install --only-binary=:all:
-c constraints.txt edgefleet[EXTRAS]`` from aarch64 wheels, as a box would. Prints MB per install (every file pip
recorded, .pyc included; pip itself, which comes with the venv, left out) and the largest distributions, each row
as soon as its install is done (about 15 minutes each on a busy 2-core box: run it with nohup, output to a file).
Sizes, not speed: emulation changes nothing here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = r"""
import importlib.metadata as md, json, os
out = {}
for d in md.distributions():
    total = 0
    for f in d.files or []:
        try:
            total += os.lstat(d.locate_file(f)).st_size
        except OSError:
            pass
    out[d.metadata["Name"]] = total
print(json.dumps(out))
"""
VENV_TOOLS = {"pip", "setuptools", "wheel"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("extras", nargs="+", help="extra sets, e.g. agent agent,image fleet")
    p.add_argument("--as-arm64", default=str(ROOT.parent / "shared" / "tools" / "as-arm64"))
    p.add_argument("--top", type=int, default=6, help="largest distributions shown per install")
    a = p.parse_args()
    paths = dict(line.split(None, 1) for line in subprocess.run(
        ["bash", a.as_arm64, "path"], capture_output=True, text=True, check=True).stdout.splitlines())
    root = Path(paths["sysroot"])
    py311 = root / "usr" / "bin" / "python3.11"
    if not py311.exists():
        print(f"error: no aarch64 sysroot at {root}: run '{a.as_arm64} init' in the checkout first", file=sys.stderr)
        return 2
    pipwhl = next((root / "usr" / "share" / "python-wheels").glob("pip-*.whl"))
    work = Path(tempfile.mkdtemp(prefix="edgefleet-sizes-"))
    try:
        src = work / "src"
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.split(b"\0")
        for f in filter(None, files):
            rel = Path(os.fsdecode(f))
            if (ROOT / rel).is_file() or (ROOT / rel).is_symlink():
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, src / rel, follow_symlinks=False)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(work / "whl")],
                       check=True, capture_output=True)
        wheel = next((work / "whl").glob("*.whl"))
        base = None
        print(f"{'install (aarch64)':<34} {'MB':>7} {'vs first':>9}  largest (MB)", flush=True)
        for extras in a.extras:  # each row as soon as its install is measured (an emulated install takes minutes)
            venv = work / f"venv-{extras.replace(',', '-')}"
            emu = ["qemu-aarch64", "-L", str(root)]
            subprocess.run([*emu, str(py311), "-m", "venv", "--without-pip", str(venv)], check=True)
            vpy = str(venv / "bin" / "python")
            subprocess.run([*emu, vpy, f"{pipwhl}/pip", "install", "-q", "--upgrade", "pip"], check=True)
            subprocess.run([*emu, vpy, "-m", "pip", "install", "-q", "--only-binary=:all:", "-c",
                            str(ROOT / "constraints.txt"), f"{wheel}[{extras}]"], check=True)
            sizes = json.loads(subprocess.run([*emu, vpy, "-c", SIZES], capture_output=True, text=True,
                                              check=True).stdout)
            mine = {k: v for k, v in sizes.items() if k.lower() not in VENV_TOOLS}
            total = sum(mine.values())
            base = base or total
            big = ", ".join(f"{n} {v / 1e6:.0f}" for n, v in sorted(mine.items(), key=lambda kv: -kv[1])[:a.top])
            print(f"{'edgefleet[' + extras + ']':<34} {total / 1e6:7.1f} {total / base:9.2f}  {big}", flush=True)
            shutil.rmtree(venv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
