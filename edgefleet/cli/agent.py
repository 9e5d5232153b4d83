"""``edgefleet agent`` and ``edgefleet agent install-service``: the device daemon, its flags over its --config
file, and its systemd unit."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from edgefleet.cli.command import Formatter, command, unit_written
from edgefleet.protocol import lograte
from edgefleet.protocol.exits import ExitCode


def _cpu_list(text: str) -> tuple[int, ...]:
    """``1`` / ``2,3`` / ``0-3`` (taskset's list format) -> CPU numbers."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list like 1 or 2,3 or 0-3") from None
    return tuple(cpus)


# the agent's flags that its --config file can set too: flag -> (config key, what no value in either means)
AGENT_SETTINGS: dict[str, tuple[str, str | None]] = {
    "device_id": ("device_id", None), "fleet": ("fleet_url", None), "data_dir": ("data_dir", None),
    "trusted_root": ("trusted_root", "none"), "trust_on_first_use": ("trust_on_first_use", None),
    "mqtt_url": ("mqtt_url", "the one the fleet advertises"), "http_host": ("http_host", None),
    "http_port": ("http_port", None), "max_batch_size": ("max_batch_size", None),
    "max_queue_delay_us": ("max_queue_delay_us", None), "telemetry_interval_s": ("telemetry_interval_s", None),
    "threads": ("intra_op_threads", None), "instances": ("instances", None), "precision": ("precision", None),
    "inference_cpus": ("inference_cpus", "no pinning"), "grpc_port": ("grpc_port", "off"),
    "local_socket": ("local_socket", "off"),
}


@command("agent", imports=("edgefleet.agent.config", "edgefleet.agent.daemon"))
def cmd_agent(a: argparse.Namespace) -> int:
    from edgefleet.agent.config import load_config
    from edgefleet.agent.daemon import check_runtime_config, require_trust_anchor, run_agent

    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format=f"%(asctime)s agent[{a.device_id or '?'}] %(levelname)s %(name)s: %(message)s")
    lograte.install()  # repeated errors rate-limited (protocol/lograte.py)
    overrides: dict[str, object] = {key: getattr(a, dest) for dest, (key, _) in AGENT_SETTINGS.items()}
    overrides["enroll_token"] = a.enroll_token or os.environ.get("EDGEFLEET_ENROLL_TOKEN")
    cfg = load_config(a.config, overrides)
    require_trust_anchor(cfg)
    check_runtime_config(cfg)
    try:
        run_agent(cfg)
    except KeyboardInterrupt:
        pass
    return ExitCode.OK


@command("agent", imports=("edgefleet.agent.config", "edgefleet.agent.systemd"))
def cmd_agent_install_service(a: argparse.Namespace) -> int:
    from edgefleet.agent.config import load_config
    from edgefleet.agent.systemd import SERVICE_NAME, install_unit, render_unit

    config = a.service_config.resolve()
    unit = render_unit(config, load_config(config, {}), user=a.user)
    return unit_written(unit, a, install_unit, SERVICE_NAME)


class _AgentFormatter(Formatter):
    settings = AGENT_SETTINGS

def add_parsers(sub: Any) -> None:
    ag = sub.add_parser("agent", formatter_class=_AgentFormatter, help="run the device agent",
                        description="Follow the fleet's desired state (MQTT), install verified bundles (TUF) and "
                                    "serve the Open Inference Protocol (KServe v2) on HTTP with dynamic batching. "
                                    "Flags override the --config YAML file.")
    ag.add_argument("--config", type=Path, help="YAML file with the settings below (unknown keys are errors)")
    ag.add_argument("--device-id", help="this device's id")
    ag.add_argument("--fleet", help="fleet server URL, e.g. http://127.0.0.1:8700")
    ag.add_argument("--data-dir", type=Path, help="model store, TUF state, telemetry spool")
    ag.add_argument("--trusted-root", type=Path,
                    help="root.json from 'edgefleet keys init' or 'edgefleet keys create' (the anchor of trust); "
                         "required unless the data dir already holds a root or --trust-on-first-use is given")
    ag.add_argument("--trust-on-first-use", action="store_true", default=None,
                    help="without --trusted-root, trust the root.json the fleet serves the first time this device "
                         "connects (whoever answers for the fleet's address then can sign its models); kept in the "
                         "data dir and used from then on")
    ag.add_argument("--mqtt-url", help="the MQTT broker to connect to, e.g. mqtts://broker.example:8883")
    ag.add_argument("--enroll-token", help="one-time token from 'edgefleet fleet enroll DEVICE', traded once for this "
                                           "device's MQTT credentials (kept in the data dir) (default: "
                                           "$EDGEFLEET_ENROLL_TOKEN, else from --config)")
    ag.add_argument("--http-host", help="inference API bind address")
    ag.add_argument("--http-port", type=int, help="inference API port (0 picks a free one)")
    ag.add_argument("--max-batch-size", type=int, help="largest batch the batcher forms")
    ag.add_argument("--max-queue-delay-us", type=int,
                    help="longest a request may wait for a fuller batch; 0 batches what is already queued, which "
                         "measured best here (bench/README.md)")
    ag.add_argument("--telemetry-interval-s", type=float, help="seconds between telemetry records")
    ag.add_argument("--threads", type=int, help="onnxruntime intra-op threads per instance")
    ag.add_argument("--instances", type=int,
                    help="backend instances per model, each with its own inference thread; on CPUs, N instances of "
                         "1 thread often serve more under load than 1 of N threads, while 1 of N answers a lone "
                         "request sooner: bench/serve.py measures both")
    ag.add_argument("--precision", choices=("auto", "bundle", "fp32", "fp16", "int8", "bf16"),
                    help="for a bundle that carries several precisions (compiled where its devices' CPU could not be "
                         "timed): auto times them here at install and serves the faster; bundle serves its own engine "
                         "untimed; or name one")
    ag.add_argument("--inference-cpus", type=_cpu_list, metavar="CPUS",
                    help="run the inference threads on these CPUs (0-based, as taskset -c counts them: 1 or 2,3 or "
                         "2-3) and everything else on the rest")
    ag.add_argument("--grpc-port", type=int,
                    help="also serve the Open Inference Protocol over gRPC on this port of --http-host (0: a free one)")
    ag.add_argument("--local-socket", type=Path, metavar="PATH",
                    help="also serve the Open Inference Protocol on this Unix socket, without HTTP (protocol/local.py; "
                         "relative: under --data-dir; mode 0660)")
    ag.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    ag.set_defaults(fn=cmd_agent)
    ag_sub = ag.add_subparsers(dest="agent_command", metavar="{install-service}")
    svc = ag_sub.add_parser("install-service", formatter_class=Formatter, help="write the systemd unit",
                            description="Validate the agent's YAML config and write a systemd unit that runs "
                                        "`edgefleet agent --config CONFIG` (Type=notify, SIGTERM drains in-flight "
                                        "requests). Never runs systemctl: it prints the commands to enable it.")
    svc.add_argument("--config", dest="service_config", type=Path, default=Path("/etc/edgefleet/agent.yaml"),
                     help="the agent's YAML config (validated now; the unit refers to it)")
    svc.add_argument("--unit-dir", type=Path, default=Path("/etc/systemd/system"), help="where to write the unit")
    svc.add_argument("--user", default="edgefleet", help="the system user the agent runs as")
    svc.add_argument("--dry-run", action="store_true", help="print the unit instead of writing it")
    svc.set_defaults(fn=cmd_agent_install_service)
