"""A pipeline through the whole loop (issue 34): ``edgefleet compile-pipeline`` builds rapidocr's real PP-OCRv4
detector + recognizer into one bundle, the fleet signs and rolls it out over a real Mosquitto, a real agent installs
it as one model, and a PNG page sent to the agent's ``/infer/image`` comes back as the strings the FP32 models read
(decoded independently in tests/test_pipeline_compile.py). The fleet then holds the agent's per-stage telemetry.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.demo import LocalFleet
from tests.conftest import Mosquitto, wait_for
from tests.test_pipeline_compile import _models, independent_read, pages, run_cli, write_pipeline, write_prep


def _png(page: np.ndarray) -> bytes:
    import cv2

    bgr = np.clip((page * 0.5 + 0.5) * 255 + 0.5, 0, 255).astype(np.uint8).transpose(1, 2, 0)
    ok, buf = cv2.imencode(".png", bgr)
    assert ok
    return buf.tobytes()


@pytest.mark.timeout(600)
def test_a_pipeline_is_compiled_rolled_out_and_served_as_one_model(tmp_path: Path, mosquitto: Mosquitto) -> None:
    models = _models()
    det, rec = models / "ch_PP-OCRv4_det_infer.onnx", models / "ch_PP-OCRv4_rec_infer.onnx"
    np.savez(tmp_path / "eval.npz", x=pages(12, seed=3))
    r = run_cli("compile-pipeline", str(write_pipeline(tmp_path, det, rec)), "--profile", "x86-cpu", "--eval",
                str(tmp_path / "eval.npz"), "--preprocess", str(write_prep(tmp_path)), "-o",
                str(tmp_path / "ocr.bundle"), "--no-benchmark", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    json.loads(r.stdout)  # --json: one document on stdout

    lf = LocalFleet(tmp_path / "fleet", mqtt_url=mosquitto.url, telemetry_interval_s=0.5)
    try:
        lf.start()
        lf.client.upload(tmp_path / "ocr.bundle")
        lf.client.register("ocr-box")
        lf.start_agent("ocr-box")
        lf.wait_online(["ocr-box"])
        assert lf.wait_rollout(lf.client.rollout("ocr", "1.0.0", ["ocr-box"]).id, 300).status == "succeeded"

        url = lf.agents["ocr-box"].url
        test_pages = pages(3, seed=11)  # pages the compile never saw
        truth = independent_read(det, rec, test_pages)
        assert sum(len(t) for t in truth) >= 6, truth
        for page, want in zip(test_pages, truth, strict=True):
            a = httpx.post(f"{url}/v2/models/ocr/infer/image", content=_png(page),
                           headers={"Content-Type": "image/png"}, timeout=60)
            assert a.status_code == 200, a.text
            body = a.json()
            # the pipeline answers in reading order; the independent decode in its regions' label order
            assert sorted(body["texts"]) == sorted(want), body
            ys = [b[1] for b in body["boxes"]]
            assert ys == sorted(ys), body["boxes"]  # one line per text here: reading order is top to bottom
            assert body["count"] == len(want) and len(body["boxes"]) == len(want)
        config = httpx.get(f"{url}/v2/models/ocr/config", timeout=30).json()
        assert [s["name"] for s in config["pipeline"]["stages"]] == ["det", "rec"], config

        # the fleet holds the agent's figures per stage and the whole pipeline's latency: from the interval that
        # held the requests (a record of an idle interval has stages but no latency figures)
        def staged() -> list:
            return [t for t in lf.client.telemetry("ocr-box", 50) if getattr(t, "stages", None)
                    and t.latency is not None and t.latency.p99_ms is not None]
        wait_for(lambda: staged(), 60, "telemetry with per-stage figures and the pipeline's latency at the fleet",
                 interval_s=0.3)
        rec_t = staged()[0]
        assert set(rec_t.stages) == {"det", "rec"}, rec_t.stages
        assert rec_t.latency is not None and rec_t.latency.p99_ms is not None and rec_t.latency.p99_ms > 0
    finally:
        lf.stop()
