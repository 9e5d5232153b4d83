"""``edgefleet simulate``: simulated agents against a fleet's broker (fleet/simulator.py), for rehearsing rollouts
and for bench/fleet_scale.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from edgefleet.cli.command import Formatter, UsageError, command
from edgefleet.protocol.errors import ConfigError, EdgefleetError
from edgefleet.protocol.exits import ExitCode

if TYPE_CHECKING:
    from edgefleet.fleet.simulator import Simulator


def _pairs(items: list[str], what: str) -> dict[str, float]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        try:
            out[k] = float(v)
        except ValueError:
            sep = ""
        if not sep or not k:  # a usage error (exit 2), as argparse's own
            raise UsageError(f"{what} {it!r} must look like VERSION=NUMBER")
    return out


def add_parsers(sub: Any) -> None:
    # the description is fleet/simulator.py's first line, written here: building the parser (every command does, the
    # agent's restart too) imports nothing of the fleet
    sp = sub.add_parser("simulate", formatter_class=Formatter, help="run simulated agents against a broker",
                        description="A fleet of simulated agents: one MQTT connection each, on one asyncio loop.")
    sp.add_argument("--devices", type=int, required=True, help="how many simulated devices")
    sp.add_argument("--mqtt-url", default="mqtt://127.0.0.1:1883", help="the fleet's broker (mqtts://: over TLS)")
    sp.add_argument("--mqtt-ca-file", help="for mqtts:// brokers: the CA of the broker's certificate (default: the "
                                           "system's CAs)")
    sp.add_argument("--prefix", default="sim", help="device ids are PREFIX-00000, PREFIX-00001, ...")
    sp.add_argument("--first-index", type=int, default=0, help="number of the first device")
    sp.add_argument("--profile", default="x86-cpu", help="hardware profile the devices announce")
    sp.add_argument("--install-s", type=float, default=0.05, help="seconds from desired state to report")
    sp.add_argument("--failure-rate", type=float, default=0.0, help="share of installs that fail")
    sp.add_argument("--fail-version", action="append", default=[], metavar="VERSION=RATE",
                    help="failure rate of one version (repeatable)")
    sp.add_argument("--telemetry-interval-s", type=float, default=0.0, help="0: no telemetry")
    sp.add_argument("--p99-ms", type=float, default=10.0, help="p99 latency the devices report")
    sp.add_argument("--slow-version", action="append", default=[], metavar="VERSION=FACTOR",
                    help="p99 of this version is FACTOR times --p99-ms (repeatable)")
    sp.add_argument("--error-rate", type=float, default=0.0, help="share of requests that fail")
    sp.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    sp.add_argument("--fleet", help="a fleet whose broker needs device accounts (the embedded one does): enroll "
                                    "each device there first (not read from $EDGEFLEET_URL: enrolling is asked for)")
    sp.add_argument("--token", help="with --fleet: an operator's API token (default $EDGEFLEET_TOKEN)")
    sp.add_argument("--json", action="store_true", help="print the final counters as JSON")
    sp.add_argument("--stats-file", help="also write the counters (JSON) to this file four times a second, for a "
                                         "benchmark that watches them")
    sp.set_defaults(fn=cmd_simulate)


@command()
def cmd_simulate(a: argparse.Namespace) -> int:
    import dataclasses
    import resource
    import sys

    from edgefleet.fleet import simulator
    from edgefleet.fleet.client import FleetClientError, FleetUnreachable
    from edgefleet.protocol import mqtt as proto

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < a.devices + 100 and hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(a.devices + 100, soft)), hard))
    try:
        proto.parse_mqtt_url(a.mqtt_url)
    except ValueError as exc:  # urlsplit's own (an unclosed '['): bad input as well
        raise ConfigError(f"MQTT URL {a.mqtt_url!r}: {exc}") from exc
    cfg = simulator.SimConfig(
        mqtt_url=a.mqtt_url, mqtt_ca_file=a.mqtt_ca_file, devices=a.devices, prefix=a.prefix,
        first_index=a.first_index, profile=a.profile, install_s=a.install_s, failure_rate=a.failure_rate,
        failure_rate_by_version=_pairs(a.fail_version, "--fail-version"), telemetry_interval_s=a.telemetry_interval_s,
        p99_ms=a.p99_ms, p99_factor_by_version=_pairs(a.slow_version, "--slow-version"), error_rate=a.error_rate)
    if a.fleet:
        ids = [f"{a.prefix}-{a.first_index + i:05d}" for i in range(a.devices)]
        try:
            cfg = dataclasses.replace(cfg, passwords=simulator.enroll_all(a.fleet, ids, a.token))
        except EdgefleetError as exc:
            raise FleetClientError(f"enrolling the simulated devices failed: {exc}") from exc
        print(f"enrolled {len(ids)} simulated devices at {a.fleet}", file=sys.stderr, flush=True)
    try:
        sim = simulator.Simulator(cfg)
    except OSError as exc:  # the CA file: missing, unreadable, not PEM
        raise ConfigError(f"--mqtt-ca-file {a.mqtt_ca_file}: {exc}") from exc

    async def main() -> None:
        t0 = time.monotonic()
        await sim.connect_all()
        print(f"{a.devices} simulated devices connected in {time.monotonic() - t0:.1f}s", file=sys.stderr,
              flush=True)
        writer = asyncio.ensure_future(_write_stats(sim, a.stats_file)) if a.stats_file else None
        try:
            if a.duration_s > 0:
                await asyncio.sleep(a.duration_s)
            else:
                await asyncio.Event().wait()
        finally:
            if writer is not None:
                writer.cancel()
            await sim.stop_all()

    try:
        _run(main())
    except KeyboardInterrupt:
        pass
    except (OSError, ConnectionError) as exc:  # the broker: gone, refused, or dropped us
        raise FleetUnreachable(str(exc)) from exc
    print(json.dumps(sim.stats.as_json()) if a.json else
          " ".join(f"{k}={v}" for k, v in sim.stats.as_json().items()), flush=True)
    return ExitCode.OK


async def _write_stats(sim: Simulator, path: str) -> None:
    import os

    while True:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"t": time.time(), **sim.stats.as_json()}, f)
        os.replace(tmp, path)
        await asyncio.sleep(0.25)


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)
