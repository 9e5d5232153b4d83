"""``edgefleet demo``: the whole loop on this machine (edgefleet/demo.py), in one command."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edgefleet.cli.command import Formatter, command, need, require


@command("agent", "compiler", "fleet", "demo", advise="demo", imports=("edgefleet.demo",))
def cmd_demo(a: argparse.Namespace) -> int:
    from edgefleet.demo import DemoOptions, run_demo

    if a.mqtt_url is None:
        try:
            require("broker")
        except ImportError as exc:
            return need("demo", exc)
    return run_demo(DemoOptions(work_dir=a.work_dir, agents=a.agents, mqtt_url=a.mqtt_url, port=a.port,
                                embedded_mqtt_port=a.embedded_mqtt_port, keep_running=not a.exit,
                                as_json=a.json, pipeline=a.pipeline))


def add_parsers(sub: Any) -> None:
    d = sub.add_parser("demo", formatter_class=Formatter, help="run the whole loop locally",
                       description="Start a fleet (embedded broker), compile the digits model for x86-cpu, start "
                                   "agents as separate processes, roll the model out, send the test images through "
                                   "every agent and print a summary. Ctrl-C stops everything.")
    d.add_argument("--work-dir", type=Path, default=Path(".edgefleet-demo"), help="keys, fleet data, agent stores")
    d.add_argument("--agents", type=int, default=3, help="number of agent processes")
    d.add_argument("--mqtt-url", help="use this broker instead of the embedded one")
    d.add_argument("--port", type=int, default=0, help="fleet HTTP port (0: a free one)")
    d.add_argument("--embedded-mqtt-port", type=int, default=0, help="embedded broker port (0: a free one)")
    d.add_argument("--exit", action="store_true", help="stop after the summary instead of running until Ctrl-C")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument("--no-pipeline", dest="pipeline", action="store_false",
                   help="skip step 7, the OCR pipeline (PP-OCRv4 detector + recognizer as one model)")
    d.set_defaults(fn=cmd_demo)
