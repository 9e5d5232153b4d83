"""A device's latest report is acked by the fleet, and sent again until it is (issue 20): the report
gets the treatment telemetry has. Real Mosquitto, real fleet, the agent's own MQTT link."""

from __future__ import annotations

import queue
import time

import paho.mqtt.client as mqtt

from edgefleet.agent.link.mqtt import MqttLink
from edgefleet.agent.link.spool import Spool
from edgefleet.protocol import mqtt as proto
from tests.fleet_harness import api, running_fleet
from tests.waiting import wait_for, watch


def _report(device_id: str, state: str) -> proto.ReportedState:
    return proto.ReportedState(device_id=device_id, ts=time.time(), state=state, rollout_id=None,  # type: ignore[arg-type]
                               model="digits", version="1.0.0", running_model=None, running_version=None)


def _watch(port: int, topic: str) -> tuple[mqtt.Client, queue.Queue]:
    got: queue.Queue = queue.Queue()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{time.monotonic_ns()}")
    c.on_message = lambda cl, u, m: got.put(proto.decode(proto.ReportedState, m.payload, "reported"))
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.subscribe(topic, 1)
    return c, got


RESENDS_S = 1.5  # several resend intervals (ack_timeout_s 0.3): nothing more may come in it (an absence, not a wait)


def test_an_unacked_report_is_sent_again_until_the_fleet_acks_it(tmp_path, mosquitto):
    watcher, seen = _watch(mosquitto.port, proto.topic("edge-r", "reported"))
    link = MqttLink("edge-r", mosquitto.url, Spool(tmp_path / "spool"), "http://127.0.0.1:1", lambda d: None,
                    ack_timeout_s=0.3)
    link.start()
    try:
        wait_for(link.connected.is_set, 10, "the link connected")
        link.report(_report("edge-r", "installed"))
        # no fleet listens: the report goes out again and again, each time with a newer ts
        first = seen.get(timeout=10)
        again = [seen.get(timeout=10) for _ in range(2)]
        assert all(r.state == "installed" for r in again) and again[0].ts > first.ts and again[1].ts > again[0].ts
        # a fleet comes and stores it: the ack stops the resending
        with running_fleet(tmp_path / "fleet", mosquitto.url) as (_, url):
            wait_for(lambda: api.get(f"{url}/api/v1/devices/edge-r").json().get("last_state") == "installed", 30,
                     "the fleet stored the report")
            wait_for(lambda: link._report_sent is None, 30, "the fleet acked the latest report")
            while not seen.empty():
                seen.get_nowait()
            watch(lambda: not seen.empty(), RESENDS_S)
            assert seen.empty(), [r.ts for r in list(seen.queue)]
    finally:
        link.stop()
        watcher.loop_stop()
