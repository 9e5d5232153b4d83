"""``edgefleet``: one command line for the compiler, the fleet, the agent and the demo.

Every command opens and closes the same way (``command`` below): the extras it needs are checked first, and an
error it raises ends it with one line on stderr and its exit code, from the one table (protocol/exits.py, printed
by ``edgefleet --help``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgefleet.progress import progress_bar
from edgefleet.protocol import lograte
from edgefleet.protocol.errors import ConfigError, EdgefleetError
from edgefleet.protocol.exits import ExitCode, exit_for, table

Command = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Flags that parse but do not make sense together (exit 2)."""

    exit_code = ExitCode.USAGE


def _need(extra: str, exc: ImportError) -> int:
    print(f"error: this command needs edgefleet[{extra}] ({exc.name} is not installed): "
          f"pip install 'edgefleet[{extra}]'", file=sys.stderr)
    return ExitCode.INPUT


EXTRAS = {  # what each part imports lazily; checked up front so a missing one is a message, not a traceback
    # (the runtimes are not here: a box has the one its profile uses, and loading a bundle names a missing one)
    "agent": ("paho.mqtt", "starlette", "uvicorn", "tuf", "cryptography", "psutil"),
    "compiler": ("onnx", "onnxruntime.quantization", "tuf", "cryptography"),
    "fleet": ("fastapi", "uvicorn", "sqlalchemy", "paho.mqtt", "tuf", "cryptography"),
    "broker": ("amqtt",),  # the fleet's embedded broker
    "keys": ("tuf", "cryptography"),  # in both [compiler] and [fleet]
    "demo": ("httpx",),  # the demo's load client
}


def _require(*extras: str) -> None:
    import importlib.util

    for extra in extras:
        for mod in EXTRAS[extra]:
            try:
                found = importlib.util.find_spec(mod) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                raise ImportError(f"No module named {mod!r}", name=mod)


def command(*extras: str, advise: str | None = None, imports: tuple[str, ...] = (),
            json_error: Callable[[argparse.Namespace, str, ExitCode], dict[str, Any]] | None = None
            ) -> Callable[[Command], Command]:
    """A command's one opening and closing.

    Opening: the ``extras`` it needs are installed and its heavy ``imports`` import (else one line naming the
    extra to install: ``advise``, default the first extra; exit 4). Closing: an error the body raises is one line on
    stderr and its code (``exit_for``), with ``json_error``'s document on stdout under ``--json``; a bug (exit 1,
    not an error edgefleet raises on purpose) keeps its traceback.
    """

    def wrap(fn: Command) -> Command:
        @functools.wraps(fn)
        def run(a: argparse.Namespace) -> int:
            try:
                _require(*extras)
                for mod in imports:
                    importlib.import_module(mod)
            except ImportError as exc:
                return _need(advise or (extras[0] if extras else "all"), exc)
            try:
                return int(fn(a))
            except Exception as exc:
                code, line = exit_for(exc)
                if code is ExitCode.INTERNAL and not isinstance(exc, EdgefleetError):
                    raise
                print(f"error: {line}", file=sys.stderr)
                if json_error is not None and getattr(a, "json", False):
                    print(json.dumps(json_error(a, line, code)))
                return code

        return run

    return wrap


def _bundle_file(path: Path) -> Path:
    if not path.is_file():
        raise ConfigError(f"{path}: no such bundle file")
    return path


def _print(doc: Any, as_json: bool, human: str) -> None:
    print(json.dumps(doc, indent=2) if as_json else human)


# -- compile ----------------------------------------------------------------------------------------
@command("compiler", imports=("edgefleet.compiler.pipeline", "edgefleet.compiler.fallback"))
def cmd_compile(a: argparse.Namespace) -> int:
    from edgefleet.compiler.fallback import choose as choose_fallback
    from edgefleet.protocol.profile import list_profiles

    profiles = list_profiles() if a.profile == "all" else [p.strip() for p in a.profile.split(",") if p.strip()]
    if not profiles:
        raise UsageError("--profile names no profile")
    matrix = len(profiles) > 1
    results: list[dict[str, Any]] = []
    done: dict[str, dict[str, Any]] = {}  # profile built -> its result: a fallback also asked for is built once
    first_failure = ExitCode.OK
    for i, profile in enumerate(profiles, start=1):
        fallback = None if a.no_cpu_fallback else choose_fallback(profile)
        build = fallback.profile_arg if fallback is not None else profile
        label = f"[{i}/{len(profiles)} {profile}] " if matrix else ""
        if build in done:  # built already in this compile (as asked, or as another profile's fallback)
            r = {**done[build], "seconds": 0.0}
        else:
            r = done[build] = _compile_one(a, build, label)
        if fallback is not None:
            # one entry per profile asked for; the bundle (and its manifest) is the fallback's
            r = {**r, "profile": profile, "cpu_fallback": fallback.as_json()}
            if r["ok"]:
                print(fallback.line(), file=sys.stderr)
            else:
                r["error"] = (f"{fallback.reason}; building its CPU fallback {fallback.built} instead failed: "
                              f"{r['error']}")
        if not r["ok"]:
            first_failure = first_failure or r["exit_code"]
            if not a.json:
                sys.stderr.write("\n")
                print(f"error: {label}{r['error']}", file=sys.stderr)
        elif not matrix and not a.json:
            print(_compile_summary(Path(r["bundle"]), r.pop("_manifest"), r["cached"]))
        r.pop("_manifest", None)
        results.append(r)
    if a.json:
        print(json.dumps({"ok": first_failure == ExitCode.OK, "builds": results} if matrix else results[0], indent=2))
    elif matrix:
        print(_matrix_table(results))
    return first_failure


def _compile_one(a: argparse.Namespace, profile: str, label: str) -> dict[str, Any]:
    """One build; a failure is a result (``ok`` false, its exit code), not an exception."""
    from edgefleet.compiler.cache import default_cache_dir
    from edgefleet.compiler.pipeline import CompileOptions, compile_model

    opts = CompileOptions(
        model=a.model, profile=profile, calibration=a.calibration, eval=a.eval, out_dir=a.out,
        name=a.name or _default_name(a.model), version=a.version, precision=a.precision,
        max_accuracy_drop=a.max_accuracy_drop, benchmark=not a.no_benchmark, gate=a.gate,
        min_agreement=a.min_agreement, agreement_metric=a.agreement_metric,
        cache_dir=None if a.no_cache else default_cache_dir(), preprocess=a.preprocess,
        fallback=not a.no_fallback, task=a.task, task_args=a.task_args)
    progress = (lambda *_: None) if a.json or a.quiet else (
        lambda step, total, what, label=label: progress_bar(step, total, label + what))
    t0 = time.monotonic()
    try:
        result = compile_model(opts, progress)
    except EdgefleetError as exc:
        code, line = exit_for(exc)
        return {"ok": False, "profile": profile, "error": line, "kind": type(exc).__name__, "exit_code": code,
                "seconds": round(time.monotonic() - t0, 2)}
    m = result.manifest
    return {"ok": True, "profile": profile, "bundle": str(result.bundle), "cached": result.cached,
            "seconds": round(time.monotonic() - t0, 2), "manifest": m.model_dump(mode="json"), "_manifest": m}


def _default_name(model: Path) -> str:
    """The model's folder name (or file stem) as a registry name: lower case, [a-z0-9._-]."""
    import re

    raw = model.parent.name if model.parent.name not in ("", ".") else model.stem
    return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-._")[:63] or "model"


def _compile_summary(bundle: Path, m: Any, cached: bool) -> str:
    acc = m.accuracy
    if acc.task is not None:
        figure = (f"{acc.task.metric.replace('_', ' ')} {acc.task.value:.4f} against {acc.reference_precision} "
                  f"({'passed' if acc.passed else 'FAILED'} the {acc.task.task} gate, {acc.eval_samples} samples)")
    elif acc.metric == "agreement":
        worst = min(acc.outputs, key=lambda o: o.value)
        figure = (f"agreement with {acc.reference_precision} {acc.candidate:.4f} (worst output {worst.name!r} by "
                  f"{worst.metric.replace('_', ' ')}; needed {1 - acc.max_drop:.4f}, {acc.eval_samples} samples)")
    else:
        ci = f", 95% CI {acc.drop_ci95[0]:+.4f}..{acc.drop_ci95[1]:+.4f}" if acc.drop_ci95 else ""
        figure = (f"top-1 {acc.candidate_precision} {acc.candidate:.4f}  vs {acc.reference_precision} "
                  f"{acc.reference:.4f}  (drop {acc.drop:+.4f}{ci}, allowed {acc.max_drop:.4f}, "
                  f"{acc.eval_samples} samples)")
    lines = [f"bundle    {bundle}" + ("  (reused from the build cache: inputs unchanged)" if cached else ""),
             f"model     {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision}",
             f"accuracy  {figure}"]
    if acc.task is not None:
        from edgefleet.compiler.pipeline import task_figures

        t = acc.task
        lines.append(f"task      {t.task} ({t.source}) on output {t.output!r}: {task_figures(t)}")
    if acc.not_judged:
        moved = {k.split(".", 1)[1]: v for k, v in (acc.task.details if acc.task else {}).items()
                 if k.startswith("unjudged_rel_l2.")}
        lines.append("not judged " + ", ".join(f"{o!r}" + (f" (relative L2 vs fp32 {moved[o]:.3g})" if o in moved
                                                           else "") for o in acc.not_judged)
                     + ": no task reads it; declare its task in a --task list to judge it")
    for o in acc.outputs:
        t1 = "" if o.top1_agreement is None else f"top-1 agreement {o.top1_agreement:.4f}, "
        lines.append(f"output    {o.name}: {t1}cosine {o.cosine:.4f}, max abs error {o.max_abs_error:.4g}, "
                     f"mean abs error {o.mean_abs_error:.4g}")
    if m.precision_choice is not None:
        for c in m.precision_choice.candidates:
            if c.precision != m.precision and c.top1 is not None:
                what = "agreement" if c.metric == "agreement" else "top-1"
                shipped = "; shipped too: the device times it" if c.precision in m.precisions else ""
                lines.append(f"also      {what} {c.precision} {c.top1:.4f} (drop {c.drop:+.4f}, "
                             f"{'passed' if c.passed else 'FAILED'} the gate)" + (f"; {c.note}" if c.note else "")
                             + shipped)
            elif c.note:
                lines.append(f"also      {c.precision}: {c.note}")
    if m.quantization is not None:
        q = m.quantization
        lines.append(f"int8      {q.scheme} ({q.activation_type} activations, {q.weight_bits}-bit {q.weight_type} "
                     f"weights): {q.reason}")
        for step in q.fallback_steps:
            lines.append(f"fallback  {step}")
        for p in q.fallback_speed:
            lines.append(f"fallback  speed at batch {p.batch_size}: {p.speedup:.2f}x of all-int8")
    for n in getattr(m, "build_notes", ()):  # every retry, fallback and workaround of the build
        lines.append(f"build     {n.step}: {n.action}" + (f" ({n.reason})" if n.reason else ""))
    if m.benchmark:
        ref, cand = m.benchmark.reference_precision, m.benchmark.candidate_precision or acc.candidate_precision
        for p in m.benchmark.points:
            p99 = f", p99 {p.reference_ms_p99:.3f} / {p.candidate_ms_p99:.3f} ms" if p.candidate_ms_p99 else ""
            lines.append(f"latency   batch {p.batch_size:>3}: {ref} {p.reference_ms_p50:.3f} ms, "
                         f"{cand} {p.candidate_ms_p50:.3f} ms p50 ({p.speedup:.2f}x){p99}")
    if m.build_host is not None:
        lines.append(f"built on  {m.build_host.arch} with {', '.join(m.build_host.cpu_features)}; "
                     f"the engine needs {', '.join(m.cpu_features) or 'no particular CPU feature'}")
    if m.engine_compatibility:
        lines.append("engine    needs " + ", ".join(f"{k} {v}" for k, v in sorted(m.engine_compatibility.items())))
    if m.precision_choice is not None:
        lines.append(f"chose     {m.precision_choice.reason}")
    return "\n".join(lines)


def _matrix_table(results: list[dict[str, Any]]) -> str:
    head = f"{'PROFILE':<18} {'BACKEND':<12} {'PREC':<5} {'SIZE':>9} {'FIDELITY':<22} {'LATENCY b1':>11} STATUS"
    rows = [head]
    for r in results:
        fb = r.get("cpu_fallback")
        asked = r["profile"]
        if not r["ok"]:
            rows.append(f"{asked:<18} {'–':<12} {'–':<5} {'–':>9} {'–':<22} {'–':>11} FAILED: {r['error']}")
            continue
        m = r["manifest"]
        acc = m["accuracy"]
        task = acc.get("task")
        fid = (f"top-1 {acc['candidate']:.4f} (-{acc['drop']:.4f})" if acc["metric"] == "top1"
               else f"{task['task']} {task['value']:.4f}" if task else f"agree {acc['candidate']:.4f}")
        size = sum(f["size_bytes"] for f in m["files"].values())
        bench = m.get("benchmark") or {}
        pts = bench.get("points") or []
        shipped = "candidate_ms_p50" if bench.get("candidate_precision") == m["precision"] else "reference_ms_p50"
        lat = f"{pts[0][shipped]:.3f} ms" if pts else "–"  # of the precision shipped
        status = "ok (cached)" if r["cached"] else "ok"
        if fb:
            status += f": built its CPU fallback {fb['built']} ({fb['reason']})"
        rows.append(f"{asked:<18} {m['backend']:<12} {m['precision']:<5} {size / 1024:>7.0f}KB {fid:<22} "
                    f"{lat:>11} {status}")
    return "\n".join(rows)


# -- compile-pipeline -------------------------------------------------------------------------------
@command("compiler", imports=("edgefleet.compiler.pipeline_bundle",),
         json_error=lambda a, line, code: {"ok": False, "pipeline": str(a.pipeline), "profile": a.profile,
                                           "error": line, "exit_code": int(code)})
def cmd_compile_pipeline(a: argparse.Namespace) -> int:
    from edgefleet.compiler.cache import default_cache_dir
    from edgefleet.compiler.pipeline_bundle import PipelineOptions, compile_pipeline

    out = a.out if a.out is not None else Path("dist") / f"{a.pipeline.parent.name or 'pipeline'}-{a.profile}.bundle"
    opts = PipelineOptions(pipeline=a.pipeline, profile=a.profile, eval=a.eval, out=out, calibration=a.calibration,
                           preprocess=a.preprocess, version=a.version, benchmark=not a.no_benchmark,
                           fallback=not a.no_fallback, cache_dir=None if a.no_cache else default_cache_dir(),
                           min_answers=a.min_answers, max_cer=a.max_cer)
    progress = (lambda *_: None) if a.json or a.quiet else progress_bar
    t0 = time.monotonic()
    r = compile_pipeline(opts, progress)
    m = r.manifest
    seconds = round(time.monotonic() - t0, 2)
    if a.json:
        print(json.dumps({"ok": True, "profile": m.profile, "bundle": str(r.bundle), "seconds": seconds,
                          "stage_seconds": r.stage_seconds, "notes": list(r.notes), "gate": list(r.gate),
                          "manifest": m.model_dump(mode="json")}, indent=2))
        return ExitCode.OK
    from edgefleet.compiler.pipeline import task_figures

    assert m.pipeline is not None and m.accuracy.task is not None
    lines = [f"bundle    {r.bundle}",
             f"pipeline  {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision} (lowest stage)"]
    for st in m.pipeline.stages:
        lines.append(f"stage     {st.name}: {st.precision}, engine {st.engine}; "
                     + (st.precision_choice.reason if st.precision_choice is not None else ""))
    for t in r.gate:
        lines.append(f"gate      {' and '.join(f'{k} {v}' for k, v in t['stages'].items())} ({t['how']}): "
                     f"{t['kept']} of {t['of']} end answers kept, {'passed' if t['passed'] else 'FAILED'}")
    lines.append(f"end gate  {task_figures(m.accuracy.task)} on {m.accuracy.eval_samples} images")
    lines.append(f"took      {seconds:.1f} s")
    print("\n".join(lines))
    return ExitCode.OK


# -- keys -------------------------------------------------------------------------------------------
@command("keys", advise="compiler", imports=("edgefleet.fleet.keys",))
def cmd_keys_init(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import init_keys

    root = init_keys(a.dir, force=a.force)
    _print({"ok": True, "keys_dir": str(a.dir), "root": str(root)}, a.json,
           f"wrote TUF keys (root, targets, snapshot, timestamp) to {a.dir}\n"
           f"give agents {root} as --trusted-root; keep root.key offline in production")
    return ExitCode.OK


def _keys_answer(a: argparse.Namespace, doc: dict[str, Any], human: str) -> int:
    _print({"ok": True, **doc}, a.json, human)
    return ExitCode.OK


def _publish_signed(a: argparse.Namespace, path: Path) -> str:
    if a.publish_to is None:
        return f"the fleet publishes {path.name} when it starts next (or pass --publish-to)"
    from edgefleet.fleet.keys import KeyStore
    from edgefleet.fleet.tuf_repo import Repository

    repo = Repository(a.publish_to, KeyStore(a.dir / "fleet"))
    (repo.publish_targets if path.name == "targets.json" else repo.publish_root)(path.read_bytes())
    return f"published in {a.publish_to}"


@command("keys", advise="compiler")
def cmd_keys_create(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import create_keys

    fleet = create_keys(a.dir, force=a.force)
    return _keys_answer(a, {"fleet_keys": str(fleet), "offline": str(a.dir / "offline"), "ci": str(a.dir / "ci")},
                        f"offline (root, targets; keep off any server): {a.dir / 'offline'}\n"
                        f"fleet (snapshot, timestamp; start the fleet with --keys): {fleet}\n"
                        f"ci (bundles: signs each bundle, delegated): {a.dir / 'ci'}\n"
                        f"give agents {fleet / 'root.json'} as --trusted-root")


@command("keys", advise="compiler")
def cmd_keys_rotate(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import rotate_key

    out = rotate_key(a.dir, a.role, a.key_uri)
    return _keys_answer(a, {"role": a.role, "signed": str(out)},
                        f"new {a.role} key; signed {out}; {_publish_signed(a, out)}")


@command("keys", advise="compiler")
def cmd_keys_revoke(a: argparse.Namespace) -> int:
    from edgefleet.fleet.keys import revoke_key

    out = revoke_key(a.dir, a.role, a.keyid)
    return _keys_answer(a, {"role": a.role, "keyid": a.keyid, "signed": str(out)},
                        f"revoked {a.role} key {a.keyid[:12]}…; signed {out}; {_publish_signed(a, out)}")


# -- fleet ------------------------------------------------------------------------------------------
@command("fleet", imports=("edgefleet.fleet.server",))
def cmd_fleet_serve(a: argparse.Namespace) -> int:
    from edgefleet.fleet.server import FleetConfig, FleetServer

    if a.mqtt_url is None:
        try:
            _require("broker")
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
    serve = build_parser().parse_args(["fleet", "serve", *args])  # its usage error, now rather than at boot
    unit = render_unit(args, serve, Path.cwd(), user=a.user)
    if a.dry_run:
        print(unit, end="")
        return ExitCode.OK
    path = install_unit(unit, a.unit_dir)
    print(f"wrote {path}\nnext: systemctl daemon-reload && systemctl enable --now {SERVICE_NAME}")
    return ExitCode.OK


def _client(a: argparse.Namespace):
    from edgefleet.fleet.client import FleetClient

    return FleetClient(a.fleet, token=a.token)


def _print_answer(answer: Any, as_json: bool, human: str) -> None:
    """A typed answer of the fleet: ``--json`` prints it as the fleet sent it."""
    from pydantic import TypeAdapter

    _print(TypeAdapter(Any).dump_python(answer, mode="json", exclude_unset=True), as_json, human)


@command()
def cmd_fleet_upload(a: argparse.Namespace) -> int:
    m = _client(a).upload(_bundle_file(a.bundle), a.sign_key)
    _print_answer(m, a.json, f"uploaded {m.name} {m.version} ({m.profile}) as TUF target {m.target}")
    return ExitCode.OK


@command()
def cmd_fleet_register(a: argparse.Namespace) -> int:
    out = [_client(a).register(d) for d in a.device_ids]
    _print_answer(out, a.json, "\n".join(f"registered {d.device_id}" for d in out))
    return ExitCode.OK


@command()
def cmd_fleet_enroll(a: argparse.Namespace) -> int:
    c = _client(a)
    out = [c.enrollment_token(d, a.ttl) for d in a.device_ids]
    _print_answer(out, a.json, "\n".join(f"{t.device_id}  {t.token}" for t in out)
                  + f"\n(one-time tokens, valid {a.ttl:.0f}s: edgefleet agent --device-id DEVICE --enroll-token "
                    "TOKEN)")
    return ExitCode.OK


@command()
def cmd_fleet_decommission(a: argparse.Namespace) -> int:
    d = _client(a).decommission(a.device_id)
    _print_answer(d, a.json, f"decommissioned {d.device_id}: its MQTT credentials are revoked")
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
    _print_answer(devs, a.json, "\n".join(lines))
    return ExitCode.OK


@command()
def cmd_fleet_models(a: argparse.Namespace) -> int:
    ms = _client(a).models()
    lines = [f"{m.name} {m.version} {m.profile} {m.backend} {m.precision} top-1 {m.accuracy.candidate:.4f}"
             for m in ms]
    _print_answer(ms, a.json, "\n".join(lines) or "no models uploaded")
    return ExitCode.OK


# -- agent ------------------------------------------------------------------------------------------
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
    if a.dry_run:
        print(unit, end="")
        return ExitCode.OK
    path = install_unit(unit, a.unit_dir)
    print(f"wrote {path}\nnext: systemctl daemon-reload && systemctl enable --now {SERVICE_NAME}")
    return ExitCode.OK


# -- bench ------------------------------------------------------------------------------------------
@command("agent", imports=("edgefleet.agent.install.bench",))
def cmd_bench(a: argparse.Namespace) -> int:
    from edgefleet.agent.install.bench import bench_bundle

    _bundle_file(a.bundle)
    try:
        sizes = tuple(int(x) for x in a.batch_sizes.split(",")) if a.batch_sizes else None
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError("batch sizes must be positive")
    except ValueError as exc:
        raise UsageError(f"--batch-sizes {a.batch_sizes!r}: {exc} (e.g. --batch-sizes 1,16)") from None
    m, points, feats = bench_bundle(a.bundle, sizes, a.iterations, threads=a.threads)
    host = m.build_host
    doc = {"bundle": f"{m.name} {m.version} {m.profile}", "precision": m.precision, "cpu_features": list(feats),
           "build_host_cpu_features": list(host.cpu_features) if host else None,
           "points": [p.to_json() for p in points]}
    lines = [f"bundle  {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision}",
             f"here    {', '.join(feats)}",
             f"build   {', '.join(host.cpu_features) if host else 'not recorded'}",
             f"{'batch':>6} {'p50 ms':>9} {'p99 ms':>9} {'items/s':>10} {'build p50':>10} {'here vs build':>13}"]
    for p in points:
        j = p.to_json()
        build = f"{p.build_ms_p50:.3f}" if p.build_ms_p50 else "–"
        ratio = f"{j['vs_build']:.2f}x" if j["vs_build"] else "–"
        lines.append(f"{p.batch_size:>6} {p.ms_p50:>9.3f} {p.ms_p99:>9.3f} {p.items_per_s:>10.1f} {build:>10} "
                     f"{ratio:>13}")
    _print(doc, a.json, "\n".join(lines))
    return ExitCode.OK


# -- toolchain --------------------------------------------------------------------------------------
@command(json_error=lambda a, line, code: {"ok": False, "name": a.name, "error": line, "exit_code": code})
def cmd_toolchain_install(a: argparse.Namespace) -> int:
    from edgefleet.compiler import toolchain

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    st = toolchain.install(a.name, say, force=True) if a.force else toolchain.ensure(a.name, say)
    _print({"ok": True, **st.to_json()}, a.json, _toolchain_line(st))
    return ExitCode.OK


@command()
def cmd_toolchain_status(a: argparse.Namespace) -> int:
    from edgefleet.compiler import toolchain

    found = [toolchain.status(n) for n in ([a.name] if a.name else sorted(toolchain.TOOLCHAINS))]
    doc: Any = found[0].to_json() if a.name else {"toolchains": [st.to_json() for st in found]}
    _print(doc, a.json, "\n".join(_toolchain_line(st) for st in found))
    return ExitCode.TOOLCHAIN if a.name and not found[0].installed else ExitCode.OK


def _toolchain_line(st: Any) -> str:
    if not st.installed:
        line = f"{st.name:<8} not installed: run `edgefleet toolchain install {st.name}`"
    else:
        versions = ", ".join(f"{k} {v}" for k, v in st.versions.items())
        line = (f"{st.name:<8} installed {st.installed_at} in {st.install_seconds:.0f} s, "
                f"{(st.size_bytes or 0) / 1e9:.2f} GB at {st.path}\n         {versions}")
    if st.stale:
        line += f"\n         older environments that can be deleted: {', '.join(str(p) for p in st.stale)}"
    return line


# -- verify -----------------------------------------------------------------------------------------
@command("agent", imports=("edgefleet.agent.install.verify",),
         json_error=lambda a, line, code: {"ok": False, "error": line})
def cmd_verify(a: argparse.Namespace) -> int:
    from edgefleet.agent.install.verify import verify_bundle

    _bundle_file(a.bundle)
    r = verify_bundle(a.bundle, a.eval, threads=a.threads, skip_cpu_check=a.skip_cpu_check,
                      precision=a.precision, reference=a.reference)
    m = r.manifest
    lines = [f"bundle    {m.name} {m.version}  profile {m.profile}  {m.backend} {m.precision}",
             f"this CPU  {r.arch} with {', '.join(r.cpu_features)}"]
    if not r.cpu_ok:
        lines.append(f"REFUSED   {r.cpu_reason}" + (" (running anyway: --skip-cpu-check)" if a.skip_cpu_check else ""))
    if r.selftest is None and r.selftest_error:
        lines.append(f"FAILED    {r.selftest_error}")
    elif r.selftest is not None:
        st = r.selftest
        top = f", top-1 {st.top1:.4f}" if st.top1 is not None else ""
        lines.append(f"self-test {st.samples} samples: drift {st.drift:.2f}x tolerance{top}"
                     + (f" (build: {m.selftest_summary.top1:.4f})" if m.selftest_summary
                        and m.selftest_summary.top1 is not None else ""))
    if r.top1 is not None and r.drop_vs_fp32 is not None:
        lines.append(f"top-1     {r.top1:.4f} on {r.eval_samples} samples here; recorded {r.recorded_top1:.4f}, "
                     f"fp32 {m.accuracy.reference:.4f} (drop {r.drop_vs_fp32:+.4f}, allowed {m.accuracy.max_drop:.4f})")
    elif r.top1 is not None:
        lines.append(f"top-1     {r.top1:.4f} on {r.eval_samples} samples here (the build was gated by agreement "
                     f"with fp32, worst output {m.accuracy.candidate:.4f}: no labelled figure to compare)")
    if r.gate is not None:
        g = r.gate
        what = (f"{g.task.task}: {', '.join(f'{c.name} {c.value:.4f}' for c in g.task.criteria)}" if g.task
                else f"agreement {g.candidate:.4f} (needs {1 - g.max_drop:.4f})")
        note = f"; {r.gate_note}" if r.gate_note else ""
        lines.append(f"gate      {what} on {g.eval_samples} samples of {a.eval} (no labels), this CPU against "
                     f"{r.gate_reference}{note}: {'holds' if g.passed else 'FAILS'}")
    if r.selftest is not None or r.selftest_error:
        lines.append("computes  " + ("as gated: the same answers the compiler measured" if r.computes_as_gated
                                     else "NOT as gated: this CPU gives other answers than the ones gated"))
    _print(r.to_json(), a.json, "\n".join(lines))
    if not r.cpu_ok and not a.skip_cpu_check:
        return ExitCode.INPUT
    return ExitCode.OK if r.computes_as_gated else ExitCode.GATE


# -- demo -------------------------------------------------------------------------------------------
@command("agent", "compiler", "fleet", "demo", advise="demo", imports=("edgefleet.demo",))
def cmd_demo(a: argparse.Namespace) -> int:
    from edgefleet.demo import DemoOptions, run_demo

    if a.mqtt_url is None:
        try:
            _require("broker")
        except ImportError as exc:
            return _need("demo", exc)
    return run_demo(DemoOptions(work_dir=a.work_dir, agents=a.agents, mqtt_url=a.mqtt_url, port=a.port,
                                embedded_mqtt_port=a.embedded_mqtt_port, keep_running=not a.exit,
                                as_json=a.json, pipeline=a.pipeline))


# -- parser -----------------------------------------------------------------------------------------
def _shown(value: Any) -> str:
    """A default as an operator would type it (a list as its comma list), %-escaped for argparse."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, bool):
        value = "on" if value else "off"
    return str(value).replace("%", "%%")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default stated once, and only where it says something: not for an
    option whose help already states it (or what its absence means), a flag, or a default of nothing."""

    settings: dict[str, tuple[str, str | None]] = {}  # flags a config file can set too (the agent's)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.dest in self.settings:
            return text + self._setting(*self.settings[action.dest], action.dest)
        default = action.default
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or default in ([], ()) or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        return f"{text} (default: {_shown(default)})"

    @staticmethod
    def _setting(key: str, none_means: str | None, dest: str) -> str:
        from edgefleet.agent.config import AgentConfig  # at --help only; pydantic and PyYAML are base dependencies

        field = AgentConfig.model_fields[key]
        named = "" if key == dest else f" (key {key} in --config)"
        if field.is_required():
            return f"{named} (required: here or in --config)"
        value = field.get_default(call_default_factory=True)
        return f"{named} (default: from --config, else {(none_means or 'none') if value is None else _shown(value)})"


class _AgentFormatter(_Formatter):
    settings = AGENT_SETTINGS


def build_parser() -> argparse.ArgumentParser:
    from edgefleet.fleet import cli_rollout, simulator  # argparse only: nothing heavy is imported here

    p = argparse.ArgumentParser(prog="edgefleet", formatter_class=_Formatter, description=(
        "edgefleet: compile models into signed bundles, roll them out to edge devices over MQTT, and serve\n"
        "them on each device with dynamic batching.\n\n"
        "  edgefleet demo                       the whole loop on this machine, in one command\n"
        "  edgefleet compile MODEL --profile P  build a quantized, gated, benchmarked bundle\n"
        "  edgefleet compile-pipeline P.yaml    build a detector + reader pipeline as one bundle\n"
        "  edgefleet keys init DIR              make the TUF signing keys\n"
        "  edgefleet fleet serve ...            run the fleet server (REST, console, TUF repo, MQTT)\n"
        "  edgefleet agent ...                  run the device daemon"), epilog=table())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_compile, _add_compile_pipeline, _add_bench, _add_verify, _add_toolchain, _add_keys, _add_fleet,
                _add_agent, _add_demo):
        add(sub)
    simulator.add_parser(sub, _Formatter)
    cli_rollout.add_parsers(sub, _Formatter)
    return p


def _add_compile(sub: Any) -> None:
    c = sub.add_parser("compile", formatter_class=_Formatter, help="compile an ONNX model into a bundle",
                       description="Check the graph, quantize (static INT8, QDQ) for the weakest CPU the profile "
                                   "admits (its cpu_features, never the build host), gate on accuracy against FP32, "
                                   "benchmark, keep the fastest precision that passes (--precision auto), and "
                                   "write a bundle archive.")
    c.add_argument("model", type=Path, help="source ONNX model with a dynamic batch dimension")
    c.add_argument("--profile", required=True,
                   help="hardware profile name (hw-profiles/NAME.yaml) or a YAML path; several as a comma list, or "
                        "'all': builds each, continues past a failed one, prints a summary table, and exits "
                        "non-zero if any failed")
    c.add_argument("--calibration", type=Path,
                   help="for INT8 calibration: an .npz keyed by input name, an .npy, or a folder of images "
                        "(decoded with OpenCV through --preprocess)")
    c.add_argument("--preprocess", type=Path,
                   help="preprocess.yaml (input, height, width, color rgb|bgr|gray, layout nchw|nhwc, scale, mean, "
                        "std): how an image becomes the input; recorded in the bundle for the agent's image "
                        "endpoint (default with image folders: RGB in [0, 1] at the input's size)")
    c.add_argument("--eval", required=True, type=Path,
                   help=".npz with the input(s), and 'labels' if you have them, or a folder of images (one "
                        "subfolder per class gives labels): with labels the gate is top-1 accuracy against fp32, "
                        "without it is output agreement with fp32")
    c.add_argument("--name", help="model name in the registry (default: the model's folder name)")
    c.add_argument("--version", default="1.0.0", help="model version, MAJOR.MINOR.PATCH")
    c.add_argument("--precision", choices=["auto", "int8", "bf16", "fp32", "fp16"], default="auto",
                   help="auto: build every precision the profile allows and this host can gate (bf16: a CPU with "
                        "avx512_bf16 or amx_bf16 and edgefleet[openvino]), keep the fastest that passes the "
                        "accuracy gate on the profile's benchmark, and record each")
    c.add_argument("--max-accuracy-drop", type=float,
                   help="largest allowed top-1 drop versus FP32, absolute (default: the profile's accuracy.max_drop)")
    c.add_argument("--gate", choices=["auto", "accuracy", "agreement"], default="auto",
                   help="auto: accuracy when --eval has labels that fit the first output, else agreement")
    c.add_argument("--min-agreement", type=float,
                   help="agreement gate: every output's top-1 agreement (class scores, sequences) or cosine "
                        "similarity (other outputs) with fp32 must reach this (default: the profile's "
                        "accuracy.min_agreement)")
    c.add_argument("--agreement-metric", choices=["auto", "top1", "cosine"], default="auto",
                   help="how outputs are compared without labels; use cosine for embeddings")
    c.add_argument("--task", help="what the model is for, judged by the gate without labels: classification (top-1 "
                   "agreement), detection (box recall/precision/IoU), ctc (decoded strings: exact agreement, "
                   "character error rate), segmentation (mask IoU), regression (decision agreement, errors; alias "
                   "probabilities), embedding (cosine), keypoints (landmarks, pose: PCK). A model whose outputs "
                   "serve several tasks: a list 'NAME:k=v,...;NAME:output=OUT,...' (e.g. 'classification:output=prob;"
                   "keypoints:output=lms,boxes=box'), each task after the first naming its output. Default: "
                   "MODEL.task.yaml beside the model, else inferred from the output shapes (printed)")
    c.add_argument("--task-args", help="k=v,... for the (first) task, e.g. 'format=yolov8,score=0.25,iou=0.5' or "
                   "'format=centernet,wh=WH,offset=REG,landmarks=LMS' (detection), 'boxes=BOX,pck=0.05' (keypoints), "
                   "'blank=0,min_exact=0.95,max_cer=0.02' (ctc), 'threshold=0.5' (regression, segmentation), "
                   "'output=NAME' (which output the task reads)")
    c.add_argument("--no-fallback", action="store_true",
                   help="int8 over budget fails (or auto ships another precision) instead of keeping the layers "
                        "that lose most to quantization in float until it passes (onnxruntime targets)")
    c.add_argument("--no-cpu-fallback", action="store_true",
                   help="a profile whose toolchain is not on this host (TensorRT for jetson-*) fails (exit 5) instead "
                        "of building the CPU profile it names as cpu_fallback (arm64-cpu), which its devices then "
                        "get until a bundle of their own profile is uploaded")
    c.add_argument("--no-cache", action="store_true",
                   help="build even if an identical build is cached ($EDGEFLEET_CACHE_DIR or ~/.cache/edgefleet)")
    c.add_argument("--out", type=Path, default=Path("dist"), help="folder for the bundle")
    c.add_argument("--no-benchmark", action="store_true", help="skip the latency benchmark")
    c.add_argument("--json", action="store_true", help="print the result as JSON on stdout (for CI)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_compile)


def _add_compile_pipeline(sub: Any) -> None:
    c = sub.add_parser(
        "compile-pipeline", formatter_class=_Formatter, help="compile a detector + reader pipeline into one bundle",
        description="Build a detect-then-read pipeline (pipeline.yaml: two stages, each an ONNX model, and the steps "
                    "between them: boxes from the detector, crops, CTC decode or top-k) for one hardware profile as "
                    "ONE bundle the agent serves as one model. The FP32 pipeline runs once on --eval: its end "
                    "answers are the reference and its crops become the reader's evaluation and calibration data. "
                    "Each stage is compiled as 'edgefleet compile' would (its precision from pipeline.yaml, default "
                    "auto; gated on its own task: segmentation for a probability-map detector, detection for a YOLO "
                    "head, ctc or classification for the reader), then the whole pipeline is gated on its end "
                    "answers against the FP32 pipeline (boxes matched at IoU 0.5, strings exact and by character "
                    "error rate). Signing happens at upload, as for compile (edgefleet fleet upload --sign-key).")
    c.add_argument("pipeline", type=Path, help="pipeline.yaml (stages' model paths relative to its folder)")
    c.add_argument("--profile", required=True, help="hardware profile name (hw-profiles/NAME.yaml) or a YAML path")
    c.add_argument("--eval", required=True, type=Path,
                   help="the detector's input images: an .npz keyed by its input name (NCHW, normalized as "
                        "crop.source says), an .npy, or a folder of images (needs --preprocess); at least 10 boxes "
                        "must be found on them for the end-answer gate to judge")
    c.add_argument("--calibration", type=Path,
                   help="images INT8 calibrates on, same forms as --eval (default: the --eval images; the reader "
                        "calibrates on the FP32 pipeline's crops of them)")
    c.add_argument("--preprocess", type=Path,
                   help="preprocess.yaml for the detector's input (its scale/mean/std must be crop.source's): recorded "
                        "so the agent's /infer/image feeds the pipeline; needed with a folder of images")
    c.add_argument("-o", "--out", type=Path,
                   help="the bundle file to write (default dist/<pipeline folder>-<profile>.bundle)")
    c.add_argument("--version", help="the bundle's version (default: pipeline.yaml's)")
    c.add_argument("--min-answers", type=float, default=0.98,
                   help="end-answer gate: the share of the FP32 pipeline's answers (boxes found and read the same) "
                        "the built pipeline must keep")
    c.add_argument("--max-cer", type=float, default=0.02,
                   help="end-answer gate: the largest character error rate against the FP32 pipeline's strings")
    c.add_argument("--no-fallback", action="store_true",
                   help="a stage's int8 over its gate is not rescued by keeping its most sensitive layers in float")
    c.add_argument("--no-cache", action="store_true", help="build each stage even if an identical build is cached")
    c.add_argument("--no-benchmark", action="store_true", help="skip the stages' latency benchmarks")
    c.add_argument("--json", action="store_true", help="print the result as JSON on stdout (for CI)")
    c.add_argument("--quiet", action="store_true", help="no progress")
    c.set_defaults(fn=cmd_compile_pipeline)


def _bundle_command(sub: Any, name: str, fn: Command, help_: str, description: str) -> argparse.ArgumentParser:
    """A command that runs a bundle on this machine: the bundle, its inference threads, --json."""
    p = sub.add_parser(name, formatter_class=_Formatter, help=help_, description=description)
    p.add_argument("bundle", type=Path, help="bundle archive from 'edgefleet compile'")
    p.add_argument("--threads", type=int, default=2, help="inference threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (for CI)")
    p.set_defaults(fn=fn)
    return p


def _add_bench(sub: Any) -> None:
    b = _bundle_command(sub, "bench", cmd_bench, "benchmark a bundle on this box",
                        "Run a bundle's engine through the agent's backend on this machine at the "
                        "batch sizes the compiler benchmarked (or --batch-sizes), and print latency "
                        "p50/p99 and throughput next to the build host's figures from the manifest "
                        "(here vs build > 1 means faster here). Fixed iteration counts; nothing leaves "
                        "the machine.")
    b.add_argument("--batch-sizes", help="comma list, e.g. 1,16 (default: those in the manifest's benchmark)")
    b.add_argument("--iterations", type=int, default=30, help="timed runs per batch size")


def _add_verify(sub: Any) -> None:
    v = _bundle_command(sub, "verify", cmd_verify, "run a bundle on this CPU as an agent would",
                        "Load a bundle through the agent's backend on this machine's CPU, run its "
                        "self-test and, with --eval, measure top-1 against the figure the compiler "
                        "recorded (without labels in --eval: the gate's own metric on those inputs "
                        "against an fp32 engine run on the same inputs: the bundle's own, or "
                        "--reference; refused when there is none). Exit 0 if it holds, 3 if this CPU "
                        "computes something else, 4 if this CPU lacks the instruction sets the bundle "
                        "needs or the data cannot be judged. Try it on an emulated "
                        "AVX2-only CPU: qemu-x86_64 -cpu Haswell .venv/bin/python -m edgefleet.cli verify")
    v.add_argument("--eval", type=Path, help=".npz with input(s) and 'labels' (e.g. models/digits/test.npz); "
                   "without labels, the gate's own metric on its inputs against fp32 (the bundle's fp32 engine, or "
                   "--reference)")
    v.add_argument("--reference", type=Path, metavar="MODEL.onnx",
                   help="the fp32 model the bundle was compiled from: what a label-free --eval set is judged against "
                        "when the bundle carries no fp32 engine (checked against the fp32 outputs the bundle recorded)")
    v.add_argument("--precision", metavar="P",
                   help="verify this precision's engine: a bundle compiled where its devices' CPU could not be timed "
                        "carries every precision that passed the gate, and the device picks one (default: the "
                        "bundle's own engine, the one an agent serves before it times them)")
    v.add_argument("--skip-cpu-check", action="store_true",
                   help="run even if this CPU lacks the features the bundle's profile promises (diagnostics)")


def _add_toolchain(sub: Any) -> None:
    tc = sub.add_parser("toolchain", help="install or inspect the isolated build toolchains (tflite: onnx2tf)"
                        ).add_subparsers(dest="toolchain_cmd", required=True)
    ti = tc.add_parser("install", formatter_class=_Formatter, help="create a toolchain's environment",
                       description="Create the toolchain's own virtual environment ($EDGEFLEET_TOOLCHAIN_DIR, "
                                   "default ~/.cache/edgefleet/toolchains) and install its pinned packages from "
                                   "PyPI. tflite (onnx2tf, TensorFlow) is about 2.6 GB. Progress goes to stderr. "
                                   "Nothing is installed into edgefleet's own environment.")
    ti.add_argument("name", help="toolchain name: tflite")
    ti.add_argument("--force", action="store_true", help="reinstall even if it is installed")
    ti.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ti.set_defaults(fn=cmd_toolchain_install)
    ts = tc.add_parser("status", formatter_class=_Formatter, help="show installed toolchains",
                       description="Show whether a toolchain is installed, its versions, size and install time. "
                                   "With NAME, exits 5 if that toolchain is not installed.")
    ts.add_argument("name", nargs="?", help="toolchain name (default: all)")
    ts.add_argument("--json", action="store_true", help="JSON output")
    ts.set_defaults(fn=cmd_toolchain_status)


def _add_keys(sub: Any) -> None:
    k = sub.add_parser("keys", help="manage the TUF signing keys").add_subparsers(dest="keys_cmd", required=True)
    ki = k.add_parser("init", formatter_class=_Formatter, help="create root/targets/snapshot/timestamp keys",
                      description="Create one Ed25519 key per TUF role and the first signed root.json.")
    ki.add_argument("dir", type=Path, help="folder for the keys (created; files are mode 0600)")
    ki.add_argument("--force", action="store_true", help="replace existing keys (devices must get the new root.json)")
    ki.add_argument("--json", action="store_true", help="JSON output")
    ki.set_defaults(fn=cmd_keys_init)
    kc = k.add_parser("create", formatter_class=_Formatter, help="create keys split by where they live",
                      description="Root and targets keys for offline storage, snapshot and timestamp keys for the "
                                  "fleet, and a 'bundles' key for the compiler's CI (a delegated targets role): a "
                                  "compromised fleet server alone cannot make a device install a model.")
    kc.add_argument("dir", type=Path, help="folder for offline/, fleet/ and ci/ (files are mode 0600)")
    kc.add_argument("--force", action="store_true", help="replace existing keys (devices must get the new root.json)")
    kc.add_argument("--json", action="store_true", help="JSON output")
    kc.set_defaults(fn=cmd_keys_create)
    for name, fn, help_ in (("rotate", cmd_keys_rotate, "replace a role's key (needs the offline keys)"),
                            ("revoke", cmd_keys_revoke, "remove one key from a role (needs the offline keys)")):
        kr = k.add_parser(name, formatter_class=_Formatter, help=help_, description=help_ + "; writes a newly "
                          "signed root.json (or targets.json for 'bundles') into DIR/fleet.")
        kr.add_argument("dir", type=Path, help="the folder from 'edgefleet keys create'")
        kr.add_argument("role", choices=("root", "targets", "snapshot", "timestamp", "bundles"))
        if name == "revoke":
            kr.add_argument("keyid", help="the key's id (hex), as in root.json or targets.json")
        else:
            kr.add_argument("--key-uri", help="the new key is not a file here but at this URI: hsm:2?label=TOKEN "
                            "(PKCS#11; PYKCS11LIB, $EDGEFLEET_HSM_PIN), encfile:PATH (an encrypted PKCS#8 PEM; "
                            "$EDGEFLEET_KEY_PASSPHRASE), file2:PATH")
        kr.add_argument("--publish-to", type=Path, help="a fleet's TUF folder (DATA_DIR/tuf) to publish in at once")
        kr.add_argument("--json", action="store_true", help="JSON output")
        kr.set_defaults(fn=fn)


def _add_fleet(sub: Any) -> None:
    from edgefleet.fleet.cli_rollout import add_create_parser, fleet_options

    f = sub.add_parser("fleet", help="run or talk to the fleet server").add_subparsers(dest="fleet_cmd",
                                                                                       required=True)
    fs = f.add_parser("serve", formatter_class=_Formatter, help="run the fleet server",
                      description="REST API, web console, TUF repository and MQTT bridge. Binds 127.0.0.1 unless "
                                  "--host says otherwise. Without --mqtt-url it embeds an MQTT broker.")
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
    svc = f.add_parser("install-service", formatter_class=_Formatter, help="write the fleet's systemd unit",
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
        sp = f.add_parser(name, formatter_class=_Formatter, help=help_, description=help_)
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
    add_create_parser(f, "rollout", _Formatter, "the same as 'edgefleet rollout create' (an older name, kept for "
                                                "scripts)", listed=False)
    f.metavar = "{" + listed + "}"


def _add_agent(sub: Any) -> None:
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
    svc = ag_sub.add_parser("install-service", formatter_class=_Formatter, help="write the systemd unit",
                            description="Validate the agent's YAML config and write a systemd unit that runs "
                                        "`edgefleet agent --config CONFIG` (Type=notify, SIGTERM drains in-flight "
                                        "requests). Never runs systemctl: it prints the commands to enable it.")
    svc.add_argument("--config", dest="service_config", type=Path, default=Path("/etc/edgefleet/agent.yaml"),
                     help="the agent's YAML config (validated now; the unit refers to it)")
    svc.add_argument("--unit-dir", type=Path, default=Path("/etc/systemd/system"), help="where to write the unit")
    svc.add_argument("--user", default="edgefleet", help="the system user the agent runs as")
    svc.add_argument("--dry-run", action="store_true", help="print the unit instead of writing it")
    svc.set_defaults(fn=cmd_agent_install_service)


def _add_demo(sub: Any) -> None:
    d = sub.add_parser("demo", formatter_class=_Formatter, help="run the whole loop locally",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
