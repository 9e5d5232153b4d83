"""The agent's KServe v2 endpoint against a real server on loopback: answers, and bad input gets a 4xx
that says what was wrong while the agent keeps serving."""

import json

import httpx
import numpy as np
import pytest

from tests.agent_harness import preinstall, running_agent


@pytest.fixture(scope="module")
def agent_url(tmp_path_factory, digits_bundle):
    data = tmp_path_factory.mktemp("agent")
    preinstall(data, digits_bundle)
    with running_agent(data, max_body_bytes=64 * 1024) as (_agent, url):
        yield url


def body(images: np.ndarray, **over) -> dict:
    t = {"name": "input", "shape": list(images.shape), "datatype": "FP32", "data": images.reshape(-1).tolist()}
    t.update(over)
    return {"inputs": [t]}


def infer(url, doc, model="digits", **kw):
    return httpx.post(f"{url}/v2/models/{model}/infer", timeout=30, **({"json": doc} if doc is not None else kw))


def test_health_and_metadata(agent_url):
    assert httpx.get(f"{agent_url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{agent_url}/v2/health/ready").status_code == 200
    meta = httpx.get(f"{agent_url}/v2/models/digits").json()
    assert meta["name"] == "digits" and meta["versions"] == ["1.0.0"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert meta["precision"] == "int8"
    assert httpx.get(f"{agent_url}/v2/models/digits/ready").json()["ready"] is True


def test_classifies_real_test_images(agent_url, test_images):
    images, labels = test_images
    r = infer(agent_url, body(images[:16]) | {"id": "req-7"})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["id"] == "req-7" and doc["model_version"] == "1.0.0"
    out = doc["outputs"][0]
    assert out["name"] == "logits" and out["shape"] == [16, 10] and out["datatype"] == "FP32"
    pred = np.array(out["data"]).reshape(16, 10).argmax(1)
    assert (pred == labels[:16]).mean() >= 0.9


def test_nested_data_is_accepted(agent_url, test_images):
    images, labels = test_images
    r = infer(agent_url, {"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                      "data": images[:1].tolist()}]})
    assert r.status_code == 200
    assert int(np.argmax(r.json()["outputs"][0]["data"])) == int(labels[0])


def test_version_path(agent_url, test_images):
    images, _ = test_images
    assert httpx.post(f"{agent_url}/v2/models/digits/versions/1.0.0/infer", json=body(images[:1])).status_code == 200
    r = httpx.post(f"{agent_url}/v2/models/digits/versions/9.9.9/infer", json=body(images[:1]))
    assert r.status_code == 404 and "9.9.9" in r.json()["error"]


BAD = [
    ("wrong shape", lambda im: body(np.zeros((1, 1, 9, 9), np.float32)), 400, "dimension 2 must be 8"),
    ("wrong rank", lambda im: body(np.zeros((1, 64), np.float32)), 400, "has 2 dimensions, the model expects 4"),
    ("wrong dtype", lambda im: body(im[:1], datatype="INT64"), 400,
     "datatype 'INT64' does not match the model's 'FP32'"),
    ("too few values", lambda im: body(im[:1]) | {"inputs": [body(im[:1])["inputs"][0] | {"data": [0.0] * 10}]},
     400, "10 values given, shape [1, 1, 8, 8] needs 64"),
    ("strings as data", lambda im: body(im[:1]) | {"inputs": [body(im[:1])["inputs"][0] | {"data": ["a"] * 64}]},
     400, "not a (nested) list of FP32 numbers"),
    ("unknown input", lambda im: body(im[:1], name="image"), 400, "unknown input 'image'"),
    ("no inputs", lambda im: {"inputs": []}, 400, "'inputs' must be a non-empty list"),
    ("unknown field", lambda im: body(im[:1]) | {"inptus": []}, 400, "unknown request field(s) ['inptus']"),
    ("zero batch", lambda im: body(np.zeros((0, 1, 8, 8), np.float32)), 400, "batch dimension must be at least 1"),
    ("unknown output", lambda im: body(im[:1]) | {"outputs": [{"name": "probs"}]}, 400, "unknown output(s) ['probs']"),
    ("over max batch", lambda im: body(np.zeros((17, 1, 8, 8), np.float32)), 400, "exceeds this model's max batch"),
]


@pytest.mark.parametrize(("case", "make", "status", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_precise_4xx_and_the_agent_keeps_serving(agent_url, test_images, case, make, status,
                                                                  message):
    images, labels = test_images
    r = infer(agent_url, make(images))
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    ok = infer(agent_url, body(images[:1]))
    assert ok.status_code == 200


def test_nan_is_refused(agent_url):
    doc = json.dumps(body(np.zeros((1, 1, 8, 8), np.float32))).replace("0.0", "NaN", 1)
    r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=doc, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "NaN" in r.json()["error"]


@pytest.mark.parametrize(("raw", "message"), [
    ('{"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [1e39' + ", 0" * 63 + "]}]}",
     "does not fit FP32"),
    ('{"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [1e400' + ", 0" * 63 + "]}]}",
     "NaN or infinity"),
    ('{"inputs": ' + "[" * 20000 + "]" * 20000 + "}", "nested too deeply"),
])
def test_values_that_do_not_fit_are_400_not_500(agent_url, raw, message):
    r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=raw.encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


@pytest.mark.parametrize("req_id", ["caméra-7 帧 42", "\ud800 lone surrogate"])
def test_the_request_id_comes_back_as_sent(agent_url, test_images, req_id):
    """Whatever JSON string a client sends as its id is echoed, escaped where UTF-8 cannot carry it."""
    doc = {"id": req_id, **body(test_images[0][:1])}
    raw = json.dumps(doc).encode()  # ASCII with \u escapes, as the json module writes a lone surrogate
    r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert json.loads(r.content)["id"] == req_id


def test_malformed_json(agent_url):
    r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=b'{"inputs": [', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


def test_unknown_model(agent_url, test_images):
    r = infer(agent_url, body(test_images[0][:1]), model="resnet")
    assert r.status_code == 404 and "unknown model 'resnet'; this agent serves 'digits'" in r.json()["error"]
    assert httpx.get(f"{agent_url}/v2/models/resnet").status_code == 404


def test_oversized_body_is_413(agent_url):
    r = httpx.post(f"{agent_url}/v2/models/digits/infer", content=b"[" + b"0," * 40000 + b"0]",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the 65536-byte limit" in r.json()["error"]


def test_concurrent_clients_get_their_own_answers(agent_url, test_images):
    from concurrent.futures import ThreadPoolExecutor

    images, labels = test_images
    def classify(c: httpx.Client, i: int) -> int:
        r = c.post(f"{agent_url}/v2/models/digits/infer", json=body(images[i : i + 1]))
        return int(np.argmax(r.json()["outputs"][0]["data"]))

    with httpx.Client(timeout=30) as c, ThreadPoolExecutor(8) as pool:
        preds = list(pool.map(lambda i: classify(c, i), range(64)))
    assert (np.array(preds) == labels[:64]).mean() >= 0.95


def test_no_model_installed_is_503(tmp_path):
    with running_agent(tmp_path) as (_agent, url):
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503
        r = httpx.post(f"{url}/v2/models/digits/infer", json={"inputs": []})
        assert r.status_code == 503 and "no model is loaded" in r.json()["error"]


def test_large_bodies_are_decoded_and_a_flood_is_bounded(tmp_path, digits_bundle, test_images):
    images, labels = test_images
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    payload = json.dumps(body(images[:16])).encode()  # ~30 KB
    with running_agent(data, max_body_bytes=400_000, max_inflight_body_bytes=400_000) as (_agent, url):
        padded = payload + b" " * 300_000  # valid JSON above LARGE_BODY: decoded on a worker thread
        r = httpx.post(f"{url}/v2/models/digits/infer", content=padded)
        assert r.status_code == 200
        pred = np.array(r.json()["outputs"][0]["data"]).reshape(16, 10).argmax(1)
        assert (pred == labels[:16]).mean() >= 0.9
    # bodies held at once are bounded: a flood gets 503s, never unbounded memory, and nothing leaks
    with running_agent(data, max_body_bytes=40_000, max_inflight_body_bytes=40_000) as (_agent, url):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{url}/v2/models/digits/infer", content=payload,
                                                       timeout=30).status_code, range(32)))
        assert set(codes) <= {200, 503} and 200 in codes
        assert httpx.post(f"{url}/v2/models/digits/infer", content=payload).status_code == 200
