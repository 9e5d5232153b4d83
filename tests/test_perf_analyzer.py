"""Triton's Performance Analyzer (perf_analyzer, from tritonclient 2.41.0's wheel) runs against the agent unchanged
(issue 41.1): HTTP and gRPC, synchronous and --async, with and without --shared-memory system, concurrency 1 and 4,
no -x (the version it reads is the agent's integer one), for a single model (digits) and a pipeline (OCR). Each
run must finish with rc 0 and a throughput for every concurrency level, and the agent must have counted the
requests perf_analyzer says its server answered. Skipped, with the reason, where bench/perf_analyzer.sh cannot fetch
the binary or it cannot load (libb64-0d missing, no libcudart.so.12). The figures are not checked (a shared CI box);
bench/README.md compares them with bench/serve.py's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.agent_harness import installed_agent, ocr_pipeline_or_skip, preinstall, running_agent

ROOT = Path(__file__).resolve().parent.parent
# short windows and any spread accepted: the test checks that the runs complete, not the figures
WINDOWS = ["--measurement-interval", "500", "--stability-percentage", "1000", "--max-trials", "10"]


@pytest.fixture(scope="module")
def perf_analyzer() -> str:
    try:
        got = subprocess.run(["bash", str(ROOT / "bench" / "perf_analyzer.sh")], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "PYTHON": sys.executable})
    except subprocess.TimeoutExpired:
        pytest.skip("bench/perf_analyzer.sh did not fetch perf_analyzer within 600 s")
    if got.returncode != 0:
        pytest.skip(f"bench/perf_analyzer.sh could not fetch perf_analyzer: {got.stderr.strip()[-500:]}")
    path = got.stdout.strip().splitlines()[-1]
    probe = subprocess.run([path], capture_output=True, text=True, timeout=60)
    if "error while loading shared libraries" in probe.stderr:
        pytest.skip(f"perf_analyzer cannot load: {probe.stderr.strip()[-300:]}")
    return path


def run(pa: str, model: str, url: str, *args: str, timeout_s: float = 240) -> dict[int, float]:
    """One perf_analyzer run -> {concurrency: infer/sec}, asserting it finished well."""
    cmd = [pa, "-m", model, "-u", url, *WINDOWS, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-2000:])
    assert "Unable to unregister" not in p.stdout + p.stderr, p.stdout[-2000:]
    return {int(c): float(t) for c, t in re.findall(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec", p.stdout)}


def served(url: str, model: str) -> int:
    return httpx.get(f"{url}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]["inference_count"]


RUNS = [("http", ()), ("http", ("--async", "--shared-memory", "system")),
        ("grpc", ("--shared-memory", "system")), ("grpc", ("--async",))]


def test_perf_analyzer_runs_against_a_single_model(perf_analyzer, tmp_path, digits_bundle):
    with installed_agent(tmp_path, digits_bundle, grpc_port=0) as (agent, url):
        for proto, extra in RUNS:
            before = served(url, "digits")
            where = url.removeprefix("http://") if proto == "http" else f"127.0.0.1:{agent.grpc_port}"
            got = run(perf_analyzer, "digits", where, "-i", proto, "--concurrency-range", "1:4:3", *extra)
            assert set(got) == {1, 4} and all(t > 0 for t in got.values()), (proto, extra, got)
            assert served(url, "digits") > before  # answered by the agent, counted in its statistics
        # the regions perf_analyzer registered are gone (it unregistered them; the agent answered)
        assert httpx.get(f"{url}/v2/systemsharedmemory/status", timeout=10).json() == []


def test_perf_analyzer_runs_against_a_pipeline(perf_analyzer, tmp_path):
    ocr = ocr_pipeline_or_skip()
    bundle = ocr.ocr_bundle(tmp_path / "ocr-1.0.0.tar", "1.0.0", spec=ocr.ocr_spec(max_crops=64))
    data = tmp_path / "agent"
    preinstall(data, bundle)
    with running_agent(data, grpc_port=0, max_batch_size=4, queue_timeout_ms=120_000) as (agent, url):
        cfg = httpx.get(f"{url}/v2/models/ocr/config", timeout=10).json()
        h, w = cfg["pipeline"]["image_size"]  # its input is [N, 3, H, W] with H and W open: perf_analyzer asks
        # blank pages (its random FP32 data holds NaN here, which the agent refuses, as it should)
        # and windows of a few requests, not of a time (a page takes 0.1-0.5 s here)
        shape = ["--shape", f"x:3,{h},{w}", "--input-data", "zero", "--measurement-mode", "count_windows",
                 "--measurement-request-count", "4"]
        for proto, extra in (RUNS[1], RUNS[2]):
            before = served(url, "ocr")
            where = url.removeprefix("http://") if proto == "http" else f"127.0.0.1:{agent.grpc_port}"
            got = run(perf_analyzer, "ocr", where, "-i", proto, "--concurrency-range", "1:2", *shape, *extra)
            assert set(got) == {1, 2} and all(t > 0 for t in got.values()), (proto, extra, got)
            assert served(url, "ocr") > before
