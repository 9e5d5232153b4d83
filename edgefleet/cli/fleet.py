"""``edgefleet fleet ...``: run the fleet server (serve, install-service) or talk to one through its API (upload,
register, enroll, decommission, devices, models; ``fleet rollout``, the older name of ``edgefleet rollout
create``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from edgefleet.cli.command import Formatter, bundle_file, command, fleet_options, print_answer, require, unit_written
from edgefleet.cli.rollout import add_create_parser
from edgefleet.protocol import lograte
from edgefleet.protocol.errors import ConfigError
from edgefleet.protocol.exits import ExitCode


@command("fleet", imports=("edgefleet.fleet.app",))
def cmd_fleet_serve(a: argparse.Namespace) -> int:
    from edgefleet.fleet.app import FleetConfig, FleetServer

    if a.mqtt_url is None:
        try:
            require("broker")
        except ImportError as exc:
            raise ConfigError(f"the embedded MQTT broker needs edgefleet[broker] ({exc.name} is not installed): "
                              "pip install 'edgefleet[broker]', or give --mqtt-url mqtt://HOST:PORT (Mosquitto)"
                              ) from exc
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s fleet %(levelname)s %(name)s: %(message)s")
    lograte.install()  # a repeated error: one line, then its count per interval (an attacker fills no disk)
    cfg = FleetConfig(data_dir=a.data_dir, keys_dir=a.keys, host=a.host, port=a.port, db_url=a.db_url,
                      mqtt_url=a.mqtt_url, embedded_mqtt_host=a.embedded_mqtt_host,
                      embedded_mqtt_port=a.embedded_mqtt_port, agent_mqtt_url=a.agent_mqtt_url,
                      public_url=a.public_url, shared_subscription_group=a.shared_subscription_group,
                      mqtt_username=a.mqtt_username, mosquitto_password_file=a.mosquitto_password_file,
                      mosquitto_fleet_password_file=a.mosquitto_fleet_password_file,
                      mosquitto_acl_file=a.mosquitto_acl_file, mosquitto_pid_file=a.mosquitto_pid_file,
                      mqtt_ca_file=a.mqtt_ca_file, mqtt_cert_file=a.mqtt_cert_file, mqtt_key_file=a.mqtt_key_file,
                      tuf_store=a.tuf_store)
    server = FleetServer(cfg)
    print(f"edgefleet fleet on http://{a.host}:{a.port}  (console: http://{a.host}:{a.port}/ , "
          f"MQTT: {server.mqtt_url})", file=sys.stderr, flush=True)
    server.serve()
    return ExitCode.OK


@command("fleet", imports=("edgefleet.fleet.unit",))
def cmd_fleet_install_service(a: argparse.Namespace) -> int:
    from edgefleet.fleet.unit import SERVICE_NAME, install_unit, render_unit

    args = a.serve_args[1:] if a.serve_args[:1] == ["--"] else a.serve_args
    serve = _serve_options(argparse.ArgumentParser(prog="edgefleet fleet serve", formatter_class=Formatter,
                                                   description=SERVE)).parse_args(args)  # its usage error, now
    unit = render_unit(args, serve, Path.cwd(), user=a.user)
    return unit_written(unit, a, install_unit, SERVICE_NAME)


def _client(a: argparse.Namespace):
    from edgefleet.fleet.client import FleetClient

    return FleetClient(a.fleet, token=a.token)


@command()
def cmd_fleet_upload(a: argparse.Namespace) -> int:
    m = _client(a).upload(bundle_file(a.bundle), a.sign_key)
    print_answer(m, a.json, f"uploaded {m.name} {m.version} ({m.profile}) as TUF target {m.target}")
    return ExitCode.OK


@command()
def cmd_fleet_register(a: argparse.Namespace) -> int:
    out = [_client(a).register(d) for d in a.device_ids]
    print_answer(out, a.json, "\n".join(f"registered {d.device_id}" for d in out))
    return ExitCode.OK


@command()
def cmd_fleet_enroll(a: argparse.Namespace) -> int:
    c = _client(a)
    out = [c.enrollment_token(d, a.ttl) for d in a.device_ids]
    print_answer(out, a.json, "\n".join(f"{t.device_id}  {t.token}" for t in out)
                  + f"\n(one-time tokens, valid {a.ttl:.0f}s: edgefleet agent --device-id DEVICE --enroll-token "
                    "TOKEN)")
    return ExitCode.OK


@command()
def cmd_fleet_decommission(a: argparse.Namespace) -> int:
    d = _client(a).decommission(a.device_id)
    print_answer(d, a.json, f"decommissioned {d.device_id}: its MQTT credentials are revoked")
    return ExitCode.OK


@command()
def cmd_fleet_devices(a: argparse.Namespace) -> int:
    devs = _client(a).devices()
    lines = [f"{'DEVICE':<20} {'STATUS':<8} {'RUNNING':<18} {'LAST REPORT':<12} {'REQ/S':>7} {'P95 MS':>7} "
             f"{'CPU%':>5} {'RSS MB':>7}"]
    for d in devs:
        running = f"{d.running_model} {d.running_version}" if d.running_model else "-"
        t = d.telemetry
        rate = f"{t.requests / t.interval_s:.1f}" if t and t.interval_s else "-"
        p95 = t.latency.p95_ms if t else None
        lines.append(f"{d.device_id:<20} {'online' if d.online else 'offline':<8} {running:<18} "
                     f"{d.last_state or '-':<12} {rate:>7} {'-' if p95 is None else f'{p95:.1f}':>7} "
                     f"{t.cpu_percent if t else '-':>5} {t.rss_mb if t else '-':>7}")
    print_answer(devs, a.json, "\n".join(lines))
    return ExitCode.OK


@command()
def cmd_fleet_models(a: argparse.Namespace) -> int:
    ms = _client(a).models()
    lines = [f"{m.name} {m.version} {m.profile} {m.backend} {m.precision} top-1 {m.accuracy.candidate:.4f}"
             for m in ms]
    print_answer(ms, a.json, "\n".join(lines) or "no models uploaded")
    return ExitCode.OK


SERVE = ("REST API, web console, TUF repository and MQTT bridge. Binds 127.0.0.1 unless --host says otherwise. "
         "Without --mqtt-url it embeds an MQTT broker.")


def _serve_options(fs: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``edgefleet fleet serve`` (also what ``fleet install-service`` checks its options with)."""
    fs.add_argument("--data-dir", type=Path, default=Path("fleet-data"), help="database, TUF repository")
    fs.add_argument("--keys", type=Path, required=True, help="key folder from 'edgefleet keys init'")
    fs.add_argument("--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0 opens it to the network)")
    fs.add_argument("--port", type=int, default=8700, help="HTTP port")
    fs.add_argument("--db-url", help="SQLAlchemy URL, e.g. postgresql+psycopg://user@127.0.0.1/fleet "
                                     "(default: SQLite in --data-dir)")
    fs.add_argument("--tuf-store", choices=("auto", "db", "dir"), default="auto",
                    help="where the TUF repository (signed metadata and bundles) lives: db = the fleet's database, "
                         "so replicas share nothing but it and the broker; dir = --data-dir/tuf; auto (default): "
                         "db on PostgreSQL, dir on SQLite")
    fs.add_argument("--mqtt-url", help="external broker, e.g. mqtt://127.0.0.1:1883 (default: embedded broker)")
    fs.add_argument("--embedded-mqtt-host", default="127.0.0.1", help="bind address of the embedded broker")
    fs.add_argument("--embedded-mqtt-port", type=int, default=1884, help="port of the embedded broker")
    fs.add_argument("--agent-mqtt-url", help="broker URL handed to agents, if it differs from the fleet's")
    fs.add_argument("--public-url", help="base URL agents use for HTTP (default http://HOST:PORT)")
    fs.add_argument("--shared-subscription-group",
                    help="consume telemetry via $share/GROUP/... so replicas split the load (Mosquitto, EMQX)")
    fs.add_argument("--mqtt-username", help="the fleet's account on the external broker (password: "
                                            "$EDGEFLEET_MQTT_PASSWORD); the embedded broker needs none")
    fs.add_argument("--mqtt-ca-file", type=Path, help="for mqtts:// brokers: the CA of the broker's certificate")
    fs.add_argument("--mqtt-cert-file", type=Path, help="mutual TLS: the fleet's client certificate")
    fs.add_argument("--mqtt-key-file", type=Path, help="mutual TLS: the fleet's client key")
    fs.add_argument("--mosquitto-password-file", type=Path,
                    help="write device accounts here (Mosquitto password_file) whenever they change")
    fs.add_argument("--mosquitto-fleet-password-file", type=Path,
                    help="write the fleet's own account alone here: the password_file of the fleet's listener, "
                         "apart from the devices' listener (see the README's Mosquitto configuration)")
    fs.add_argument("--mosquitto-acl-file", type=Path, help="write the topic ACL here (Mosquitto acl_file)")
    fs.add_argument("--mosquitto-pid-file", type=Path, help="Mosquitto's pid file: SIGHUP it after writing")
    fs.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    fs.set_defaults(fn=cmd_fleet_serve)
    return fs


def add_parsers(sub: Any) -> None:
    f = sub.add_parser("fleet", help="run or talk to the fleet server").add_subparsers(dest="fleet_cmd",
                                                                                       required=True)
    _serve_options(f.add_parser("serve", formatter_class=Formatter, help="run the fleet server", description=SERVE))
    svc = f.add_parser("install-service", formatter_class=Formatter, help="write the fleet's systemd unit",
                       description="Write a systemd unit that runs `edgefleet fleet serve OPTIONS` from this folder "
                                   "(LimitNOFILE=65536, writing only its data dir and the Mosquitto files named). "
                                   "Never runs systemctl: it prints the commands to enable it.")
    svc.add_argument("--unit-dir", type=Path, default=Path("/etc/systemd/system"), help="where to write the unit")
    svc.add_argument("--user", default="edgefleet", help="the system user the fleet runs as")
    svc.add_argument("--dry-run", action="store_true", help="print the unit instead of writing it")
    svc.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- OPTIONS",
                     help="the options of 'edgefleet fleet serve' (checked now), e.g. -- --keys /etc/edgefleet/keys")
    svc.set_defaults(fn=cmd_fleet_install_service)

    def client_parser(name: str, help_: str, fn) -> argparse.ArgumentParser:
        sp = f.add_parser(name, formatter_class=Formatter, help=help_, description=help_)
        fleet_options(sp)
        sp.add_argument("--json", action="store_true", help="JSON output")
        sp.set_defaults(fn=fn)
        return sp

    up = client_parser("upload", "upload a bundle (publishes it as a signed TUF target)", cmd_fleet_upload)
    up.add_argument("bundle", type=Path)
    up.add_argument("--sign-key", type=Path, help="the CI's bundles key (from 'edgefleet keys create DIR': DIR/ci/"
                                                  "bundles.key): sign the bundle here, for a fleet that holds no "
                                                  "signing key for bundles")
    client_parser("register", "register devices by id", cmd_fleet_register).add_argument("device_ids", nargs="+")
    client_parser("devices", "list devices", cmd_fleet_devices)
    en = client_parser("enroll", "issue one-time enrollment tokens (a device trades its token for its own MQTT "
                                 "credentials: edgefleet agent --enroll-token TOKEN)", cmd_fleet_enroll)
    en.add_argument("device_ids", nargs="+")
    en.add_argument("--ttl", type=float, default=86400.0, help="seconds the token can be redeemed")
    client_parser("decommission", "revoke a device's MQTT credentials (it can no longer connect); admin role",
                  cmd_fleet_decommission).add_argument("device_id")
    client_parser("models", "list uploaded models", cmd_fleet_models)
    # an older name of 'edgefleet rollout create', kept for the scripts that call it; not listed
    listed = ",".join(f.choices)
    add_create_parser(f, "rollout", "the same as 'edgefleet rollout create' (an older name, kept for scripts)",
                      listed=False)
    f.metavar = "{" + listed + "}"
