"""``edgefleet rollout create|list|status|pause|resume|abort|rollback|audit``: the one rollout front end, over
``fleet.client`` (stdlib HTTP, so an agent-only install runs it). ``edgefleet fleet rollout`` is the same
``create`` under its older name, kept for scripts and not listed in the help.

The fleet is ``--fleet`` or ``$EDGEFLEET_URL``, the token ``--token`` or ``$EDGEFLEET_TOKEN`` (``fleet_options``,
shared by every command that talks to a fleet). A command exits through the CLI's one ``command`` path, with a code
from its one table (``protocol/exits.py``): 0 ok, 2 usage, 6 the fleet is unreachable or refused (the message is
the server's), 7 a rollout waited for (``--wait``) did not succeed or did not finish in time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edgefleet.cli.command import Formatter, api_command
from edgefleet.protocol.exits import ExitCode

if TYPE_CHECKING:
    from edgefleet.fleet.client import FleetClient
    from edgefleet.fleet.schemas import Rollout

__all__ = ["add_create_parser", "add_parsers"]

Command = Callable[[argparse.Namespace, "FleetClient"], tuple[Any, str, int]]  # -> (answer, human text, exit)


def _human(r: Rollout) -> str:
    lines = [f"rollout #{r.id} {r.model} {r.version} ({', '.join(r.profiles or [r.profile])}): {r.status}"
             + (f" - {r.reason}" if r.reason else "")]
    for w in r.waves:
        mark = "▶" if w.index == r.current_wave and r.status in ("in_progress", "paused") else " "
        gates = ", ".join(f"{g.name} {'n/a' if g.value is None else format(g.value, '.3g')}"
                          f"{'≥' if g.name == 'install_success' else '≤'}{g.threshold:g}"
                          f"{'' if g.passed else ' FAILED'}" for g in w.gates or [])
        lines.append(f" {mark} wave {w.index + 1}: {w.size:>6} devices  {w.state:<10} "
                     f"{w.installed} installed, {w.failed} failed" + (f"  [{gates}]" if gates else ""))
    lines.append(f"   devices: {_counts(r)}")
    return "\n".join(lines)


def _counts(r: Rollout) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(r.counts.items()))


def _progress(r: Rollout) -> None:
    sys.stderr.write(f"\rrollout #{r.id}: {_counts(r):<70}")
    sys.stderr.flush()


def cmd_create(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
    gates: dict[str, Any] = {"install_success_min": a.min_install_success}
    if a.max_error_rate is not None:
        gates["error_rate_max"] = a.max_error_rate
    if a.max_p99_ratio is not None:
        gates["p99_ratio_max"] = a.max_p99_ratio
    shadow = None if a.shadow_agreement is None else {"agreement_min": a.shadow_agreement,
                                                      "min_samples": a.shadow_samples}
    r = c.create_rollout(a.model, a.version, devices=a.devices or None, group=a.group, tags=a.tag, profile=a.profile,
                         waves=a.waves, soak_s=a.soak_s, gates=gates, shadow=shadow, on_failure=a.on_failure,
                         rollback_on_failure=a.rollback_on_failure, offline_grace_s=a.offline_grace_s,
                         require_telemetry=a.require_telemetry,
                         **({"download_max_bytes_per_s": a.download_max_bytes_per_s}
                            if a.download_max_bytes_per_s else {}),
                         **({"max_concurrent_downloads": a.max_concurrent_downloads}
                            if a.max_concurrent_downloads else {}), **({"urgent": True} if a.urgent else {}))
    if not a.wait:
        return r, _human(r), ExitCode.OK
    r = c.wait_rollout(r.id, a.wait_s, targets=False, progress=None if a.json else _progress)
    if not a.json:
        sys.stderr.write("\n")
    return r, _human(r), ExitCode.OK if r.status == "succeeded" else ExitCode.ROLLOUT


def cmd_status(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
    r = c.get_rollout(a.id, targets=a.targets)
    human = _human(r) + "".join(f"\n   {t.device_id:<24} wave {t.wave + 1}  {t.state}"
                                + (f"  ({t.error})" if t.error else "") + _download(t.download)
                                for t in r.targets or [])
    return r, human, ExitCode.OK


def _download(d: Any) -> str:
    """A target's download in progress, from its newest telemetry: percent, rate, time left."""
    if d is None:
        return ""
    eta = f", {d.eta_s:.0f}s left" if d.eta_s is not None else ""
    done = 100 * d.bytes_done / d.bytes_total
    return f"  downloading {done:.0f}% of {d.bytes_total} B at {d.bytes_per_s:.0f} B/s{eta}"


def cmd_list(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
    rs = c.rollouts()
    human = "\n".join(f"#{r.id:<5} {r.model} {r.version:<10} {r.status:<12} wave "
                      f"{min(r.current_wave + 1, len(r.waves))}/{len(r.waves)}" for r in rs)
    return rs, human or "no rollouts", ExitCode.OK


def _action(name: str) -> Command:
    def run(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
        r = c.rollout_action(a.id, name)
        return r, _human(r), ExitCode.OK

    return run


def cmd_audit(a: argparse.Namespace, c: FleetClient) -> tuple[Any, str, int]:
    rows = c.rollout_audit(a.id)
    return rows, "\n".join(f"{(x.ts or '')[:19]}  {x.actor:<16} {x.action:<22} "
                           f"{json.dumps(x.detail) if x.detail else ''}" for x in reversed(rows)), ExitCode.OK


def _split(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _floats(value: str) -> list[float]:
    try:
        return [float(x) for x in _split(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of seconds") from None


def add_create_parser(sub: Any, name: str, help_: str = "roll a model version out in waves",
                      listed: bool = True) -> argparse.ArgumentParser:
    """``edgefleet rollout create``; ``edgefleet fleet rollout`` is this parser under another name (``listed``
    false: no line in its group's help)."""
    listing = {"help": help_} if listed else {}
    c = api_command(sub.add_parser(name, formatter_class=Formatter, description=help_, **listing), cmd_create)
    c.add_argument("model")
    c.add_argument("version")
    c.add_argument("--devices", type=_split, help="comma-separated device ids")
    c.add_argument("--group", help="every device of this group")
    c.add_argument("--tag", action="append", help="devices with this tag (repeat: all of them)")
    c.add_argument("--profile", help="devices of this hardware profile (and the build for devices of unknown one)")
    c.add_argument("--waves", type=_split, default=["100%"],
                   help="cumulative wave ends, e.g. 1%%,10%%,50%%,100%% or 5,100%%")
    c.add_argument("--soak-s", type=_floats, default=[0.0],
                   help="soak seconds per wave, comma-separated; the last repeats")
    c.add_argument("--min-install-success", type=float, default=1.0, help="gate: installed/(installed+failed)")
    c.add_argument("--max-error-rate", type=float, help="gate: errors/requests on the new model")
    c.add_argument("--max-p99-ratio", type=float, help="gate: p99 new / p99 previous model, same devices")
    c.add_argument("--shadow-agreement", type=float,
                   help="run each wave's candidate in shadow first (devices mirror live requests to it and keep "
                        "serving their model); install only if top-1 agreement reaches this, e.g. 0.99")
    c.add_argument("--shadow-samples", type=int, default=100, help="mirrored requests per wave before judging")
    c.add_argument("--require-telemetry", action="store_true", help="soak until telemetry gates have figures")
    c.add_argument("--download-max-bytes-per-s", type=int, default=0,
                   help="hold each device's bundle download to this rate (>= 4096; 0: no cap)")
    c.add_argument("--max-concurrent-downloads", type=int, default=0,
                   help="send a wave's update to at most this many devices at a time, more as they finish (0: all)")
    c.add_argument("--urgent", action="store_true", help="install at once, not waiting for maintenance windows")
    c.add_argument("--on-failure", choices=("pause", "abort"), default="pause", help="what a failed gate does")
    c.add_argument("--rollback-on-failure", action="store_true", help="send a failed wave back to its previous model")
    c.add_argument("--offline-grace-s", type=float, default=300.0, help="then a wave stops waiting for offline devices")
    c.add_argument("--wait", action="store_true",
                   help="wait until it leaves in_progress (exit 7 unless it succeeded, or if --wait-s passes)")
    c.add_argument("--wait-s", "--timeout", type=float, default=600.0, help="how long to --wait")
    return c


def add_parsers(sub: Any) -> None:
    ro = sub.add_parser("rollout", help="create and steer rollouts (waves, gates) through the fleet's API")
    rs = ro.add_subparsers(dest="rollout_cmd", required=True)

    def common(name: str, help_: str, fn: Command) -> argparse.ArgumentParser:
        return api_command(rs.add_parser(name, formatter_class=Formatter, help=help_, description=help_), fn)

    add_create_parser(rs, "create")
    st = common("status", "show a rollout: waves, gates, device counts", cmd_status)
    st.add_argument("id", type=int)
    st.add_argument("--targets", action="store_true", help="also list every device")
    common("list", "list rollouts, newest first", cmd_list)
    for name, help_ in (("pause", "stop starting new waves"), ("resume", "go on (past a failed gate too)"),
                        ("abort", "stop for good"), ("rollback", "send its devices back to their previous model")):
        common(name, help_, _action(name)).add_argument("id", type=int)
    common("audit", "who did what to a rollout", cmd_audit).add_argument("id", type=int)
