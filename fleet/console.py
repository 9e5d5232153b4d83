"""The web console: one server-rendered page, readable at a glance, refreshing itself."""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["render"]

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
.summary span{margin-right:18px} code{font-size:12px}
"""

_PILL = {"online": "ok", "offline": "off", "installed": "ok", "succeeded": "ok", "failed": "bad",
         "rolled_back": "bad", "in_progress": "wait", "pending": "wait", "downloading": "wait", "installing": "wait"}


def _pill(text: str | None) -> str:
    if not text:
        return "–"
    return f'<span class="pill {_PILL.get(text, "off")}">{escape(text)}</span>'


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


def render(devices: list[dict[str, Any]], models: list[dict[str, Any]], rollouts: list[dict[str, Any]]) -> str:
    online = sum(1 for d in devices if d["online"])
    failing = sum(1 for d in devices if d["last_state"] in ("failed", "rolled_back"))
    rows = []
    for d in devices:
        running = f'{_e(d["running_model"])} {_e(d["running_version"])}' if d["running_model"] else "–"
        desired = d["desired"]
        want = f'{escape(desired["model"])} {escape(desired["version"])}' if desired else "–"
        err = f'<br><small class="pill bad">{escape(d["last_error"][:200])}</small>' if d["last_error"] else ""
        rows.append(f'<tr><td><b>{escape(d["device_id"])}</b>{_hardware(d.get("hardware"))}</td>'
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
        rrows.append(f'<tr><td>#{r["id"]}</td><td>{escape(r["model"])} {escape(r["version"])}</td>'
                     f'<td>{escape(r["profile"])}</td><td>{_pill(r["status"])}</td><td>{counts}</td>'
                     f'<td>{_ts(r["created_at"])}</td></tr>')
    empty = '<tr><td colspan="10" class="sub">none yet</td></tr>'
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>edgefleet console</title><style>{CSS}</style></head><body>
<h1>edgefleet fleet console</h1>
<div class="sub summary"><span><b>{len(devices)}</b> devices</span><span><b>{online}</b> online</span>
<span><b>{failing}</b> failing</span><span><b>{len(models)}</b> model builds</span>
<span><b>{sum(1 for r in rollouts if r["status"] == "in_progress")}</b> rollouts in progress</span>
<span>refreshes every 5 s</span></div>
<h2>Devices</h2><table><tr><th>device</th><th>status</th><th>running</th><th>desired</th><th>last report</th>
<th>self-test on device</th><th>requests</th><th>p95 latency</th><th>mean batch</th><th>cpu · memory</th>
<th>last seen (UTC)</th></tr>
{"".join(rows) or empty}</table>
<h2>Models</h2><table><tr><th>name</th><th>version</th><th>profile</th><th>engine</th><th>accuracy (top-1)</th>
<th>sha256</th><th>uploaded (UTC)</th></tr>{"".join(mrows) or empty}</table>
<h2>Rollouts</h2><table><tr><th>id</th><th>model</th><th>profile</th><th>status</th><th>devices</th>
<th>created (UTC)</th></tr>{"".join(rrows) or empty}</table>
</body></html>"""


def login_page(error: str | None = None) -> str:
    err = f'<p class="pill bad">{escape(error)}</p>' if error else ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>edgefleet console: sign in</title>
<style>{CSS}</style></head><body><h1>edgefleet fleet console</h1>
<div class="sub">Paste an API token (the first admin token is in the fleet's data dir, <code>admin-token</code>).</div>
{err}<form method="post" action="/login"><input name="token" type="password" size="60" autofocus>
<button type="submit">Sign in</button></form></body></html>"""
