"""The web console: one server-rendered page, readable at a glance, refreshing itself."""

from __future__ import annotations

from html import escape
from typing import Any
from urllib.parse import urlencode

from edgefleet.fleet.charts import device_time_charts
from edgefleet.fleet.states import TargetState

__all__ = ["PAGE_SIZE", "STATE_STYLES", "render"]

PAGE_SIZE = 50  # rows of a console list per page (devices, a rollout's targets); filtered and paged in SQL

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


def _pill(text: str | None) -> str:
    if not text:
        return "–"
    return f'<span class="pill {STATE_STYLES.get(text, "off")}">{escape(text)}</span>'


_UNDONE = ("failed", "rolled_back", "rollback_failed")  # targets counted as failed in a rollout's progress bar


def _ts(iso: str | None) -> str:
    """'2026-11-22T00:41:24.414568+00:00' -> '2026-11-22 00:41:24'."""
    return "–" if not iso else escape(iso.replace("T", " ")[:19])


def _e(v: Any) -> str:
    return "–" if v is None or v == "" else escape(str(v))


def _telemetry_cells(t: dict[str, Any] | None) -> str:
    if not t:
        return '<td colspan="4" class="sub">no telemetry yet</td>'
    rate = t["requests"] / t["interval_s"] if t["interval_s"] else 0.0
    p95 = t["latency"]["p95_ms"]
    err = f' <span class="pill bad">{t["errors"]} err</span>' if t["errors"] else ""
    batch = f'{t["batch_size_mean"]:.1f}' if t["batch_size_mean"] is not None else "–"
    return (f'<td>{rate:.1f}/s{err}</td><td>{"–" if p95 is None else f"{p95:.1f} ms"}</td><td>{batch}</td>'
            f'<td>{t["cpu_percent"]:.0f}% · {t["rss_mb"]:.0f} MB</td>')


def _selftest_cell(st: dict[str, Any] | None, running: tuple[Any, Any] | None = None) -> str:
    """The device's own self-test figure next to the compile-time one for the same build; marked as
    stale when the device no longer runs the build it was measured on (e.g. after a rollback)."""
    if not st:
        return "–"
    stale = ""
    if running is not None and (st.get("model"), st.get("version")) != tuple(running):
        stale = f' <small class="pill wait">of {escape(str(st.get("model")))} {escape(str(st.get("version")))}</small>'
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
    return (f'<span class="pill {cls}" title="{escape(tip)}">{escape(mine)}</span>'
            f'{f" <small>({escape(theirs)})</small>" if theirs else ""}{stale}')


def _serving(st: dict[str, Any] | None) -> str:
    """How the device serves its model, as it chose on its own CPU: 'int8 (timed here: int8 412/s, fp32 230/s),
    batches up to 8 (measured), 1 instance of 2 threads (default)'."""
    sv = (st or {}).get("serving")
    if not sv:
        return "–"
    how = {"device": "timed here", "operator": "set on the device", "bundle": "the bundle's"}.get(
        sv["precision_source"], sv["precision_source"])
    figures = ", ".join(f'{t["precision"]} {t["items_per_s"]:g}/s' for t in sv.get("precisions") or [])
    detail = escape(how + (f": {figures}" if figures else ""))
    batch = escape(sv["batch_source"])
    layout = escape(sv.get("layout_source", "default"))
    return (f'<b>{escape(sv["precision"])}</b> <small class="sub">({detail})</small> · '
            f'batches ≤ {sv["max_batch_size"]} <small class="sub">({batch})</small> · '
            f'{sv["instances"]}×{sv["threads"]} <small class="sub">({layout})</small>')


def _serving_source(d: dict[str, Any]) -> dict[str, Any] | None:
    """The newest word on how the device serves: its last telemetry record (a restart chooses again and sends no
    install report) when that is of the model it runs, else its last install report (kept with the self-test)."""
    t = d.get("telemetry") or {}
    if t.get("serving") and (t.get("model"), t.get("version")) == (d.get("running_model"), d.get("running_version")):
        return t
    return d.get("selftest")


def _hardware(h: dict[str, Any] | None) -> str:
    if not h:
        return ""
    feats = set(h.get("cpu_features") or [])
    isa = "AVX-512 VNNI" if "avx512_vnni" in feats else "AVX2" if "avx2" in feats else (h.get("arch") or "")
    return f'<br><small class="sub">{escape(isa)}</small>'


def _accuracy(a: dict[str, Any]) -> str:
    if a["metric"] == "agreement":
        return f'agreement {a["candidate"]:.4f} with fp32 (no labels)'
    return f'{a["candidate"]:.4f} (fp32 {a["reference"]:.4f})'


def _choice(m: dict[str, Any]) -> str:
    c = m.get("precision_choice")
    q = m.get("quantization")
    parts = [f'<br><small class="sub">{escape(c["reason"])}</small>'] if c else []
    if q:
        parts.append(f'<br><small class="sub">{escape(q["scheme"])}: {q["weight_bits"]}-bit weights</small>')
    return "".join(parts)


def _pager(path: str, filters: dict[str, str], offset: int, shown: int, total: int, limit: int = PAGE_SIZE) -> str:
    """'rows 51-100 of 1234' with previous/next links that keep the filters."""
    def link(to: int, text: str, rel: str) -> str:
        query = urlencode({**{k: v for k, v in filters.items() if v}, **({"offset": to} if to else {})})
        return f'<a rel="{rel}" href="{escape(path + ("?" + query if query else ""))}">{text}</a>'
    first = f"{offset + 1}–{offset + shown}" if shown else "none"
    prev = link(max(0, offset - limit), "← previous", "prev") if offset > 0 else ""
    nxt = link(offset + limit, "next →", "next") if offset + shown < total else ""
    return f'<nav class="pager sub">rows <b>{first}</b> of <b>{total}</b> {prev} {nxt}</nav>'


def _select(name: str, current: str, options: tuple[str, ...]) -> str:
    opts = "".join(f'<option value="{escape(o)}"{" selected" if o == current else ""}>{escape(o) or "any"}</option>'
                   for o in ("", *options))
    return f'<select name="{escape(name)}">{opts}</select>'


# the filters' choices: a device's connection or last report (protocol.mqtt.ReportedState), a target's state
DEVICE_STATES = ("online", "offline", "downloading", "installing", "installed", "shadowing", "failed",
                 "rolled_back", "decommissioned")
TARGET_STATES = tuple(str(t) for t in TargetState)


def _engine_error(r: dict[str, Any]) -> str:
    """A rollout the engine cannot evaluate, marked in the list (its page says why in full)."""
    if not r.get("engine_error"):
        return ""
    return f'<br><small class="sub engine-error">not evaluated: {escape(r["engine_error"][:120])}</small>'


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
    online, failing = fleet["online"], fleet["failing"]
    form = (f'<form id="device-filter" method="get" action="/"><label>group <input name="group" size="10" '
            f'value="{escape(filters.get("group", ""))}"></label><label>state '
            f'{_select("state", filters.get("state", ""), DEVICE_STATES)}</label>'
            f'<label>id contains <input name="q" size="14" value="{escape(filters.get("q", ""))}"></label>'
            f'<button type="submit">filter</button> <a href="/">clear</a></form>')
    pager = _pager("/", filters, offset, len(devices), matching)
    rows = []
    for d in devices:
        running = f'{_e(d["running_model"])} {_e(d["running_version"])}' if d["running_model"] else "–"
        desired = d["desired"]
        want = f'{escape(desired["model"])} {escape(desired["version"])}' if desired else "–"
        err = f'<br><small class="pill bad">{escape(d["last_error"][:200])}</small>' if d["last_error"] else ""
        rows.append(f'<tr><td><a href="/devices/{escape(d["device_id"])}"><b>{escape(d["device_id"])}</b></a>'
                    f'{_hardware(d.get("hardware"))}</td>'
                    f'<td>{_pill("online" if d["online"] else "offline")}'
                    f'</td><td>{running}</td><td>{want}</td><td>{_pill(d["last_state"])}{err}</td>'
                    f'<td>{_selftest_cell(d.get("selftest"), (d["running_model"], d["running_version"]))}</td>'
                    f'{_telemetry_cells(d["telemetry"])}<td>{_ts(d["last_seen"])}</td></tr>')
    mrows = [f'<tr><td><b>{escape(m["name"])}</b></td><td>{escape(m["version"])}</td><td>{escape(m["profile"])}</td>'
             f'<td>{escape(m["backend"])} {escape(m["precision"])}{_choice(m)}</td>'
             f'<td>{_accuracy(m["accuracy"])}</td>'
             f'<td><code>{escape(m["sha256"][:16])}…</code></td><td>{_ts(m["uploaded_at"])}</td></tr>' for m in models]
    rrows = []
    for r in rollouts:
        counts = ", ".join(f"{v} {escape(k)}" for k, v in sorted(r["counts"].items()))
        done = r["counts"].get("installed", 0)
        bad = sum(r["counts"].get(k, 0) for k in _UNDONE)
        total = sum(w["size"] for w in r["waves"])
        rrows.append(f'<tr><td><a href="/rollouts/{r["id"]}">#{r["id"]}</a> {_bar(done, bad, total)}</td>'
                     f'<td>{escape(r["model"])} {escape(r["version"])}</td>'
                     f'<td>{escape(r["profile"])}</td><td>{_pill(r["status"])}{_engine_error(r)}</td>'
                     f'<td>{counts}</td><td>{_ts(r["created_at"])}</td></tr>')
    empty = '<tr><td colspan="10" class="sub">none yet</td></tr>'
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>edgefleet console</title><style>{CSS}</style></head><body>
<h1>edgefleet fleet console</h1>
<div class="sub summary"><span><b>{fleet["devices"]}</b> devices</span><span><b>{online}</b> online</span>
<span><b>{failing}</b> failing</span><span><b>{len(models)}</b> model builds</span>
<span><b>{sum(1 for r in rollouts if r["status"] == "in_progress")}</b> rollouts in progress</span>
<span>refreshes every 5 s</span></div>
<h2>Devices</h2>{form}{pager}
<table id="devices"><tr><th>device</th><th>status</th><th>running</th><th>desired</th><th>last report</th>
<th>self-test on device</th><th>requests</th><th>p95 latency</th><th>mean batch</th><th>cpu · memory</th>
<th>last seen (UTC)</th></tr>
{"".join(rows) or empty}</table>
<h2>Models</h2><table><tr><th>name</th><th>version</th><th>profile</th><th>engine</th><th>accuracy (top-1)</th>
<th>sha256</th><th>uploaded (UTC)</th></tr>{"".join(mrows) or empty}</table>
<h2>Rollouts</h2>{f'<p class="pill bad">{escape(message)}</p>' if message else ""}
{new_rollout_form(models) if can_operate else ""}
<table><tr><th>id</th><th>model</th><th>profile</th><th>status</th><th>devices</th>
<th>created (UTC)</th></tr>{"".join(rrows) or empty}</table>
</body></html>"""


def login_page(error: str | None = None) -> str:
    err = f'<p class="pill bad">{escape(error)}</p>' if error else ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>edgefleet console: sign in</title>
<style>{CSS}</style></head><body><h1>edgefleet fleet console</h1>
<div class="sub">Paste an API token (the first admin token is in the fleet's data dir, <code>admin-token</code>).</div>
{err}<form method="post" action="/login"><input name="token" type="password" size="60" autofocus>
<button type="submit">Sign in</button></form></body></html>"""


# -- rollout and device pages ---------------------------------------------------------------------------
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


def _page(title: str, body: str, refresh_s: int | None = None) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (f'<!doctype html><html><head><meta charset="utf-8">{meta}<title>{escape(title)}</title>'
            f'<style>{CSS}{CSS_MORE}</style></head><body><nav><a href="/">overview</a></nav>{body}</body></html>')


def _bar(done: int, bad: int, total: int) -> str:
    ok = 100 * done / total if total else 0
    no = 100 * bad / total if total else 0
    return (f'<span class="bar" title="{done} installed, {bad} failed of {total}">'
            f'<i style="width:{ok:.0f}%;float:left"></i>'
            f'<i class="badbar" style="width:{no:.0f}%;float:left"></i></span>')


def _gate_cells(gates: list[dict[str, Any]] | None, live: bool) -> str:
    if not gates:
        return '<span class="sub">–</span>'
    out = []
    for g in gates:
        value = "–" if g["value"] is None else f'{g["value"]:.3g}'
        op = "≥" if g["name"] == "install_success" else "≤"
        cls = ("wait" if live else "ok") if g["passed"] else ("wait" if live else "bad")
        out.append(f'<span class="pill {cls}" title="{escape(g["detail"])}">{escape(g["name"])} {value} '
                   f'{op} {g["threshold"]:.3g}</span>')
    return " ".join(out) + (' <small class="sub">(so far)</small>' if live else "")


def rollout_page(r: dict[str, Any], devices: dict[str, dict[str, Any]], can_operate: bool,
                 message: str | None = None, state: str = "", offset: int = 0) -> str:
    """One rollout: progress, each wave with its gates against their thresholds, the buttons, and one page of
    its targets (``r["targets"]``, ``offset`` into ``r["targets_total"]`` matching ``state``; ``devices``
    those targets' devices)."""
    total = sum(w["size"] for w in r["waves"])
    installed = r["counts"].get("installed", 0)
    failed = sum(r["counts"].get(k, 0) for k in _UNDONE)
    wrows = []
    for w in r["waves"]:
        gates, live = (w.get("gates"), False) if w.get("gates") else (w.get("gates_live"), True)
        soak = f'{w["soak_s"]:.0f} s soak' + (f', until {_ts(w["soak_until"])}' if w["soak_until"] else "")
        wrows.append(f'<tr data-wave="{w["index"]}"><td>{w["index"] + 1}</td><td>{w["size"]}</td>'
                     f'<td class="wave-state">{_pill(w["state"])}</td>'
                     f'<td>{_bar(w["installed"], w["failed"], w["size"])} '
                     f'{w["installed"]} ok · {w["failed"]} failed</td>'
                     f'<td>{_gate_cells(gates, live)}</td><td class="sub">{soak}</td></tr>')
    buttons = ""
    if can_operate:
        buttons = "".join(
            f'<form class="inline" method="post" action="/console/rollouts/{r["id"]}/{a}">'
            f'<button type="submit" name="action" value="{a}" '
            f'class="{"danger" if a in ("abort", "rollback") else ""}">{a}</button></form>'
            for a in ACTIONS.get(r["status"], ()))
    trows = []
    for t in r.get("targets", []):
        d = devices.get(t["device_id"], {})
        tel = d.get("telemetry")
        err = f'<br><small class="pill bad">{escape(t["error"][:200])}</small>' if t.get("error") else ""
        bp = t.get("bundle_profile")
        if bp and d.get("profile") and bp != d["profile"]:  # served by its profile's CPU fallback
            err += (f'<br><small class="sub fallback">{escape(bp)} bundle (CPU fallback of '
                    f'{escape(d["profile"])})</small>')
        trows.append(f'<tr><td><a href="/devices/{escape(t["device_id"])}">{escape(t["device_id"])}</a></td>'
                     f'<td>{t["wave"] + 1}</td><td>{_pill(t["state"])}{err}</td>'
                     f'<td>{_e(d.get("running_version"))}</td>{_telemetry_cells(tel)}</tr>')
    by_version = _by_version([devices.get(t["device_id"], {}) for t in r.get("targets", [])])
    targets = r.get("targets", [])
    total_targets = r.get("targets_total", len(targets))
    path = f'/rollouts/{r["id"]}'
    tfilter = (f'<form id="target-filter" method="get" action="{escape(path)}"><label>state '
               f'{_select("state", state, TARGET_STATES)}</label><button type="submit">filter</button></form>')
    pager = _pager(path, {"state": state}, offset, len(targets), total_targets)
    msg = f'<p class="pill bad">{escape(message)}</p>' if message else ""
    tone = "bad" if r["status"] in ("failed", "aborted") else "wait"
    reason = f'<div class="pill {tone}">{escape(r["reason"])}</div>' if r.get("reason") else ""
    if r.get("engine_error"):
        reason += (f'<div class="pill bad engine-error">the engine cannot evaluate this rollout (it retries; the '
                   f'others go on), since {_ts(r.get("engine_error_at"))}: {escape(r["engine_error"])}</div>')
    body = f"""<h1>Rollout #{r["id"]}: {escape(r["model"])} {escape(r["version"])} {_pill(r["status"])}</h1>
<div class="sub summary"><span>{_bar(installed, failed, total)} <b>{installed}</b> of {total} installed</span>
<span><b>{failed}</b> failed</span>
<span>wave <b>{min(r["current_wave"] + 1, len(r["waves"]))}</b> of {len(r["waves"])}</span>
<span>by {escape(r["created_by"] or "?")}, {_ts(r["created_at"])}</span><span>refreshes every 2 s</span></div>
{reason}{msg}<div id="actions">{buttons}</div>
<h2>Waves</h2><table id="waves"><tr><th>wave</th><th>devices</th><th>state</th><th>progress</th>
<th>gates (value vs threshold)</th><th>soak</th></tr>{"".join(wrows)}</table>
<h2>By model version (latest telemetry of the devices on this page)</h2>{by_version}
<h2>Devices</h2>{tfilter}{pager}
<table id="targets"><tr><th>device</th><th>wave</th><th>state</th><th>running</th><th>requests</th>
<th>p95 latency</th><th>mean batch</th><th>cpu · memory</th></tr>{"".join(trows)}</table>"""
    return _page(f"rollout #{r['id']}", body, refresh_s=2)


def _by_version(devs: list[dict[str, Any]]) -> str:
    acc: dict[str, list[dict[str, Any]]] = {}
    for d in devs:
        t = d.get("telemetry")
        if t and t.get("version"):
            acc.setdefault(f'{t.get("model")} {t["version"]}', []).append(t)
    if not acc:
        return '<p class="sub">no telemetry from these devices yet</p>'
    rows = []
    for v, ts in sorted(acc.items()):
        req = sum(t["requests"] for t in ts)
        rate = sum(t["requests"] / t["interval_s"] for t in ts if t["interval_s"])
        errs = sum(t["errors"] for t in ts)
        p99s = [t["latency"]["p99_ms"] for t in ts if t["latency"]["p99_ms"] is not None]
        p99 = f"{sum(p99s) / len(p99s):.1f} ms" if p99s else "–"
        rows.append(f"<tr><td>{escape(v)}</td><td>{len(ts)}</td><td>{rate:.1f}/s</td><td>{p99}</td>"
                    f"<td>{errs / req:.2%}</td></tr>" if req else
                    f"<tr><td>{escape(v)}</td><td>{len(ts)}</td><td>0/s</td><td>{p99}</td><td>–</td></tr>")
    return ("<table><tr><th>model version</th><th>devices</th><th>requests</th><th>mean p99</th><th>errors</th></tr>"
            + "".join(rows) + "</table>")


def _chart(title: str, series: dict[str, list[float | None]], unit: str) -> str:
    """A small SVG line chart (oldest left); each series one polyline."""
    w, h, pad = 320, 90, 4
    values = [v for vs in series.values() for v in vs if v is not None]
    if not values:
        return f'<div class="chart"><h3>{escape(title)}</h3><span class="sub">no data yet</span></div>'
    top = max(values) or 1.0
    colors = ["#0969da", "#cf222e", "#8250df", "#1a7f37"]
    lines, legend = [], []
    for (name, vs), color in zip(series.items(), colors, strict=False):
        n = len(vs)
        pts = [f"{pad + (w - 2 * pad) * i / max(n - 1, 1):.1f},{h - pad - (h - 2 * pad) * v / top:.1f}"
               for i, v in enumerate(vs) if v is not None]
        lines.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(pts)}"/>')
        last = next((v for v in reversed(vs) if v is not None), None)
        legend.append(f'<span style="color:{color}">{escape(name)} {"–" if last is None else f"{last:.3g}"}</span>')
    return (f'<div class="chart"><h3>{escape(title)} <small class="sub">max {top:.3g} {escape(unit)}</small></h3>'
            f'<svg width="{w}" height="{h}" role="img" aria-label="{escape(title)}">{"".join(lines)}</svg>'
            f'<div class="sub">{" · ".join(legend)}</div></div>')


def device_page(d: dict[str, Any], telemetry: list[dict[str, Any]], drift: list[dict[str, Any]] | None = None) -> str:
    """One device: what it runs, its self-test, and charts of its telemetry by model version; latency, throughput,
    errors and drift over time with time axes (fleet.charts)."""
    rows = list(reversed(telemetry))  # oldest first

    def col(f) -> list[float | None]:
        return [f(t) for t in rows]

    versions = sorted({f'{t.get("model")} {t.get("version")}' for t in rows if t.get("version")})
    charts = [
        *device_time_charts(rows, drift or []),
        _chart("cpu", {"agent %": col(lambda t: t["cpu_percent"]),
                       "box %": col(lambda t: (t.get("device") or {}).get("cpu_percent"))}, "%"),
        _chart("memory", {"agent rss MB": col(lambda t: t["rss_mb"]),
                          "box used MB": col(lambda t: (t.get("device") or {}).get("memory_used_mb"))}, "MB"),
    ]
    temps = col(lambda t: (t.get("device") or {}).get("temperature_c"))
    if any(v is not None for v in temps):
        charts.append(_chart("temperature", {"°C": temps}, "°C"))
    by_version = [_chart(f"p99 on {v}", {"p99": col(lambda t, v=v: t["latency"]["p99_ms"]
                                                     if f'{t.get("model")} {t.get("version")}' == v else None)}, "ms")
                  for v in versions] if len(versions) > 1 else []
    body = f"""<h1>{escape(d["device_id"])} {_pill("online" if d["online"] else "offline")}</h1>
<div class="sub summary"><span>running <b>{_e(d["running_model"])} {_e(d["running_version"])}</b></span>
<span>last report {_pill(d["last_state"])}</span>
<span>self-test {_selftest_cell(d.get("selftest"), (d["running_model"], d["running_version"]))}</span>
<span>serves {_serving(_serving_source(d))}</span>
<span>group {_e(d.get("group"))}</span><span>profile {_e(d.get("profile"))}</span>
<span>last seen {_ts(d["last_seen"])}</span><span>{len(rows)} telemetry records</span></div>
<div class="grid">{"".join(charts + by_version)}</div>"""
    return _page(f"device {d['device_id']}", body, refresh_s=5)


def new_rollout_form(models: list[dict[str, Any]]) -> str:
    versions = sorted({(m["name"], m["version"]) for m in models})
    opts = "".join(f'<option value="{escape(n)} {escape(v)}">{escape(n)} {escape(v)}</option>' for n, v in versions)
    if not opts:
        return '<p class="sub">upload a bundle to start a rollout</p>'
    return f"""<form id="new-rollout" method="post" action="/console/rollouts">
<label>model <select name="model_version">{opts}</select></label>
<label>group <input name="group" size="10"></label><label>tags <input name="tags" size="10" placeholder="a,b"></label>
<label>profile <input name="profile" size="10"></label>
<label>devices <input name="devices" size="16" placeholder="id,id"></label>
<br><label>waves <input name="waves" value="10%,100%" size="14"></label>
<label>soak s <input name="soak_s" value="60" size="5"></label>
<label>install success ≥ <input name="install_success_min" value="0.95" size="4"></label>
<label>error rate ≤ <input name="error_rate_max" size="4"></label>
<label>p99 ratio ≤ <input name="p99_ratio_max" size="4"></label>
<label>on failure <select name="on_failure"><option>pause</option><option>abort</option></select></label>
<label><input type="checkbox" name="rollback_on_failure" value="1"> roll back a failed wave</label>
<br><label><input type="checkbox" name="shadow" value="1"> shadow each wave first: top-1 agreement ≥
<input name="shadow_agreement" value="0.99" size="4"> over <input name="shadow_samples" value="100" size="5">
mirrored requests</label>
<button type="submit">start rollout</button></form>"""
