"""bench/serve_load.py's load against a pipeline (issue 41: bench/perf_analyzer_vs_serve.py --model ocr compares
perf_analyzer with it on the OCR pipeline): its HTTP (binary tensors), gRPC and system shared-memory clients, at one
client (the blocking paths; gRPC's request, one 320x480 page, is over one HTTP/2 frame, so grpcio's stub carries it)
and at two (the asyncio paths), send the pipeline's page and read every answer's strings, counting each answer right
and wrong against the agent's own strings for that page. The figures are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.agent_harness import ocr_pipeline_or_skip, preinstall, running_agent

pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc] (grpcio, tritonclient[grpc])")
ROOT = Path(__file__).resolve().parent.parent

LEVELS = """
import json, sys
sys.path.insert(0, "bench")
sys.path.insert(0, ".")
from serve_load import bodies, run_level
from tests.ocr_pipeline import pages
http, grpc_port, want = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
page = pages(1, seed=1000)
out = {}
for kind, url in (("binary", http), ("grpc", f"http://127.0.0.1:{grpc_port}"), ("shm", http)):
    path, reqs, _ = bodies(kind, "ocr", page, "x")
    for clients in (1, 2):
        for name, lab in (("right", want), ("wrong", want + ["not read"])):
            r = run_level(url, kind, path, reqs, [lab], clients, 4, 1, timeout_s=240, shape=list(page.shape),
                          answer="texts")
            out[f"{kind} {clients} {name}"] = {k: r[k] for k in ("requests", "errors", "wrong", "first_error")}
print(json.dumps(out))
"""


def test_pipeline_levels_check_every_answer(tmp_path):
    ocr = ocr_pipeline_or_skip()
    data = tmp_path / "agent"
    preinstall(data, ocr.ocr_bundle(tmp_path / "ocr-1.0.0.tar", "1.0.0"))
    with running_agent(data, grpc_port=0, queue_timeout_ms=120_000) as (agent, url):
        content, headers = ocr.body(ocr.pages(1, seed=1000))
        r = httpx.post(f"{url}/v2/models/ocr/infer", content=content, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        want = ocr.texts(r.json())[0]
        assert want  # the page's lines: something to compare
        p = subprocess.run([sys.executable, "-c", LEVELS, url, str(agent.grpc_port), json.dumps(want)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for kind in ("binary", "grpc", "shm"):
        for clients in (1, 2):
            right, wrong = got[f"{kind} {clients} right"], got[f"{kind} {clients} wrong"]
            assert right == {"requests": 4, "errors": 0, "wrong": 0, "first_error": None}, got
            assert wrong == {"requests": 4, "errors": 0, "wrong": 4, "first_error": None}, got
