"""The speed-reference zoo (models/zoo/make_zoo.py): reproducible builds, sane graphs, rebuild on change."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgefleet.compiler.graph import check_model
from tests.conftest import REPO

ZOO = REPO / "models" / "zoo"
NAMES = ("mobilenetv2", "resnet18")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_zoo", ZOO / "make_zoo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def zoo() -> ModuleType:
    return _script()


@pytest.fixture(scope="session")
def built(zoo: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both models built once per session, through ensure(), into a temporary root."""
    root = tmp_path_factory.mktemp("zoo-a")
    for name in NAMES:
        assert zoo.ensure(name, root) == root / name
    return root


@pytest.mark.parametrize("name", NAMES)
def test_building_twice_gives_the_same_bytes(zoo: ModuleType, built: Path, name: str,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    again = zoo.build(name, tmp_path_factory.mktemp("zoo-b") / name)
    for f in zoo.FILES:
        assert _sha256(again / f) == _sha256(built / name / f), f"{name}/{f} differs between two builds"


@pytest.mark.parametrize("name", NAMES)
def test_files_have_the_promised_shapes(zoo: ModuleType, built: Path, name: str) -> None:
    model = onnx.load(str(built / name / "model.onnx"))
    props = {p.key: p.value for p in model.metadata_props}
    assert props["edgefleet.script_sha256"] == zoo.script_sha256()
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 13)]
    with np.load(built / name / "calibration.npz") as npz:
        assert set(npz.files) == {"input"}
        assert npz["input"].shape == (128, 3, 224, 224) and npz["input"].dtype == np.float32
    with np.load(built / name / "eval.npz") as npz:
        assert set(npz.files) == {"input", "labels"}
        assert npz["input"].shape == (64, 3, 224, 224) and npz["input"].dtype == np.float32
        assert npz["labels"].shape == (64,) and npz["labels"].dtype == np.int64
        assert np.isfinite(npz["input"]).all() and abs(float(npz["input"].mean())) < 1.0


@pytest.mark.parametrize("name", NAMES)
def test_dynamic_batch_and_sane_logits(built: Path, name: str) -> None:
    sess = _session(built / name / "model.onnx")
    with np.load(built / name / "eval.npz") as npz:
        x, labels = npz["input"][:3], npz["labels"][:3]
    one = sess.run(["logits"], {"input": x[:1]})[0]
    three = sess.run(["logits"], {"input": x})[0]
    assert one.shape == (1, 1000) and three.shape == (3, 1000)
    np.testing.assert_allclose(three[:1], one, rtol=1e-4, atol=1e-4)
    assert np.isfinite(three).all()
    assert (three.std(axis=1) > 1e-3).all(), "logits are constant across classes"
    assert float(np.abs(three[0] - three[1]).max()) > 1e-3, "logits do not depend on the image"
    assert float(np.abs(three).max()) < 1e3, "activations blew up"
    np.testing.assert_array_equal(three.argmax(axis=1), labels)  # eval labels are FP32's own top-1


@pytest.mark.parametrize("name", NAMES)
def test_the_compiler_accepts_the_model(built: Path, name: str) -> None:
    info = check_model(built / name / "model.onnx")
    assert [(s.name, tuple(s.shape), s.batch_axis) for s in info.inputs] == [("input", (-1, 3, 224, 224), 0)]
    assert [(s.name, tuple(s.shape), s.batch_axis) for s in info.outputs] == [("logits", (-1, 1000), 0)]
    assert info.opset == 13 and info.has_conv
    assert ("Clip" in info.op_types) == (name == "mobilenetv2")
    assert "BatchNormalization" not in info.op_types  # folded, as an eval-mode export writes it


def test_ensure_rebuilds_only_when_stale(zoo: ModuleType, built: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "mobilenetv2"
    shutil.copytree(built / "mobilenetv2", model_dir)
    onnx_path = model_dir / "model.onnx"
    good = _sha256(onnx_path)
    stamp = onnx_path.stat().st_mtime_ns

    assert zoo.ensure("mobilenetv2", tmp_path) == model_dir
    assert onnx_path.stat().st_mtime_ns == stamp, "rebuilt although nothing changed"

    model = onnx.load(str(onnx_path))  # as if an older script had built it
    for p in model.metadata_props:
        if p.key == "edgefleet.script_sha256":
            p.value = "0" * 64
    onnx.save(model, str(onnx_path))
    assert not zoo.is_current(model_dir)
    zoo.ensure("mobilenetv2", tmp_path)
    assert zoo.is_current(model_dir) and _sha256(onnx_path) == good

    (model_dir / "eval.npz").unlink()
    zoo.ensure("mobilenetv2", tmp_path)
    assert _sha256(model_dir / "eval.npz") == _sha256(built / "mobilenetv2" / "eval.npz")

    with pytest.raises(ValueError, match="unknown zoo model"):
        zoo.ensure("vgg16", tmp_path)
