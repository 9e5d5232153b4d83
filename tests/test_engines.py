"""The engines (engines/): onnxruntime, LiteRT and TensorRT behind one interface, as the agent loads them
from a bundle (the conformance suite, tests/test_engines_conformance.py, holds every engine to the same
per-model expectations).

LiteRT runs for real (ai-edge-litert): small .tflite models written here with the TFLite schema, and the
digits model compiled by the real onnx2tf toolchain and served through the real agent over HTTP. TensorRT
runs against the fake ``tensorrt`` and CUDA modules of tests/fakes (no GPU here); the test of the real one
skips with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from edgefleet.engines import KINDS, EngineClosed, EngineLoadError, EngineSpec, load_bundle_engine
from edgefleet.engines.litert import LiteRTEngine, read_tflite_metadata
from edgefleet.engines.onnxruntime import CPU, CUDA, TENSORRT, OnnxRuntimeEngine, providers_for
from edgefleet.protocol.bundle import extract_bundle
from edgefleet.protocol.manifest import Manifest, TensorSpec
from tests.agent_harness import preinstall, running_agent
from tests.conftest import DIGITS, REPO
from tests.fakes import install_fake_gpu
from tests.test_litert import tflite_toolchain  # noqa: F401  (the session fixture that installs onnx2tf)
from tests.waiting import concurrently


def _real_tensorrt_missing() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # ImportError, or the PyPI stub failing in its own way
        return f"no NVIDIA GPU / tensorrt module: import tensorrt failed ({' '.join(str(exc).split())})"
    return None


REAL_TENSORRT_MISSING = _real_tensorrt_missing()


@pytest.fixture(scope="module")
def digits_x86(digits_bundle, tmp_path_factory) -> tuple[Manifest, Path]:
    d = tmp_path_factory.mktemp("digits-x86")
    return extract_bundle(digits_bundle, d), d


@pytest.fixture(scope="module")
def reference():
    sess = ort.InferenceSession(str(DIGITS / "model.onnx"), providers=[CPU])
    return lambda x: sess.run(None, {"input": x})[0]


def test_importing_the_agent_loads_no_runtime_it_does_not_need():
    code = ("import sys, edgefleet.engines, edgefleet.agent.daemon, edgefleet.engines.litert, "
            "edgefleet.engines.tensorrt, edgefleet.engines.cuda; "
            "print(sorted(m for m in ('tensorrt', 'ai_edge_litert', 'tflite_runtime', 'cuda', 'pycuda', "
            "'edgefleet.compiler', 'onnx', 'edgefleet.fleet') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert set(KINDS) == {"onnxruntime", "litert", "tensorrt"}


# -- onnxruntime ------------------------------------------------------------------------------------------
def test_onnxruntime_cpu_profile_runs_on_cpu_without_spinning(digits_x86, reference, test_images):
    manifest, d = digits_x86
    assert providers_for(manifest.profile) == (CPU,)  # x86-cpu: accelerator cpu
    backend = load_bundle_engine(manifest, d / manifest.engine, 2)
    assert isinstance(backend, OnnxRuntimeEngine)
    assert backend.device == CPU and backend.providers == (CPU,)
    opts = backend._sess.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    # the CPU provider is warmed at the smallest batch only; a session on CUDA (set by hand: no GPU here) at all
    assert backend.warm_up_sizes((1, 4, 16)) == (1,)
    on_gpu = OnnxRuntimeEngine(EngineSpec.from_manifest(manifest))
    on_gpu.providers = (CUDA, CPU)
    assert on_gpu.warm_up_sizes((1, 4, 16)) == (1, 4, 16)
    images, labels = test_images
    (logits,) = backend.infer({"input": images[:32]})
    assert logits.shape == (32, 10) and (logits.argmax(1) == labels[:32]).mean() >= 0.9
    backend.close()
    with pytest.raises(EngineClosed, match="closed"):
        backend.infer({"input": images[:1]})


def test_onnxruntime_gpu_profile_asks_for_tensorrt_and_cuda_and_reports_what_runs(digits_x86, test_images, caplog):
    manifest, d = digits_x86
    gpu_manifest = manifest.model_copy(update={"profile": "jetson-orin-nano"})  # accelerator: gpu
    assert providers_for(gpu_manifest.profile) == (TENSORRT, CUDA, CPU)
    backend = load_bundle_engine(gpu_manifest, d / manifest.engine, 1)
    assert isinstance(backend, OnnxRuntimeEngine)
    assert backend.requested == (TENSORRT, CUDA, CPU)
    # decided from the session: on this machine (onnxruntime's CPU build, no GPU) only the CPU runs it
    assert backend.providers == tuple(backend._sess.get_providers()) == (CPU,)
    assert backend.device == CPU
    assert f"asked for {TENSORRT}; onnxruntime runs it on {CPU}" in caplog.text
    assert backend.infer({"input": test_images[0][:2]})[0].shape == (2, 10)


def test_onnxruntime_providers_from_config_and_unknown_ones(digits_x86):
    manifest, d = digits_x86
    backend = load_bundle_engine(manifest, d / manifest.engine, 1, providers=(CUDA, CPU))
    assert isinstance(backend, OnnxRuntimeEngine) and backend.requested == (CUDA, CPU) and backend.device == CPU
    with pytest.raises(EngineLoadError, match="unknown onnxruntime execution provider 'CudaProvider'"):
        load_bundle_engine(manifest, d / manifest.engine, 1, providers=("CudaProvider",))


def test_onnxruntime_engine_that_is_not_onnx_is_a_one_line_error(digits_x86, tmp_path):
    manifest, _ = digits_x86
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not a model\n" * 10)
    with pytest.raises(EngineLoadError) as err:
        load_bundle_engine(manifest, bad, 1)
    assert str(err.value).startswith("onnxruntime could not load model.onnx") and "\n" not in str(err.value)


# -- LiteRT: small engines written with the TFLite schema ------------------------------------------------
def make_tflite(path: Path, quantized_io: bool = False, metadata: dict | None = None) -> Path:
    """x[N,3] -> doubled = 2x, plus1 = x+1. The signature names them output_1 and output_0 (the other way round
    from the manifest, like onnx2tf's quantized engines); with ``quantized_io`` the engine takes and returns int8
    (x: scale 0.05 zero point -3; outputs: scale 0.1 zero point 4) around float arithmetic."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb

    buffers = [fb.BufferT()]
    tensors: list = []

    def buf(data: bytes | None = None) -> int:
        b = fb.BufferT()
        if data is not None:
            b.data = np.frombuffer(data, np.uint8)
        buffers.append(b)
        return len(buffers) - 1

    def tensor(name: str, ttype: int = fb.TensorType.FLOAT32, data: np.ndarray | None = None,
               q: tuple[float, int] | None = None) -> int:
        t = fb.TensorT()
        t.name, t.type = name, ttype
        t.shape, t.shapeSignature = ([1], [1]) if data is not None else ([1, 3], [-1, 3])
        t.buffer = buf(None if data is None else data.tobytes())
        if q is not None:
            t.quantization = fb.QuantizationParametersT()
            t.quantization.scale, t.quantization.zeroPoint = [q[0]], [q[1]]
        tensors.append(t)
        return len(tensors) - 1

    def op(code: int, ins: list[int], outs: list[int], opt_type: int = 0, opt: object = None):
        o = fb.OperatorT()
        o.opcodeIndex, o.inputs, o.outputs, o.builtinOptionsType, o.builtinOptions = code, ins, outs, opt_type, opt
        return o

    codes = []
    for builtin in (fb.BuiltinOperator.MUL, fb.BuiltinOperator.ADD, fb.BuiltinOperator.DEQUANTIZE,
                    fb.BuiltinOperator.QUANTIZE):
        c = fb.OperatorCodeT()
        c.builtinCode, c.deprecatedBuiltinCode, c.version = builtin, min(builtin, 127), 1
        codes.append(c)
    operators = []
    x_in = x = tensor("x")
    if quantized_io:
        x_in = tensor("x_q", fb.TensorType.INT8, q=(0.05, -3))
        operators.append(op(2, [x_in], [x]))
    two = tensor("two", data=np.array([2.0], np.float32))
    one = tensor("one", data=np.array([1.0], np.float32))
    doubled, plus1 = tensor("doubled"), tensor("plus1")
    operators += [op(0, [x, two], [doubled], fb.BuiltinOptions.MulOptions, fb.MulOptionsT()),
                  op(1, [x, one], [plus1], fb.BuiltinOptions.AddOptions, fb.AddOptionsT())]
    if quantized_io:
        dq, pq = tensor("doubled_q", fb.TensorType.INT8, q=(0.1, 4)), tensor("plus1_q", fb.TensorType.INT8, q=(0.1, 4))
        operators += [op(3, [doubled], [dq]), op(3, [plus1], [pq])]
        doubled, plus1 = dq, pq
    sg = fb.SubGraphT()
    sg.tensors, sg.inputs, sg.outputs, sg.operators, sg.name = tensors, [x_in], [plus1, doubled], operators, "main"

    def tmap(name: str, index: int):
        t = fb.TensorMapT()
        t.name, t.tensorIndex = name, index
        return t

    sig = fb.SignatureDefT()
    sig.signatureKey, sig.subgraphIndex = "serving_default", 0
    sig.inputs, sig.outputs = [tmap("x", x_in)], [tmap("output_0", plus1), tmap("output_1", doubled)]
    model = fb.ModelT()
    model.version, model.operatorCodes, model.subgraphs, model.signatureDefs = 3, codes, [sg], [sig]
    if metadata is not None:
        entry = fb.MetadataT()
        entry.name, entry.buffer = "edgefleet_io", buf(json.dumps(metadata).encode())
        model.metadata = [entry]
    model.buffers = buffers
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    path.write_bytes(bytes(builder.Output()))
    return path


IO_MAP = {"format": 1, "signature": "serving_default", "inputs": [{"name": "x", "key": "x", "perm": None}],
          "outputs": [{"name": "doubled", "key": "output_1", "perm": None},
                      {"name": "plus1", "key": "output_0", "perm": None}]}


def tiny_manifest(digits_manifest: Manifest) -> Manifest:
    def spec(name: str) -> TensorSpec:
        return TensorSpec(name=name, datatype="FP32", shape=(-1, 3))

    return digits_manifest.model_copy(update={"backend": "litert", "inputs": (spec("x"),),
                                              "outputs": (spec("doubled"), spec("plus1"))})


def test_litert_metadata_is_read_from_the_flatbuffer(tmp_path):
    engine = make_tflite(tmp_path / "m.tflite", metadata=IO_MAP)
    assert json.loads(read_tflite_metadata(engine.read_bytes(), "edgefleet_io") or b"") == IO_MAP
    assert read_tflite_metadata(engine.read_bytes(), "other") is None
    assert read_tflite_metadata(make_tflite(tmp_path / "plain.tflite").read_bytes(), "edgefleet_io") is None


@pytest.mark.parametrize("quantized_io", [False, True])
def test_litert_outputs_come_in_manifest_order_at_any_batch_size(digits_x86, tmp_path, quantized_io):
    manifest = tiny_manifest(digits_x86[0])
    engine = make_tflite(tmp_path / "m.tflite", quantized_io=quantized_io, metadata=IO_MAP)
    backend = load_bundle_engine(manifest, engine, 1)
    assert isinstance(backend, LiteRTEngine) and "ai-edge-litert" in backend.device
    rng = np.random.default_rng(0)
    tol = 0.1 if quantized_io else 1e-6  # int8 steps: 0.05 on the input, 0.1 on the outputs
    for n in (1, 7, 2, 7):  # the input is resized when the batch size changes, back and forth
        x = rng.uniform(-2, 2, (n, 3)).astype(np.float32)
        doubled, plus1 = backend.infer({"x": x})
        assert doubled.shape == plus1.shape == (n, 3) and doubled.dtype == plus1.dtype == np.float32
        np.testing.assert_allclose(doubled, 2 * x, atol=tol)
        np.testing.assert_allclose(plus1, x + 1, atol=tol)
    if quantized_io:  # exactly what int8 with those scales gives: x_q = round(x / 0.05) - 3, ...
        (doubled, plus1) = backend.infer({"x": np.array([[0.65, -0.15, 10.0]], np.float32)})
        np.testing.assert_allclose(doubled, [[1.3, -0.3, 12.3]], atol=1e-6)  # 10.0 saturates at int8 127
    backend.close()


def test_litert_without_metadata_uses_onnx2tf_naming(digits_x86, tmp_path):
    manifest = digits_x86[0]
    spec = TensorSpec(name="x", datatype="FP32", shape=(-1, 3))
    named = manifest.model_copy(update={"backend": "litert", "inputs": (spec,),
                                        "outputs": (spec.model_copy(update={"name": "output_0"}),
                                                    spec.model_copy(update={"name": "output_1"}))})
    backend = load_bundle_engine(named, make_tflite(tmp_path / "m.tflite"), 1)
    plus1, doubled = backend.infer({"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(plus1, np.full((2, 3), 2.0))
    np.testing.assert_array_equal(doubled, np.full((2, 3), 2.0))
    with pytest.raises(EngineLoadError, match="no tensor 'doubled' of the spec"):
        load_bundle_engine(tiny_manifest(manifest), make_tflite(tmp_path / "m2.tflite"), 1)


def test_litert_several_instances_run_at_once(digits_x86, tmp_path):
    manifest = tiny_manifest(digits_x86[0])
    engine = make_tflite(tmp_path / "m.tflite", metadata=IO_MAP)
    backends = [load_bundle_engine(manifest, engine, 1) for _ in range(3)]

    def work(i: int) -> None:
        for n in range(1, 40):
            x = np.full((1 + (n + i) % 5, 3), float(i), np.float32)
            doubled, plus1 = backends[i].infer({"x": x})
            assert np.array_equal(doubled, 2 * x) and np.array_equal(plus1, x + 1)

    errors = concurrently(work, 3, timeout_s=60)
    assert not errors, errors
    assert len({id(b._interp) for b in backends}) == 3  # type: ignore[attr-defined]


def test_litert_not_a_tflite_file_is_a_one_line_error(digits_x86, tmp_path):
    bad = tmp_path / "model.tflite"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(EngineLoadError, match=r"^model\.tflite is not a TFLite flatbuffer"):
        load_bundle_engine(tiny_manifest(digits_x86[0]), bad, 1)


# -- LiteRT: the digits model through onnx2tf, served over HTTP --------------------------------------------
@pytest.mark.timeout(1800)  # the first use installs the toolchain
def test_litert_digits_bundle_served_over_http_keeps_its_accuracy(tflite_toolchain, tmp_path):  # noqa: F811
    from edgefleet.compiler.compile import CompileOptions, compile_model

    # a LiteRT profile this x86 box runs (arm64-cpu's needs NEON, which the agent rightly refuses here)
    arm = (REPO / "hw-profiles" / "arm64-cpu.yaml").read_text()
    profile = tmp_path / "x86-litert.yaml"
    profile.write_text(arm.replace("name: arm64-cpu", "name: x86-litert").replace("arch: aarch64", "arch: x86_64")
                       .replace("cpu_features: [neon]", "cpu_features: []"))
    result = compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile=str(profile), calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=tmp_path / "out", name="digits", version="1.0.0", precision="int8",
        benchmark=False))
    m = result.manifest
    assert (m.backend, m.precision, m.profile) == ("litert", "int8", "x86-litert")
    with np.load(DIGITS / "test.npz") as npz:
        images, labels = npz["input"], npz["labels"]
    preinstall(tmp_path / "agent", result.bundle)
    with running_agent(tmp_path / "agent", max_batch_size=8) as (agent, url):
        assert agent.host.current is not None and agent.host.current.backend.kind == "litert"
        meta = httpx.get(f"{url}/v2/models/digits").json()
        assert meta["platform"] == "litert"
        preds = []
        with httpx.Client(timeout=30) as client:
            for i in range(0, len(images), 8):
                x = images[i:i + 8]
                r = client.post(f"{url}/v2/models/digits/infer", json={"inputs": [
                    {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
                assert r.status_code == 200, r.text
                out = r.json()["outputs"][0]
                preds.append(np.array(out["data"], np.float32).reshape(out["shape"]).argmax(1))
    top1 = float((np.concatenate(preds) == labels).mean())
    print(f"digits LiteRT int8 over HTTP: top-1 {top1:.4f}, manifest {m.accuracy.candidate:.4f}")
    assert len(labels) == m.accuracy.eval_samples
    assert top1 == pytest.approx(m.accuracy.candidate, abs=1e-9)


# -- TensorRT against the fakes ---------------------------------------------------------------------------
@pytest.fixture
def jetson_bundle(monkeypatch, tmp_path) -> tuple[Manifest, Path]:
    from edgefleet.compiler.compile import CompileOptions, compile_model

    install_fake_gpu(monkeypatch)  # TensorRT 10.3.0, sm87
    result = compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="jetson-orin-nano", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=tmp_path / "out", name="digits", version="1.0.0", precision="fp16",
        benchmark=False))
    d = tmp_path / "bundle"
    return extract_bundle(result.bundle, d), d


@pytest.mark.parametrize(("api", "cuda"), [("10", "bindings"), ("10", "cudart"), ("10", "pycuda")])
def test_tensorrt_runs_the_engine_and_frees_the_device(monkeypatch, jetson_bundle, reference, test_images, api,
                                                       cuda):
    manifest, d = jetson_bundle
    gpu = install_fake_gpu(monkeypatch, api=api, cuda=cuda)
    backend = load_bundle_engine(manifest, d / manifest.engine, 2)
    assert backend.kind == "tensorrt" and backend.device == "TensorRT 10.3.0 on GPU sm87"
    images = test_images[0]
    for n in (1, 5, 40):  # 40 is above the engine's profile (16): split and joined
        (logits,) = backend.infer({"input": images[:n]})
        assert logits.shape == (n, 10) and logits.dtype == np.float32
        np.testing.assert_allclose(logits, reference(images[:n]), rtol=1e-5, atol=1e-5)
    assert gpu.memory.live > 0
    backend.close()
    backend.close()
    assert gpu.memory.live == 0
    assert not gpu.memory.streams or cuda == "pycuda"  # pycuda destroys a stream when it is collected


def test_tensorrt_8_binding_api(monkeypatch, jetson_bundle, reference, test_images):
    manifest, d = jetson_bundle
    install_fake_gpu(monkeypatch, api="8", version="10.3.0", cuda="cudart")  # a v2-only context
    backend = load_bundle_engine(manifest, d / manifest.engine, 2)
    (logits,) = backend.infer({"input": test_images[0][:3]})
    np.testing.assert_allclose(logits, reference(test_images[0][:3]), rtol=1e-5, atol=1e-5)
    backend.close()


def test_tensorrt_bundle_without_tensorrt_fails_in_one_line(monkeypatch, jetson_bundle):
    manifest, d = jetson_bundle
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt raises ImportError
    with pytest.raises(EngineLoadError) as err:
        load_bundle_engine(manifest, d / manifest.engine, 2)
    msg = str(err.value)
    assert msg.startswith("TensorRT is not installed on this machine") and "install a bundle built for" in msg
    assert "\n" not in msg


def test_tensorrt_engine_for_another_tensorrt_or_gpu_is_refused(monkeypatch, jetson_bundle):
    manifest, d = jetson_bundle
    install_fake_gpu(monkeypatch, version="10.0.1")
    with pytest.raises(EngineLoadError, match=r"built for TensorRT 10\.3\.0; this box has 10\.0\.1"):
        load_bundle_engine(manifest, d / manifest.engine, 2)
    gpu = install_fake_gpu(monkeypatch, compute_capability=(7, 2))
    with pytest.raises(EngineLoadError, match=r"compute capability 8\.7; this one is 7\.2"):
        load_bundle_engine(manifest, d / manifest.engine, 2)
    assert gpu.memory.live == 0 and not gpu.memory.streams
    # what TensorRT itself says when the manifest does not record the version
    bare = manifest.model_copy(update={"engine_compatibility": {}})
    install_fake_gpu(monkeypatch, version="10.0.1")
    with pytest.raises(EngineLoadError, match=r"TensorRT 10\.0\.1 cannot load model\.engine .*expecting library"):
        load_bundle_engine(bare, d / manifest.engine, 2)


def test_tensorrt_without_cuda_bindings_says_what_to_install(monkeypatch, jetson_bundle):
    manifest, d = jetson_bundle
    install_fake_gpu(monkeypatch, cuda=None)
    with pytest.raises(EngineLoadError, match="pip install cuda-python"):
        load_bundle_engine(manifest, d / manifest.engine, 2)


@pytest.mark.skipif(REAL_TENSORRT_MISSING is not None, reason=REAL_TENSORRT_MISSING or "")
def test_real_tensorrt_backend_matches_onnxruntime(tmp_path, reference, test_images):
    from edgefleet.compiler.compile import CompileOptions, compile_model

    result = compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="jetson-orin-nano", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=tmp_path / "out", name="digits", version="1.0.0", precision="fp16",
        benchmark=False))
    manifest = extract_bundle(result.bundle, tmp_path / "b")
    backend = load_bundle_engine(manifest, tmp_path / "b" / manifest.engine, 2)
    (logits,) = backend.infer({"input": test_images[0][:5]})
    np.testing.assert_allclose(logits, reference(test_images[0][:5]), rtol=2e-2, atol=2e-2)
    backend.close()
