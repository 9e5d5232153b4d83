"""What Triton's own tools need of the agent (issue 41), against a real agent on loopback: integer versions beside
the bundles' semantic ones (statistics, config; either accepted in a path; kept across a restart), every call HTTP
answers answered over gRPC too (statistics, repository index, model control refused with Triton's code, CUDA shared
memory answered as none), with tritonclient.grpc and with the generated stubs, and Triton's raw binary request."""

import json

import httpx
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from edgefleet.agent.core.versions import MAX_FILE_BYTES, VersionNumbers
from tests.agent_harness import installed_agent, preinstall, running_agent

grpc = pytest.importorskip("grpc", reason="gRPC needs edgefleet[grpc] (grpcio, tritonclient[grpc])")
tgrpc = pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc] (grpcio, tritonclient[grpc])")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def agent(tmp_path_factory, digits_bundle):
    with installed_agent(tmp_path_factory.mktemp("agent"), digits_bundle, grpc_port=0, batch_tuning="off",
                         max_body_bytes=MAX_BODY) as agent_url:
        yield agent_url


@pytest.fixture
def gclient(agent):
    with tgrpc.InferenceServerClient(f"127.0.0.1:{agent[0].grpc_port}") as c:
        yield c


@pytest.fixture
def stub(agent):
    with grpc.insecure_channel(f"127.0.0.1:{agent[0].grpc_port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _infer(url: str, x: np.ndarray, path: str = "/v2/models/digits") -> httpx.Response:
    doc = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    return httpx.post(f"{url}{path}/infer", json=doc, timeout=30)


def test_versions_are_integers_where_triton_reads_them_and_semantic_beside(agent, test_images):
    url = agent[1]
    stats = httpx.get(f"{url}/v2/models/digits/stats", timeout=10).json()["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("digits", "1")]  # perf_analyzer stoll()s it
    assert [s["version"] for s in httpx.get(f"{url}/v2/models/stats", timeout=10).json()["model_stats"]] == ["1"]
    cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
    assert cfg["version_policy"] == {"specific": {"versions": ["1"]}}
    assert cfg["parameters"]["semantic_version"] == {"string_value": "1.0.0"}
    meta = httpx.get(f"{url}/v2/models/digits", timeout=10).json()
    assert meta["versions"] == ["1.0.0"] and meta["version_number"] == "1"
    x = np.ascontiguousarray(test_images[0][:2], dtype=np.float32)
    for ref in ("1", "1.0.0"):  # either names the version, in every route that takes one
        assert _infer(url, x, f"/v2/models/digits/versions/{ref}").status_code == 200
        assert httpx.get(f"{url}/v2/models/digits/versions/{ref}/stats", timeout=10).json()["model_stats"][0][
            "version"] == "1"
    for ref in ("2", "0", "01x", "9" * 40):
        r = _infer(url, x, f"/v2/models/digits/versions/{ref}")
        assert r.status_code == 404 and "serving 1.0.0 (number 1)" in r.json()["error"], (ref, r.text)


def test_version_numbers_increase_and_survive_in_their_file(tmp_path):
    path = tmp_path / "version-numbers.json"
    v = VersionNumbers(path)
    assert [v.number("digits", "1.0.0"), v.number("digits", "1.1.0"), v.number("digits", "1.0.0"),
            v.number("ocr", "1.0.0")] == [1, 2, 1, 1]
    again = VersionNumbers(path)  # as after a restart
    assert again.number("digits", "1.1.0") == 2 and again.number("digits", "0.9.0") == 3  # never reused, increasing
    assert again.matches("digits", "1.1.0", "2") and again.matches("digits", "1.1.0", "1.1.0")
    assert not again.matches("digits", "1.1.0", "1") and not again.matches("digits", "1.1.0", "+2")
    for bad in (b"{not json", json.dumps({"models": {"digits": {"next": 1, "versions": {"1.0.0": 5}}}}).encode(),
                b" " * (MAX_FILE_BYTES + 1)):
        path.write_bytes(bad)
        assert VersionNumbers(path).number("digits", "2.0.0") == 1  # refused whole: starts afresh, still serves


def test_a_restart_keeps_each_versions_number(tmp_path, digits_bundle, digits_bundle_v2, test_images):
    x = np.ascontiguousarray(test_images[0][:1], dtype=np.float32)
    with installed_agent(tmp_path, digits_bundle, batch_tuning="off") as (_, url):
        assert _infer(url, x, "/v2/models/digits/versions/1").status_code == 200
    preinstall(tmp_path, digits_bundle_v2)  # 1.1.0 installed while the agent was down
    with running_agent(tmp_path, batch_tuning="off") as (_, url):
        stats = httpx.get(f"{url}/v2/models/digits/stats", timeout=10).json()["model_stats"]
        assert stats[0]["version"] == "2"
        assert _infer(url, x, "/v2/models/digits/versions/2").json()["model_version"] == "1.1.0"
        assert _infer(url, x, "/v2/models/digits/versions/1").status_code == 404
    doc = json.loads((tmp_path / "version-numbers.json").read_text())
    assert doc["models"]["digits"] == {"next": 3, "versions": {"1.0.0": 1, "1.1.0": 2}}


def test_grpc_answers_what_http_answers(agent, gclient, test_images):
    c = gclient
    x = np.ascontiguousarray(test_images[0][:1], dtype=np.float32)
    inp = tgrpc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    c.infer("digits", [inp])
    http_stats = httpx.get(f"{agent[1]}/v2/models/digits/stats", timeout=10).json()["model_stats"][0]
    for name, version in (("digits", ""), ("digits", "1"), ("digits", "1.0.0"), ("", "")):
        s = c.get_inference_statistics(name, version, as_json=True)["model_stats"]
        assert [(m["name"], m["version"]) for m in s] == [("digits", "1")], (name, version)
        ok, http_ok = s[0]["inference_stats"]["success"], http_stats["inference_stats"]["success"]
        assert int(ok["count"]) >= int(http_ok["count"])
        infer_count = int(s[0]["inference_stats"]["compute_infer"]["count"])
        assert int(s[0]["inference_stats"]["compute_input"]["count"]) == infer_count > 0  # perf_analyzer checks
    with pytest.raises(InferenceServerException) as err:
        c.get_inference_statistics("digits", "2")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    index = c.get_model_repository_index(as_json=True)["models"]
    http_index = httpx.post(f"{agent[1]}/v2/repository/index", json={}, timeout=10).json()
    assert [(m["name"], m["version"], m["state"]) for m in index] == [
        (m["name"], m["version"], m["state"]) for m in http_index] == [("digits", "1.0.0", "READY")]
    cfg = c.get_model_config("digits", as_json=True)["config"]
    assert cfg["version_policy"] == {"specific": {"versions": ["1"]}}
    assert cfg["parameters"]["semantic_version"] == {"string_value": "1.0.0"}
    for call in (c.load_model, c.unload_model):
        with pytest.raises(InferenceServerException) as err:
            call("digits")
        assert err.value.status() == "StatusCode.UNAVAILABLE" and "not allowed" in err.value.message()
    assert c.get_cuda_shared_memory_status(as_json=True) == {}
    c.unregister_cuda_shared_memory()  # none registered: answered, as perf_analyzer's cleanup needs
    with pytest.raises(InferenceServerException) as err:
        c.register_cuda_shared_memory("r", b"aGFuZGxl", 0, 64)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert c.is_server_live()


def test_grpc_with_the_generated_stubs(stub):
    r = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name="digits", version="1"), timeout=10)
    assert [(m.name, m.version) for m in r.model_stats] == [("digits", "1")]
    r = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=10)
    assert [(m.name, m.state) for m in r.models] == [("digits", "READY")]
    for call, req in ((stub.RepositoryModelLoad, service_pb2.RepositoryModelLoadRequest(model_name="digits")),
                      (stub.RepositoryModelUnload, service_pb2.RepositoryModelUnloadRequest(model_name="digits"))):
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    r = stub.ModelConfig(service_pb2.ModelConfigRequest(name="digits", version="1.0.0"), timeout=10)
    assert list(r.config.version_policy.specific.versions) == [1]


def test_http_model_control_is_refused_as_triton_refuses_it(agent):
    for verb in ("load", "unload"):
        r = httpx.post(f"{agent[1]}/v2/repository/models/digits/{verb}", json={}, timeout=10)
        assert r.status_code == 503 and "not allowed" in r.json()["error"]
    assert httpx.get(f"{agent[1]}/v2/cudasharedmemory/status", timeout=10).json() == []
    assert httpx.post(f"{agent[1]}/v2/cudasharedmemory/unregister", timeout=10).status_code == 200
    assert httpx.post(f"{agent[1]}/v2/cudasharedmemory/region/r/register", json={}, timeout=10).status_code == 400


def _raw(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/digits/infer", content=body, timeout=30,
                      headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"})


def test_the_raw_binary_request(agent, test_images):
    url = agent[1]
    x = np.ascontiguousarray(test_images[0][:3], dtype="<f4")
    want = np.array(_infer(url, x).json()["outputs"][0]["data"], dtype=np.float32).reshape(3, 10)
    for n in (1, 3):  # the body is the model's one input; the batch from its length
        r = _raw(url, x[:n].tobytes())
        assert r.status_code == 200, r.text
        hl = int(r.headers["inference-header-content-length"])
        head = json.loads(r.content[:hl])
        assert head["outputs"][0]["shape"] == [n, 10] and head["outputs"][0]["parameters"] == {
            "binary_data_size": n * 40}
        np.testing.assert_allclose(np.frombuffer(r.content[hl:], "<f4").reshape(n, 10), want[:n], rtol=1e-5)
    for body, status, says in ((x.tobytes()[:255], 400, "not whole FP32 tensors of input 'input'"),
                               (b"", 400, "not whole"),
                               (np.zeros((17, 1, 8, 8), "<f4").tobytes(), 400, "16"),  # the batch bound
                               (np.full((1, 1, 8, 8), np.nan, "<f4").tobytes(), 400, "NaN"),
                               (b"\0" * (MAX_BODY + 256), 413, "limit")):  # the same bounds as any body
        r = _raw(url, body)
        assert r.status_code == status and says in r.json()["error"], (len(body), r.text)
    assert _raw(url, x[:1].tobytes()).status_code == 200  # and it serves on
