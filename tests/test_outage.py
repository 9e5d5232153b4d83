"""Offline and broker outages: telemetry and reports wait on the device's disk while the broker is
away and reach the fleet, in order, once it is back; a full spool drops its oldest records and says
how many. Real Mosquitto (stopped and restarted on the same port), a real fleet, a real agent."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import paho.mqtt.client as mqtt

from edgefleet.agent.link.mqtt import MqttLink
from edgefleet.agent.link.spool import Spool
from edgefleet.protocol import mqtt as proto
from tests.agent_harness import running_agent
from tests.conftest import Mosquitto, wait_for
from tests.fleet_harness import running_fleet
from tests.test_crash_random import record_figures

DEVICE = "edge-out"


def _rows(fs) -> list[dict]:
    """Stored telemetry of DEVICE in the order the fleet stored it."""
    return [r.model_dump(mode="json") for r in reversed(fs.service.devices.device_telemetry(DEVICE, limit=1000))]


def _spooled(data: Path) -> int:
    return len([p for p in (data / "spool").glob("*.json") if p.stem.isdigit()])


def _made(data: Path) -> int:
    return int((data / "spool" / "next_seq").read_text())


def _drain(tmp_path: Path, fs, url: str) -> None:
    """Restart the agent so it makes no new records and wait until it has sent all it holds."""
    with running_agent(tmp_path / "agent", device_id=DEVICE, fleet_url=url, telemetry_interval_s=3600):
        wait_for(lambda: _spooled(tmp_path / "agent") == 0, 60, "the spool drained")


def test_broker_outage_mid_stream_loses_nothing_and_keeps_order(tmp_path, mosquitto: Mosquitto):
    data = tmp_path / "agent"
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        fs.service.devices.register_device(DEVICE)
        with running_agent(data, device_id=DEVICE, fleet_url=url, telemetry_interval_s=0.1):
            wait_for(lambda: len(_rows(fs)) >= 10, 30, "telemetry flowing")
            mosquitto.stop()
            before = _made(data)
            wait_for(lambda: _made(data) - before >= 30, 30, "records spooled while the broker is away")
            assert _spooled(data) >= 30
            made_offline = _made(data) - before
            mosquitto.start()  # the same port
            wait_for(lambda: len(_rows(fs)) >= _made(data) - 5, 60, "the backlog delivered")
        _drain(tmp_path, fs, url)
        made = _made(data)
        rows = _rows(fs)
    seqs = [r["seq"] for r in rows]
    print(f"\nbroker outage: {made} records made ({made_offline} while the broker was away), {len(rows)} stored")
    record_figures("outage", {"sent": made, "delivered": len(rows), "while_away": made_offline})
    assert made_offline >= 30
    assert len(seqs) == made and sorted(seqs) == list(range(made)), "lost or duplicated records"
    assert seqs == sorted(seqs), f"stored out of order: {seqs}"
    assert not any((data / "spool" / "rejected").glob("*"))


def test_full_spool_drops_the_oldest_and_the_fleet_learns_how_many(tmp_path, mosquitto: Mosquitto):
    data = tmp_path / "agent"
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        fs.service.devices.register_device(DEVICE)
        with running_agent(data, device_id=DEVICE, fleet_url=url, telemetry_interval_s=0.1, max_spool_records=10):
            wait_for(lambda: len(_rows(fs)) >= 3, 30, "telemetry flowing")
            mosquitto.stop()
            wait_for(lambda: (data / "spool" / "dropped").exists() and
                     int((data / "spool" / "dropped").read_text()) >= 15, 30, "overflow while away")
            assert _spooled(data) <= 10
            mosquitto.start()
            wait_for(lambda: fs.service.devices.get_device(DEVICE).telemetry.dropped, 60,
                     "a record after the drops")
        _drain(tmp_path, fs, url)
        made = _made(data)
        rows = _rows(fs)
    dropped = int((data / "spool" / "dropped").read_text())
    stored = {r["seq"] for r in rows}
    print(f"\nspool overflow: {made} made, {len(stored)} stored, {dropped} dropped (reported: "
          f"{max(r.get('dropped') or 0 for r in rows)})")
    # every record is at the fleet or counted as dropped; a record the fleet stored but whose ack the outage
    # cut off can be both (the spool cannot know): at most the few in flight when the broker went away
    assert made - len(stored) <= dropped <= made - len(stored) + 3
    assert max(r.get("dropped") or 0 for r in rows) == dropped  # and the fleet was told the count
    # the dropped ones are the oldest of the backlog: what was stored is a head and a contiguous tail
    tail = sorted(stored)[-10:]
    assert tail == list(range(made - 10, made))


def test_spool_overflow_unit(tmp_path):
    sp = Spool(tmp_path / "s", max_records=10)
    for _ in range(25):
        sp.append(lambda seq: json.dumps({"seq": seq}).encode())
    assert sp.dropped == 15
    assert [int(p.stem) for p in sp.pending()] == list(range(15, 25))
    again = Spool(tmp_path / "s", max_records=10)  # the count and the queue survive a restart
    assert again.dropped == 15 and len(again.pending()) == 10
    seq = again.append(lambda seq: json.dumps({"seq": seq}).encode())
    assert seq == 25 and again.dropped == 16


def test_report_made_offline_survives_a_restart_and_arrives(tmp_path, mosquitto: Mosquitto):
    """The agent reports while the broker is away, restarts, and the report still reaches the broker."""
    mosquitto.stop()
    spool = Spool(tmp_path / "spool")
    link = MqttLink(DEVICE, mosquitto.url, spool, "http://127.0.0.1:1", lambda d: None)
    link.start()
    msg = proto.ReportedState(device_id=DEVICE, ts=1.0, state="failed", rollout_id=3, model="digits",
                              version="1.0.0", running_model=None, running_version=None, error="made offline")
    link.report(msg)
    link.stop()  # the agent restarts, still offline
    mosquitto.start()
    got: list[proto.ReportedState] = []
    seen = threading.Event()

    def on_message(client, userdata, m):
        got.append(proto.decode(proto.ReportedState, bytes(m.payload), source=m.topic))
        seen.set()

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher")
    sub.on_message = on_message
    sub.connect("127.0.0.1", mosquitto.port)
    sub.subscribe(proto.topic(DEVICE, "reported"), qos=1)
    sub.loop_start()
    again = MqttLink(DEVICE, mosquitto.url, Spool(tmp_path / "spool"), "http://127.0.0.1:1", lambda d: None)
    again.start()
    try:
        assert seen.wait(20), "the saved report never arrived"
    finally:
        again.stop()
        sub.loop_stop()
        sub.disconnect()
    assert got[0].error == "made offline" and got[0].rollout_id == 3
