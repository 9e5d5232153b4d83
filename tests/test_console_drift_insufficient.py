"""Issue 40.7: a drift score the judge calls "insufficient" (too few answers for its noise) is not drawn as a
reading on the console: no point, no line, the word "insufficient" instead; the same for a rollout's wave charts."""

from __future__ import annotations

from edgefleet.fleet.charts import device_time_charts, wave_time_charts

T0 = 1_790_000_000.0


def _drift_chart(charts: list[str]) -> str:
    return next(c for c in charts if "drift (PSI)" in c)


def test_a_device_s_insufficient_drift_is_said_not_drawn():
    # the demo's case: two answers, PSI 5.04 against noise 2.25, level insufficient
    rows = [{"ts": T0, "psi": 0.0, "level": "insufficient", "scored_samples": 0},
            {"ts": T0 + 30, "psi": 5.04, "level": "insufficient", "scored_samples": 2, "noise": 2.25}]
    chart = _drift_chart(device_time_charts([], rows))
    assert "<polyline" not in chart and "<circle" not in chart and "5.04" not in chart
    assert "insufficient (2 answers" in chart


def test_a_device_s_scored_drift_is_drawn_and_an_insufficient_newest_one_is_named():
    rows = [{"ts": T0, "psi": 0.05, "level": "stable", "scored_samples": 400},
            {"ts": T0 + 30, "psi": 0.31, "level": "drift", "scored_samples": 600},
            {"ts": T0 + 60, "psi": 7.0, "level": "insufficient", "scored_samples": 3}]
    chart = _drift_chart(device_time_charts([], rows))
    assert "<polyline" in chart  # the two readings
    assert "psi 0.31" in chart  # the legend's newest reading is the last scored one, not 7.0
    assert "insufficient (3 answers" in chart


def test_a_wave_s_insufficient_buckets_are_gaps():
    pts = [{"t": T0 + 60 * i, "span_s": 60.0, "model": "m", "version": "1.0.0", "p99_ms": 1.0,
            "throughput_rps": 1.0, "error_rate": 0.0, "psi": psi, "drift_level": level, "drift_samples": n}
           for i, (psi, level, n) in enumerate([(4.0, "insufficient", 5), (6.0, "insufficient", 9)])]
    chart = _drift_chart(wave_time_charts({"index": 0, "points": pts}, 60.0, model="m"))
    assert "<polyline" not in chart and "<circle" not in chart
    assert "insufficient (9 answers" in chart
