"""bench/serve_load.py's one-client path (issue 41: at one client the load generator's CPU per request is on the
latency path, so it drives HTTP, gRPC and shared memory blocking, with no event loop: bench/serve_one.py):
bench/grpc_h2.py's HTTP/2 gRPC client against the agent's gRPC port, answer for answer against tritonclient's, its
errors as gRPC statuses, and serve_load's one-client levels (gRPC, system shared memory, HTTP binary and JSON)
counting every answer right and wrong as the asyncio path does. The figures are not checked
(bench/perf_analyzer_vs_serve.py measures them)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.agent_harness import installed_agent

tgrpc = pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc] (grpcio, tritonclient[grpc])")
from tritonclient.grpc import service_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PATH = "/inference.GRPCInferenceService/ModelInfer"


def _grpc_h2():  # loaded from its file: bench/ is not a package, and its modules' names are not put on sys.path
    spec = importlib.util.spec_from_file_location("grpc_h2", ROOT / "bench" / "grpc_h2.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def agent(tmp_path_factory, digits_bundle):
    with installed_agent(tmp_path_factory.mktemp("agent"), digits_bundle, grpc_port=0) as agent_url:
        yield agent_url


def _request(model: str, image: np.ndarray) -> bytes:
    r = service_pb2.ModelInferRequest(model_name=model)
    r.inputs.add(name="input", datatype="FP32", shape=[1, *image.shape])
    r.raw_input_contents.append(np.ascontiguousarray(image[None], dtype=np.float32).tobytes())
    return r.SerializeToString()


def test_the_http2_client_answers_as_tritonclient_does(agent, test_images):
    h2 = _grpc_h2()
    port = agent[0].grpc_port
    images = test_images[0][:16]
    client = h2.UnaryClient("127.0.0.1", port, PATH, timeout_s=30)
    prepared = [client.prepare(_request("digits", img)) for img in images]
    official = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for i, img in enumerate(images):
            inp = tgrpc.InferInput("input", [1, *img.shape], "FP32")
            inp.set_data_from_numpy(np.ascontiguousarray(img[None], dtype=np.float32))
            want = official.infer("digits", [inp]).as_numpy("logits")
            got = service_pb2.ModelInferResponse.FromString(client.call(prepared[i]))
            assert got.model_name == "digits" and got.outputs[0].name == "logits"
            assert np.array_equal(np.frombuffer(got.raw_output_contents[0], np.float32).reshape(want.shape), want)
        # many calls on one connection: stream ids climb; the server's window updates (and any pings) are handled
        first = client.sock
        for i in range(400):
            assert client.call(prepared[i % 16])
        assert client.sock is first and client.sid == 2 * (16 + 400) + 1
    finally:
        official.close()
        client.close()


def test_the_http2_client_reports_a_status_and_calls_again(agent, test_images):
    h2 = _grpc_h2()
    client = h2.UnaryClient("127.0.0.1", agent[0].grpc_port, PATH, timeout_s=30)
    try:
        with pytest.raises(h2.GrpcError) as err:
            client.call(client.prepare(_request("nosuch", test_images[0][0])))
        assert err.value.status == 5 and "nosuch" in err.value.message  # NOT_FOUND
        assert service_pb2.ModelInferResponse.FromString(
            client.call(client.prepare(_request("digits", test_images[0][0])))).model_name == "digits"
    finally:
        client.close()
    with pytest.raises(OSError):  # nothing listening
        h2.UnaryClient("127.0.0.1", 9, PATH, timeout_s=5).call(client.prepare(b""))


LEVELS = """
import json, sys
import numpy as np
sys.path.insert(0, "bench")
from serve_load import bodies, run_level
http, grpc_port, labels = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
images = np.load("models/digits/test.npz")["input"][:len(labels)]
out = {}
for kind, url in (("grpc", f"http://127.0.0.1:{grpc_port}"), ("shm", http), ("binary", http), ("json", http)):
    path, reqs, _ = bodies(kind, "digits", images)
    for name, lab in (("right", labels), ("shifted", [(v + 1) % 10 for v in labels])):
        r = run_level(url, kind, path, reqs, lab, 1, 40, 2, timeout_s=120)
        out[f"{kind} {name}"] = {k: r[k] for k in ("requests", "errors", "wrong", "first_error")}
print(json.dumps(out))
"""


def test_one_client_levels_count_every_answer(agent, test_images):
    official = tgrpc.InferenceServerClient(f"127.0.0.1:{agent[0].grpc_port}")
    try:
        x = np.ascontiguousarray(test_images[0][:8], dtype=np.float32)
        inp = tgrpc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        labels = [int(v) for v in official.infer("digits", [inp]).as_numpy("logits").argmax(1)]  # the agent's own
    finally:
        official.close()
    p = subprocess.run([sys.executable, "-c", LEVELS, agent[1], str(agent[0].grpc_port), json.dumps(labels)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for kind in ("grpc", "shm", "binary", "json"):
        assert got[f"{kind} right"] == {"requests": 40, "errors": 0, "wrong": 0, "first_error": None}, got
        assert got[f"{kind} shifted"] == {"requests": 40, "errors": 0, "wrong": 40, "first_error": None}, got
