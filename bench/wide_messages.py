"""What a wide MQTT message costs the fleet, against a refused message of the same size, in one run.

    .venv/bin/python bench/wide_messages.py                # 40 rounds, alternating, ~10 s on 2 cores
    .venv/bin/python bench/wide_messages.py --rounds 100 --keys 24000 --json

A device may publish telemetry up to the protocol's size limit (protocol.mqtt.MAX_MESSAGE_BYTES). Two such
messages of the same size go through the fleet's own MQTT handler (fleet.bridge.MqttBridge, no broker: the
handler is called as paho's thread calls it, and what it would publish back is dropped):

- ``wide``: a telemetry record with ``--keys`` unknown keys (issue 30 item 6: 24,000 keys in 252 KB);
- ``numbers``: the same record with one unknown key holding an array of numbers, padded to the same size (about
  as many JSON values as ``wide``: the like-for-like baseline);
- ``string``: the same record with one unknown key holding one string of the same size (the cheapest refusal).

All are refused. Each round times one of each (rotating which goes first) in CPU seconds of this process; the
figures are the median per message and ``wide`` against each baseline, ratios in the same run (goal: ``wide /
numbers`` near 1, i.e. the cost is proportional to the bytes and values parsed, not to how many problems they
hold).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import paho.mqtt.client as mqtt

from edgefleet.fleet.audit import Rejections
from edgefleet.fleet.bridge import MqttBridge
from edgefleet.protocol import mqtt as proto

DEVICE = "edge-wide"


class _Sink:
    """Stands in for paho's client where the handler publishes an ack back."""

    def __init__(self) -> None:
        self.published = 0

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self.published += 1


def _base(seq: int) -> dict:
    return {"v": 1, "device_id": DEVICE, "ts": time.time(), "kind": "telemetry", "stream": "0123456789abcdef",
            "seq": seq, "interval_s": 10.0, "model": "digits", "version": "1.0.0", "requests": 10, "errors": 0,
            "latency": {"p50_ms": 1.0, "p95_ms": 2.0, "p99_ms": 3.0, "max_ms": 4.0}, "batches": 10,
            "batch_size_mean": 1.0, "batch_size_max": 1, "cpu_percent": 1.0, "rss_mb": 100.0}


def _dumps(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def messages(keys: int) -> dict[str, bytes]:
    """The three payloads, each of the same size."""
    wide = _base(0)
    for i in range(keys):
        wide[f"{i:05d}"] = 0
    size = len(_dumps(wide))
    string = _base(1)
    string["pad"] = ""
    string["pad"] = "x" * (size - len(_dumps(string)))
    numbers = _base(2)
    numbers["pad"] = []
    room = size - len(_dumps(numbers))  # n zeros take 2n - 1 bytes; an even room gets one "10"
    numbers["pad"] = [0] * ((room + 1) // 2)
    if room % 2 == 0:
        numbers["pad"][0] = 10
    out = {"wide": _dumps(wide), "numbers": _dumps(numbers), "string": _dumps(string)}
    assert {len(v) for v in out.values()} == {size} and size <= proto.MAX_MESSAGE_BYTES, {k: len(v) for k, v in
                                                                                          out.items()}
    return out


def _message(payload: bytes) -> mqtt.MQTTMessage:
    m = mqtt.MQTTMessage(topic=proto.topic(DEVICE, "telemetry").encode())
    m.payload = payload
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=24_000, help="unknown keys in the wide message")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the fleet logs each kind of rejection once; not what is measured
    bridge = MqttBridge("mqtt://127.0.0.1:9")  # never started: only its message handler runs
    bridge.rejections = Rejections()
    sink = _Sink()
    payloads = messages(args.keys)
    cases = {name: _message(raw) for name, raw in payloads.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for name in names:  # warm up
        bridge._handle(sink, cases[name])
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            t0 = time.process_time()
            bridge._handle(sink, cases[name])
            times[name].append(time.process_time() - t0)
    if bridge.rejected != len(names) * (args.rounds + 1):
        raise SystemExit(f"expected every message refused, {bridge.rejected} of {len(names) * (args.rounds + 1)} "
                         "were")
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"bytes": len(payloads["wide"]), "keys": args.keys, "rounds": args.rounds,
           **{f"{k}_ms": round(v * 1e3, 3) for k, v in med.items()},
           "wide_vs_numbers": round(med["wide"] / med["numbers"], 2) if med["numbers"] else None,
           "wide_vs_string": round(med["wide"] / med["string"], 2) if med["string"] else None,
           "rejection_acks_sent": sink.published}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['bytes']} bytes each, {args.rounds} rounds, median CPU per message: wide ({args.keys} unknown "
              f"keys) {out['wide_ms']} ms, numbers (one key, an array) {out['numbers_ms']} ms, string (one key) "
              f"{out['string_ms']} ms; wide / numbers {out['wide_vs_numbers']}x, wide / string "
              f"{out['wide_vs_string']}x; rejection acks sent {sink.published}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
