"""``edgefleet toolchain install|status``: the isolated build toolchains (tflite: onnx2tf) in their own virtual
environments."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from edgefleet.cli.command import Formatter, command, show
from edgefleet.protocol.exits import ExitCode


@command(json_error=lambda a, line, code: {"ok": False, "name": a.name, "error": line, "exit_code": code})
def cmd_toolchain_install(a: argparse.Namespace) -> int:
    from edgefleet.compiler import toolchain

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    st = toolchain.install(a.name, say, force=True) if a.force else toolchain.ensure(a.name, say)
    show({"ok": True, **st.to_json()}, a.json, _toolchain_line(st))
    return ExitCode.OK


@command()
def cmd_toolchain_status(a: argparse.Namespace) -> int:
    from edgefleet.compiler import toolchain

    found = [toolchain.status(n) for n in ([a.name] if a.name else sorted(toolchain.TOOLCHAINS))]
    doc: Any = found[0].to_json() if a.name else {"toolchains": [st.to_json() for st in found]}
    show(doc, a.json, "\n".join(_toolchain_line(st) for st in found))
    return ExitCode.TOOLCHAIN if a.name and not found[0].installed else ExitCode.OK


def _toolchain_line(st: Any) -> str:
    if not st.installed:
        line = f"{st.name:<8} not installed: run `edgefleet toolchain install {st.name}`"
    else:
        versions = ", ".join(f"{k} {v}" for k, v in st.versions.items())
        line = (f"{st.name:<8} installed {st.installed_at} in {st.install_seconds:.0f} s, "
                f"{(st.size_bytes or 0) / 1e9:.2f} GB at {st.path}\n         {versions}")
    if st.stale:
        line += f"\n         older environments that can be deleted: {', '.join(str(p) for p in st.stale)}"
    return line


def add_parsers(sub: Any) -> None:
    tc = sub.add_parser("toolchain", help="install or inspect the isolated build toolchains (tflite: onnx2tf)"
                        ).add_subparsers(dest="toolchain_cmd", required=True)
    ti = tc.add_parser("install", formatter_class=Formatter, help="create a toolchain's environment",
                       description="Create the toolchain's own virtual environment ($EDGEFLEET_TOOLCHAIN_DIR, "
                                   "default ~/.cache/edgefleet/toolchains) and install its pinned packages from "
                                   "PyPI. tflite (onnx2tf, TensorFlow) is about 2.6 GB. Progress goes to stderr. "
                                   "Nothing is installed into edgefleet's own environment.")
    ti.add_argument("name", help="toolchain name: tflite")
    ti.add_argument("--force", action="store_true", help="reinstall even if it is installed")
    ti.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ti.set_defaults(fn=cmd_toolchain_install)
    ts = tc.add_parser("status", formatter_class=Formatter, help="show installed toolchains",
                       description="Show whether a toolchain is installed, its versions, size and install time. "
                                   "With NAME, exits 5 if that toolchain is not installed.")
    ts.add_argument("name", nargs="?", help="toolchain name (default: all)")
    ts.add_argument("--json", action="store_true", help="JSON output")
    ts.set_defaults(fn=cmd_toolchain_status)
