"""Time charts for the console: inline SVG drawn on the server, with a labelled time axis (UTC clock times) and a
value axis, no script. Pure functions of (unix time, value) points; every label escaped."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from html import escape

__all__ = ["device_time_charts", "time_chart", "wave_time_charts"]

W, H = 360, 150
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 8, 22
COLORS = ("#0969da", "#cf222e", "#8250df", "#1a7f37")
MAX_POINTS = 2000  # per series: the newest


def _nice_step(span: float, ticks: int) -> float:
    raw = span / max(ticks, 1)
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400):
        if step >= raw:
            return float(step)
    return 86400.0 * math.ceil(raw / 86400)


def _clock(ts: float, step: float) -> str:
    t = dt.datetime.fromtimestamp(ts, dt.UTC)
    return t.strftime("%H:%M:%S" if step < 60 else "%H:%M" if step < 86400 else "%m-%d")


def time_chart(title: str, series: dict[str, Sequence[tuple[float, float | None]]], unit: str,
               lines: dict[str, float] | None = None, empty: str = "no data yet",
               x_range: tuple[float, float] | None = None, note: str | None = None) -> str:
    """A line chart of each series over time (points: (unix seconds, value or None for a gap)); ``lines``: labelled
    horizontal thresholds (e.g. drift's 0.1 watch and 0.25 drift); ``x_range``: the time axis' span (unix seconds;
    default: the points'), e.g. a rollout's life for every wave's charts; ``note``: a line shown under the chart (or in
    place of it when there is nothing to draw), e.g. that the newest figure is insufficient."""
    pts = {k: [(t, v) for t, v in list(v)[-MAX_POINTS:] if math.isfinite(t)] for k, v in series.items()}
    values = [v for s in pts.values() for _, v in s if v is not None and math.isfinite(v)]
    times = [t for s in pts.values() for t, _ in s]
    if not values or not times:
        return (f'<div class="chart"><h3>{escape(title)}</h3><span class="sub">{escape(note or empty)}</span>'
                f'</div>')
    t0, t1 = min(times), max(times)
    if x_range is not None and math.isfinite(x_range[0]) and math.isfinite(x_range[1]):
        t0, t1 = min(t0, x_range[0]), max(t1, x_range[1])
    if t1 - t0 < 1:
        t0, t1 = t0 - 1, t1 + 1
    top = max([*values, *(lines or {}).values()]) or 1.0
    top *= 1.05
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + pw * (t - t0) / (t1 - t0)

    def y(v: float) -> float:
        return TOP + ph * (1 - max(min(v / top, 1.0), 0.0))

    out = [f'<line x1="{LEFT}" y1="{TOP + ph}" x2="{LEFT + pw}" y2="{TOP + ph}" stroke="#888"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + ph}" stroke="#888"/>']
    step = _nice_step(t1 - t0, 4)
    tick = math.ceil(t0 / step) * step
    while tick <= t1:
        anchor = "end" if x(tick) > W - 24 else "middle"  # a label at the right edge stays inside the chart
        out.append(f'<line x1="{x(tick):.1f}" y1="{TOP + ph}" x2="{x(tick):.1f}" y2="{TOP + ph + 4}" stroke="#888"/>'
                   f'<text x="{x(tick):.1f}" y="{H - 6}" font-size="10" text-anchor="{anchor}">'
                   f'{_clock(tick, step)}</text>')
        tick += step
    for frac in (0.0, 0.5, 1.0):
        out.append(f'<text x="{LEFT - 4}" y="{y(top * frac) + 3:.1f}" font-size="10" text-anchor="end">'
                   f'{top * frac:.3g}</text>')
    for name, level in (lines or {}).items():
        out.append(f'<line x1="{LEFT}" y1="{y(level):.1f}" x2="{LEFT + pw}" y2="{y(level):.1f}" stroke="#bf8700" '
                   f'stroke-dasharray="4 3"/><text x="{LEFT + pw - 2}" y="{y(level) - 2:.1f}" font-size="9" '
                   f'text-anchor="end" fill="#bf8700">{escape(name)} {level:g}</text>')
    legend = []
    for (name, s), color in zip(pts.items(), COLORS, strict=False):
        seg: list[str] = []
        for t, v in sorted(s, key=lambda p: p[0]):
            if v is None or not math.isfinite(v):
                if len(seg) > 1:
                    out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(seg)}"/>')
                seg = []
                continue
            seg.append(f"{x(t):.1f},{y(v):.1f}")
        if len(seg) > 1:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(seg)}"/>')
        elif seg:
            cx, cy = seg[0].split(",")
            out.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{color}"/>')
        last = next((v for _, v in reversed(s) if v is not None), None)
        legend.append(f'<span style="color:{color}">{escape(name)} {"–" if last is None else f"{last:.3g}"}</span>')
    return (f'<div class="chart"><h3>{escape(title)} <small class="sub">{escape(unit)}, time UTC</small></h3>'
            f'<svg width="{W}" height="{H}" role="img" aria-label="{escape(title)} over time">{"".join(out)}</svg>'
            f'<div class="sub">{" · ".join(legend)}</div>'
            + (f'<div class="sub">{escape(note)}</div>' if note else "") + '</div>')


def device_time_charts(telemetry: Sequence[dict], drift: Sequence[dict]) -> list[str]:
    """Latency, throughput, errors and drift of one device over time (telemetry records and drift rows, any order)."""
    tel = sorted((t for t in telemetry if isinstance(t.get("ts"), (int, float))), key=lambda t: t["ts"])
    lat = [(t["ts"], (t.get("latency") or {}).get("p50_ms")) for t in tel]
    p99 = [(t["ts"], (t.get("latency") or {}).get("p99_ms")) for t in tel]
    thr = [(t["ts"], t["requests"] / t["interval_s"] if t.get("interval_s") else None) for t in tel]
    err = [(t["ts"], float(t.get("errors") or 0)) for t in tel]
    rows = sorted((r for r in drift if isinstance(r.get("ts"), (int, float))), key=lambda r: r["ts"])
    # a score the judge calls insufficient (too few answers for its noise) is no reading: a gap, not a point
    psi = [(r["ts"], None if r.get("level") == "insufficient" else r.get("psi")) for r in rows]
    return [time_chart("latency", {"p50": lat, "p99": p99}, "ms"),
            time_chart("throughput", {"req/s": thr}, "requests/s"),
            time_chart("errors", {"errors": err}, "per interval"),
            # a score needs the bundle's drift reference and 200 answers (fleet.drift): say so, not "no data"
            time_chart("drift (PSI)", {"psi": psi}, "vs the compile-time reference", {"watch": 0.1, "drift": 0.25},
                       empty="no score yet: it needs the bundle's drift reference and 200 answers",
                       note=_insufficient(rows[-1] if rows else None, "level", "scored_samples"))]


def _insufficient(latest: dict | None, level_key: str, samples_key: str) -> str | None:
    """What a drift chart says of its newest figure when the judge calls it insufficient: the level, not a number."""
    if latest is None or latest.get(level_key) != "insufficient":
        return None
    n = latest.get(samples_key)
    return (f"newest: insufficient ({n} answers; a score needs 200)" if isinstance(n, int)
            else "newest: insufficient (too few answers to score)")


def _label(p: dict, model: str | None) -> str:
    if p["model"] == "other":
        return "other versions"
    return p["version"] if p["model"] == model else f'{p["model"]} {p["version"]}'.strip()


def wave_time_charts(wave: dict, bucket_s: float, model: str | None = None,
                     x_range: tuple[float, float] | None = None) -> list[str]:
    """Latency p99, throughput, error rate and drift of one rollout wave over time (fleet.series points: one per
    bucket and model version), a line per version, broken where a bucket has no records of it; ``x_range``: the
    time axis (the rollout's series' start and end, the same for every wave)."""
    series: dict[str, dict[float, dict]] = {}
    for p in wave.get("points") or []:
        series.setdefault(_label(p, model), {})[p["t"]] = p

    def line(value: Callable[[dict], float | None]) -> dict[str, Sequence[tuple[float, float | None]]]:
        out: dict[str, Sequence[tuple[float, float | None]]] = {}
        for name, pts in series.items():
            ts = sorted(pts)
            line_: list[tuple[float, float | None]] = []
            for i, t in enumerate(ts):
                if i and t - ts[i - 1] > bucket_s * 1.5:  # a bucket without records of this version: a gap
                    line_.append((ts[i - 1] + bucket_s, None))
                line_.append((t + pts[t]["span_s"] / 2, value(pts[t])))
            out[name] = line_
        return out

    n = wave["index"] + 1
    x = x_range
    points = [p for p in wave.get("points") or [] if p.get("model") == model] or list(wave.get("points") or [])
    newest = max(points, key=lambda p: p["t"]) if points else None
    return [time_chart(f"wave {n}: latency p99", line(lambda p: p["p99_ms"]), "ms, mean of its devices' p99",
                       x_range=x),
            time_chart(f"wave {n}: throughput", line(lambda p: p["throughput_rps"]), "requests/s, all its devices",
                       x_range=x),
            time_chart(f"wave {n}: errors", line(lambda p: None if p["error_rate"] is None else 100 * p["error_rate"]),
                       "% of requests", x_range=x),
            time_chart(f"wave {n}: drift (PSI)",
                       line(lambda p: None if p.get("drift_level") == "insufficient" else p["psi"]),
                       "its answers vs the compile-time reference", {"watch": 0.1, "drift": 0.25},
                       empty="no score yet: it needs the version's drift reference and 200 answers in a bucket",
                       x_range=x, note=_insufficient(newest, "drift_level", "drift_samples"))]
