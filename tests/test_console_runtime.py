"""The runtime a device chose (issue 35: ServingChoice.runtime, in its install report) on the fleet console: the
device page says which runtime serves, whether it was pinned in the agent's config or chosen by timing (auto),
and the figures it was chosen by; the device list names it too. Real Mosquitto, a real fleet (its MQTT ingest,
database and console over HTTP), the agent's own MQTT link sending the reports."""

from __future__ import annotations

import functools
import html
import re
import time

from edgefleet.agent.link.mqtt import MqttLink
from edgefleet.agent.link.spool import Spool
from edgefleet.protocol import mqtt as proto
from tests.fleet_harness import api, running_fleet
from tests.waiting import wait_for

HOSTILE = "m<i>\"&"  # a model name a device may send (64 characters of anything): shown as text


def _installed(device_id: str, runtime: proto.RuntimeChoice) -> proto.ReportedState:
    serving = proto.ServingChoice(precision="int8", precision_source="bundle", max_batch_size=8,
                                  batch_source="measured", instances=1, threads=2, runtime=runtime)
    return proto.ReportedState(device_id=device_id, ts=time.time(), state="installed", rollout_id=None,
                               model=HOSTILE, version="1.0.0", running_model=HOSTILE, running_version="1.0.0",
                               selftest=proto.SelfTestResult(samples=8, top1=1.0, drift=0.1), serving=serving)


def _timing(runtime: str, b1: float, b8: float, mean: float) -> proto.RuntimeTiming:
    return proto.RuntimeTiming(runtime=runtime, items_per_s=mean,  # type: ignore[arg-type]
                               timings=(proto.Timing(batch_size=1, items_per_s=b1),
                                        proto.Timing(batch_size=8, items_per_s=b8)))


def test_the_device_page_and_list_show_the_runtime_its_source_and_figures(tmp_path, mosquitto):
    reports = {
        "edge-auto": proto.RuntimeChoice(runtime="openvino", source="device", runtimes=(
            _timing("onnxruntime", 301.5, 540.0, 403.5), _timing("openvino", 455.0, 823.0, 612.0))),
        "edge-pin": proto.RuntimeChoice(runtime="onnxruntime", source="operator"),
        "edge-one": proto.RuntimeChoice(runtime="onnxruntime", source="only"),
    }
    links = []
    with running_fleet(tmp_path / "fleet", mosquitto.url) as (_, url):
        try:
            for device, rc in reports.items():
                link = MqttLink(device, mosquitto.url, Spool(tmp_path / device), "http://127.0.0.1:1",
                                lambda d: None, ack_timeout_s=0.3)
                link.start()
                links.append(link)
                wait_for(link.connected.is_set, 10, f"{device}'s link connected")
                link.report(_installed(device, rc))

            def stored(device: str) -> object:
                return (api.get(f"{url}/api/v1/devices/{device}").json().get("selftest") or {}).get("serving")

            for device in reports:
                wait_for(functools.partial(stored, device), 30, f"the fleet stored {device}'s serving choice")
            pages = {d: api.get(f"{url}/devices/{d}") for d in reports}
            overview = api.get(f"{url}/")
        finally:
            for link in links:
                link.stop()
    assert all(p.status_code == 200 for p in pages.values()) and overview.status_code == 200

    def runtime_line(page: str) -> str:
        m = re.search(r"<span>runtime (.*?)</span>\n", page)
        assert m, page
        return html.unescape(re.sub(r"<[^>]+>", "", m.group(1)))

    auto = pages["edge-auto"].text
    assert runtime_line(auto) == "openvino (auto · timed here: onnxruntime 403.5/s, openvino 612/s)"
    assert '<b class="runtime">openvino</b>' in auto
    # the figures per batch size are its tooltip
    assert 'title="onnxruntime: batch 1 301.5/s, batch 8 540/s; openvino: batch 1 455/s, batch 8 823/s"' in auto
    assert runtime_line(pages["edge-pin"].text) == "onnxruntime (pinned · set in the agent's config)"
    assert runtime_line(pages["edge-one"].text) == \
        "onnxruntime (one runtime · the only runtime here that runs it)"
    # what the device sent is text on the page: escaped once, never markup
    for page in (*(p.text for p in pages.values()), overview.text):
        body = page.split("</style>", 1)[1]
        assert "m&lt;i&gt;&#34;&amp;" in body and "<i>" not in body and "&amp;lt;" not in body
    # the device list names the runtime under the model it runs, with how it was chosen
    rows = {d: re.search(rf'<tr><td><a href="/devices/{d}">.*?</tr>', overview.text, re.S) for d in reports}
    assert all(rows.values()), overview.text
    assert "on openvino (auto)" in rows["edge-auto"].group(0)  # type: ignore[union-attr]
    assert "on onnxruntime (pinned)" in rows["edge-pin"].group(0)  # type: ignore[union-attr]
    assert "on onnxruntime (one runtime)" in rows["edge-one"].group(0)  # type: ignore[union-attr]
