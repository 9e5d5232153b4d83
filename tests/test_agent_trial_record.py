"""A restart with nothing changed serves from the install's kept trial results (agent/install/trials.py): the trials
run once, at the first start over an installed bundle, and not again until something they depend on changes. Counted
through the agent's /metrics (edgefleet_model_events_total, kinds trials_timed and trials_recalled), never timed."""

import json
import os

import httpx
import numpy as np
import pytest

from tests.agent_harness import preinstall, running_agent


def _events(url: str, kind: str) -> float:
    from tests.agent_harness import metric

    return metric(url, "edgefleet_model_events_total", model="digits", version="1.0.0", kind=kind)


def _answers(url: str) -> None:
    x = np.zeros((1, 1, 8, 8), np.float32)
    r = httpx.post(f"{url}/v2/models/digits/infer", json={"inputs": [
        {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}, timeout=30)
    assert r.status_code == 200, r.text


def _start(data, **overrides) -> tuple[float, float, str]:
    """Start an agent over ``data``, answer once -> (trials timed, trials recalled, the model's config)."""
    with running_agent(data, **overrides) as (_, url):
        _answers(url)
        serving = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        return _events(url, "trials_timed"), _events(url, "trials_recalled"), json.dumps(serving, sort_keys=True)


def _record(data):
    records = list((data / "store" / "trials").glob("*.json"))
    assert len(records) == 1, records
    return records[0]


def test_restart_with_nothing_changed_serves_from_the_record(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    timed, recalled, first_config = _start(data)
    assert (timed, recalled) == (1, 0)  # no record yet: the trials ran and were kept
    doc = json.loads(_record(data).read_text())
    assert doc["key"]["bundle_sha256"] == _record(data).stem and doc["record"]["layout"] is not None
    timed, recalled, config = _start(data)
    assert (timed, recalled) == (0, 1)  # nothing changed: served from the record, no trial ran
    assert config == first_config  # and serves as the timed start chose (layout, batch sizes, runtime, figures)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to change the agent's CPUs")
def test_a_changed_key_times_again(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    assert _start(data)[:2] == (1, 0)
    before = _record(data).read_bytes()
    assert _start(data, inference_cpus=[0])[:2] == (1, 0)  # the CPUs it may use changed: timed again, before serving
    assert _record(data).read_bytes() != before  # and kept under the new key
    assert _start(data, inference_cpus=[0])[:2] == (0, 1)
    assert _start(data, inference_cpus=[0], precision="bundle")[:2] == (1, 0)  # a setting changed


def test_a_truncated_record_is_ignored_and_timed_again(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    assert _start(data)[:2] == (1, 0)
    path = _record(data)
    path.write_bytes(path.read_bytes()[:100])  # a record cut short (a crash mid-write of a non-atomic copy)
    assert _start(data)[:2] == (1, 0)  # ignored: timed again before serving (and it served: _start answered)
    assert json.loads(path.read_bytes())["format"] == 1  # rewritten whole
    assert _start(data)[:2] == (0, 1)


@pytest.mark.parametrize("damage", ["garbage", "empty", "wrong_types", "foreign_layout", "other_format", "huge",
                                    "not_an_object"])
def test_a_damaged_record_is_never_trusted(tmp_path, damage):
    """The store's reading of a record file on disk: each kind of damage reads as no record (the agent times again)."""
    from edgefleet.agent.core.batching.tuning import LayoutFigures
    from edgefleet.agent.core.runtime_pick import RuntimePick
    from edgefleet.agent.install.trials import MAX_RECORD_BYTES, TrialRecord, TrialStore

    store = TrialStore(tmp_path / "trials")
    key = {"bundle_sha256": "ab" * 32, "cpus": [0, 1]}
    record = TrialRecord(precision=("int8", "bundle", "", ()), runtime=RuntimePick("onnxruntime", "only"),
                         layout=((2, 1), (LayoutFigures(2, 1, ((1, 10.0), (8, 70.0)), 0.05),
                                          LayoutFigures(1, 2, ((1, 12.0),), 0.04))))
    store.keep(key, record)
    got = store.recall(key)
    assert got is not None and got.recalled and got.layout == record.layout and got.runtime == record.runtime
    assert store.recall({**key, "cpus": [0]}) is None  # another key: not this record
    path = store.path(key["bundle_sha256"])
    doc = json.loads(path.read_bytes())
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "wrong_types":
        doc["record"]["layout"]["figures"][0]["images_per_s"] = "fast"
        path.write_text(json.dumps(doc))
    elif damage == "foreign_layout":  # the chosen layout is none of those timed
        doc["record"]["layout"]["chosen"] = [7, 7]
        path.write_text(json.dumps(doc))
    elif damage == "other_format":
        doc["format"] = 99
        path.write_text(json.dumps(doc))
    elif damage == "huge":
        path.write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    else:
        path.write_text("[1, 2]")
    assert store.recall(key) is None


def test_runtime_and_layout_trials_are_kept_together(tmp_path, digits_bundle):
    """runtime: auto with two runtimes here: the layout trial runs in the runtime trial's child, on the runtime
    chosen, and both are kept; the restart times neither."""
    from edgefleet.engines import runtime_installed

    if not (runtime_installed("onnxruntime") and runtime_installed("openvino")):
        pytest.skip("needs onnxruntime and OpenVINO (edgefleet[openvino]) for a runtime trial")
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    timed, recalled, first_config = _start(data, runtime="auto")
    assert (timed, recalled) == (1, 0)
    kept = json.loads(_record(data).read_text())["record"]
    assert kept["runtime"]["source"] == "device" and len(kept["runtime"]["timings"]) == 2
    assert kept["layout"] is not None and len(kept["layout"]["figures"]) >= 1
    timed, recalled, config = _start(data, runtime="auto")
    assert (timed, recalled) == (0, 1) and config == first_config
