"""``edgefleet rollout create|list|status|pause|resume|abort|rollback|audit`` over the REST API (httpx).

The token comes from ``--token`` or ``$EDGEFLEET_TOKEN``; exit codes are the CLI's: 0 ok, 4 bad
input, 6 the fleet is unreachable or refused (the message is the server's), 7 a rollout did not
succeed (with ``--wait``) or is not in a good state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["add_parsers"]

EXIT_OK, EXIT_INPUT, EXIT_FLEET, EXIT_ROLLOUT = 0, 4, 6, 7


class _Fail(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _call(a: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    import httpx

    token = a.token or os.environ.get("EDGEFLEET_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.request(method, a.fleet.rstrip("/") + path, json=body, headers=headers, timeout=a.timeout_s)
    except httpx.HTTPError as exc:
        raise _Fail(EXIT_FLEET, f"cannot reach the fleet at {a.fleet}: {exc}") from exc
    if r.status_code >= 400:
        try:
            msg = r.json().get("error") or json.dumps(r.json().get("detail"))
        except ValueError:
            msg = r.text[:500]
        raise _Fail(EXIT_FLEET, f"HTTP {r.status_code}: {msg}")
    return r.json() if r.content else None


def _human(r: dict[str, Any]) -> str:
    lines = [f"rollout #{r['id']} {r['model']} {r['version']} ({', '.join(r.get('profiles') or [r['profile']])}): "
             f"{r['status']}" + (f" - {r['reason']}" if r.get("reason") else "")]
    for w in r.get("waves", []):
        mark = "▶" if w["index"] == r.get("current_wave") and r["status"] in ("in_progress", "paused") else " "
        gates = ", ".join(f"{g['name']} {'n/a' if g['value'] is None else format(g['value'], '.3g')}"
                          f"{'≥' if g['name'] == 'install_success' else '≤'}{g['threshold']:g}"
                          f"{'' if g['passed'] else ' FAILED'}" for g in (w.get("gates") or []))
        lines.append(f" {mark} wave {w['index'] + 1}: {w['size']:>6} devices  {w['state']:<10} "
                     f"{w['installed']} installed, {w['failed']} failed" + (f"  [{gates}]" if gates else ""))
    counts = ", ".join(f"{v} {k}" for k, v in sorted(r.get("counts", {}).items()))
    lines.append(f"   devices: {counts}")
    return "\n".join(lines)


def _out(a: argparse.Namespace, doc: Any, human: str) -> None:
    print(json.dumps(doc, indent=2) if a.json else human)


def _wait(a: argparse.Namespace, rid: int) -> dict[str, Any]:
    deadline = time.monotonic() + a.wait_s
    r = _call(a, "GET", f"/api/v1/rollouts/{rid}?targets=false")
    while r["status"] == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.5)
        r = _call(a, "GET", f"/api/v1/rollouts/{rid}?targets=false")
    return r


def cmd_create(a: argparse.Namespace) -> int:
    gates: dict[str, Any] = {"install_success_min": a.min_install_success}
    if a.max_error_rate is not None:
        gates["error_rate_max"] = a.max_error_rate
    if a.max_p99_ratio is not None:
        gates["p99_ratio_max"] = a.max_p99_ratio
    body: dict[str, Any] = {"model": a.model, "version": a.version, "waves": [w for w in a.waves.split(",") if w],
                            "soak_s": [float(x) for x in a.soak_s.split(",") if x], "gates": gates,
                            "on_failure": a.on_failure, "rollback_on_failure": a.rollback_on_failure,
                            "offline_grace_s": a.offline_grace_s, "require_telemetry": a.require_telemetry}
    if a.shadow_agreement is not None:
        body["shadow"] = {"agreement_min": a.shadow_agreement, "min_samples": a.shadow_samples}
    for key, val in (("devices", [d for d in (a.devices or "").split(",") if d] or None), ("group", a.group),
                     ("tags", a.tag or None), ("profile", a.profile)):
        if val is not None:
            body[key] = val
    r = _call(a, "POST", "/api/v1/rollouts", body)
    if a.wait:
        r = _wait(a, r["id"])
    _out(a, r, _human(r))
    return EXIT_ROLLOUT if a.wait and r["status"] != "succeeded" else EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    r = _call(a, "GET", f"/api/v1/rollouts/{a.id}?targets={'true' if a.targets else 'false'}")
    human = _human(r)
    if a.targets:
        human += "\n" + "\n".join(f"   {t['device_id']:<24} wave {t['wave'] + 1}  {t['state']}"
                                  + (f"  ({t['error']})" if t["error"] else "") for t in r["targets"])
    _out(a, r, human)
    return EXIT_OK


def cmd_list(a: argparse.Namespace) -> int:
    rs = _call(a, "GET", "/api/v1/rollouts")
    _out(a, rs, "\n".join(f"#{r['id']:<5} {r['model']} {r['version']:<10} {r['status']:<12} wave "
                          f"{min(r['current_wave'] + 1, len(r['waves']))}/{len(r['waves'])}" for r in rs)
         or "no rollouts")
    return EXIT_OK


def _action(name: str):
    def run(a: argparse.Namespace) -> int:
        r = _call(a, "POST", f"/api/v1/rollouts/{a.id}/{name}")
        _out(a, r, _human(r))
        return EXIT_OK

    return run


def cmd_audit(a: argparse.Namespace) -> int:
    rows = _call(a, "GET", f"/api/v1/rollouts/{a.id}/audit")
    _out(a, rows, "\n".join(f"{x['ts'][:19]}  {x['actor']:<16} {x['action']:<22} "
                            f"{json.dumps(x['detail']) if x['detail'] else ''}" for x in reversed(rows)))
    return EXIT_OK


def _guard(fn):
    def run(a: argparse.Namespace) -> int:
        try:
            return fn(a)
        except _Fail as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.code
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_INPUT

    return run


def add_parsers(sub: Any, formatter: Any = argparse.HelpFormatter) -> None:
    ro = sub.add_parser("rollout", help="create and steer rollouts (waves, gates) through the fleet's API")
    rs = ro.add_subparsers(dest="rollout_cmd", required=True)

    def common(name: str, help_: str, fn) -> argparse.ArgumentParser:
        p = rs.add_parser(name, formatter_class=formatter, help=help_, description=help_)
        p.add_argument("--fleet", default=os.environ.get("EDGEFLEET_URL", "http://127.0.0.1:8700"),
                       help="fleet server URL ($EDGEFLEET_URL)")
        p.add_argument("--token", help="API token (default $EDGEFLEET_TOKEN)")
        p.add_argument("--json", action="store_true", help="JSON output")
        p.add_argument("--timeout-s", type=float, default=30.0, help="HTTP timeout")
        p.set_defaults(fn=_guard(fn))
        return p

    c = common("create", "roll a model version out in waves", cmd_create)
    c.add_argument("model")
    c.add_argument("version")
    c.add_argument("--devices", help="comma-separated device ids")
    c.add_argument("--group", help="every device of this group")
    c.add_argument("--tag", action="append", help="devices with this tag (repeat: all of them)")
    c.add_argument("--profile", help="devices of this hardware profile (and the build for devices of unknown one)")
    c.add_argument("--waves", default="100%", help="cumulative wave ends, e.g. 1%%,10%%,50%%,100%% or 5,100%%")
    c.add_argument("--soak-s", default="0", help="soak seconds per wave, comma-separated; the last repeats")
    c.add_argument("--min-install-success", type=float, default=1.0, help="gate: installed/(installed+failed)")
    c.add_argument("--max-error-rate", type=float, help="gate: errors/requests on the new model")
    c.add_argument("--max-p99-ratio", type=float, help="gate: p99 new / p99 previous model, same devices")
    c.add_argument("--shadow-agreement", type=float,
                   help="run each wave's candidate in shadow first (devices mirror live requests to it and keep "
                        "serving their model); install only if top-1 agreement reaches this, e.g. 0.99")
    c.add_argument("--shadow-samples", type=int, default=100, help="mirrored requests per wave before judging")
    c.add_argument("--require-telemetry", action="store_true", help="soak until telemetry gates have figures")
    c.add_argument("--on-failure", choices=("pause", "abort"), default="pause", help="what a failed gate does")
    c.add_argument("--rollback-on-failure", action="store_true", help="send a failed wave back to its previous model")
    c.add_argument("--offline-grace-s", type=float, default=300.0, help="then a wave stops waiting for offline devices")
    c.add_argument("--wait", action="store_true", help="wait until it leaves in_progress (exit 7 unless succeeded)")
    c.add_argument("--wait-s", type=float, default=600.0, help="how long to --wait")
    st = common("status", "show a rollout: waves, gates, device counts", cmd_status)
    st.add_argument("id", type=int)
    st.add_argument("--targets", action="store_true", help="also list every device")
    common("list", "list rollouts, newest first", cmd_list)
    for name, help_ in (("pause", "stop starting new waves"), ("resume", "go on (past a failed gate too)"),
                        ("abort", "stop for good"), ("rollback", "send its devices back to their previous model")):
        common(name, help_, _action(name)).add_argument("id", type=int)
    common("audit", "who did what to a rollout", cmd_audit).add_argument("id", type=int)
