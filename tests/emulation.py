"""Run a command on an emulated CPU (qemu user mode), like ../shared/tools/as-cpu.

``Haswell`` is AVX2 + FMA without AVX-512: the weakest CPU the x86-cpu profile admits. qemu cannot
emulate AVX-512 (so VNNI figures come only from a native run on a CPU that has it). Only the named
process is emulated; it runs 5-50x slower. ``.ci/run`` installs qemu-user; without it these tests
skip and say so.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

QEMU = shutil.which("qemu-x86_64")

needs_qemu = pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="qemu-user is not installed (apt-get install qemu-user; .ci/run installs it), so the checks on an "
           "emulated AVX2-only CPU cannot run here")


def as_cpu(cpu: str, *python_args: str) -> list[str]:
    """argv that runs this venv's Python with ``python_args`` on the emulated ``cpu``."""
    assert QEMU is not None
    return [QEMU, "-cpu", cpu, sys.executable, *python_args]


def run_as_cpu(cpu: str, *python_args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(as_cpu(cpu, *python_args), capture_output=True, text=True, timeout=timeout_s)


# Set by `make test-haswell`: this pytest runs under qemu, and the CLI processes the tests start must
# run on the same emulated CPU (qemu user mode does not follow a child process on its own).
SESSION_CPU = os.environ.get("EDGEFLEET_TEST_CPU") or None


def python_argv() -> list[str]:
    """argv prefix that starts this venv's Python on the CPU this test session runs on."""
    if SESSION_CPU and QEMU:
        return [QEMU, "-cpu", SESSION_CPU, sys.executable]
    return [sys.executable]
