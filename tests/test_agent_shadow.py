"""ShadowMirror with the real digits engines: agreement counted per sample, a candidate that is slow is
skipped rather than waited for, a failing or misshapen one is a finding, not a crash."""

from __future__ import annotations

import threading
import time

import numpy as np

from edgefleet.agent.core.shadow import ShadowMirror
from edgefleet.engines import load_bundle_engine
from edgefleet.protocol.bundle import read_manifest, sha256_file
from tests.waiting import wait_for, watch


def _backend(tmp_path, bundle, name):
    from edgefleet.agent.install.store import ModelStore

    store = ModelStore(tmp_path / name)
    store.recover()
    staged = store.stage(bundle, sha256_file(bundle))
    m = staged.manifest
    return m, load_bundle_engine(m, staged.directory / m.engine, 1)


def _drain(sh: ShadowMirror, n: int) -> None:
    wait_for(lambda: sh.samples + sh.errors >= n, 30, f"{n} samples mirrored", interval_s=0.01)


IGNORED_S = 0.05  # the time a sample of another model is given to be (wrongly) counted: an absence, not a wait


def test_agreement_between_int8_and_fp32_digits(tmp_path, digits_bundle, digits_bundle_v2, test_images):
    images, _ = test_images
    m1, active = _backend(tmp_path, digits_bundle, "a")
    m2, candidate = _backend(tmp_path, digits_bundle_v2, "b")
    sh = ShadowMirror(m2, candidate, sample_rate=1.0, max_pending=1000, seed=1)
    for i in range(40):
        feeds = {"input": images[i:i + 2]}
        sh.offer("digits", feeds, active.infer(feeds))
    _drain(sh, 80)
    f = sh.figures()
    assert (f.samples, sh.compared) == (80, 80) and f.top1_agreement is not None and f.top1_agreement >= 0.95
    assert f.max_abs_error is not None and f.max_abs_error > 0  # int8 vs fp32: close, not equal
    sh.offer("other-model", {"input": images[:1]}, active.infer({"input": images[:1]}))  # not this model: ignored
    watch(lambda: sh.figures().samples != 80, IGNORED_S)
    assert sh.figures().samples == 80
    sh.close()
    active.close()


class _Slow:
    """Stands in for a candidate engine that takes long (a collaborator of the mirror, not the thing tested)."""

    def __init__(self, out):
        self.out = out
        self.gate = threading.Event()

    def infer(self, feeds):
        self.gate.wait(10)
        return self.out

    def close(self):
        pass


def test_a_slow_candidate_is_skipped_not_waited_for(tmp_path, digits_bundle, test_images):
    images, _ = test_images
    m, active = _backend(tmp_path, digits_bundle, "a")
    feeds = {"input": images[:1]}
    outs = active.infer(feeds)
    slow = _Slow(outs)
    sh = ShadowMirror(m, slow, sample_rate=1.0, max_pending=2)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for _ in range(50):
        sh.offer("digits", feeds, outs)
    assert time.perf_counter() - t0 < 5.0  # offer never blocks on the candidate
    assert sh.skipped == 48
    slow.gate.set()
    _drain(sh, 2)
    assert sh.figures().samples == 2 and sh.figures().top1_agreement == 1.0
    bad = _Slow([np.zeros((1, 3), np.float32)])  # the wrong shape: every sample disagrees
    bad.gate.set()
    sh2 = ShadowMirror(read_manifest(digits_bundle), bad, sample_rate=1.0)  # type: ignore[arg-type]
    sh2.offer("digits", feeds, outs)
    _drain(sh2, 1)
    assert sh2.figures().top1_agreement == 0.0
    sh.close()
    sh2.close()
    active.close()
