"""The progress bar redraws with ``\\r`` on a terminal only: a log file or a CI pipe gets plain lines."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import DIGITS


def test_compile_progress_into_a_pipe_has_no_carriage_returns(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgefleet.cli", "compile", str(DIGITS / "model.onnx"), "--profile",
                        "x86-cpu", "--calibration", str(DIGITS / "calibration.npz"), "--eval", str(DIGITS / "test.npz"),
                        "--name", "digits", "--version", "1.0.0", "--out", str(tmp_path), "--precision", "fp32"],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr, r.stderr[:500]
    steps = [line for line in r.stderr.splitlines() if line.startswith("[") and "/" in line.split("]")[0]]
    assert len(steps) >= 3, r.stderr  # one line per step still says where the compile is
    assert len(steps) == len(set(steps)), steps  # and none repeated
