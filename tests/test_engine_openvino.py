"""The OpenVINO engine beyond the conformance suite: precision set explicitly (never OpenVINO's bf16 default),
bf16 only where asked and only where the CPU runs it, and a box without the optional extra.

The model: ``y = x @ W`` with W [64, 16] of random values, whose products lose about 3 decimal digits in bf16
(8 bits of mantissa), so an engine that runs bf16 is told apart from one that runs f32 by its answers alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet import engines
from edgefleet.engines import EngineLoadError, EngineSpec
from edgefleet.protocol.manifest import TensorSpec
from tests.installs import run_as_installed

needs_ov = pytest.mark.skipif(not engines.runtime_installed("openvino"),
                                reason="openvino is not installed here (the optional edgefleet[openvino])")

W = np.random.default_rng(3).normal(size=(64, 16)).astype(np.float32)
X = TensorSpec(name="x", datatype="FP32", shape=(-1, 64))
Y = TensorSpec(name="y", datatype="FP32", shape=(-1, 16))


def spec(precision: str) -> EngineSpec:
    return EngineSpec((X,), (Y,), precision, None, f"matmul ({precision})")


@pytest.fixture(scope="module")
def matmul(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ov") / "matmul.onnx"
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])],
                              initializer=[numpy_helper.from_array(W, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def feed() -> np.ndarray:
    return np.random.default_rng(5).normal(size=(8, 64)).astype(np.float32)


def exact(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ W.astype(np.float64)).astype(np.float32)


@needs_ov
def test_fp32_and_int8_bundles_run_in_f32_even_where_openvinos_default_is_bf16(matmul):
    from edgefleet.engines.openvino import bf16_capable

    for precision in ("fp32", "int8"):  # an int8 bundle's float ops (outside its QDQ pairs) stay f32 too
        engine = engines.load("openvino", matmul, spec(precision), threads=1)
        try:
            assert "(f32, 1 threads)" in engine.device, engine.device
            np.testing.assert_allclose(engine.infer({"x": feed()})[0], exact(feed()), atol=1e-4)
        finally:
            engine.close()
    # the point of setting it: on this CPU OpenVINO's own default would have run the fp32 model in bf16
    if bf16_capable():
        import openvino as ov

        default = ov.Core().compile_model(str(matmul), "CPU")
        y = default.create_infer_request().infer({"x": feed()})[default.output("y")]
        assert np.abs(y - exact(feed())).max() > 1e-3, "OpenVINO's default is f32 here: the test above proves less"


@needs_ov
def test_a_bf16_bundle_runs_bf16_where_the_cpu_has_it_and_is_refused_where_it_does_not(matmul):
    from edgefleet.engines.openvino import bf16_capable

    if not bf16_capable():
        with pytest.raises(EngineLoadError, match="cannot run bf16 on this CPU"):
            engines.load("openvino", matmul, spec("bf16"), threads=1)
        return
    engine = engines.load("openvino", matmul, spec("bf16"), threads=2)
    try:
        assert "(bf16, 2 threads)" in engine.device
        diff = np.abs(engine.infer({"x": feed()})[0] - exact(feed())).max()
        assert 1e-3 < diff < 0.5, diff  # bf16's rounding, not garbage
    finally:
        engine.close()


@needs_ov
def test_precisions_openvino_does_not_run_on_a_cpu_are_refused(matmul):
    with pytest.raises(EngineLoadError, match="the openvino runtime does not run fp16 engines; onnxruntime, litert, "
                                              "tensorrt do"):
        engines.load("openvino", matmul, spec("fp16"), threads=1)
    from edgefleet.engines.openvino import OpenVINOEngine

    with pytest.raises(EngineLoadError, match="OpenVINO serves fp32, int8 and bf16 CPU bundles, not fp16"):
        OpenVINOEngine(spec("fp16"))


def test_onnxruntime_refuses_a_bf16_bundle_and_names_the_runtime_and_extra_that_run_it(matmul):
    # onnxruntime would run the file in f32 and answer for a bf16 gate it never passed
    with pytest.raises(EngineLoadError, match=r"the onnxruntime runtime does not run bf16 engines; openvino does"
                                              r"( \(install edgefleet\[openvino\]\))?$"):
        engines.load("onnxruntime", matmul, spec("bf16"), threads=1)
    # where openvino is not installed, the error says how to get it
    code = ("import sys\nfrom pathlib import Path\nfrom edgefleet import engines\n"
            "from edgefleet.protocol.manifest import TensorSpec\n"
            "x = TensorSpec(name='x', datatype='FP32', shape=(-1, 64)); y = TensorSpec(name='y', datatype='FP32', "
            "shape=(-1, 16))\n"
            "try:\n"
            "    engines.load('onnxruntime', Path(sys.argv[1]), engines.EngineSpec((x,), (y,), 'bf16'), threads=1)\n"
            "except engines.EngineLoadError as exc:\n"
            "    print(exc)\n")
    r = run_as_installed(("agent",), code, str(matmul))
    assert r.stdout.strip() == ("engine: the onnxruntime runtime does not run bf16 engines; openvino does (install "
                                "edgefleet[openvino])"), r.stderr
    assert engines.runtimes_for("onnxruntime", "bf16") == ("openvino",)
    assert engines.runtimes_for("onnxruntime") == ("onnxruntime", "openvino")
    assert engines.runtimes_for("litert") == ("litert",)


@needs_ov
def test_a_file_openvino_cannot_read_is_a_load_error(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07 not a protobuf at all" * 10)
    with pytest.raises(EngineLoadError, match=r"OpenVINO could not read model\.onnx"):
        engines.load("openvino", bad, spec("fp32"), threads=1)


def test_a_box_without_the_extra_imports_nothing_of_it_and_gets_one_line_naming_the_extra(matmul):
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from edgefleet import engines\n"
            "from edgefleet.engines import EngineSpec, openvino as ovengine\n"
            "from edgefleet.protocol.manifest import TensorSpec\n"
            "x = TensorSpec(name='x', datatype='FP32', shape=(-1, 64)); y = TensorSpec(name='y', datatype='FP32', "
            "shape=(-1, 16))\n"
            "print('installed', engines.runtime_installed('openvino'), ovengine.bf16_capable())\n"
            "try:\n"
            "    engines.load('openvino', Path(sys.argv[1]), EngineSpec((x,), (y,), 'fp32'), threads=1)\n"
            "except engines.EngineLoadError as exc:\n"
            "    print('error', exc)\n"
            "print('imported', 'openvino' in sys.modules)\n")
    r = run_as_installed(("agent",), code, str(matmul))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["installed False False",
                                     "error OpenVINO is not installed; install edgefleet[openvino]",
                                     "imported False"]
