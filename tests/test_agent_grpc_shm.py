"""On-box clients without HTTP: the Open Inference Protocol over gRPC and Triton's system shared-memory extension,
checked with the official clients (tritonclient.grpc, tritonclient.http, tritonclient.utils.shared_memory) against
a real agent on loopback, including hostile requests; each gets a clear 4xx / gRPC status and the agent keeps
serving."""

import os
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from edgefleet.agent.config import AgentConfig
from edgefleet.agent.transports.shm import SharedMemory
from tests.agent_harness import DIGITS_IN_BYTES, DIGITS_OUT_BYTES, installed_agent, preinstall, running_agent

tgrpc = pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc] (grpcio, tritonclient[grpc])")

IN_BYTES, OUT_BYTES = DIGITS_IN_BYTES * 16, DIGITS_OUT_BYTES * 16  # 16 digits images


@pytest.fixture(scope="module")
def agent(tmp_path_factory, digits_bundle):
    with installed_agent(tmp_path_factory.mktemp("agent"), digits_bundle, grpc_port=0, max_shm_regions_per_client=3,
                         max_shm_regions=4, max_shm_bytes=1024 * 1024) as agent_url:
        yield agent_url


@pytest.fixture
def http(agent):
    c = thttp.InferenceServerClient(agent[1].removeprefix("http://"), network_timeout=30)
    yield c
    c.unregister_system_shared_memory()
    c.close()


@pytest.fixture
def grpc_client(agent):
    c = tgrpc.InferenceServerClient(f"127.0.0.1:{agent[0].grpc_port}")
    yield c
    c.close()


@pytest.fixture
def region():
    """A POSIX shared-memory object of 64 KiB, unlinked after the test (if the test did not)."""
    key = f"/edgefleet-test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key[1:], key, 64 * 1024)
    yield key, handle
    try:
        shm.destroy_shared_memory_region(handle)
    except (shm.SharedMemoryException, FileNotFoundError):  # the test unlinked it itself
        pass


def test_grpc_metadata_and_infer_with_tritonclient(grpc_client, test_images):
    c = grpc_client
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("digits") and not c.is_model_ready("digits", "9.9.9")
    assert "system_shared_memory" in c.get_server_metadata().extensions
    m = c.get_model_metadata("digits", as_json=True)
    assert m["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "1", "8", "8"]}]
    cfg = c.get_model_config("digits", as_json=True)["config"]
    assert cfg["name"] == "digits" and cfg["max_batch_size"] == 16
    images, labels = test_images
    x = np.ascontiguousarray(images[:16], dtype=np.float32)
    inp = tgrpc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    r = c.infer("digits", [inp], outputs=[tgrpc.InferRequestedOutput("logits")], request_id="g-1")
    logits = r.as_numpy("logits")
    assert logits.shape == (16, 10) and (logits.argmax(1) == labels[:16]).mean() >= 0.9
    assert r.get_response().id == "g-1"


def test_grpc_bad_requests_get_a_status_and_the_agent_keeps_serving(grpc_client, test_images):
    c = grpc_client
    x = np.zeros((1, 1, 8, 8), np.float32)
    cases = [
        ("resnet", tgrpc.InferInput("input", [1, 1, 8, 8], "FP32"), "StatusCode.NOT_FOUND", "unknown model"),
        ("digits", tgrpc.InferInput("input", [1, 1, 8, 9], "FP32"), "StatusCode.INVALID_ARGUMENT", "dimension 3"),
        ("digits", tgrpc.InferInput("input", [1, 1, 8, 8], "INT64"), "StatusCode.INVALID_ARGUMENT", "datatype"),
        ("digits", tgrpc.InferInput("image", [1, 1, 8, 8], "FP32"), "StatusCode.INVALID_ARGUMENT", "unknown input"),
    ]
    for model, inp, code, words in cases:
        arr = np.zeros(inp.shape(), np.int64 if inp.datatype() == "INT64" else np.float32)
        inp.set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException) as e:
            c.infer(model, [inp])
        assert e.value.status() == code and words in e.value.message(), (code, e.value)
    # raw bytes that do not match the shape
    inp = tgrpc.InferInput("input", [2, 1, 8, 8], "FP32")
    inp.set_data_from_numpy(np.zeros((2, 1, 8, 8), np.float32))
    inp._raw_content = x.tobytes()  # a hostile client: one image's bytes for a batch of two
    with pytest.raises(InferenceServerException) as e:
        c.infer("digits", [inp])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "binary_data_size" in e.value.message()
    inp = tgrpc.InferInput("input", [1, 1, 8, 8], "FP32")
    inp.set_data_from_numpy(np.ascontiguousarray(test_images[0][:1], dtype=np.float32))
    assert c.infer("digits", [inp]).as_numpy("logits").shape == (1, 10)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_shared_memory_in_and_out(transport, http, grpc_client, region, test_images):
    c, mod = (http, thttp) if transport == "http" else (grpc_client, tgrpc)
    key, handle = region
    images, labels = test_images
    x = np.ascontiguousarray(images[:16], dtype=np.float32)
    shm.set_shared_memory_region(handle, [x])
    c.register_system_shared_memory("r1", key, 64 * 1024)
    status = c.get_system_shared_memory_status()
    if transport == "http":
        assert status == [{"name": "r1", "key": key, "offset": 0, "byte_size": 64 * 1024}]
    else:
        assert status.regions["r1"].key == key
    inp = mod.InferInput("input", list(x.shape), "FP32")
    inp.set_shared_memory("r1", IN_BYTES)
    out = mod.InferRequestedOutput("logits")
    out.set_shared_memory("r1", OUT_BYTES, offset=IN_BYTES)
    r = c.infer("digits", [inp], outputs=[out])
    assert r.get_output("logits") is not None
    logits = shm.get_contents_as_numpy(handle, np.float32, [16, 10], offset=IN_BYTES)
    assert (logits.argmax(1) == labels[:16]).mean() >= 0.9
    # the same logits as sending the bytes
    inp2 = mod.InferInput("input", list(x.shape), "FP32")
    inp2.set_data_from_numpy(x)
    assert np.allclose(c.infer("digits", [inp2]).as_numpy("logits"), logits, atol=1e-5)
    c.unregister_system_shared_memory("r1")
    with pytest.raises(InferenceServerException, match="no shared-memory region 'r1'"):
        c.infer("digits", [inp])


def _register_http(url: str, name: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v2/systemsharedmemory/region/{name}/register", json=body, timeout=10)


def test_hostile_registrations_are_refused(agent, http, region):
    _a, url = agent
    key, _ = region
    cases = [
        ("r", {"key": "/../etc/passwd", "byte_size": 16}, "POSIX shared-memory name"),
        ("r", {"key": "/..", "byte_size": 16}, "POSIX shared-memory name"),
        ("r", {"key": "etc", "byte_size": 16}, "POSIX shared-memory name"),
        ("r", {"key": "/edgefleet-no-such-object", "byte_size": 16}, "no shared-memory object"),
        ("r", {"key": key, "byte_size": 64 * 1024 + 1}, "beyond the end"),
        ("r", {"key": key, "offset": 64 * 1024, "byte_size": 1}, "beyond the end"),
        ("r", {"key": key, "byte_size": -1}, "byte count"),
        ("r", {"key": key, "byte_size": 0}, "at least 1"),
        ("r", {"key": key, "byte_size": 16, "evil": 1}, "JSON object"),
        ("bad name!", {"key": key, "byte_size": 16}, "region name"),
        ("r", {"key": key, "byte_size": 2 * 1024 * 1024}, "max_shm_bytes"),
    ]
    for name, body, words in cases:
        if words == "max_shm_bytes":
            continue  # below: needs an object that big
        resp = _register_http(url, name, body)
        assert resp.status_code == 400 and words in resp.json()["error"], (body, resp.text)
    # a symlink in /dev/shm is not followed
    link = f"/dev/shm/edgefleet-link-{uuid.uuid4().hex[:8]}"
    os.symlink("/etc/hostname", link)
    try:
        resp = _register_http(url, "r", {"key": "/" + link.rsplit("/", 1)[1], "byte_size": 4})
        assert resp.status_code == 400 and "cannot open" in resp.json()["error"]
    finally:
        os.unlink(link)
    assert http.get_system_shared_memory_status() == []


def test_too_many_regions_and_too_many_bytes(agent, http, grpc_client, region):
    _a, url = agent
    key, _ = region
    for i in range(3):
        http.register_system_shared_memory(f"r{i}", key, 1024, offset=i * 1024)
    with pytest.raises(InferenceServerException, match="max_shm_regions_per_client 3"):
        http.register_system_shared_memory("r3", key, 1024)
    with pytest.raises(InferenceServerException, match="max_shm_regions_per_client 3"):
        grpc_client.register_system_shared_memory("r3", key, 1024)
    with pytest.raises(InferenceServerException, match="already registered"):
        http.register_system_shared_memory("r0", key, 1024)
    http.unregister_system_shared_memory()
    big_key = f"/edgefleet-test-big-{uuid.uuid4().hex[:8]}"
    big = shm.create_shared_memory_region(big_key[1:], big_key, 2 * 1024 * 1024)
    try:
        with pytest.raises(InferenceServerException, match="max_shm_bytes"):
            http.register_system_shared_memory("big", big_key, 2 * 1024 * 1024)
    finally:
        shm.destroy_shared_memory_region(big)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_hostile_tensor_references(transport, http, grpc_client, region, test_images):
    c, mod = (http, thttp) if transport == "http" else (grpc_client, tgrpc)
    key, handle = region
    c.register_system_shared_memory("small", key, IN_BYTES)
    x = np.ascontiguousarray(test_images[0][:16], dtype=np.float32)
    shm.set_shared_memory_region(handle, [x])

    def infer(region_name: str, size: int, offset: int = 0, out: tuple | None = None):
        inp = mod.InferInput("input", [16, 1, 8, 8], "FP32")
        inp.set_shared_memory(region_name, size, offset)
        outs = None
        if out is not None:
            o = mod.InferRequestedOutput("logits")
            o.set_shared_memory(*out)
            outs = [o]
        return c.infer("digits", [inp], outputs=outs)

    for args, words in [(("nope", IN_BYTES), "no shared-memory region 'nope'"),
                        (("small", IN_BYTES, 4), "beyond shared-memory region"),
                        (("small", IN_BYTES - 4), "needs 4096"),
                        (("small", IN_BYTES, 0, ("small", OUT_BYTES, IN_BYTES - 8)), "beyond shared-memory region"),
                        (("small", IN_BYTES, 0, ("small", 8)), "shared_memory_byte_size gives it 8")]:
        with pytest.raises(InferenceServerException) as e:
            infer(*args)
        assert words in e.value.message(), (args, e.value.message())
        want = "400" if transport == "http" else "StatusCode.INVALID_ARGUMENT"
        assert str(e.value.status()) == want, e.value
    assert infer("small", IN_BYTES).get_output("logits") is not None  # still serving


def test_a_region_the_client_unlinked_or_truncated(http, region, test_images):
    key, handle = region
    x = np.ascontiguousarray(test_images[0][:16], dtype=np.float32)
    shm.set_shared_memory_region(handle, [x])
    http.register_system_shared_memory("r", key, IN_BYTES)
    inp = thttp.InferInput("input", [16, 1, 8, 8], "FP32")
    inp.set_shared_memory("r", IN_BYTES)
    want = http.infer("digits", [inp]).as_numpy("logits")
    os.unlink("/dev/shm" + key)  # the client unlinks it: the agent's mapping stays valid until unregistered
    assert np.array_equal(http.infer("digits", [inp]).as_numpy("logits"), want)
    http.unregister_system_shared_memory("r")
    # truncated below the region after registering: refused by name, no fault
    key2 = f"/edgefleet-test-{uuid.uuid4().hex[:12]}"
    h2 = shm.create_shared_memory_region(key2[1:], key2, 64 * 1024)
    try:
        http.register_system_shared_memory("t", key2, IN_BYTES)
        os.truncate("/dev/shm" + key2, 16)
        inp.set_shared_memory("t", IN_BYTES)
        with pytest.raises(InferenceServerException, match="was truncated"):
            http.infer("digits", [inp])
        assert http.is_server_live()
    finally:
        shm.destroy_shared_memory_region(h2)


IDLE_S = 0.1  # longer than the registry's idle_timeout_s below: being idle is what is under test, not a wait


def test_idle_regions_are_unregistered_and_all_at_close(tmp_path):
    key = f"/edgefleet-test-{uuid.uuid4().hex[:12]}"
    h = shm.create_shared_memory_region(key[1:], key, 4096)
    try:
        reg = SharedMemory(idle_timeout_s=0.05)
        reg.register("a", key, 0, 4096, "127.0.0.1")
        reg.register("b", key, 0, 4096, "127.0.0.1")
        assert len(reg.status()) == 2
        time.sleep(IDLE_S)
        assert reg.sweep() == 2 and reg.status() == []
        reg.register("c", key, 0, 4096, "127.0.0.1")
        reg.close()
        assert reg.status() == []
    finally:
        shm.destroy_shared_memory_region(h)


def test_config_keys_for_cpus_grpc_and_shared_memory(tmp_path):
    base = {"device_id": "d", "fleet_url": "http://x", "data_dir": tmp_path}
    cfg = AgentConfig(**base, inference_cpus=[1, 0], grpc_port=0, max_shm_bytes=0)
    assert cfg.inference_cpus == (0, 1) and cfg.grpc_port == 0
    for bad in ({"inference_cpus": []}, {"inference_cpus": [1, 1]}, {"inference_cpus": [-1]},
                {"max_shm_regions": -1}, {"grpc_port": 70000}, {"inference_cpu": [1]}):
        with pytest.raises(ValueError):
            AgentConfig(**base, **bad)


def test_inference_threads_run_on_the_cpus_they_are_given(tmp_path, digits_bundle):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs to split")
    preinstall(tmp_path, digits_bundle)
    main_before = os.sched_getaffinity(0)
    with running_agent(tmp_path, inference_cpus=[cpus[-1]]) as (a, url):
        x = np.zeros((1, 1, 8, 8), np.float32)
        c = thttp.InferenceServerClient(url.removeprefix("http://"))
        inp = thttp.InferInput("input", [1, 1, 8, 8], "FP32")
        inp.set_data_from_numpy(x)
        c.infer("digits", [inp])
        c.close()
        pinned = {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                  if t.name.startswith("infer-") and t.native_id is not None}
        assert pinned and all(v == {cpus[-1]} for v in pinned.values()), pinned
    assert os.sched_getaffinity(0) == main_before  # the test's own thread was not moved


def test_a_cpu_this_machine_lacks_is_a_config_error_before_start(tmp_path):
    from edgefleet.agent.daemon import check_runtime_config
    from edgefleet.protocol.errors import ConfigError

    cfg = AgentConfig(device_id="d", fleet_url="http://x", data_dir=tmp_path, inference_cpus=[4095])
    with pytest.raises(ConfigError, match=r"CPU\(s\) \[4095\] are not available"):
        check_runtime_config(cfg)
