"""The committed digits model and split are current and as accurate as promised."""

import importlib.util
import json

import numpy as np
import onnx
import onnxruntime as ort

from tests.conftest import DIGITS


def _script():
    spec = importlib.util.spec_from_file_location("make_digits", DIGITS / "make_digits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_model_was_made_by_the_committed_script():
    props = {p.key: p.value for p in onnx.load(str(DIGITS / "model.onnx")).metadata_props}
    assert props["edgefleet.script_sha256"] == _script().script_sha256(), \
        "models/digits/make_digits.py changed: run it again and commit the new files"


def test_split_and_data_files_are_current():
    mod = _script()
    x, y, split = mod.load_digits_split()
    committed = json.loads((DIGITS / "split.json").read_text())
    for k in ("train", "calibration", "test"):
        assert committed[k] == split[k]
    assert not (set(split["test"]) & set(split["train"])) and not (set(split["test"]) & set(split["calibration"]))
    with np.load(DIGITS / "test.npz") as npz:
        np.testing.assert_array_equal(npz["input"], x[split["test"]])
        np.testing.assert_array_equal(npz["labels"], y[split["test"]])
    with np.load(DIGITS / "calibration.npz") as npz:
        np.testing.assert_array_equal(npz["input"], x[split["calibration"]])


def test_fp32_accuracy_on_the_test_split():
    sess = ort.InferenceSession(str(DIGITS / "model.onnx"), providers=["CPUExecutionProvider"])
    with np.load(DIGITS / "test.npz") as npz:
        logits = sess.run(None, {"input": npz["input"]})[0]
        acc = float((logits.argmax(1) == npz["labels"]).mean())
    assert acc >= 0.97, acc


def test_batch_dimension_is_dynamic():
    sess = ort.InferenceSession(str(DIGITS / "model.onnx"), providers=["CPUExecutionProvider"])
    for n in (1, 5, 33):
        assert sess.run(None, {"input": np.zeros((n, 1, 8, 8), np.float32)})[0].shape == (n, 10)
