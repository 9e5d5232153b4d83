"""A pipeline's stages on the fleet (issue 34.3): an agent serving a pipeline (manifest v7) sends each stage's figures
in its telemetry (protocol.mqtt.Telemetry.stages); the fleet stores them with the record, the API returns them, and
the device page shows a table of them (stage, calls, errors, p50/p99, mean batch). What a device may send there is
bounded by the protocol: a stage name outside [a-z0-9._-], a count or latency past its bound, a ninth stage or an
unknown field refuses the whole record. Real Mosquitto, a real fleet, the agent's own MQTT link."""

from __future__ import annotations

import json
import re
import time

import paho.mqtt.client as mqtt
import pytest

from edgefleet.fleet import console
from edgefleet.protocol import mqtt as proto
from tests.fleet_harness import api, running_fleet
from tests.test_console_waves import _link, _telemetry
from tests.waiting import wait_for

STAGES = {
    "det": proto.StageFigures(calls=120, errors=1, batches=40, batch_size_mean=3.0, batch_size_max=4,
                              latency=proto.LatencySummary(p50_ms=12.5, p95_ms=20.0, p99_ms=31.25, max_ms=40.0)),
    "rec.v2": proto.StageFigures(calls=118, errors=0, batches=15, batch_size_mean=15.733, batch_size_max=16,
                                 latency=proto.LatencySummary(p50_ms=40.0, p95_ms=61.0, p99_ms=77.5, max_ms=90.0)),
}


def _stage_rows(page: str) -> list[list[str]]:
    m = re.search(r'<table id="stages">(.*?)</table>', page, re.S)
    assert m, "no stage table on the device page"
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)[1:]]


@pytest.mark.timeout(120)
def test_a_pipeline_s_stages_are_stored_returned_and_shown(tmp_path, mosquitto):
    with running_fleet(tmp_path / "fleet", mosquitto.url) as (_, url):
        link = _link(tmp_path, "ocr-box", mosquitto.url, installs=False)
        try:
            link.spool.append(lambda seq: _telemetry(link, seq, "1.0.0", stages=STAGES))
            records = wait_for(lambda: api.get(f"{url}/api/v1/devices/ocr-box/telemetry").json(), 30,
                               "the record stored", retry_on=(ValueError,))
            device = api.get(f"{url}/api/v1/devices/ocr-box").json()
            page = api.get(f"{url}/devices/ocr-box", token=False, cookies={"edgefleet_token": api.token})
        finally:
            link.stop()
    want = {k: v.model_dump(mode="json") for k, v in STAGES.items()}
    assert records[0]["stages"] == want and device["telemetry"]["stages"] == want  # stored as sent, in order
    assert list(records[0]["stages"]) == ["det", "rec.v2"]
    assert page.status_code == 200
    assert _stage_rows(page.text) == [["det", "120", "1", "12.5 ms", "31.2 ms", "3.0"],
                                      ["rec.v2", "118", "0", "40.0 ms", "77.5 ms", "15.7"]]
    assert "Pipeline stages" in page.text and "digits 1.0.0" in page.text


def _raw(device: str, seq: int, stages: object) -> bytes:
    """A telemetry record as JSON, its ``stages`` whatever a device (or anyone holding its credentials) puts there."""
    doc = json.loads(_telemetry_doc(device, seq))
    doc["stages"] = stages
    return json.dumps(doc).encode()


def _telemetry_doc(device: str, seq: int) -> bytes:
    return proto.encode(proto.Telemetry(
        device_id=device, ts=time.time(), stream="0123456789abcdef", seq=seq, interval_s=1.0, model="ocr",
        version="1.0.0", requests=10, errors=0, latency=proto.LatencySummary(p50_ms=1.0, p95_ms=2.0, p99_ms=3.0,
                                                                             max_ms=4.0),
        batches=10, batch_size_mean=1.0, batch_size_max=1, cpu_percent=1.0, rss_mb=10.0))


@pytest.mark.timeout(120)
def test_hostile_stage_names_and_figures_are_refused_by_the_protocol(tmp_path, mosquitto):
    figures = STAGES["det"].model_dump(mode="json")
    hostile = {
        "markup name": {"<img src=x onerror=alert(1)>": figures},
        "upper case": {"Det": figures},
        "long name": {"d" * 64: figures},
        "nine stages": {f"s{i}": figures for i in range(9)},
        "count past its bound": {"det": {**figures, "calls": proto.MAX_COUNT}},
        "negative errors": {"det": {**figures, "errors": -1}},
        "latency past its bound": {"det": {**figures, "latency": {**figures["latency"], "p99_ms": 1e300}}},
        "unknown field": {"det": {**figures, "<script>": 1}},
        "not an object": {"det": "<b>x</b>"},
    }
    device = "ocr-raw"
    with running_fleet(tmp_path / "fleet", mosquitto.url) as (_, url):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=device, protocol=mqtt.MQTTv311)
        host, port = proto.parse_mqtt_url(mosquitto.url)
        c.connect(host, port)
        c.loop_start()
        try:
            for seq, stages in enumerate(hostile.values()):
                c.publish(proto.topic(device, "telemetry"), _raw(device, seq, stages), qos=1).wait_for_publish(5)
            # then one within the bounds: stored (the device is heard as before)
            c.publish(proto.topic(device, "telemetry"), _raw(device, len(hostile), {"det": figures}),
                      qos=1).wait_for_publish(5)

            def stored() -> list[dict] | None:
                r = api.get(f"{url}/api/v1/devices/{device}/telemetry")
                return r.json() if r.status_code == 200 and r.json() else None

            records = wait_for(stored, 30, "the bounded record stored")
            rejected = wait_for(lambda: (n := api.get(f"{url}/api/v1/stats").json()["rejected"].get(
                "malformed_telemetry", 0)) >= len(hostile) and n, 30, "every hostile record refused")
            page = api.get(f"{url}/devices/{device}", token=False, cookies={"edgefleet_token": api.token})
        finally:
            c.loop_stop()
            c.disconnect()
    assert rejected == len(hostile)
    assert [r["seq"] for r in records] == [len(hostile)] and records[0]["stages"] == {"det": figures}
    assert page.status_code == 200 and _stage_rows(page.text)[0][0] == "det"
    assert "<img" not in page.text and "<script>" not in page.text and "<b>x" not in page.text


def test_the_stage_table_escapes_what_it_shows():
    """The protocol allows only [a-z0-9._-] in a stage name; the page escapes it all the same (autoescape), as it
    does every value a device sent."""
    d = {"device_id": "d", "online": True, "running_model": "ocr", "running_version": "1.0.0", "last_state": None,
         "selftest": None, "group": None, "profile": None, "last_seen": None,
         "telemetry": {"model": "o<b>cr", "version": "1.0.0", "interval_s": 10.0,
                       "stages": {"<img src=x>": STAGES["det"].model_dump(mode="json")}}}
    page = console.device_page(d, [], [])
    assert _stage_rows(page)[0][0] == "&lt;img src=x&gt;" and "<img" not in page
    assert "o&lt;b&gt;cr 1.0.0" in page
