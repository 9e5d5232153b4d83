"""A device chooses its layout (instances x intra-op threads over its inference CPUs) at install: each candidate
timed in the compute gate's turns, the choice kept unless an operator set instances or intra_op_threads, shown in
/v2/models/{name}/config and in the serving choice of the install report; answers bit-identical to the untuned
agent's. The rule is tested on given figures, never on timing thresholds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.agent.batcher import LayoutFigures, choose_layout, layout_candidates
from tests.agent_harness import preinstall, running_agent

DIGITS_EVAL = Path(__file__).resolve().parent.parent / "models" / "digits" / "test.npz"


def fig(name: str, best: float, lone_ms: float) -> LayoutFigures:
    i, t = (int(v) for v in name.split("x"))
    return LayoutFigures(i, t, ((1, best / 2), (4, best)), lone_ms)


def test_the_candidates_use_every_inference_cpu():
    assert layout_candidates(1) == ((1, 1),)
    assert layout_candidates(2) == ((1, 2), (2, 1))
    assert layout_candidates(4) == ((1, 4), (2, 2), (4, 1))


def test_a_slower_lone_request_needs_a_throughput_gain_that_pays_for_it():
    # 2x1 doubles a lone request's time: it needs 5% + 10% of 100% = 15% more images/s
    assert choose_layout([fig("1x2", 100, 10), fig("2x1", 114, 20)]).name == "1x2"
    assert choose_layout([fig("1x2", 100, 10), fig("2x1", 116, 20)]).name == "2x1"
    # barely slower alone (5%): 5.5% more is enough; 4% is not
    assert choose_layout([fig("1x2", 100, 10), fig("2x1", 106, 10.5)]).name == "2x1"
    assert choose_layout([fig("1x2", 100, 10), fig("2x1", 104, 10.5)]).name == "1x2"
    # as fast alone: the one that serves more
    # the fastest alone that also serves the most: no trade at all
    assert choose_layout([fig("1x2", 90, 20), fig("2x1", 100, 10)]).name == "2x1"
    assert choose_layout([fig("1x1", 50, 5)]).name == "1x1"


def infer(url: str, images: np.ndarray) -> list[bytes]:
    out = []
    for img in images:
        body = {"inputs": [{"name": "input", "shape": [1, *img.shape], "datatype": "FP32",
                            "data": img.reshape(-1).tolist()}],
                "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}
        r = httpx.post(f"{url}/v2/models/digits/infer", content=json.dumps(body), timeout=30)
        assert r.status_code == 200, r.text
        out.append(r.content[int(r.headers["inference-header-content-length"]):])
    return out


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="two CPUs to pin to")
def test_the_device_measures_its_layouts_and_an_operators_layout_wins(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    with np.load(DIGITS_EVAL) as npz:
        images = npz["input"][:24].astype(np.float32)
    with running_agent(data, inference_cpus=(0,)) as (agent, url):  # one inference CPU: 1x1, the only candidate
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        serving = agent.host.models["digits"].serving
    lay = cfg["batch_tuning"]["layout"]
    assert lay["source"] == "measured" and (lay["instances"], lay["threads"]) == (1, 1) and list(lay["measured"]) == \
        ["1x1"]
    assert (serving.instances, serving.threads, serving.layout_source) == (1, 1, "measured")

    with running_agent(data, inference_cpus=(0, 1)) as (agent, url):
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        serving = agent.host.models["digits"].serving
        auto = infer(url, images)
    t, lay = cfg["batch_tuning"], cfg["batch_tuning"]["layout"]
    assert lay["source"] == "measured" and list(lay["measured"]) == ["1x2", "2x1"]
    figures = [LayoutFigures(*(int(v) for v in n.split("x")), ((1, f["images_per_second"]),), f["lone_call_ms"])
               for n, f in lay["measured"].items()]
    assert f"{lay['instances']}x{lay['threads']}" == choose_layout(figures).name  # the rule, on its own figures
    assert cfg["instance_group"][0]["count"] == lay["instances"]
    assert (serving.instances, serving.threads, serving.layout_source) == (lay["instances"], lay["threads"],
                                                                           "measured")
    assert t["mode"] == "measured" and serving.max_batch_size == t["max_formed_batch_size"]

    with running_agent(data, instances=2, intra_op_threads=1) as (agent, url):  # the operator's layout, kept
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        serving = agent.host.models["digits"].serving
    lay = cfg["batch_tuning"]["layout"]
    assert (lay["instances"], lay["threads"], lay["source"], lay["measured"]) == (2, 1, "operator", {})
    assert cfg["instance_group"][0]["count"] == 2
    assert (serving.instances, serving.threads, serving.layout_source) == (2, 1, "operator")

    with running_agent(data, batch_tuning="off") as (agent, url):  # the untuned agent: 1x2, batches up to 16
        cfg = httpx.get(f"{url}/v2/models/digits/config", timeout=10).json()
        untuned = infer(url, images)
    assert cfg["batch_tuning"]["layout"]["source"] == "default" and cfg["instance_group"][0]["count"] == 1
    assert auto == untuned  # bit for bit
