"""A detect-then-read pipeline (manifest version 7) served as one model by a real agent on loopback (issue 34.2 and
34.3): the PP-OCRv4 detector and recognizer from rapidocr-onnxruntime, FP32, in a bundle assembled by
tests/ocr_pipeline.py. Images in over KServe v2 HTTP (binary tensors), gRPC, the local socket and /infer/image;
strings out, matching an independent FP32 run of the same two ONNX files. Crops of concurrent requests share the
reader's batches (seen in the stage's batch sizes, not in timings); a request that could need more crops than the
pipeline's bound, a wrong size, a NaN are refused with a 4xx and the agent serves on; a hot swap under load fails
no request and every answer is one version's; latency, errors and batches are counted per stage and sent in
telemetry, with the pipeline's own p99 as the model's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.protocol import mqtt as proto
from tests.agent_harness import Load, metric, ocr_pipeline_or_skip, preinstall, running_agent, under_load
from tests.waiting import concurrently, wait_for

ocr = ocr_pipeline_or_skip()
body, texts = ocr.body, ocr.texts

MAX_CROPS = 64  # 16 boxes an image: at most 4 images a request


def spec(upper: bool = False):
    return ocr.ocr_spec(upper=upper, max_crops=MAX_CROPS)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ocr-bundles")
    return {"1.0.0": ocr.ocr_bundle(d / "ocr-1.0.0.tar", "1.0.0", spec=spec()),
            "1.1.0": ocr.ocr_bundle(d / "ocr-1.1.0.tar", "1.1.0", spec=spec(upper=True))}


@pytest.fixture(scope="module")
def agent(tmp_path_factory, bundles):
    data = tmp_path_factory.mktemp("agent")
    preinstall(data, bundles["1.0.0"])
    # the operator's max_batch_size: batches of up to 16 in each stage (a device left to choose measures each
    # stage's sizes and may keep batches of 1: test_hot_swap's agent); a batch formed while others are queued or
    # running may wait 20 ms for company (max_queue_delay_us), as an operator sets it for concurrent clients; and a
    # long queue timeout: 8 concurrent pages on a loaded 2-core box (a reader batch of 16 crops took 2 s here) wait
    # past the default 5 s, a latency bound this file does not test
    with running_agent(data, grpc_port=0, local_socket="local.sock", max_batch_size=16,
                       max_queue_delay_us=20_000, queue_timeout_ms=120_000) as (a, url):
        yield a, url


def infer(url: str, images: np.ndarray, client: httpx.Client | None = None) -> httpx.Response:
    content, headers = body(images)
    c = client or httpx
    return c.post(f"{url}/v2/models/ocr/infer", content=content, headers=headers, timeout=60)


def expected(images: np.ndarray, upper: bool = False) -> list[list[str]]:
    ends = ocr.fp32_run(spec(upper), images)
    return [ocr.strings(ends, i) for i in range(len(images))]


def test_images_in_strings_out_on_every_transport_matching_an_independent_fp32_run(agent):
    a, url = agent
    images = ocr.pages(3, seed=11)
    want = expected(images)
    assert sum(len(w) for w in want) >= 9 and all(w for w in want)  # the pages are read, or this proves nothing

    r = infer(url, images)  # HTTP, binary tensors in, JSON out
    assert r.status_code == 200, r.text
    assert r.json()["model_name"] == "ocr" and r.json()["model_version"] == "1.0.0"
    assert texts(r.json()) == want

    import tritonclient.grpc as grpcclient  # gRPC, the official client

    with grpcclient.InferenceServerClient(f"127.0.0.1:{a.grpc_port}") as c:
        inp = grpcclient.InferInput("x", list(images.shape), "FP32")
        inp.set_data_from_numpy(images)
        res = c.infer("ocr", [inp], outputs=[grpcclient.InferRequestedOutput(n) for n in ("count", "text", "boxes")])
        count, text = res.as_numpy("count"), res.as_numpy("text")
        assert [[bytes(t).rstrip(b"\0").decode() for t in text[i, :count[i]]] for i in range(3)] == want
        assert res.as_numpy("boxes").shape == (3, 16, 4)

    from edgefleet.agent.transports.local_client import LocalClient  # the local socket

    with LocalClient(a.local_socket, timeout_s=60) as c:
        outs = c.infer("ocr", {"x": images})
        got = [[bytes(t).rstrip(b"\0").decode() for t in outs["text"][i, :outs["count"][i]]] for i in range(3)]
        assert got == want

    import cv2  # /infer/image: one PNG page, the pipeline's preprocessing, boxes and strings as JSON

    page = ((images[0].transpose(1, 2, 0) * 0.5 + 0.5) * 255).round().astype(np.uint8)[:, :, ::-1]  # RGB -> BGR
    ok, png = cv2.imencode(".png", page)
    assert ok
    r = httpx.post(f"{url}/v2/models/ocr/infer/image", content=png.tobytes(), timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["texts"] == want[0] and doc["count"] == len(want[0])
    assert len(doc["boxes"]) == len(doc["scores"]) == len(doc["text_scores"]) == len(want[0])
    assert all(0 <= x0 < x1 <= ocr.WIDTH and 0 <= y0 < y1 <= ocr.HEIGHT for x0, y0, x1, y1 in doc["boxes"])

    cfg = httpx.get(f"{url}/v2/models/ocr/config", timeout=10).json()
    assert [(s["name"], s["role"], s["precision"]) for s in cfg["pipeline"]["stages"]] == [
        ("det", "detector", "fp32"), ("rec", "reader", "fp32")]
    assert cfg["pipeline"]["max_images_per_request"] == MAX_CROPS // 16
    assert [(s["max_batch_size"], s["batch_tuning"]["mode"]) for s in cfg["pipeline"]["stages"]] == [
        (4, "operator"), (16, "operator")]  # the detector's: at most the images a request may hold


def test_crops_of_concurrent_requests_share_a_reader_batch(agent):
    """Each request is one page of 4 lines (4 crops); a reader batch of more than 4 crops holds crops of several
    requests. Rounds of 8 concurrent requests until one is seen (bounded), read from the stage's batch sizes."""
    _, url = agent
    pages = [ocr.pages(1, seed=100 + i) for i in range(8)]

    def rec_batches() -> dict[int, int]:
        stats = httpx.get(f"{url}/v2/models/ocr/stats", timeout=10).json()["model_stats"][0]
        rec = next(s for s in stats["stages"] if s["name"] == "ocr/rec")
        return {b["batch_size"]: b["compute_infer"]["count"] for b in rec["batch_stats"]}

    most = 0
    counts = [0] * 8  # crops (lines read) of each request of the latest round

    def one(i: int) -> None:
        r = infer(url, pages[i])
        assert r.status_code == 200, r.text
        counts[i] = len(texts(r.json())[0])

    for _ in range(20):
        assert concurrently(one, 8, timeout_s=240) == []
        most = max(counts)
        if max(rec_batches()) > most:
            break
    assert max(rec_batches()) > most, (rec_batches(), most)
    # the detector stacked images of concurrent requests too
    det = next(s for s in httpx.get(f"{url}/v2/models/ocr/stats", timeout=10).json()["model_stats"][0]["stages"]
               if s["name"] == "ocr/det")
    assert max(b["batch_size"] for b in det["batch_stats"]) > 1


def test_hostile_requests_get_a_precise_4xx_and_the_agent_serves_on(agent):
    _, url = agent
    before = metric(url, "edgefleet_batch_size_count", model="ocr/det")
    r = infer(url, ocr.pages(5))  # 5 images x 16 boxes could need 80 crops: over max_crops, refused unrun
    assert r.status_code == 400 and "64 crops per request" in r.json()["error"] and "at most 4 images" in \
        r.json()["error"], r.text
    assert metric(url, "edgefleet_batch_size_count", model="ocr/det") == before  # no detector batch ran for it

    r = infer(url, np.zeros((1, 3, 64, 64), np.float32))  # another size than the pipeline reads
    assert r.status_code == 400 and "320x480" in r.json()["error"], r.text
    x = ocr.pages(1)
    x[0, 0, 5, 5] = np.nan
    r = infer(url, x)
    assert r.status_code == 400 and "NaN" in r.json()["error"], r.text
    r = infer(url, np.zeros((1, 1, 320, 480), np.float32))  # one channel where the detector takes three
    assert r.status_code == 400 and "x" in r.json()["error"], r.text
    content, headers = body(np.zeros((2, 3, 320, 480), np.float32))  # says 2 images, carries 1
    r = httpx.post(f"{url}/v2/models/ocr/infer", content=content[: -3 * 320 * 480 * 4], headers=headers, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert metric(url, "edgefleet_batch_size_count", model="ocr/det") == before

    r = infer(url, ocr.pages(1, seed=11))  # still serving, and right
    assert r.status_code == 200 and texts(r.json()) == expected(ocr.pages(1, seed=11))


def test_latency_errors_and_batches_per_stage_in_metrics_and_telemetry(agent, tmp_path):
    a, url = agent
    requests = metric(url, "edgefleet_inference_requests_total", model="ocr", version="1.0.0")
    for _ in range(2):
        assert infer(url, ocr.pages(1, seed=3)).status_code == 200
    assert infer(url, ocr.pages(5)).status_code == 400
    # a pipeline request counts once, as the model's (its stages' calls are counted apart)
    assert metric(url, "edgefleet_inference_requests_total", model="ocr", version="1.0.0") == requests + 3
    for stage in ("ocr/det", "ocr/rec"):
        assert metric(url, "edgefleet_inference_requests_total", model=stage, version="1.0.0") >= 2
        assert metric(url, "edgefleet_request_duration_seconds_count", model=stage, version="1.0.0") >= 2
        assert metric(url, "edgefleet_batch_size_count", model=stage, version="1.0.0") >= 2
    assert metric(url, "edgefleet_inference_errors_total", model="ocr", version="1.0.0", code="400") >= 1
    stats = httpx.get(f"{url}/v2/models/ocr/stats", timeout=10).json()["model_stats"][0]
    assert stats["name"] == "ocr" and [s["name"] for s in stats["stages"]] == ["ocr/det", "ocr/rec"]

    # telemetry (spooled: this agent has no fleet): the pipeline's requests and p99 as the model's, and each stage
    spool = Path(a.config.data_dir) / "spool"

    def records() -> list[proto.Telemetry]:
        out = []
        for p in sorted(spool.glob("[0-9]*.json")):
            try:
                out.append(proto.decode(proto.Telemetry, p.read_bytes(), str(p)))
            except (OSError, proto.MessageError):  # being written
                continue
        return out

    start = len(records())
    assert infer(url, ocr.pages(1, seed=4)).status_code == 200
    assert infer(url, np.zeros((1, 3, 64, 64), np.float32)).status_code == 400

    def seen() -> list[proto.Telemetry] | None:  # the two requests' records (a request may span two intervals)
        got = [t for t in records()[start:] if t.model == "ocr"]
        done = sum(t.requests for t in got) >= 2 and all(
            sum(t.stages[s].calls for t in got if t.stages) >= 1 for s in ("det", "rec"))
        return got if done else None

    recs = wait_for(seen, 30, "telemetry records of both requests, with the pipeline's stages")
    assert all(t.version == "1.0.0" and t.stages is not None and set(t.stages) == {"det", "rec"} for t in recs)
    assert sum(t.errors for t in recs) >= 1  # the refused one: the model's error, no stage ran it
    assert all(t.latency.p99_ms is not None for t in recs if t.requests)  # the pipeline's p99 is the model's
    for name in ("det", "rec"):
        used = [t.stages[name] for t in recs if t.stages and t.stages[name].calls]
        assert used and all(st.latency.p99_ms is not None and st.errors == 0 for st in used)
        assert sum(st.batches for st in used) >= 1


def test_hot_swap_under_load_fails_no_request_and_each_answer_is_one_versions(tmp_path, bundles):
    data = tmp_path / "agent"
    preinstall(data, bundles["1.0.0"])
    preinstall(data, bundles["1.1.0"])  # active; 1.0.0 kept for rollback
    images = [ocr.pages(1, seed=200 + i) for i in range(4)]
    want = {"1.0.0": [expected(x)[0] for x in images], "1.1.0": [expected(x, upper=True)[0] for x in images]}
    assert want["1.0.0"] != want["1.1.0"]  # the versions answer differently: a mixed pair would show
    # the device chooses each stage's batches (measured at install), and the queue timeout is long: the swap's own
    # calls (self-tests, batch sizes timed, warm-up) take turns with the serving batches, each request needs a turn
    # of each stage, and on a loaded 2-core box that passed the default 5 s (a latency bound, not what this tests)
    with running_agent(data, queue_timeout_ms=120_000) as (a, url):
        def client(load: Load, seed: int) -> None:
            with httpx.Client(timeout=60) as c:
                for k in range(100_000):  # bounded; stopped by the event long before
                    if load.stopped.is_set():
                        return
                    i = (seed + k) % len(images)
                    r = infer(url, images[i], c)
                    version = r.json().get("model_version") if r.status_code == 200 else None
                    right = version is not None and texts(r.json())[0] == want[version][i]
                    load.add((r.status_code, version, right),
                             f"{r.status_code}: {r.text[:300]}" if r.status_code != 200 else None)

        with under_load(client, 4, join_s=120) as load:
            # left to choose, the device measured each stage's batch sizes
            stages = httpx.get(f"{url}/v2/models/ocr/config", timeout=10).json()["pipeline"]["stages"]
            assert all(s["batch_tuning"]["mode"] == "measured" and "1" in s["batch_tuning"]["items_per_second"]
                       and s["max_batch_size"] in {int(n) for n in s["batch_tuning"]["items_per_second"]}
                       for s in stages), stages
            wait_for(lambda: load.count() >= 8, 120, "load before the swap")
            assert a._loop is not None
            swapped = asyncio.run_coroutine_threadsafe(a.rollback("ocr"), a._loop).result(300)
            assert swapped.version == "1.0.0"
            before = load.count()
            wait_for(lambda: load.count() >= before + 8, 120, "load after the swap")
    results, failures = load.results, load.failures
    assert {s for s, _, _ in results} == {200}, failures[:5]
    assert all(right for _, _, right in results), [r for r in results if not r[2]][:5]
    versions = [v for _, v, _ in results]
    assert versions[0] == "1.1.0" and versions[-1] == "1.0.0"


def test_the_openapi_document_describes_a_pipelines_image_answer(agent):
    """/openapi.json's 200 of /infer/image is a KServe v2 response or a pipeline's answer (count, boxes, scores,
    texts, text_scores): the pipeline's real answer matches the second and not the first, and the same model's
    JSON /infer answer the first and not the second."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="schemathesis's validator (the dev extra)")
    import cv2

    _, url = agent
    doc = httpx.get(f"{url}/openapi.json", timeout=10).json()

    def valid(schema: dict, instance: dict) -> bool:  # OpenAPI 3.0's schemas are JSON Schema draft 4's, mostly
        return jsonschema_rs.Draft4Validator({**schema, "components": doc["components"]}).is_valid(instance)

    documented = doc["paths"]["/v2/models/{name}/infer/image"]["post"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    pipeline = {"$ref": "#/components/schemas/PipelineImageAnswer"}
    kserve = {"$ref": "#/components/schemas/InferResponse"}
    images = ocr.pages(1, seed=11)
    page = ((images[0].transpose(1, 2, 0) * 0.5 + 0.5) * 255).round().astype(np.uint8)[:, :, ::-1]
    ok, png = cv2.imencode(".png", page)
    assert ok
    r = httpx.post(f"{url}/v2/models/ocr/infer/image", content=png.tobytes(), timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["count"] >= 3 and set(answer) == {"model_name", "model_version", "count", "boxes", "scores",
                                                    "texts", "text_scores"}
    assert valid(documented, answer) and valid(pipeline, answer) and not valid(kserve, answer)
    assert not valid(documented, {**answer, "boxes": [[0, 0, 1]]})  # the schema says something: a box is 4 numbers
    r = infer(url, images)  # the same model over /infer: a KServe v2 response
    assert r.status_code == 200, r.text
    assert valid(documented, r.json()) and valid(kserve, r.json()) and not valid(pipeline, r.json())


def test_the_local_socket_decodes_a_pipeline_request_once(agent, monkeypatch):
    """The local socket's fast path (agent/transports/local.py _quick: a template cached per connection decodes a
    request that starts with the bytes of one before, and the batcher queues it) is a single model's; a pipeline runs
    through ModelHost.infer. The same page sent three times on one connection is decoded once each, by parse_body, and
    never first by a cached template whose work the normal path then does again (counted: calls, not time)."""
    from edgefleet.agent.transports import kserve
    from edgefleet.agent.transports import local as agent_local
    from edgefleet.agent.transports.local_client import LocalClient

    a, _ = agent
    calls = {"template": 0, "parse_body": 0}
    real_apply, real_parse = kserve.RequestTemplate.apply, agent_local.parse_body

    def apply(self, *args, **kwargs):
        calls["template"] += 1
        return real_apply(self, *args, **kwargs)

    def parse(*args, **kwargs):
        calls["parse_body"] += 1
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(kserve.RequestTemplate, "apply", apply)
    monkeypatch.setattr(agent_local, "parse_body", parse)
    images = ocr.pages(1, seed=11)
    want = expected(images)
    with LocalClient(a.local_socket, timeout_s=60) as c:
        for _ in range(3):
            outs = c.infer("ocr", {"x": images})
            assert [[bytes(t).rstrip(b"\0").decode() for t in outs["text"][0, :outs["count"][0]]]] == want
    assert calls == {"template": 0, "parse_body": 3}
