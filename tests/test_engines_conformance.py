"""One conformance suite for every registered engine: the same tiny model, the same expectations.

The model: ``x [N, 3] -> (doubled = 2x, plus1 = x + 1)``, made here for each runtime (an ONNX graph for
onnxruntime, a TFLite flatbuffer written with the TFLite schema for LiteRT, and the same ONNX built by the
compiler's TensorRT target against the fake ``tensorrt`` of tests/fakes for TensorRT, whose GPU this
machine lacks; OpenVINO loads the very ONNX file onnxruntime loads, and is skipped, saying so, where the
optional ``edgefleet[openvino]`` is not installed). Every engine must give the reference outputs at several
batch sizes with the spec's dtypes and shapes, refuse every malformed feed with EngineInputError and keep
working after it, and be safe to close twice. A new runtime is proven by adding its maker to ``MAKERS``: a
registered runtime without one fails ``test_every_registered_engine_is_in_this_suite``.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgefleet import engines
from edgefleet.engines import EngineClosed, EngineInputError, EngineSpec
from edgefleet.protocol.manifest import Backend, TensorSpec
from tests.fakes import install_fake_gpu
from tests.test_engines import IO_MAP, make_tflite

X = TensorSpec(name="x", datatype="FP32", shape=(-1, 3))
SPEC = EngineSpec((X,), (X.model_copy(update={"name": "doubled"}), X.model_copy(update={"name": "plus1"})),
                  "fp32", None, "conformance model")
TOLERANCE = {"onnxruntime": 1e-6, "litert": 1e-6, "tensorrt": 1e-5, "openvino": 1e-6}


def make_onnx(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 3]) for n in ("doubled", "plus1")]
    consts = [helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0]), helper.make_tensor("one", TensorProto.FLOAT,
                                                                                           [1], [1.0])]
    nodes = [helper.make_node("Mul", ["x", "two"], ["doubled"], name="double"),
             helper.make_node("Add", ["x", "one"], ["plus1"], name="add_one")]
    graph = helper.make_graph(nodes, "conformance", [x], outs, initializer=consts)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def _onnxruntime(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, EngineSpec]:
    return make_onnx(tmp / "model.onnx"), SPEC


def _litert(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, EngineSpec]:
    return make_tflite(tmp / "model.tflite", metadata=IO_MAP), SPEC


def _tensorrt(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, EngineSpec]:
    from edgefleet.compiler.graph import check_model
    from edgefleet.compiler.targets.tensorrt import TensorRTTarget
    from edgefleet.protocol.profile import load_profile

    install_fake_gpu(monkeypatch)  # TensorRT 10.3.0 on sm87, cuda-python's runtime API
    model = make_onnx(tmp / "model.onnx")
    engine = tmp / "model.engine"
    TensorRTTarget().build(model, check_model(model), "fp16", load_profile("jetson-orin-nano"), None, engine)
    return engine, EngineSpec(SPEC.inputs, SPEC.outputs, "fp16", "jetson-orin-nano", SPEC.label)


def _openvino(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, EngineSpec]:
    if not engines.runtime_installed("openvino"):
        pytest.skip("openvino is not installed here (the optional edgefleet[openvino]; the dev extra has it)")
    return make_onnx(tmp / "model.onnx"), SPEC  # the same file as onnxruntime's


MAKERS: dict[str, Callable[[Path, pytest.MonkeyPatch], tuple[Path, EngineSpec]]] = {
    "onnxruntime": _onnxruntime, "litert": _litert, "tensorrt": _tensorrt, "openvino": _openvino}


def test_every_registered_engine_is_in_this_suite():
    assert set(engines.KINDS) == set(typing.get_args(Backend)), "the registry and the manifest's kinds differ"
    assert set(MAKERS) == set(engines.RUNTIMES), \
        f"runtimes without a conformance maker: {set(engines.RUNTIMES) - set(MAKERS)}"


@pytest.fixture(params=sorted(MAKERS))
def engine(request, tmp_path, monkeypatch) -> Iterator[engines.Engine]:
    path, spec = MAKERS[request.param](tmp_path, monkeypatch)
    loaded = engines.load(request.param, path, spec, threads=1)
    yield loaded
    loaded.close()


def test_outputs_match_the_reference_at_every_batch_size(engine):
    assert engine.kind in engines.RUNTIMES and engine.device != "?"
    rng = np.random.default_rng(7)
    for n in (1, 3, 16, 7, 40, 1):  # sizes change back and forth; 40 is above TensorRT's profile (16)
        x = rng.uniform(-4, 4, (n, 3)).astype(np.float32)
        outs = engine.infer({"x": x})
        assert [o.shape for o in outs] == [(n, 3), (n, 3)]
        assert all(o.dtype == np.float32 for o in outs)
        np.testing.assert_allclose(outs[0], 2 * x, atol=TOLERANCE[engine.kind])
        np.testing.assert_allclose(outs[1], x + 1, atol=TOLERANCE[engine.kind])


BAD_FEEDS: list[tuple[str, Callable[[], object], str]] = [
    ("missing input", lambda: {}, "missing \\['x'\\]"),
    ("unknown input", lambda: {"x": np.ones((1, 3), np.float32), "y": np.ones((1, 3), np.float32)},
     "unknown \\['y'\\]"),
    ("float64", lambda: {"x": np.ones((2, 3))}, "is float64, the engine takes float32"),
    ("int32", lambda: {"x": np.ones((2, 3), np.int32)}, "is int32"),
    ("rank 1", lambda: {"x": np.ones(3, np.float32)}, "has shape \\[3\\]"),
    ("rank 3", lambda: {"x": np.ones((1, 1, 3), np.float32)}, "has shape \\[1, 1, 3\\]"),
    ("fixed dimension", lambda: {"x": np.ones((2, 4), np.float32)}, "takes \\[-1, 3\\]"),
    ("empty batch", lambda: {"x": np.ones((0, 3), np.float32)}, "empty batch"),
    ("a list", lambda: {"x": [[1.0, 2.0, 3.0]]}, "not a numpy array"),
    ("not a dict", lambda: [np.ones((1, 3), np.float32)], "must be a dict"),
]


@pytest.mark.parametrize(("what", "feed", "message"), BAD_FEEDS, ids=[b[0] for b in BAD_FEEDS])
def test_bad_input_is_refused_and_the_engine_keeps_working(engine, what, feed, message):
    with pytest.raises(EngineInputError, match=message):
        engine.infer(feed())  # type: ignore[arg-type]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(engine.infer({"x": x})[0], 2 * x, atol=TOLERANCE[engine.kind])


def test_close_twice_is_safe_and_infer_after_close_says_closed(engine):
    engine.infer({"x": np.zeros((1, 3), np.float32)})
    engine.close()
    engine.close()
    assert engine.closed
    with pytest.raises(EngineClosed, match="closed"):
        engine.infer({"x": np.zeros((1, 3), np.float32)})


def test_an_engine_whose_tensors_are_not_the_spec_is_refused_at_load(tmp_path, monkeypatch):
    for kind, make in MAKERS.items():
        if kind == "openvino" and not engines.runtime_installed(kind):  # the optional extra
            continue
        (tmp_path / kind).mkdir()
        path, spec = make(tmp_path / kind, monkeypatch)
        wrong = EngineSpec(spec.inputs, (spec.outputs[0].model_copy(update={"name": "tripled"}),), spec.precision,
                           spec.profile, spec.label)
        with pytest.raises(engines.EngineLoadError, match="tripled"):
            engines.load(kind, path, wrong, threads=1)


def test_an_unknown_kind_names_the_ones_there_are(tmp_path):
    with pytest.raises(engines.EngineLoadError, match="no 'tflite' engine here \\(available: litert, onnxruntime, "
                                                      "openvino, tensorrt\\)"):
        engines.load("tflite", tmp_path / "m.tflite", SPEC, threads=1)
