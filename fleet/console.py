"""The web console: server-rendered pages, readable at a glance, refreshing themselves.

The pages are Jinja2 templates (``fleet/templates``) with autoescaping on: every value a device, an operator or the
database gave is HTML-escaped by the template engine, none by hand, and nothing is marked safe but this module's
CSS and the SVG charts of ``fleet.charts`` (which escape their labels). This module turns the fleet's records into
plain values (numbers formatted, links built); the templates hold all the markup.
"""

from __future__ import annotations

import datetime as dt
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, StrictUndefined, Template
from markupsafe import Markup

from ..protocol import mqtt as proto
from ..protocol.signed_time import describe_skew
from ..protocol.window import MaintenanceWindow, next_window
from .charts import device_time_charts, wave_time_charts
from .states import TargetState

__all__ = ["PAGE_SIZE", "STATE_STYLES", "render"]

PAGE_SIZE = 50  # rows of a console list per page (devices, a rollout's targets); filtered and paged in SQL
TEMPLATES = Path(__file__).resolve().parent / "templates"

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1b1f24;background:#fafbfc}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
.sub{color:#57606a;margin-bottom:16px}
table{border-collapse:collapse;width:100%;background:#fff;border:1px solid #d0d7de}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #eaeef2;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
.pill{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600}
.ok{background:#dafbe1;color:#116329}.bad{background:#ffebe9;color:#a40e26}
.wait{background:#fff8c5;color:#7d4e00}.off{background:#eaeef2;color:#57606a}
.info{background:#ddf4ff;color:#0550ae}
.summary span{margin-right:18px} code{font-size:12px}
"""

# the pill of every state shown: a rollout's, a wave's and a target's (fleet.states), a device's last report
# (protocol.mqtt.ReportedState) and its connection; tests/test_rollout_states.py checks none is missing.
# ok: done well; bad: failed or undone; wait: under way; info: shadowing (serving the old model, judging the
# new one); off: nothing to do
STATE_STYLES = {
    "online": "ok", "offline": "off", "decommissioned": "off",
    "in_progress": "wait", "paused": "wait", "succeeded": "ok", "failed": "bad", "aborted": "bad",
    "rolled_back": "bad",
    "pending": "wait", "shadowing": "info", "installing": "wait", "soaking": "wait", "passed": "ok",
    "downloading": "wait", "installed": "ok", "rolling_back": "wait", "rollback_failed": "bad",
}


_UNDONE = ("failed", "rolled_back", "rollback_failed")  # targets counted as failed in a rollout's progress bar
# the filters' choices: a device's connection or last report (protocol.mqtt.ReportedState), a target's state
DEVICE_STATES = ("online", "offline", "downloading", "installing", "installed", "shadowing", "failed",
                 "rolled_back", "decommissioned")
TARGET_STATES = tuple(str(t) for t in TargetState)
ACTIONS = {"in_progress": ("pause", "abort", "rollback"), "paused": ("resume", "abort", "rollback"),
           "failed": ("rollback",), "aborted": ("rollback",), "succeeded": ("rollback",)}
CSS_MORE = """
.bar{background:#eaeef2;border-radius:4px;height:10px;width:160px;display:inline-block;vertical-align:middle}
.bar i{display:block;height:10px;border-radius:4px;background:#2da44e}.bar i.badbar{background:#cf222e}
form.inline{display:inline;margin-right:6px} button{font:inherit;padding:3px 12px;cursor:pointer}
button.danger{color:#a40e26} nav{margin-bottom:12px} nav a{margin-right:14px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(330px,1fr));gap:12px}
.chart{background:#fff;border:1px solid #d0d7de;padding:8px} .chart h3{font-size:13px;margin:0 0 4px}
label{margin-right:12px} input,select{font:inherit}
"""




@lru_cache(maxsize=1)
def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
    env.globals.update(STATE_STYLES=STATE_STYLES, DEVICE_STATES=DEVICE_STATES, TARGET_STATES=TARGET_STATES)
    return env


def _template(name: str) -> Template:
    return _env().get_template(name)


def _macros() -> Any:
    return _template("_macros.html").module


def _html(name: str, **values: Any) -> str:
    return _template(name).render(**values)


# -- values for the templates (plain text; the templates escape it) ------------------------------------------
def _pill(text: str | None) -> str:
    return str(_macros().pill(text))


def _telemetry(t: dict[str, Any] | None) -> SimpleNamespace | None:
    if not t:
        return None
    rate = t["requests"] / t["interval_s"] if t["interval_s"] else 0.0
    p95 = t["latency"]["p95_ms"]
    return SimpleNamespace(rate=f"{rate:.1f}", errors=t["errors"], p95="–" if p95 is None else f"{p95:.1f} ms",
                           batch=f'{t["batch_size_mean"]:.1f}' if t["batch_size_mean"] is not None else "–",
                           cpu=f'{t["cpu_percent"]:.0f}', rss=f'{t["rss_mb"]:.0f}')


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} ms"


def _stages(t: dict[str, Any] | None) -> list[SimpleNamespace]:
    """A pipeline's stages in the device's newest telemetry record (protocol.mqtt.StageFigures, as the agent sent them:
    in pipeline order), over that record's interval; none for a single model."""
    stages = (t or {}).get("stages") or {}
    return [SimpleNamespace(name=name, calls=f["calls"], errors=f["errors"], p50=_ms(f["latency"]["p50_ms"]),
                            p99=_ms(f["latency"]["p99_ms"]),
                            batch="–" if f.get("batch_size_mean") is None else f'{f["batch_size_mean"]:.1f}',
                            batches=f["batches"]) for name, f in stages.items()]


def _selftest(st: dict[str, Any] | None, running: tuple[Any, Any] | None = None) -> SimpleNamespace | None:
    """The device's own self-test figure next to the compile-time one for the same build; marked as
    stale when the device no longer runs the build it was measured on (e.g. after a rollback)."""
    if not st:
        return None
    stale = None
    if running is not None and (st.get("model"), st.get("version")) != tuple(running):
        stale = (str(st.get("model")), str(st.get("version")))
    build = st.get("build") or {}
    if st.get("top1") is not None:
        mine = f'top-1 {st["top1"]:.3f}'
        theirs = f'build {build["top1"]:.3f}' if build.get("top1") is not None else ""
    elif st.get("top1_agreement") is not None:
        mine, theirs = f'agree {st["top1_agreement"]:.3f}', ""
    else:
        mine, theirs = f'drift {st["drift"]:.2f}×', ""
    cls = "ok" if (st.get("top1") is None or build.get("top1") is None or st["top1"] >= build["top1"]) else "wait"
    what = "agreement with fp32 (worst output)" if build.get("metric") == "agreement" else "top-1"
    tip = (f'{st["samples"]} samples on this device; drift {st["drift"]:.2f}× tolerance; compile-time {what} '
           f'{build.get("accuracy", "?")} on {build.get("eval_samples", "?")} samples')
    return SimpleNamespace(cls=cls, tip=tip, mine=mine, theirs=theirs, stale=stale)


def _selftest_cell(st: dict[str, Any] | None, running: tuple[Any, Any] | None = None) -> str:
    return str(_macros().selftest_cell(_selftest(st, running)))


def _serving(st: dict[str, Any] | None) -> SimpleNamespace | None:
    """How the device serves its model, as it chose on its own CPU: 'int8 (timed here: int8 412/s, fp32 230/s),
    batches up to 8 (measured), 1 instance of 2 threads (default)'."""
    sv = (st or {}).get("serving")
    if not sv:
        return None
    how = {"device": "timed here", "operator": "set on the device", "bundle": "the bundle's"}.get(
        sv["precision_source"], sv["precision_source"])
    figures = ", ".join(f'{t["precision"]} {t["items_per_s"]:g}/s' for t in sv.get("precisions") or [])
    return SimpleNamespace(precision=sv["precision"], detail=how + (f": {figures}" if figures else ""),
                           max_batch_size=sv["max_batch_size"], batch_source=sv["batch_source"],
                           instances=sv["instances"], threads=sv["threads"],
                           layout_source=sv.get("layout_source", "default"), runtime=_runtime(sv.get("runtime")))


# how the runtime was chosen, as the console names it: pinned (the agent's config names it), auto (timed here), or
# one runtime (the only one installed there that runs the bundle: nothing to choose)
_RUNTIME_SOURCES = {"operator": ("pinned", "set in the agent's config"), "device": ("auto", "timed here"),
                    "only": ("one runtime", "the only runtime here that runs it")}


def _runtime(rc: dict[str, Any] | None) -> SimpleNamespace | None:
    """The runtime serving the model (issue 35): 'openvino (auto · timed here: openvino 612/s, onnxruntime 402/s)'
    or 'onnxruntime (pinned · set in the agent's config)'; the figures per batch size as its tooltip. None from an
    agent that does not say (older releases)."""
    if not rc:
        return None
    mode, how = _RUNTIME_SOURCES.get(rc["source"], (rc["source"], ""))
    figures = ", ".join(f'{t["runtime"]} {t["items_per_s"]:g}/s' for t in rc.get("runtimes") or [])
    per_batch = "; ".join(f'{t["runtime"]}: ' + ", ".join(f'batch {b["batch_size"]} {b["items_per_s"]:g}/s'
                                                          for b in t.get("timings") or [])
                          for t in rc.get("runtimes") or [] if t.get("timings"))
    return SimpleNamespace(name=rc["runtime"], mode=mode,
                           detail=how + (f": {figures}" if figures else ""), tip=per_batch)


def _serving_source(d: dict[str, Any]) -> dict[str, Any] | None:
    """The newest word on how the device serves: its last telemetry record (a restart chooses again and sends no
    install report) when that is of the model it runs, else its last install report (kept with the self-test)."""
    t = d.get("telemetry") or {}
    if t.get("serving") and (t.get("model"), t.get("version")) == (d.get("running_model"), d.get("running_version")):
        return t
    return d.get("selftest")


def _isa(h: dict[str, Any] | None) -> str | None:
    if not h:
        return None
    feats = set(h.get("cpu_features") or [])
    return "AVX-512 VNNI" if "avx512_vnni" in feats else "AVX2" if "avx2" in feats else (h.get("arch") or "")


def _accuracy(a: dict[str, Any]) -> str:
    if a["metric"] == "agreement":
        return f'agreement {a["candidate"]:.4f} with fp32 (no labels)'
    return f'{a["candidate"]:.4f} (fp32 {a["reference"]:.4f})'


def _pager(path: str, filters: dict[str, str], offset: int, shown: int, total: int,
           limit: int = PAGE_SIZE) -> SimpleNamespace:
    """'rows 51-100 of 1234' with previous/next links that keep the filters."""
    def link(to: int) -> str:
        query = urlencode({**{k: v for k, v in filters.items() if v}, **({"offset": to} if to else {})})
        return path + ("?" + query if query else "")
    return SimpleNamespace(first=f"{offset + 1}–{offset + shown}" if shown else "none", total=total,
                           prev=link(max(0, offset - limit)) if offset > 0 else None,
                           next=link(offset + limit) if offset + shown < total else None)


def _bar(done: int, bad: int, total: int) -> SimpleNamespace:
    ok = 100 * done / total if total else 0
    no = 100 * bad / total if total else 0
    return SimpleNamespace(done=done, bad=bad, total=total, ok_pct=f"{ok:.0f}", no_pct=f"{no:.0f}")


def _gates(gates: list[dict[str, Any]] | None, live: bool) -> list[SimpleNamespace]:
    return [SimpleNamespace(cls=("wait" if live else "ok") if g["passed"] else ("wait" if live else "bad"),
                            detail=g["detail"], name=g["name"],
                            value="–" if g["value"] is None else f'{g["value"]:.3g}',
                            op="≥" if g["name"] == "install_success" else "≤", threshold=f'{g["threshold"]:.3g}')
            for g in gates or []]


def _rollout_versions(models: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted({(m["name"], m["version"]) for m in models})


# -- pages ----------------------------------------------------------------------------------------------------
def render(devices: list[dict[str, Any]], models: list[dict[str, Any]], rollouts: list[dict[str, Any]],
           can_operate: bool = False, message: str | None = None, fleet: dict[str, int] | None = None,
           matching: int | None = None, filters: dict[str, str] | None = None, offset: int = 0) -> str:
    """The overview. ``devices`` is one page (``offset`` into ``matching`` devices that pass ``filters``);
    ``fleet`` the whole fleet's figures (FleetService.device_counts); without them, ``devices`` is all."""
    filters = filters or {}
    if fleet is None:
        fleet = {"devices": len(devices), "online": sum(1 for d in devices if d["online"]),
                 "failing": sum(1 for d in devices if d["last_state"] in ("failed", "rolled_back"))}
    matching = len(devices) if matching is None else matching
    # records as they are (read by key) with their view values added
    rows = [{**d, "isa": _isa(d.get("hardware")), "telemetry_view": _telemetry(d["telemetry"]),
             "selftest_view": _selftest(d.get("selftest"), (d["running_model"], d["running_version"])),
             "runtime_view": _runtime(((_serving_source(d) or {}).get("serving") or {}).get("runtime"))}
            for d in devices]
    mrows = [{**m, "accuracy_text": _accuracy(m["accuracy"])} for m in models]
    rrows = []
    for r in rollouts:
        done = r["counts"].get("installed", 0)
        bad = sum(r["counts"].get(k, 0) for k in _UNDONE)
        rrows.append({**r, "bar": _bar(done, bad, sum(w["size"] for w in r["waves"])),
                      "counts_sorted": sorted(r["counts"].items())})
    return _html("overview.html", title="edgefleet console", css=Markup(CSS), refresh_s=5, nav=False,
                 fleet=fleet, models=mrows, in_progress=sum(1 for r in rollouts if r["status"] == "in_progress"),
                 filters=filters, device_pager=_pager("/", filters, offset, len(devices), matching),
                 devices=rows, rollouts=rrows, message=message,
                 can_operate=can_operate, rollout_versions=_rollout_versions(models))


def login_page(error: str | None = None) -> str:
    return _html("login.html", title="edgefleet console: sign in", css=Markup(CSS), refresh_s=None, nav=False,
                 error=error)


def rollout_page(r: dict[str, Any], devices: dict[str, dict[str, Any]], can_operate: bool,
                 message: str | None = None, state: str = "", offset: int = 0,
                 series: dict[str, Any] | None = None, waits: dict[int, str | None] | None = None) -> str:
    """One rollout: progress, each wave with its gates against their thresholds, the buttons, each started wave's
    latency, throughput, errors and drift over time (``series``: fleet.series.rollout_series), and one page of
    its targets (``r["targets"]``, ``offset`` into ``r["targets_total"]`` matching ``state``; ``devices``
    those targets' devices)."""
    total = sum(w["size"] for w in r["waves"])
    installed = r["counts"].get("installed", 0)
    failed = sum(r["counts"].get(k, 0) for k in _UNDONE)
    waves = []
    for w in r["waves"]:
        gates, live = (w.get("gates"), False) if w.get("gates") else (w.get("gates_live"), True)
        waves.append(SimpleNamespace(index=w["index"], size=w["size"], state=w["state"], installed=w["installed"],
                                     failed=w["failed"], bar=_bar(w["installed"], w["failed"], w["size"]),
                                     gates=_gates(gates, live), live=live, soak=f'{w["soak_s"]:.0f} s soak',
                                     soak_until=w["soak_until"], waits=(waits or {}).get(w["index"])))
    targets = []
    for t in r.get("targets", []):
        d = devices.get(t["device_id"], {})
        bp = t.get("bundle_profile")
        fallback = (bp, d["profile"]) if bp and d.get("profile") and bp != d["profile"] else None  # CPU fallback
        targets.append(SimpleNamespace(device_id=t["device_id"], wave=t["wave"], state=t["state"],
                                       error=t.get("error"), fallback=fallback,
                                       running_version=d.get("running_version"),
                                       telemetry=_telemetry(d.get("telemetry"))))
    path = f'/rollouts/{r["id"]}'
    shown = r.get("targets", [])
    wave_charts = []  # the waves that started (or have records): fleet.charts escapes every label of its SVG
    if series:
        for w in series["waves"]:
            if w.get("started_at") or w.get("points"):
                charts = wave_time_charts(w, series["bucket_s"], r.get("model"), (series["start"], series["end"]))
                wave_charts.append(SimpleNamespace(index=w["index"], state=w["state"],
                                                   charts=Markup("".join(charts))))
    return _html("rollout.html", title=f"rollout #{r['id']}", css=Markup(CSS + CSS_MORE), refresh_s=2, nav=True,
                 r=r, progress=_bar(installed, failed, total), installed=installed, failed=failed, total=total,
                 wave_now=min(r["current_wave"] + 1, len(r["waves"])),
                 tone="bad" if r["status"] in ("failed", "aborted") else "wait", message=message,
                 actions=ACTIONS.get(r["status"], ()) if can_operate else (), waves=waves,
                 by_version=_by_version([devices.get(t["device_id"], {}) for t in shown]), path=path, state=state,
                 target_pager=_pager(path, {"state": state}, offset, len(shown), r.get("targets_total", len(shown))),
                 targets=targets, wave_charts=wave_charts,
                 bucket_min=f'{series["bucket_s"] / 60:g}' if series else None)


def _by_version(devs: list[dict[str, Any]]) -> list[SimpleNamespace]:
    acc: dict[str, list[dict[str, Any]]] = {}
    for d in devs:
        t = d.get("telemetry")
        if t and t.get("version"):
            acc.setdefault(f'{t.get("model")} {t["version"]}', []).append(t)
    rows = []
    for v, ts in sorted(acc.items()):
        req = sum(t["requests"] for t in ts)
        rate = sum(t["requests"] / t["interval_s"] for t in ts if t["interval_s"])
        errs = sum(t["errors"] for t in ts)
        p99s = [t["latency"]["p99_ms"] for t in ts if t["latency"]["p99_ms"] is not None]
        rows.append(SimpleNamespace(version=v, devices=len(ts), rate=f"{rate:.1f}" if req else "0",
                                    p99=f"{sum(p99s) / len(p99s):.1f} ms" if p99s else "–",
                                    errors=f"{errs / req:.2%}" if req else "–"))
    return rows


def _chart(title: str, series: dict[str, list[float | None]], unit: str) -> SimpleNamespace:
    """A small SVG line chart (oldest left); each series one polyline."""
    w, h, pad = 320, 90, 4
    values = [v for vs in series.values() for v in vs if v is not None]
    if not values:
        return SimpleNamespace(title=title, lines=[])
    top = max(values) or 1.0
    colors = ["#0969da", "#cf222e", "#8250df", "#1a7f37"]
    lines, legend = [], []
    for (name, vs), color in zip(series.items(), colors, strict=False):
        n = len(vs)
        pts = [f"{pad + (w - 2 * pad) * i / max(n - 1, 1):.1f},{h - pad - (h - 2 * pad) * v / top:.1f}"
               for i, v in enumerate(vs) if v is not None]
        lines.append((color, " ".join(pts)))
        last = next((v for v in reversed(vs) if v is not None), None)
        legend.append((color, name, "–" if last is None else f"{last:.3g}"))
    return SimpleNamespace(title=title, lines=lines, legend=legend, top=f"{top:.3g}", unit=unit, w=w, h=h)


def device_page(d: dict[str, Any], telemetry: list[dict[str, Any]], drift: list[dict[str, Any]] | None = None,
                window: MaintenanceWindow | None = None) -> str:
    """One device: what it runs, its self-test, and charts of its telemetry by model version; latency, throughput,
    errors and drift over time with time axes (fleet.charts)."""
    rows = list(reversed(telemetry))  # oldest first

    def col(f) -> list[float | None]:
        return [f(t) for t in rows]

    versions = sorted({f'{t.get("model")} {t.get("version")}' for t in rows if t.get("version")})
    charts = [
        _chart("cpu", {"agent %": col(lambda t: t["cpu_percent"]),
                       "box %": col(lambda t: (t.get("device") or {}).get("cpu_percent"))}, "%"),
        _chart("memory", {"agent rss MB": col(lambda t: t["rss_mb"]),
                          "box used MB": col(lambda t: (t.get("device") or {}).get("memory_used_mb"))}, "MB"),
    ]
    temps = col(lambda t: (t.get("device") or {}).get("temperature_c"))
    if any(v is not None for v in temps):
        charts.append(_chart("temperature", {"°C": temps}, "°C"))
    if len(versions) > 1:
        charts += [_chart(f"p99 on {v}", {"p99": col(lambda t, v=v: t["latency"]["p99_ms"]
                                                      if f'{t.get("model")} {t.get("version")}' == v else None)},
                          "ms") for v in versions]
    # fleet.charts draws its SVG with every label escaped (its own tests): the one HTML taken as it is
    time_charts = Markup("".join(device_time_charts(rows, drift or [])))
    newest = d.get("telemetry") or {}
    return _html("device.html", title=f"device {d['device_id']}", css=Markup(CSS + CSS_MORE), refresh_s=5, nav=True,
                 d=d, selftest=_selftest(d.get("selftest"), (d["running_model"], d["running_version"])),
                 serves=_serving(_serving_source(d)), records=len(rows), time_charts=time_charts, charts=charts,
                 stages=_stages(newest), stages_of=(newest.get("model"), newest.get("version"),
                                                    newest.get("interval_s")),
                 clock=_clock(newest.get("clock_skew_s")),
                 download=_download(newest.get("download"), (d.get("running_model"), d.get("running_version"))),
                 window=_window(window))


def _window(w: MaintenanceWindow | None) -> dict[str, str] | None:
    """A device's maintenance window as its page shows it: the schedule, and open now or when it next opens (on the
    fleet's clock)."""
    if w is None:
        return None
    now = dt.datetime.now(dt.UTC)
    opens, closes = next_window(w, now)
    when = (f"open now, until {closes.isoformat(timespec='minutes')}" if opens <= now
            else f"next opens {opens.isoformat(timespec='minutes')}")
    return {"what": f"{','.join(w.days)} {w.start} {w.tz}, {w.duration_min} min", "when": when}


def _download(d: Any, running: tuple[Any, Any] = (None, None)) -> dict[str, Any] | None:
    """The bundle download in progress in the device's newest telemetry (protocol.mqtt.DownloadFigures), as the page
    shows it; None when there is none, it does not parse, or it is of the version the device already runs (``running``:
    model, version; the record was made before the install its state report says finished)."""
    try:
        f = proto.DownloadFigures.model_validate(d) if d is not None else None
    except ValueError:
        return None
    if f is None or (running[0] is not None and f.target.split("/")[:2] == [running[0], running[1]]):
        return None
    return {"target": f.target, "done": f"{f.bytes_done / 1e6:.1f} MB", "total": f"{f.bytes_total / 1e6:.1f} MB",
            "pct": f"{100 * f.bytes_done / f.bytes_total:.0f}", "rate": f"{f.bytes_per_s / 1e3:.0f} kB/s",
            "eta": None if f.eta_s is None else f"{f.eta_s:.0f} s", "resumes": f.resumes}


def _clock(skew_s: Any) -> str | None:
    """The device's clock against the time it trusts, when its newest telemetry says it is off (agent/link/clock.py)."""
    return describe_skew(float(skew_s)) if isinstance(skew_s, (int, float)) and skew_s else None


def new_rollout_form(models: list[dict[str, Any]]) -> str:
    return _html("new_rollout_form.html", rollout_versions=_rollout_versions(models))
