"""The LiteRT (TFLite) build target and its isolated onnx2tf toolchain, on the digits model.

The session fixture installs the real "tflite" toolchain when it is missing (CI starts from a fresh machine;
PyPI is reachable): about a minute and 2.6 GB in ``$EDGEFLEET_TOOLCHAIN_DIR`` or ~/.cache/edgefleet/toolchains.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgefleet.cli import main as cli_main
from edgefleet.compiler import toolchain
from edgefleet.compiler.errors import ToolchainError
from edgefleet.compiler.graph import GraphInfo, check_model
from edgefleet.compiler.targets.litert import LiteRTTarget
from edgefleet.engines import EngineSpec
from edgefleet.engines import load as load_engine
from edgefleet.engines.litert import IOMap, interpreter_class, read_io_map
from edgefleet.judge.data import Dataset, load_dataset
from edgefleet.protocol.manifest import QuantizationInfo
from edgefleet.protocol.profile import HardwareProfile, load_profile
from tests.conftest import DIGITS

# the first test that needs the toolchain installs it: allow for that download beyond the default 600 s
pytestmark = pytest.mark.timeout(1800)

MODEL = DIGITS / "model.onnx"


@pytest.fixture(scope="session")
def tflite_toolchain() -> toolchain.ToolchainStatus:
    def say(msg: str) -> None:
        print(f"[toolchain] {msg}", file=sys.stderr, flush=True)

    st = toolchain.ensure("tflite", say)
    assert st.installed
    return st


@pytest.fixture(scope="module")
def digits() -> tuple[GraphInfo, HardwareProfile, Dataset, Dataset]:
    info = check_model(MODEL)
    calib = load_dataset(DIGITS / "calibration.npz", info.inputs, need_labels=False, what="calibration set")
    evals = load_dataset(DIGITS / "test.npz", info.inputs, need_labels=True, what="evaluation set")
    return info, load_profile("arm64-cpu"), calib, evals


@pytest.fixture(scope="module")
def reference(digits) -> np.ndarray:
    """fp32 logits of the ONNX model from onnxruntime: the yardstick."""
    _, _, _, evals = digits
    return ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"input": evals.inputs["input"]})[0]


@pytest.fixture(scope="module")
def engines(tflite_toolchain, digits, tmp_path_factory) -> dict[str, tuple[Path, Path, QuantizationInfo | None]]:
    """precision -> (engine, onnx2tf's kept work folder, QuantizationInfo | None), built through LiteRTTarget."""
    info, profile, calib, _ = digits
    root = tmp_path_factory.mktemp("litert")
    out: dict[str, tuple[Path, Path, QuantizationInfo | None]] = {}
    for precision in ("int8", "fp32"):
        work = root / f"work-{precision}"
        engine = root / f"digits-{precision}.tflite"
        quant = LiteRTTarget(keep_dir=work).build(MODEL, info, precision, profile,
                                                  calib if precision == "int8" else None, engine)
        out[precision] = (engine, work, quant)
    return out


def runner(engine: Path, profile: HardwareProfile):
    """The engine as the gate and the agent run it (engines.load)."""
    info = check_model(MODEL)
    spec = EngineSpec(info.inputs, info.outputs, "fp32", profile.name, engine.name)
    return load_engine("litert", engine, spec, profile.runtime.intra_op_threads).infer


def io_map(engine: Path) -> IOMap:
    interp = interpreter_class()[0](model_path=str(engine))
    return read_io_map(engine.read_bytes(), interp.get_signature_list())


def predict(engine: Path, profile: HardwareProfile, x: np.ndarray, batch: int) -> np.ndarray:
    run = runner(engine, profile)
    outs = [run({"input": x[i:i + batch]}) for i in range(0, len(x), batch)]
    assert all(len(o) == 1 for o in outs)
    return np.concatenate([o[0] for o in outs])


def top1(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(axis=1) == labels).mean())


def test_int8_top1_within_half_a_point_of_onnxruntime_fp32(engines, digits, reference):
    _, profile, _, evals = digits
    ref_top1 = top1(reference, evals.labels)
    int8_top1 = top1(predict(engines["int8"][0], profile, evals.inputs["input"], 16), evals.labels)
    assert ref_top1 >= 0.97
    assert int8_top1 >= ref_top1 - 0.005, (int8_top1, ref_top1)


def test_fp32_engine_computes_what_onnxruntime_computes(engines, digits, reference):
    _, profile, _, evals = digits
    got = predict(engines["fp32"][0], profile, evals.inputs["input"], 16)
    assert got.shape == reference.shape and got.dtype == np.float32
    assert float(np.abs(got - reference).max()) <= 1e-3
    assert top1(got, evals.labels) == top1(reference, evals.labels)


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_batch_sizes_1_and_7(engines, digits, precision):
    _, profile, _, evals = digits
    x = evals.inputs["input"][:21]
    whole = runner(engines[precision][0], profile)({"input": x})[0]
    for batch in (1, 7):
        got = predict(engines[precision][0], profile, x, batch)
        assert got.shape == (21, 10)
        np.testing.assert_allclose(got, whole, atol=1e-5)
    # the same runner switches batch sizes back and forth
    run = runner(engines[precision][0], profile)
    assert [run({"input": x[:n]})[0].shape for n in (7, 1, 7)] == [(7, 10), (1, 10), (7, 10)]


def test_onnx2tf_is_given_our_calibration_data(engines, digits):
    _, _, calib, _ = digits
    _, work, quant = engines["int8"]
    cmd = json.loads((work / "onnx2tf-command.json").read_text())
    i = cmd.index("--custom_input_op_name_np_data_path")  # onnx2tf's -cind: no MS-COCO download
    name, npy, mean, std = cmd[i + 1:i + 5]
    assert name == "input" and float(mean) == 0.0 and float(std) == 1.0  # our samples pass through unchanged
    data = np.load(npy)
    assert data.shape == (len(calib), 1, 8, 8) == (128, 1, 8, 8) and data.dtype == np.float32
    np.testing.assert_array_equal(data, calib.inputs["input"])  # NCHW: onnx2tf keeps the input layout
    assert cmd[cmd.index("--keep_ncw_or_nchw_or_ncdhw_input_names") + 1] == "input"
    assert quant is not None and quant.calibration_samples == 128
    assert "calibration_image_sample_data" not in (work / "onnx2tf.log").read_text()
    assert not list(work.rglob("calibration_image_sample_data*"))


def test_int8_engine_is_full_integer_with_float_io_in_nchw(engines):
    from ai_edge_litert.interpreter import Interpreter

    engine, _, quant = engines["int8"]
    assert quant is not None
    assert (quant.scheme, quant.activation_type, quant.weight_type) == ("s8s8", "int8", "int8")
    interp = Interpreter(model_path=str(engine))
    (inp,), (out,) = interp.get_input_details(), interp.get_output_details()
    assert list(inp["shape_signature"]) == [-1, 1, 8, 8] and inp["dtype"] == np.float32  # the manifest's spec
    assert out["dtype"] == np.float32
    int8_tensors = [t for t in interp.get_tensor_details() if t["dtype"] == np.int8]
    assert len(int8_tensors) >= 6  # conv/gemm weights and activations are int8 inside
    io = io_map(engine)  # onnx2tf named the quantized output output_0; the engine maps it back
    assert [(p.name, p.key) for p in io.outputs] == [("logits", "output_0")]
    assert [(p.name, p.key) for p in io_map(engines["fp32"][0]).outputs] == [("logits", "logits")]


def test_missing_toolchain_is_a_one_line_error(tmp_path, monkeypatch, digits, capsys):
    info, profile, calib, _ = digits
    monkeypatch.setenv("EDGEFLEET_TOOLCHAIN_DIR", str(tmp_path / "no-toolchains"))
    with pytest.raises(ToolchainError) as err:
        LiteRTTarget().build(MODEL, info, "int8", profile, calib, tmp_path / "m.tflite")
    msg = str(err.value)
    assert "\n" not in msg and "run `edgefleet toolchain install tflite`" in msg
    assert err.value.exit_code == 5
    assert cli_main(["toolchain", "status", "tflite"]) == 5
    assert "not installed" in capsys.readouterr().out
    code = cli_main(["compile", str(MODEL), "--profile", "arm64-cpu", "--calibration", str(DIGITS / "calibration.npz"),
                     "--eval", str(DIGITS / "test.npz"), "--out", str(tmp_path / "out"), "--precision", "int8",
                     "--quiet", "--no-cache"])
    assert code == 5
    assert "edgefleet toolchain install tflite" in capsys.readouterr().err


def test_onnx2tf_failure_names_its_error(tflite_toolchain, digits, tmp_path):
    info, profile, _, _ = digits
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["input"], ["flat"]),
         helper.make_node("Frobnicate", ["flat"], ["logits"], domain="com.example")], "bad",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), tmp_path / "bad.onnx")
    with pytest.raises(ToolchainError, match=r"^onnx2tf failed \(exit 1\): ERROR: Frobnicate OP is not yet"):
        LiteRTTarget().build(tmp_path / "bad.onnx", info, "fp32", profile, None, tmp_path / "bad.tflite")


def test_toolchain_lives_outside_the_main_environment(tflite_toolchain):
    st = toolchain.status("tflite")
    assert st.installed and st.path == tflite_toolchain.path
    assert st.versions["onnx2tf"] and st.versions["tensorflow"] and st.size_bytes and st.size_bytes > 1e9
    assert st.install_seconds is not None and st.install_seconds > 0 and st.installed_at
    assert all("==" in r for r in st.requirements)  # every pin exact
    assert importlib.util.find_spec("onnx2tf") is None and importlib.util.find_spec("tensorflow") is None
    assert not str(toolchain.python("tflite")).startswith(sys.prefix)
    versions = LiteRTTarget().toolchain_versions()
    assert versions["onnx2tf"] == st.versions["onnx2tf"] and versions["tensorflow"] == st.versions["tensorflow"]
    assert "ai-edge-litert" in versions


def test_changed_pins_make_a_new_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEFLEET_TOOLCHAIN_DIR", str(tmp_path))
    before = toolchain.status("tflite").path
    bumped = replace(toolchain.TOOLCHAINS["tflite"], requirements=("onnx2tf==0.0.1",))
    monkeypatch.setitem(toolchain.TOOLCHAINS, "tflite", bumped)
    st = toolchain.status("tflite")
    assert st.path != before and st.path.parent == tmp_path and not st.installed


def test_compile_pipeline_builds_a_litert_int8_bundle(tflite_toolchain, tmp_path):
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.protocol.bundle import extract_bundle

    result = compile_model(CompileOptions(
        model=MODEL, profile="arm64-cpu", calibration=DIGITS / "calibration.npz", eval=DIGITS / "test.npz",
        out_dir=tmp_path, name="digits", version="1.0.0", precision="int8", benchmark=False))
    m = result.manifest
    assert m.backend == "litert" and m.precision == "int8" and m.engine == "model.tflite"
    acc = m.accuracy
    assert acc.passed and acc.metric == "top1" and acc.eval_samples == 359
    assert acc.reference >= 0.97 and acc.candidate >= acc.reference - 0.005, (acc.candidate, acc.reference)
    assert m.quantization is not None and m.quantization.scheme == "s8s8"
    assert m.toolchain["onnx2tf"] == tflite_toolchain.versions["onnx2tf"]
    assert [s.name for s in m.inputs] == ["input"] and list(m.inputs[0].shape) == [-1, 1, 8, 8]
    extracted = extract_bundle(result.bundle, tmp_path / "x")
    assert (tmp_path / "x" / extracted.engine).read_bytes()[4:8] == b"TFL3"


def test_a_build_host_that_cannot_time_arm_cpus_ships_every_passing_precision(tflite_toolchain, tmp_path):
    """This x86 host cannot say which precision is faster on an ARM core: --precision auto for arm64-cpu ships
    int8 and fp32 (manifest version 4), each with its own engine, self-test and gate report, leaves the choice to
    the device and records no x86 timings as if they were the device's; each engine computes as gated."""
    r = subprocess.run([sys.executable, "-m", "edgefleet.cli", "compile", str(MODEL), "--profile", "arm64-cpu",
                        "--calibration", str(DIGITS / "calibration.npz"), "--eval", str(DIGITS / "test.npz"),
                        "--name", "digits", "--version", "1.0.0", "--out", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["manifest"]
    assert m["manifest_version"] == 6 and m["drift"] and m["precision"] == "int8"  # v6: drift; int8 first
    choice = m["precision_choice"]
    assert choice["mode"] == "device" and "x86_64 while arm64-cpu devices are aarch64" in choice["reason"], choice
    assert [v["precision"] for v in m["variants"]] == ["fp32"] and m["variants"][0]["accuracy"]["passed"]
    assert m["benchmark"] is None
    bundle = tmp_path / "digits-1.0.0-arm64-cpu.tar"
    for precision in ("int8", "fp32"):  # LiteRT runs on x86 too: past the CPU check, the numbers are the same
        v = subprocess.run([sys.executable, "-m", "edgefleet.cli", "verify", str(bundle), "--precision", precision,
                            "--skip-cpu-check", "--eval", str(DIGITS / "test.npz"), "--json"],
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        doc = json.loads(v.stdout)
        assert doc["computes_as_gated"] and doc["selftest"]["drift"] <= 1.0, doc
        want = m["accuracy"] if precision == "int8" else m["variants"][0]["accuracy"]
        assert abs(doc["top1"] - want["candidate"]) <= 1 / doc["eval_samples"] + 1e-9, (precision, doc)
    bad = subprocess.run([sys.executable, "-m", "edgefleet.cli", "verify", str(bundle), "--precision", "fp16",
                          "--skip-cpu-check"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 4 and "has no fp16 engine (it has int8, fp32)" in bad.stderr, bad.stderr


def test_a_build_host_that_can_time_the_profile_keeps_choosing_at_compile_time(tmp_path):
    """x86-cpu on this x86 host: the compiler times both and ships one (today's choice, manifest version 2)."""
    r = subprocess.run([sys.executable, "-m", "edgefleet.cli", "compile", str(MODEL), "--profile", "x86-cpu",
                        "--calibration", str(DIGITS / "calibration.npz"), "--eval", str(DIGITS / "test.npz"),
                        "--name", "digits", "--version", "1.0.0", "--out", str(tmp_path), "--json", "--no-cache"],
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["manifest"]
    # v6: every bundle now carries its drift reference (issue 34; was 2 before it)
    assert m["manifest_version"] == 6 and m["precision_choice"]["mode"] == "auto" and not m["variants"]
    assert m["benchmark"] is not None


def test_a_relative_out_path_builds(tflite_toolchain, digits, tmp_path, monkeypatch):
    """`edgefleet compile --out dist` from a project folder: the engine path is relative to the caller's folder, and
    onnx2tf runs in its work folder, so every path it is given must be absolute (it was not: onnx2tf read
    dist/edgefleet-onnx2tf-*/model.onnx from inside that folder and found nothing)."""
    info, profile, _, _ = digits
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dist").mkdir()
    LiteRTTarget().build(MODEL, info, "fp32", profile, None, Path("dist") / "digits.tflite")
    assert (tmp_path / "dist" / "digits.tflite").stat().st_size > 0
