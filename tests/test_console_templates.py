"""The console's pages go through Jinja2 templates with autoescaping: a hostile string in any field a device, an
operator or the database gives shows as text on every page, never as markup. The pages' content is checked by the
console's other tests (test_fleet_paging, test_rollout_states, test_console_browser, ...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgefleet.fleet import console

X = "\"'><script>alert(1)</script><img src=x onerror=alert(2)>&"
TAGS = re.compile(r"<(script|img)\b", re.I)


def _telemetry(version: str = "1.0.0" + X) -> dict:
    return {"requests": 120, "interval_s": 10.0, "errors": 3, "latency": {"p95_ms": 4.25, "p99_ms": 9.5},
            "batch_size_mean": 2.5, "cpu_percent": 33.3, "rss_mb": 120.7, "model": "m" + X, "version": version,
            "ts": 1.7e9, "device": {"cpu_percent": 40, "memory_used_mb": 900, "temperature_c": 50},
            "serving": {"precision": "int8" + X, "precision_source": "device" + X, "max_batch_size": 8,
                        "precisions": [{"precision": "int8" + X, "items_per_s": 412.0}], "batch_source": "m" + X,
                        "instances": 1, "threads": 2, "layout_source": "default" + X,
                        "runtime": {"runtime": "openvino" + X, "source": "device" + X, "runtimes": [
                            {"runtime": "openvino" + X, "items_per_s": 612.0,
                             "timings": [{"batch_size": 8, "items_per_s": 823.0}]}]}}}


def _device() -> dict:
    selftest = {"model": "m" + X, "version": "0.9" + X, "samples": 8, "drift": 0.1, "top1": 0.9,
                "build": {"top1": 0.95, "metric": "top1" + X, "accuracy": X, "eval_samples": X}}
    return {"device_id": "dev" + X, "online": True, "running_model": "m" + X, "running_version": "1.0.0" + X,
            "desired": {"model": "m" + X, "version": "1.1" + X}, "last_state": "failed" + X, "last_error": X,
            "selftest": selftest, "telemetry": _telemetry(), "last_seen": "2026-11-22T00:41:24" + X,
            "hardware": {"arch": "aarch64" + X}, "group": "g" + X, "profile": "p" + X}


def _rollout() -> dict:
    gates = [{"name": "error_rate" + X, "value": 0.5, "threshold": 0.1, "passed": False, "detail": X}]
    return {"id": 7, "model": "m" + X, "version": "1.1" + X, "profile": "p" + X, "status": "failed",
            "counts": {"installed": 1, "odd" + X: 2}, "created_at": "2026-11-22" + X, "created_by": "ops" + X,
            "reason": "halted" + X, "engine_error": "bad" + X, "engine_error_at": "2026" + X, "current_wave": 0,
            "waves": [{"index": 0, "size": 3, "state": "failed" + X, "installed": 1, "failed": 2, "gates": gates,
                       "soak_s": 60, "soak_until": "2026" + X}],
            "targets": [{"device_id": "dev" + X, "wave": 0, "state": "failed" + X, "error": X,
                         "bundle_profile": "arm" + X}], "targets_total": 1}


PAGES = {
    "overview": lambda: console.render([_device()], [{
        "name": "m" + X, "version": "1" + X, "profile": "p" + X, "backend": "b" + X, "precision": "int8" + X,
        "precision_choice": {"reason": X}, "quantization": {"scheme": X, "weight_bits": 8},
        "accuracy": {"metric": "top1", "candidate": 0.9, "reference": 0.95}, "sha256": X * 2,
        "uploaded_at": "2026" + X}], [_rollout()], True, "message" + X, None, None,
        {"group": X, "state": X, "q": X}, 0),
    "login": lambda: console.login_page("error" + X),
    "rollout": lambda: console.rollout_page(_rollout(), {"dev" + X: _device()}, True, "message" + X, state=X),
    "device": lambda: console.device_page(_device(), [_telemetry(), _telemetry("2.0" + X)], []),
}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_a_hostile_string_in_every_field_stays_text(page):
    html = PAGES[page]()
    body = html.split("</style>", 1)[1]
    assert not TAGS.search(body), TAGS.search(body)
    # it is there, as text: escaped once (not twice: &amp;lt; would show the entity to the reader)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "&amp;lt;" not in body
    # and no attribute was broken out of: every quote inside a value is an entity
    assert '"\'>' not in body


def test_the_console_escapes_nothing_by_hand_and_marks_nothing_safe_in_its_templates():
    """One omission of a hand-written escape() was an XSS: the module has none left, the engine escapes by
    default, and no template turns that off for a value."""
    source = Path(console.__file__).read_text()
    assert "escape(" not in source and "from html import" not in source
    assert console._env().autoescape is True
    for template in (Path(console.__file__).parent / "templates").glob("*.html"):
        text = template.read_text()
        assert "|safe" not in text.replace(" ", "") and "autoescape false" not in text, template.name
