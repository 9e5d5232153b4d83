"""What a hostile archive header costs the bundle reader, against reading a valid bundle, in one run.

usage: .venv/bin/python bench/bundle_headers.py BUNDLE.tar [--digits 120000] [--rounds 5]

Times, alternating, (a) ``check_bundle`` of the valid bundle, (b) ``check_bundle`` refusing the CVE-2024-6232
shape (a pax header of ``--digits`` digits in front of the same bundle) and (c) Python's own ``tarfile`` opening
that archive (what the reader cost before it walked headers itself; quadratic in the digits on Python before
3.11.10 / 3.12.6, run once). Prints medians and the ratios to (a).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from edgefleet.protocol.bundle import BundleError, check_bundle


def pax_bomb(digits: int) -> bytes:
    ti = tarfile.TarInfo("././@PaxHeader")
    ti.type, ti.size = tarfile.XHDTYPE, digits
    return ti.tobuf(tarfile.USTAR_FORMAT) + b"0" * digits + b"\0" * (-digits % 512)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--digits", type=int, default=120_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bomb = Path(tmp) / "bomb.tar"
        bomb.write_bytes(pax_bomb(args.digits) + args.bundle.read_bytes())
        valid, refused = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            check_bundle(args.bundle)
            valid.append(time.perf_counter() - t)
            t = time.perf_counter()
            try:
                check_bundle(bomb)
                raise SystemExit("the CVE-2024-6232 shape was accepted")
            except BundleError:
                refused.append(time.perf_counter() - t)
        t = time.perf_counter()
        with tarfile.open(bomb) as tar:
            names = tar.getnames()
        plain = time.perf_counter() - t
    v, r = statistics.median(valid), statistics.median(refused)
    print(f"Python {sys.version.split()[0]}, {args.bundle.stat().st_size} B bundle, pax header of {args.digits} digits")
    print(f"check_bundle, valid bundle (read and hashed): {v * 1e3:9.3f} ms  (1.00x)")
    print(f"check_bundle, CVE-2024-6232 shape refused:    {r * 1e3:9.3f} ms  ({r / v:.3f}x)")
    print(f"tarfile.open alone on that shape (before):    {plain * 1e3:9.1f} ms  ({plain / v:.0f}x; read {names})")


if __name__ == "__main__":
    main()
