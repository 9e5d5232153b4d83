"""`edgefleet demo`: the one-command main job prints its summary, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(900)
def test_demo_json_summary(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgefleet.cli", "demo", "--work-dir", str(tmp_path / "d"), "--exit",
                        "--json"], capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["rollout"]["status"] == "succeeded" and len(s["devices"]) == 3
    for d in s["devices"]:
        assert d["version"] == "1.0.0" and d["images"] == 359
        # the agents serve exactly the model whose accuracy the compiler measured, whichever it chose
        assert d["accuracy_served"] == pytest.approx(s["accuracy_at_compile"]["shipped"], abs=1e-4)
        # and each measured the bundle's self-test on its own CPU, matching the compile-time figure
        assert d["selftest_top1"] == pytest.approx(s["selftest_top1_at_compile"], abs=1e-9)
        assert d["selftest_drift"] <= 1.0
    assert s["precision"] in ("int8", "fp32") and s["precision_reason"].startswith(s["precision"] + ":")
    assert {"fp32", "int8"} <= set(s["accuracy_at_compile"])
    assert s["console"].startswith("http://127.0.0.1:")
    # step 7: the OCR pipeline served as one model on every agent, each reading the same strings on new pages
    ocr = s["pipeline"]
    assert ocr["rollout"]["status"] == "succeeded" and set(ocr["stages"]) == {"det", "rec"}, ocr
    reads = list(ocr["texts"].values())
    assert len(reads) == 3 and all(r == reads[0] for r in reads) and sum(len(p) for p in reads[0]) >= 4, ocr
    assert all(v >= 0.98 for k, v in ocr["end_gate"].items() if k != "char_error_rate"), ocr


def test_demo_failure_is_one_line_not_a_traceback(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = subprocess.run([sys.executable, "-m", "edgefleet.cli", "demo", "--work-dir", str(blocker), "--exit"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 4
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error: ") and "--work-dir" in r.stderr


@pytest.mark.timeout(300)
def test_ctrl_c_stops_everything(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "edgefleet.cli", "demo", "--work-dir", str(tmp_path / "d"),
                             "--agents", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    try:
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "press Ctrl-C" in line or time.monotonic() > deadline:
                break
        assert any("press Ctrl-C" in s for s in seen), "".join(seen)[-3000:]
        children = _descendants(proc.pid)
        assert len(children) >= 3  # the fleet and two agents
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the whole foreground group
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
