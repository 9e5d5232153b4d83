"""The TensorRT build target, against the fake ``tensorrt`` and CUDA of tests/fakes (TensorRT needs an NVIDIA GPU).

The fake engine records what the builder was asked and runs the embedded ONNX with onnxruntime, so the engine is
checked end to end against onnxruntime. The last test builds with the real TensorRT and skips without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgefleet.compiler.compile import CompileOptions, compile_model
from edgefleet.compiler.errors import InputError, ToolchainError
from edgefleet.compiler.graph import GraphInfo, check_model
from edgefleet.compiler.targets import get_target
from edgefleet.compiler.targets.tensorrt import TensorRTTarget, l4t_release
from edgefleet.engines import EngineInputError, EngineLoadError, EngineSpec
from edgefleet.engines import load as load_engine
from edgefleet.judge.data import Dataset, load_dataset
from edgefleet.protocol.bundle import extract_bundle
from edgefleet.protocol.manifest import QuantizationInfo
from edgefleet.protocol.profile import HardwareProfile, TensorRTSettings, load_profile
from tests.conftest import DIGITS, REPO
from tests.fakes import install_fake_gpu
from tests.fakes.fake_tensorrt import read_engine

MODEL = DIGITS / "model.onnx"


def _real_tensorrt_missing() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # ImportError, or the PyPI download stub failing in its own way
        return f"TensorRT is not installed on this machine (no GPU): import tensorrt failed ({exc})"
    return None


REAL_TENSORRT_MISSING = _real_tensorrt_missing()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def info() -> GraphInfo:
    return check_model(MODEL)


@pytest.fixture(scope="module")
def calibration(info: GraphInfo) -> Dataset:
    return load_dataset(DIGITS / "calibration.npz", info.inputs, need_labels=False, what="calibration set")


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    with np.load(DIGITS / "test.npz") as npz:
        return npz["input"]


@pytest.fixture(scope="module")
def reference() -> Callable[[np.ndarray], np.ndarray]:
    sess = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"input": x})[0]


def jetson(max_batch_size: int | None = None, **changes: object) -> HardwareProfile:
    profile = load_profile("jetson-orin-nano")
    if max_batch_size is not None:
        changes["runtime"] = profile.runtime.model_copy(update={"max_batch_size": max_batch_size})
    return profile.model_copy(update=changes)


def build(tmp_path: Path, info: GraphInfo, precision: str = "fp16", profile: HardwareProfile | None = None,
          calibration: Dataset | None = None, name: str = "model",
          model: Path = MODEL) -> tuple[Path, dict, QuantizationInfo | None]:
    out = tmp_path / f"{name}.engine"
    quantization = TensorRTTarget().build(model, info, precision, profile or jetson(), calibration, out)
    header, _ = read_engine(out)
    return out, header, quantization


def load_trt(engine: Path, info: GraphInfo, outputs: tuple[str, ...] | None = None):
    """The built engine as the gate and the agent run it (engines.load); ``outputs`` reorders the outputs."""
    by_name = {o.name: o for o in info.outputs}
    specs = info.outputs if outputs is None else tuple(
        by_name.get(n, info.outputs[0].model_copy(update={"name": n})) for n in outputs)
    return load_engine("tensorrt", engine, EngineSpec(info.inputs, specs, "fp16", "jetson-orin-nano"), 2)


def test_module_imports_without_tensorrt():
    code = "import sys, edgefleet.compiler.targets.tensorrt; assert 'tensorrt' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_without_tensorrt_every_call_says_so_in_one_line(monkeypatch, tmp_path, info):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    target = get_target("tensorrt")
    engine = tmp_path / "model.engine"
    calls = [lambda: target.build(MODEL, info, "fp16", jetson(), None, engine), target.toolchain_versions,
             target.engine_compatibility]
    for call in calls:
        with pytest.raises(ToolchainError) as err:
            call()
        assert str(err.value).startswith("TensorRT is not installed on this machine")
        assert "Jetson" in str(err.value) and "\n" not in str(err.value)
        assert err.value.exit_code == 5
    assert not engine.exists()


@pytest.mark.parametrize("api", ["8", "10"])
def test_fp16_build_sets_the_flag_and_the_batch_profile(monkeypatch, tmp_path, info, api):
    gpu = install_fake_gpu(monkeypatch, api=api)
    _, header, quantization = build(tmp_path, info)
    assert quantization is None
    assert header["flags"] == ["FP16"]
    assert header["profiles"] == [{"input": [[1, 1, 8, 8], [16, 1, 8, 8], [16, 1, 8, 8]]}]
    assert header["workspace_bytes"] == 1024 << 20
    assert header["network_flags"] == (1 if api == "8" else 0)  # EXPLICIT_BATCH on 8; ignored (so not set) on 10
    assert header["dla_core"] is None and header["calibration"] is None
    assert gpu.memory.live == 0


@pytest.mark.parametrize("api", ["8", "10"])
def test_int8_build_feeds_every_calibration_sample_in_batches(monkeypatch, tmp_path, info, calibration, api):
    gpu = install_fake_gpu(monkeypatch, api=api)
    data = calibration.head(40)  # batches of 12: three full ones, the fourth completed from the start
    _, header, quantization = build(tmp_path, info, "int8", jetson(max_batch_size=12), data)
    assert header["flags"] == ["FP16", "INT8"]
    assert header["profiles"] == [{"input": [[1, 1, 8, 8], [12, 1, 8, 8], [12, 1, 8, 8]]}]
    fed = header["calibration"]
    assert fed["algorithm"] == "MINMAX_CALIBRATION"  # the profile's calibration_method
    assert (fed["batch_size"], fed["batches"], fed["shapes"]) == (12, 4, {"input": [12, 1, 8, 8]})
    per_sample = data.inputs["input"].reshape(40, -1).sum(axis=1, dtype=np.float64)
    np.testing.assert_allclose(fed["sample_sums"]["input"], per_sample[np.arange(48) % 40], rtol=1e-6)
    assert quantization is not None
    assert (quantization.scheme, quantization.activation_type, quantization.weight_type) == ("s8s8", "int8", "int8")
    assert (quantization.calibration_samples, quantization.calibration_method) == (40, "minmax")
    assert gpu.memory.allocations_made > 0 and gpu.memory.live == 0


def test_int8_calibrator_follows_the_profile(monkeypatch, tmp_path, info, calibration):
    install_fake_gpu(monkeypatch)
    profile = jetson()
    entropy = profile.model_copy(update={"quantization": profile.quantization.model_copy(
        update={"calibration_method": "entropy", "max_calibration_samples": 32})})
    _, header, quantization = build(tmp_path, info, "int8", entropy, calibration)
    assert header["calibration"]["algorithm"] == "ENTROPY_CALIBRATION_2"
    assert header["calibration"]["batches"] == 2
    assert quantization is not None and quantization.calibration_samples == 32
    percentile = profile.model_copy(update={"quantization": profile.quantization.model_copy(
        update={"calibration_method": "percentile"})})
    with pytest.raises(InputError, match="no percentile calibrator"):
        build(tmp_path, info, "int8", percentile, calibration)


def test_int8_without_calibration_data_is_an_input_error(monkeypatch, tmp_path, info):
    install_fake_gpu(monkeypatch)
    with pytest.raises(InputError, match="calibration set"):
        build(tmp_path, info, "int8")


def test_dla_core_comes_from_the_profile(monkeypatch, tmp_path, info):
    install_fake_gpu(monkeypatch, dla_cores=2)
    _, header, _ = build(tmp_path, info, profile=jetson(tensorrt=TensorRTSettings(workspace_mb=256, dla_core=1)))
    assert header["dla_core"] == 1
    assert header["flags"] == ["FP16", "GPU_FALLBACK"]
    assert header["workspace_bytes"] == 256 << 20


def test_dla_core_the_device_lacks_is_a_toolchain_error(monkeypatch, tmp_path, info):
    install_fake_gpu(monkeypatch, dla_cores=0)
    with pytest.raises(ToolchainError, match="DLA core 1 and this device has 0"):
        build(tmp_path, info, profile=jetson(tensorrt=TensorRTSettings(dla_core=1)))


def test_timing_cache_is_saved_and_reused_by_the_next_build(monkeypatch, tmp_path, info, cache_dir):
    install_fake_gpu(monkeypatch)
    _, first, _ = build(tmp_path, info, name="first")
    saved = cache_dir / "tensorrt" / "timing-10.3.0-sm87.cache"
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]
    assert first["timing_cache_entries_given"] == 0
    assert len(json.loads(saved.read_bytes())["entries"]) == 1
    _, second, _ = build(tmp_path, info, name="second")
    assert second["timing_cache_entries_given"] == 1

    saved.write_bytes(b"not a timing cache")  # a damaged cache costs time, never the build
    _, third, _ = build(tmp_path, info, name="third")
    assert third["timing_cache_entries_given"] == 0
    assert len(json.loads(saved.read_bytes())["entries"]) == 1


def test_engine_compatibility_names_tensorrt_gpu_and_l4t(monkeypatch, tmp_path):
    install_fake_gpu(monkeypatch, compute_capability=(8, 7))
    release = tmp_path / "nv_tegra_release"
    release.write_text("# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, "
                       "DATE: Mon May  6 17:34:21 UTC 2024\n")
    assert TensorRTTarget(tegra_release=release).engine_compatibility() == {
        "tensorrt": "10.3.0", "gpu_compute_capability": "8.7", "l4t": "36.3.0"}
    assert TensorRTTarget(tegra_release=tmp_path / "absent").engine_compatibility()["l4t"] == "none"


@pytest.mark.parametrize(("api", "cuda"), [("10", "bindings"), ("10", "cudart"), ("8", "cudart"), ("10", "pycuda")])
def test_engine_matches_onnxruntime(monkeypatch, tmp_path, info, digits, reference, api, cuda):
    gpu = install_fake_gpu(monkeypatch, api=api, cuda=cuda)
    engine, _, _ = build(tmp_path, info)
    run = load_trt(engine, info)
    for n in (1, 5, 40):  # 40 is above the engine's batch 16: the engine splits it
        (logits,) = run.infer({"input": digits[:n]})
        assert logits.shape == (n, 10) and logits.dtype == np.float32
        np.testing.assert_allclose(logits, reference(digits[:n]), rtol=1e-5, atol=1e-5)
    run.close()
    assert gpu.memory.live == 0


def test_engine_orders_outputs_by_name(monkeypatch, tmp_path):
    install_fake_gpu(monkeypatch)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    nodes = [helper.make_node("Neg", ["x"], ["neg"], name="negate"), helper.make_node("Relu", ["x"], ["relu"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 3]) for n in ("neg", "relu")]
    graph = helper.make_graph(nodes, "two_outputs", [x], outputs)
    model = tmp_path / "two.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    two = check_model(model)
    engine, _, _ = build(tmp_path, two, model=model)
    feed = {"x": np.array([[-1.0, 0.0, 2.0]], np.float32)}
    neg, relu = load_trt(engine, two).infer(feed)
    np.testing.assert_array_equal(neg, -feed["x"])
    named = load_trt(engine, two, ("relu", "neg")).infer(feed)
    np.testing.assert_array_equal(named[0], relu)
    np.testing.assert_array_equal(named[1], neg)
    with pytest.raises(EngineLoadError, match="no output 'logits'"):
        load_trt(engine, two, ("logits",))


def test_engine_refuses_an_input_the_engine_was_not_built_for(monkeypatch, tmp_path, info):
    install_fake_gpu(monkeypatch)
    engine, _, _ = build(tmp_path, info)
    with pytest.raises(EngineInputError, match=r"has shape \[2, 1, 9, 9\], the engine takes \[-1, 1, 8, 8\]"):
        load_trt(engine, info).infer({"input": np.zeros((2, 1, 9, 9), np.float32)})


@pytest.mark.parametrize("api", ["8", "10"])
def test_parser_failure_names_the_node(monkeypatch, tmp_path, info, api):
    install_fake_gpu(monkeypatch, api=api)
    model = onnx.load(str(MODEL))
    node = next(n for n in model.graph.node if n.name == "conv2_relu")
    node.op_type, node.domain = "FancyRelu", "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    bad = tmp_path / "custom-op.onnx"
    onnx.save(model, bad)
    with pytest.raises(ToolchainError) as err:
        build(tmp_path, info, model=bad)
    assert str(err.value) == ("TensorRT's ONNX parser rejected custom-op.onnx: node 'conv2_relu' (FancyRelu): "
                              "No importer registered for op: FancyRelu")
    assert not (tmp_path / "model.engine").exists()


def test_no_cuda_bindings_is_a_toolchain_error(monkeypatch, tmp_path, info):
    install_fake_gpu(monkeypatch, cuda=None)
    with pytest.raises(ToolchainError, match="pip install cuda-python"):
        build(tmp_path, info)


def test_engine_from_another_tensorrt_is_refused(monkeypatch, tmp_path, info):
    install_fake_gpu(monkeypatch, api="8")
    engine, _, _ = build(tmp_path, info)
    install_fake_gpu(monkeypatch, api="10")
    with pytest.raises(EngineLoadError,
                       match=r"cannot load model\.engine .*expecting library version 10\.3\.0 got 8\.2"):
        load_trt(engine, info)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_pipeline_compiles_digits_for_jetson(monkeypatch, tmp_path, precision):
    install_fake_gpu(monkeypatch)
    result = compile_model(CompileOptions(
        model=MODEL, profile="jetson-orin-nano", calibration=DIGITS / "calibration.npz", eval=DIGITS / "test.npz",
        out_dir=tmp_path / "out", name="digits", version="1.0.0", precision=precision, benchmark=False))
    m = result.manifest
    assert (m.backend, m.precision, m.engine) == ("tensorrt", precision, "model.engine")
    assert m.engine_compatibility == {"tensorrt": "10.3.0", "gpu_compute_capability": "8.7", "l4t": l4t_release()}
    assert m.toolchain["tensorrt"] == "10.3.0"
    assert m.accuracy.passed and m.accuracy.eval_samples == 359
    assert (m.quantization.scheme if m.quantization else None) == ("s8s8" if precision == "int8" else None)
    extracted = extract_bundle(result.bundle, tmp_path / "bundle")
    header, _ = read_engine(tmp_path / "bundle" / extracted.engine)
    assert precision.upper() in header["flags"]


@pytest.mark.skipif(REAL_TENSORRT_MISSING is not None, reason=REAL_TENSORRT_MISSING or "")
def test_real_tensorrt_build_matches_onnxruntime(tmp_path, info, digits, reference):
    target = TensorRTTarget()
    engine = tmp_path / "digits.engine"
    target.build(MODEL, info, "fp16", jetson(), None, engine)
    run = load_trt(engine, info)
    for n in (1, 5, 40):
        (logits,) = run.infer({"input": digits[:n]})
        np.testing.assert_allclose(logits, reference(digits[:n]), rtol=2e-2, atol=2e-2)
    assert set(target.engine_compatibility()) == {"tensorrt", "gpu_compute_capability", "l4t"}


def _dynamic_hw_model(path: Path) -> Path:
    """A one-conv 'detector': [N, 3, H, W] -> [N, 1, H, W], every dimension but C dynamic."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).normal(size=(1, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, "H", "W"])],
        [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_pipeline_fp16_fixes_dynamic_height_and_width_at_the_data_size(monkeypatch, tmp_path):
    # no calibration set for a float build: the evaluation data gives the sizes TensorRT builds for
    install_fake_gpu(monkeypatch)
    model = _dynamic_hw_model(tmp_path / "det.onnx")
    np.savez(tmp_path / "eval.npz", x=np.random.default_rng(1).random((8, 3, 24, 32), dtype=np.float32))
    result = compile_model(CompileOptions(
        model=model, profile="jetson-orin-nano", calibration=None, eval=tmp_path / "eval.npz",
        out_dir=tmp_path / "out", name="det", version="1.0.0", precision="fp16", benchmark=False))
    m = result.manifest
    assert (m.backend, m.precision, m.accuracy.metric) == ("tensorrt", "fp16", "agreement") and m.accuracy.passed
    header, _ = read_engine(_engine_of(result.bundle, tmp_path))
    assert header["profiles"] == [{"x": [[1, 3, 24, 32], [16, 3, 24, 32], [16, 3, 24, 32]]}]  # min, opt, max


def _engine_of(bundle: Path, tmp_path: Path) -> Path:
    m = extract_bundle(bundle, tmp_path / "unpacked")
    return tmp_path / "unpacked" / m.engine
