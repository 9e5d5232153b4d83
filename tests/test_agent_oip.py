"""The Open Inference Protocol over HTTP, checked with the official client (tritonclient[http]) against a real
agent on loopback: binary and JSON tensors, metadata, config, statistics, repository index; the image
endpoint; Prometheus /metrics; and bad input, each of which gets a 4xx naming the problem, is counted, and
leaves the agent serving."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import cv2
import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from edgefleet.agent.core.batching.settings import BatchSettings
from edgefleet.agent.core.host import ModelHost
from edgefleet.agent.core.metrics import Metrics
from edgefleet.agent.install.store import ModelStore
from edgefleet.agent.transports.http import create_app
from edgefleet.engines import EngineSpec
from edgefleet.engines.onnxruntime import OnnxRuntimeEngine
from edgefleet.protocol.bundle import sha256_file
from edgefleet.protocol.preprocess import decode_image
from tests.agent_harness import preinstall, running_agent, serving_app
from tests.waiting import wait_for

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def agent_url(tmp_path_factory, image_bundle):
    data = tmp_path_factory.mktemp("agent")
    preinstall(data, image_bundle)
    with running_agent(data, max_body_bytes=MAX_BODY) as (_agent, url):
        yield url


@pytest.fixture
def client(agent_url):
    c = triton.InferenceServerClient(agent_url.removeprefix("http://"), network_timeout=30)
    yield c
    c.close()


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (0 if absent), parsed with prometheus_client's own parser."""
    text = httpx.get(f"{url}/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def errors(url: str, code: int, model: str = "digits", version: str = "1.0.0") -> float:
    return metric(url, "edgefleet_inference_errors_total", model=model, version=version, code=str(code))


# -- tritonclient ---------------------------------------------------------------------------------


def test_server_and_model_metadata_with_tritonclient(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("digits", "1.0.0")
    assert not client.is_model_ready("digits", "9.9.9")
    meta = client.get_server_metadata()
    assert meta["name"] == "edgefleet-agent" and "binary_tensor_data" in meta["extensions"]
    m = client.get_model_metadata("digits")
    assert m["versions"] == ["1.0.0"]
    assert m["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert m["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]


def test_model_config_with_tritonclient(client):
    cfg = client.get_model_config("digits")
    assert cfg["name"] == "digits" and cfg["max_batch_size"] == 16
    assert cfg["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [1, 8, 8]}]
    assert cfg["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]
    assert cfg["dynamic_batching"]["priority_levels"] == 2
    # the layout the device measured and chose (tests/test_agent_layout.py): 1x2 or 2x1 on two CPUs
    assert cfg["instance_group"][0]["count"] == cfg["batch_tuning"]["layout"]["instances"]
    assert cfg["image_preprocessing"]["color"] == "gray"
    assert client.get_model_config("digits", "1.0.0")["name"] == "digits"


def test_repository_index_with_tritonclient(client):
    assert client.get_model_repository_index() == [
        {"name": "digits", "version": "1.0.0", "state": "READY", "reason": ""}]


@pytest.mark.parametrize(("binary_in", "binary_out"), [(True, True), (True, False), (False, True), (False, False)],
                         ids=["binary-binary", "binary-json", "json-binary", "json-json"])
def test_infer_with_tritonclient(client, test_images, binary_in, binary_out):
    images, labels = test_images
    x = np.ascontiguousarray(images[:16], dtype=np.float32)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    out = triton.InferRequestedOutput("logits", binary_data=binary_out)
    r = client.infer("digits", [inp], outputs=[out], request_id="r-1")
    logits = r.as_numpy("logits")
    assert logits.shape == (16, 10) and logits.dtype == np.float32
    assert (logits.argmax(1) == labels[:16]).mean() >= 0.9
    resp = r.get_response()
    assert resp["id"] == "r-1" and resp["model_version"] == "1.0.0"
    assert ("parameters" in resp["outputs"][0]) == binary_out  # binary_data_size only for a binary output


def test_binary_and_json_give_the_same_logits(client, test_images):
    x = np.ascontiguousarray(test_images[0][:4], dtype=np.float32)
    got = []
    for binary in (True, False):
        inp = triton.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        got.append(client.infer("digits", [inp]).as_numpy("logits"))  # no outputs named: all binary
    np.testing.assert_array_equal(got[0], got[1])


def test_statistics_with_tritonclient(client, test_images):
    before = client.get_inference_statistics("digits")["model_stats"][0]
    x = np.ascontiguousarray(test_images[0][:3], dtype=np.float32)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client.infer("digits", [inp])
    after = client.get_inference_statistics("digits", "1.0.0")["model_stats"][0]
    # the version asked by its semantic name, answered with its integer (Triton's, which perf_analyzer reads)
    assert after["name"] == "digits" and after["version"] == "1"
    assert after["inference_count"] == before["inference_count"] + 3
    assert after["execution_count"] == before["execution_count"] + 1
    s = after["inference_stats"]
    assert s["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert s["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]
    assert any(b["batch_size"] == 3 for b in after["batch_stats"])
    every = client.get_inference_statistics()["model_stats"]
    assert [m["name"] for m in every] == ["digits"]


def test_tritonclient_sees_json_errors(client, test_images):
    x = np.ascontiguousarray(test_images[0][:1], dtype=np.float32)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="unknown model 'resnet'") as exc:
        client.infer("resnet", [inp])
    assert exc.value.status() == "404"
    with pytest.raises(InferenceServerException, match=r"version '9\.9\.9' is not loaded"):
        client.get_model_config("digits", "9.9.9")
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_inference_statistics("resnet")


# -- raw HTTP: the binary extension byte by byte ---------------------------------------------------


def binary_body(x: np.ndarray, **tensor_over) -> tuple[bytes, dict[str, str]]:
    t = {"name": "input", "shape": list(x.shape), "datatype": "FP32",
         "parameters": {"binary_data_size": x.nbytes}} | tensor_over
    head = json.dumps({"inputs": [t], "parameters": {"binary_data_output": True}}).encode()
    return head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head)),
                                "Content-Type": "application/octet-stream"}


def test_binary_response_layout(agent_url, test_images):
    x = np.ascontiguousarray(test_images[0][:2], dtype=np.float32)
    body, headers = binary_body(x)
    r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=body, headers=headers)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    hl = int(r.headers["inference-header-content-length"])
    head = json.loads(r.content[:hl])
    out = head["outputs"][0]
    assert out["parameters"]["binary_data_size"] == 2 * 10 * 4 == len(r.content) - hl
    logits = np.frombuffer(r.content[hl:], np.float32).reshape(2, 10)
    assert list(logits.argmax(1)) == list(test_images[1][:2])


def test_odd_header_length_is_served(agent_url, test_images):
    """A JSON header whose length is not a multiple of 4 puts the tensor off alignment: still right."""
    x = np.ascontiguousarray(test_images[0][:1], dtype=np.float32)
    for pad in range(4):
        t = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "parameters": {"binary_data_size": 256}}
        head = json.dumps({"id": "x" * pad, "inputs": [t]}).encode()
        r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=head + x.tobytes(),
                       headers={"Inference-Header-Content-Length": str(len(head))})
        assert r.status_code == 200, r.text
        assert int(np.argmax(r.json()["outputs"][0]["data"])) == int(test_images[1][0])


def _good(url: str, images: np.ndarray) -> None:
    body, headers = binary_body(np.ascontiguousarray(images[:1], dtype=np.float32))
    assert httpx.post(f"{url}/v2/models/digits/infer", content=body, headers=headers).status_code == 200


def _lying_header(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    body, headers = binary_body(x)
    return body, {**headers, "Inference-Header-Content-Length": str(len(body) + 10)}


def _short_header(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    body, headers = binary_body(x)
    return body, {**headers, "Inference-Header-Content-Length": "20"}


ONE = np.zeros((1, 1, 8, 8), np.float32)
BAD_BINARY = [
    ("wrong shape", lambda: binary_body(np.zeros((1, 1, 9, 9), np.float32)), 400, "dimension 2 must be 8"),
    ("wrong dtype", lambda: binary_body(ONE.astype(np.int64), datatype="INT64"), 400,
     "datatype 'INT64' does not match the model's 'FP32'"),
    ("element count", lambda: binary_body(ONE, parameters={"binary_data_size": 200}), 400,
     "binary_data_size is 200 bytes; shape [1, 1, 8, 8] of FP32 needs 256"),
    ("truncated data", lambda: (binary_body(ONE)[0][:-16], binary_body(ONE)[1]), 400, "binary data truncated"),
    ("extra data", lambda: (binary_body(ONE)[0] + b"\0" * 8, binary_body(ONE)[1]), 400,
     "add up to 256 bytes, but 264 bytes of binary data follow"),
    ("header longer than the body", lambda: _lying_header(ONE), 400, "Inference-Header-Content-Length says"),
    ("header cut inside the JSON", lambda: _short_header(ONE), 400, "JSON header"),
    ("header not a number", lambda: (binary_body(ONE)[0], {"Inference-Header-Content-Length": "12x"}), 400,
     "must be a byte count"),
    ("binary size without binary data", lambda: (json.dumps({"inputs": [{
        "name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "parameters": {"binary_data_size": 256}}]
    }).encode(), {}), 400, "no Inference-Header-Content-Length header"),
    ("nan", lambda: binary_body(np.full((1, 1, 8, 8), np.nan, np.float32)), 400, "NaN or infinity"),
    ("bad priority", lambda: (json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                                      "data": [0.0] * 64}], "parameters": {"priority": 7}}).encode(),
                              {}), 400, "parameter 'priority' must be 0"),
    ("over the size limit", lambda: binary_body(np.zeros((16, 1, 32, 32), np.float32)), 413,
     f"exceeds the {MAX_BODY}-byte limit"),
]


@pytest.mark.parametrize(("case", "make", "status", "message"), BAD_BINARY, ids=[b[0] for b in BAD_BINARY])
def test_bad_binary_input_is_a_counted_4xx_and_the_agent_keeps_serving(agent_url, test_images, case, make, status,
                                                                       message):
    before = errors(agent_url, status)
    body, headers = make()
    r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert errors(agent_url, status) == before + 1
    _good(agent_url, test_images[0])


def test_unknown_model_or_version_is_a_counted_404(agent_url, test_images):
    body, headers = binary_body(ONE)
    before = errors(agent_url, 404, model="_unknown", version="")
    r = httpx.post(f"{agent_url}/v2/models/resnet/infer", content=body, headers=headers)
    assert r.status_code == 404 and "unknown model 'resnet'; this agent serves 'digits'" in r.json()["error"]
    assert errors(agent_url, 404, model="_unknown", version="") == before + 1
    before_v = errors(agent_url, 404, version="_unknown")
    r = httpx.post(f"{agent_url}/v2/models/digits/versions/2.0.0/infer", content=body, headers=headers)
    assert r.status_code == 404 and "version '2.0.0' is not loaded" in r.json()["error"]
    assert errors(agent_url, 404, version="_unknown") == before_v + 1
    _good(agent_url, test_images[0])


@pytest.mark.parametrize(("method", "path", "status", "message"), [
    ("GET", "/v3/nothing", 404, "no such endpoint: GET /v3/nothing"),
    ("GET", "/v2/models/digits/infer", 405, "GET is not allowed on /v2/models/digits/infer"),
    ("DELETE", "/v2/models/digits", 405, "DELETE is not allowed"),
    ("POST", "/v2/models/digits/versions/1.0.0/unload", 404, "no such endpoint"),
])
def test_unknown_routes_and_methods_answer_json(agent_url, method, path, status, message):
    r = httpx.request(method, f"{agent_url}{path}")
    assert r.status_code == status
    assert message in r.json()["error"]


# -- the image endpoint ----------------------------------------------------------------------------


def png(image: np.ndarray) -> bytes:
    """A digits test sample (1x8x8, pixels / 16) as the 8-bit gray PNG a camera would send."""
    ok, buf = cv2.imencode(".png", np.round(image[0] * 255).astype(np.uint8))
    assert ok
    return buf.tobytes()


def test_image_endpoint_classifies_pngs(agent_url, test_images):
    images, labels = test_images
    preds = []
    for img in images[:32]:
        r = httpx.post(f"{agent_url}/v2/models/digits/infer/image", content=png(img),
                       headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        preds.append(int(np.argmax(r.json()["outputs"][0]["data"])))
    assert (np.array(preds) == labels[:32]).mean() >= 0.9


def test_image_endpoint_applies_the_recorded_preprocessing(agent_url, image_bundle, tmp_path, test_images):
    """A 40x48 color JPEG: resized, grayed and scaled by the bundle's own Preprocessing, the same tensor the
    compiler would make, so /infer with that tensor gives the same logits."""
    store = ModelStore(tmp_path / "store")
    store.recover()
    staged = store.stage(image_bundle, sha256_file(image_bundle))
    prep = staged.manifest.preprocessing
    assert prep is not None
    gray = np.round(test_images[0][5, 0] * 255).astype(np.uint8)
    big = cv2.resize(cv2.cvtColor(gray, cv2.COLOR_GRAY2BGR), (40, 48), interpolation=cv2.INTER_NEAREST)
    ok, buf = cv2.imencode(".jpg", big, [cv2.IMWRITE_JPEG_QUALITY, 95])
    jpeg = buf.tobytes()
    r = httpx.post(f"{agent_url}/v2/models/digits/versions/1.0.0/infer/image", content=jpeg)
    assert r.status_code == 200, r.text
    x = prep.apply(decode_image(jpeg, "test"))[None]
    ref = httpx.post(f"{agent_url}/v2/models/digits/infer", json={"inputs": [{
        "name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
    np.testing.assert_allclose(r.json()["outputs"][0]["data"], ref.json()["outputs"][0]["data"], rtol=1e-5,
                               atol=1e-5)


def _huge_png() -> bytes:
    real = png(np.zeros((1, 8, 8), np.float32))
    return real[:16] + (100_000).to_bytes(4, "big") + (100_000).to_bytes(4, "big") + real[24:]


BAD_IMAGES = [
    ("not an image", b"hello, this is text", 415, "not a JPEG or PNG image"),
    ("empty body", b"", 415, "not a JPEG or PNG image"),
    ("truncated png", lambda: png(np.ones((1, 8, 8), np.float32) / 2)[:40], 400, "not a readable image"),
    ("corrupt jpeg", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00garbage", 400, "corrupt JPEG"),
    ("decompression bomb", _huge_png, 413, "100000x100000"),
    ("gif", b"GIF89a\x01\x00\x01\x00", 415, "not a JPEG or PNG image"),
]


@pytest.mark.parametrize(("case", "data", "status", "message"), BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_are_a_counted_4xx(agent_url, test_images, case, data, status, message):
    before = errors(agent_url, status)
    r = httpx.post(f"{agent_url}/v2/models/digits/infer/image", content=data() if callable(data) else data)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert errors(agent_url, status) == before + 1
    assert httpx.post(f"{agent_url}/v2/models/digits/infer/image", content=png(test_images[0][0])).status_code == 200


def test_image_endpoint_needs_recorded_preprocessing(tmp_path, digits_bundle, test_images):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)  # compiled from .npz data: no preprocessing recorded
    with running_agent(data) as (_agent, url):
        r = httpx.post(f"{url}/v2/models/digits/infer/image", content=png(test_images[0][0]))
        assert r.status_code == 400 and "records no image preprocessing" in r.json()["error"]


# -- Prometheus ------------------------------------------------------------------------------------


def test_prometheus_metrics(agent_url, test_images):
    r = httpx.get(f"{agent_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    before = metric(agent_url, "edgefleet_inference_requests_total", model="digits", version="1.0.0")
    batches = metric(agent_url, "edgefleet_batch_size_count", model="digits", version="1.0.0")
    _good(agent_url, test_images[0])
    assert metric(agent_url, "edgefleet_inference_requests_total", model="digits", version="1.0.0") == before + 1
    assert metric(agent_url, "edgefleet_batch_size_count", model="digits", version="1.0.0") == batches + 1
    for name in ("edgefleet_request_duration_seconds_count", "edgefleet_queue_duration_seconds_count",
                 "edgefleet_compute_duration_seconds_count"):
        assert metric(agent_url, name, model="digits", version="1.0.0") >= 1, name
    assert metric(agent_url, "edgefleet_queue_depth", model="digits", version="1.0.0") == 0
    assert metric(agent_url, "edgefleet_model_events_total", model="digits", version="1.0.0", kind="load") == 1
    assert metric(agent_url, "edgefleet_model_serving", model="digits", version="1.0.0") == 1


# -- queueing over HTTP: a backend held at a gate ----------------------------------------------------


class GatedBackend(OnnxRuntimeEngine):
    """The real onnxruntime engine, held at a gate so a test decides when a batch may finish."""

    def __init__(self, manifest):
        super().__init__(EngineSpec.from_manifest(manifest))
        self.gate = threading.Event()
        self.started = threading.Event()

    def _infer_impl(self, feeds):
        self.started.set()
        self.gate.wait(30)
        return super()._infer_impl(feeds)


@pytest.fixture
def gated(tmp_path, digits_bundle):
    store = ModelStore(tmp_path / "store")
    store.recover()
    staged = store.stage(digits_bundle, sha256_file(digits_bundle))
    be = GatedBackend(staged.manifest)
    be.load(staged.engine, 1)
    metrics = Metrics()
    # the engine holds its calls for as long as the test says: on the event loop (inline_max_us, for a model whose
    # lone calls are tiny, as this one's are once the gate is open) that would hold every request, not only its own
    host = ModelHost(BatchSettings(max_batch_size=1, max_queue_size=2, queue_timeout_s=30, inline_max_us=0), metrics)
    app = create_app(host, 1024 * 1024, "dev-test")
    with serving_app(app, setup=lambda: host.swap(staged.manifest, [be])) as url:
        try:
            yield url, be
        finally:
            be.gate.set()


def test_full_queue_is_429_with_retry_after_and_a_timeout_is_503(gated, test_images):
    url, be = gated
    body, headers = binary_body(np.ascontiguousarray(test_images[0][:1], dtype=np.float32))
    post = lambda **kw: httpx.post(f"{url}/v2/models/digits/infer", content=body,  # noqa: E731
                                   headers={**headers, **kw}, timeout=60)
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(post)
        assert be.started.wait(30)
        queued = [pool.submit(post) for _ in range(2)]  # the queue holds 2 samples
        wait_for(lambda: metric(url, "edgefleet_queue_depth", model="digits", version="1.0.0") == 2, 10,
                 "both requests queued", interval_s=0.01)
        full = post()
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert "queue full" in full.json()["error"]
        be.gate.set()
        assert [f.result().status_code for f in (running, *queued)] == [200, 200, 200]
    be.gate.clear()
    be.started.clear()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post)
        assert be.started.wait(30)
        t = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}
        late = httpx.post(f"{url}/v2/models/digits/infer", json={"inputs": [t], "parameters": {"timeout": 50_000}},
                          timeout=60)  # 50 ms in the queue at most, while the model is busy
        assert late.status_code == 503 and "timeout 0.05s" in late.json()["error"]
        be.gate.set()
        assert running.result().status_code == 200
    assert errors(url, 429) == 1 and errors(url, 503) == 1
