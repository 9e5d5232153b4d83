"""Output drift of a pipeline's end answers on a real agent (issue 34.4). The bundle is PP-OCRv4 (tests/ocr_pipeline.py,
FP32) whose manifest carries the drift reference of the FP32 pipeline's end answers on its evaluation set: pages of
one line each. The agent serves pages over HTTP and sends, in each telemetry record, the counts of its end answers in
the reference's bins (Telemetry.drift, as a single model does); summed and scored as the fleet scores them
(fleet.drift.add_counts, protocol.drift.score), 60 pages like the evaluation set's have its boxes per image exactly
(PSI 0) and are too few for a verdict, and 200 pages of three lines each are drift, most in boxes per image."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from edgefleet.protocol import drift as D
from edgefleet.protocol.bundle import read_manifest
from tests.agent_harness import ocr_pipeline_or_skip, preinstall, running_agent, spooled_telemetry
from tests.waiting import concurrently, wait_for

ocr = ocr_pipeline_or_skip()

EVAL_PAGES = 48  # the evaluation set the reference is made from: pages of one line each


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("ocr-drift")
    bundle = ocr.ocr_bundle(d / "ocr-1.0.0.tar", "1.0.0", spec=ocr.ocr_spec(max_crops=64),
                            drift_pages=ocr.pages(EVAL_PAGES, seed=40, lines=1))
    manifest = read_manifest(bundle)
    preinstall(d / "agent", bundle)
    # batches of one (the operator's max_batch_size): the fastest per page for both stages on this CPU, measured
    # here (detector 55 ms a page alone, 80 ms a page in fours; reader 35 ms a crop alone, 45 in fours)
    with running_agent(d / "agent", max_batch_size=1, queue_timeout_ms=120_000) as (a, url):
        yield a, url, manifest


def counted(a, url: str, pages: np.ndarray) -> tuple[dict[str, list[int]], int, int]:
    """``pages`` served one a request by two clients -> the drift counts of their end answers in the telemetry
    records that followed, summed as the fleet sums a device's records: (counts, samples, skipped)."""
    from edgefleet.fleet.drift import add_counts

    last = max((t.seq for t in spooled_telemetry(a)), default=-1)

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            for i in range(k, len(pages), 2):
                x = np.ascontiguousarray(pages[i:i + 1])
                head = (b'{"inputs": [{"name": "x", "shape": [1, 3, %d, %d], "datatype": "FP32", "parameters": '
                        b'{"binary_data_size": %d}}], "outputs": [{"name": "count"}]}' % (x.shape[2], x.shape[3],
                                                                                         x.nbytes))
                r = c.post(f"{url}/v2/models/ocr/infer", content=head + x.tobytes(),
                           headers={"Inference-Header-Content-Length": str(len(head))})
                assert r.status_code == 200, r.text

    assert concurrently(client, 2, timeout_s=600) == []

    def records():
        got = [t.drift for t in spooled_telemetry(a, last) if t.drift is not None]
        return got if sum(d.samples + d.skipped for d in got) >= len(pages) else None

    recs = wait_for(records, 60, f"telemetry counting the {len(pages)} pages' end answers")
    assert all((d.model, d.version) == ("ocr", "1.0.0") for d in recs)
    total: dict[str, list[int]] = {}
    for d in recs:
        add_counts(total, {f.name: f.counts for f in d.features})
    return total, sum(d.samples for d in recs), sum(d.skipped for d in recs)


def test_the_bundle_carries_the_reference_of_its_end_answers(served):
    _, _, m = served
    ref = m.drift
    assert ref is not None and (ref.read_as, ref.output, ref.read, ref.samples) == ("pipeline", "text", "ctc",
                                                                                    EVAL_PAGES)
    assert [f.name for f in ref.features] == ["boxes", "length", "score"]
    boxes = ref.feature("boxes")
    assert boxes is not None and boxes.shares[D.bin_counts(boxes, np.array([1.0])).argmax()] == 1.0  # one line each
    with pytest.raises(ValueError, match="drift reference reads"):  # the reference must read this pipeline's answers
        type(m).model_validate({**m.model_dump(), "drift": {**ref.model_dump(), "output": "count"}})


def test_pages_like_the_evaluation_sets_are_not_drift(served):
    a, url, m = served
    counts, samples, skipped = counted(a, url, ocr.pages(60, seed=41, lines=1))
    assert (samples, skipped) == (60, 0)
    assert sum(counts["boxes"]) == 60 and sum(counts["length"]) == sum(counts["score"]) == 60  # one line each
    sc = D.score(m.drift, counts, samples)
    print(f"\neval-like pages: {sc.as_json()}")
    assert sc.level in ("stable", "insufficient") and sc.features["boxes"] < D.WATCH_PSI


def test_pages_with_many_more_lines_are_drift(served):
    a, url, m = served
    counts, samples, skipped = counted(a, url, ocr.pages(D.MIN_SAMPLES, seed=42, lines=3))
    assert (samples, skipped) == (D.MIN_SAMPLES, 0)
    assert sum(counts["length"]) == 3 * D.MIN_SAMPLES  # one value per string
    sc = D.score(m.drift, counts, samples)
    print(f"\nthree lines a page: {sc.as_json()}")
    assert sc.level == "drift" and sc.feature == "boxes" and sc.psi is not None and sc.psi > D.DRIFT_PSI
