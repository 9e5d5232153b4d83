"""Models whose weights lie in external data files compile, quantize, bundle and serve (issue 40, item 1).

Before: ``model.onnx`` + ``model.onnx.data`` exited 5 under auto and --precision fp32 ("External data path does not
exist: .../edgefleet-build-.../model.onnx.data") and ended in a traceback with --task (compiler/graph.py name_nodes:
"... should be stored in .../edgefleet-quant-.../model.onnx.data, but it is not regular file"). The compiler now reads
the weights once and embeds them (compiler.external): the bundle's engine is one self-contained file, the manifest's
build_notes say so, and an agent serves it as any other bundle.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.agent_harness import installed_agent
from tests.test_compiler import run_cli

pytestmark = pytest.mark.timeout(600)


def _model(folder: Path, one_file: bool = True) -> Path:
    """x [N, 16] -> MatMul 16x64 -> Relu -> MatMul 64x10 -> y [N, 10], every weight in external data."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(16, 64)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.normal(size=(64, 10)) * 0.2).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], [w1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=one_file,
              location="model.onnx.data" if one_file else None, size_threshold=0)
    np.savez(folder / "d.npz", x=rng.normal(size=(64, 16)).astype(np.float32))
    return path


def _compile(model: Path, out: Path, *flags: str) -> tuple[int, dict, str]:
    d = model.parent / "d.npz"
    r = run_cli("compile", str(model), "--profile", "x86-cpu", "--calibration", str(d), "--eval", str(d),
                "--name", "ext", "--out", str(out), "--no-benchmark", "--no-cache", "--json", *flags)
    assert "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    return r.returncode, doc, r.stderr + str(doc.get("error", ""))


@pytest.mark.parametrize("flags", [(), ("--precision", "fp32"), ("--precision", "int8", "--task", "classification"),
                                   ("--task", "classification")], ids=["auto", "fp32", "int8-task", "auto-task"])
def test_a_model_with_one_external_data_file_compiles_and_says_so(tmp_path, flags):
    model = _model(tmp_path / "src")
    assert (tmp_path / "src" / "model.onnx.data").is_file() and model.stat().st_size < 1024  # weights outside
    code, doc, err = _compile(model, tmp_path / "out", *flags)
    assert code == 0, err
    m = doc["manifest"]
    assert [(n["step"], n["action"]) for n in m["build_notes"]][:1] == [("source model", "external data embedded")]
    assert m["manifest_version"] >= 8
    with tarfile.open(tmp_path / "out" / "ext-1.0.0-x86-cpu.tar") as tar:
        names = tar.getnames()
    assert "model.onnx" in names and not any(n.endswith(".data") for n in names), names  # the weights are inside


def test_a_model_with_one_data_file_per_tensor_compiles_int8_and_an_agent_serves_it(tmp_path):
    model = _model(tmp_path / "src", one_file=False)
    data_files = sorted(p.name for p in (tmp_path / "src").iterdir() if p.name not in ("model.onnx", "d.npz"))
    assert data_files == ["w1", "w2"]  # onnx names each file after its tensor
    code, doc, err = _compile(model, tmp_path / "out", "--precision", "int8", "--task", "classification")
    assert code == 0, err
    assert "2 files" in doc["manifest"]["build_notes"][0]["reason"]
    x = np.load(tmp_path / "src" / "d.npz")["x"][:4]
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with installed_agent(tmp_path / "agent", tmp_path / "out" / "ext-1.0.0-x86-cpu.tar") as (_, url):
        r = httpx.post(f"{url}/v2/models/ext/infer", timeout=30, json={"inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]})
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(want.shape)
    assert (got.argmax(1) == want.argmax(1)).all()  # int8: the same classes as the fp32 source with its data files


def test_a_missing_data_file_is_named_with_what_to_do(tmp_path):
    model = _model(tmp_path / "src")
    (tmp_path / "src" / "model.onnx.data").rename(tmp_path / "elsewhere.data")
    code, _, err = _compile(model, tmp_path / "out", "--precision", "fp32")
    assert code == 4, err
    assert "model.onnx.data" in err and "beside the model file" in err, err


def test_weights_past_what_one_onnx_file_holds_are_refused_saying_what_to_do(tmp_path, monkeypatch):
    """The 2 GiB bound, lowered so a small model crosses it (a real 2 GiB file takes too long to write in a test)."""
    from edgefleet.compiler import external
    from edgefleet.compiler.errors import InputError

    model = _model(tmp_path / "src")
    monkeypatch.setattr(external, "MAX_EMBEDDED_BYTES", 1024)
    with pytest.raises(InputError, match="at most 2 GiB") as e:
        external.embedded(model, tmp_path)
    assert "float16" in str(e.value) and "quantize" in str(e.value)
