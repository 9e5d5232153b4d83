"""The console in a real headless Chromium (Debian's, driven by Playwright through its executable path):
sign in, start a rollout from the form, watch its waves pass, start one whose installs fail and watch it
halt, abort it with the button, read a device's charts. Screenshots are kept in .artifacts/console/.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.fleet_harness import api, running_fleet
from tests.test_rollout import online, upload

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parent.parent / ".artifacts" / "console"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                                          "(.ci/ensure-system-deps installs it)")


def _until_text(page, selector: str, pattern: str, timeout_s: float = 60.0) -> str:
    """Reload (the page refreshes itself too) until ``selector``'s text matches; bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = page.inner_text(selector)
        if re.search(pattern, text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"{selector!r} never matched {pattern!r}; last text: {text[:500]}")
        time.sleep(0.5)
        page.reload()


def _start_rollout(page, model_version: str, waves: str, soak_s: str, on_failure: str | None = None) -> None:
    """Fill the console's new-rollout form as a person would (profile x86-cpu, install success >= 0.9) and submit."""
    page.select_option("select[name=model_version]", model_version)
    page.fill("input[name=profile]", "x86-cpu")
    page.fill("input[name=waves]", waves)
    page.fill("input[name=soak_s]", soak_s)
    page.fill("input[name=install_success_min]", "0.9")
    if on_failure is not None:
        page.select_option("select[name=on_failure]", on_failure)
    page.click("#new-rollout button[type=submit]")


def test_a_person_runs_rollouts_from_the_console(tmp_path, mosquitto, sims, digits_bundle, digits_bundle_v2):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with running_fleet(tmp_path, mosquitto.url, rollout_tick_s=0.05) as (fs, url):
        upload(url, digits_bundle, digits_bundle_v2)
        sims(mqtt_url=mosquitto.url, devices=10, install_s=0.05, telemetry_interval_s=0.3,
             failure_rate_by_version={"1.1.0": 0.5})
        online(url, 10)
        viewer = api.post(f"{url}/api/v1/tokens", json={"name": "watcher", "role": "viewer"}).json()["token"]
        with sync_playwright() as p:
            args = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's sandbox refuses to run as root
            browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{url}/")
                assert "sign in" in page.title()
                page.fill("input[name=token]", "wrong")
                page.click("button[type=submit]")
                assert "unknown or revoked" in page.inner_text("body")
                page.fill("input[name=token]", api.token or "")
                page.click("button[type=submit]")
                assert page.inner_text("h1") == "edgefleet fleet console"
                assert "10 devices" in page.inner_text(".summary").replace("\n", " ")

                # a good rollout, started from the form: its two waves pass
                _start_rollout(page, "digits 1.0.0", waves="3,100%", soak_s="1")
                assert re.search(r"Rollout #\d+: digits 1\.0\.0", page.inner_text("h1"))
                good = page.url
                _until_text(page, "h1", "succeeded")
                waves = page.inner_text("#waves")
                assert waves.count("passed") == 2 and "install_success 1 ≥ 0.9" in waves, waves
                page.screenshot(path=str(ARTIFACTS / "rollout-succeeded.png"), full_page=True)

                # a bad one: half the installs of 1.1.0 fail, the first wave fails its gate and it pauses
                page.goto(f"{url}/")
                _start_rollout(page, "digits 1.1.0", waves="4,100%", soak_s="0", on_failure="pause")
                bad = page.url
                _until_text(page, "h1", "paused")
                waves = page.inner_text("#waves")
                assert re.search(r"failed[\s\S]*pending", waves), waves  # wave 2 never started
                # the gate fails as soon as 0.9 is out of reach, so its value is that of the reports in by
                # then (2 of 4 devices fail: 0, 0.333, 0.5 or 0.667 depending on the order they report in)
                gate = re.search(r"install_success ([\d.]+) ≥ 0\.9", waves)
                assert gate and float(gate.group(1)) < 0.9, waves
                page.screenshot(path=str(ARTIFACTS / "rollout-halted.png"), full_page=True)
                page.click("#actions button[value=abort]")
                _until_text(page, "h1", "aborted")
                assert api.get(f"{bad.replace('/rollouts/', '/api/v1/rollouts/')}?targets=false").json()["status"] \
                    == "aborted"

                # a device's charts
                page.goto(f"{url}/devices/sim-00000")

                def charts_have_data() -> bool:
                    page.reload()
                    return "no data yet" not in page.inner_text(".grid")

                wait_for(charts_have_data, 30, "the device's charts have data", interval_s=0.5)
                assert page.locator("svg polyline").count() >= 6
                assert "temperature" in page.inner_text(".grid") and "box %" in page.inner_text(".grid")
                page.screenshot(path=str(ARTIFACTS / "device.png"), full_page=True)

                # a viewer sees rollouts but gets no buttons and no form
                ctx = browser.new_context()
                vpage = ctx.new_page()
                vpage.goto(f"{url}/")
                vpage.fill("input[name=token]", viewer)
                vpage.click("button[type=submit]")
                assert vpage.locator("#new-rollout").count() == 0
                vpage.goto(good)
                assert vpage.locator("#actions button").count() == 0
                ctx.close()
            finally:
                browser.close()
        print(f"\nscreenshots: {ARTIFACTS}")


def _bulk_fleet(sessions, model_id: int, n: int, first_wave: int, chunk: int = 10_000) -> int:
    """``n`` devices and a paused rollout of them all (two waves), written straight into the database in
    chunks of multi-row INSERTs (seconds, where ``n`` API calls would take minutes). Returns its id."""
    from sqlalchemy import insert

    from edgefleet.fleet.db import Device, Rollout, RolloutTarget, RolloutWave

    states = ("installed", "installed", "installed", "failed", "pending")
    with sessions.begin() as s:
        rid = int(s.scalar(insert(Rollout).values(
            model_id=model_id, status="paused", model_name="digits", model_version="1.0.0", current_wave=1,
            spec={"waves": ["10%", "100%"]}, created_by="bulk", reason="paused by bulk").returning(Rollout.id)))
        s.execute(insert(RolloutWave), [
            {"rollout_id": rid, "idx": 0, "size": first_wave, "state": "passed", "n_installed": first_wave},
            {"rollout_id": rid, "idx": 1, "size": n - first_wave, "state": "installing",
             "n_installed": sum(1 for i in range(first_wave, n) if states[i % 5] == "installed"),
             "n_failed": sum(1 for i in range(first_wave, n) if states[i % 5] == "failed")}])
        for start in range(0, n, chunk):
            ids = [f"bulk-{i:06d}" for i in range(start, min(n, start + chunk))]
            s.execute(insert(Device), [{"id": d, "labels": {}, "registered_via": "api", "online": i % 3 != 0,
                                        "group_name": f"g{i % 10}", "running_model": "digits",
                                        "running_version": "1.0.0", "last_state": "installed"}
                                       for i, d in enumerate(ids, start)])
            s.execute(insert(RolloutTarget), [
                {"rollout_id": rid, "device_id": d, "wave": 0 if i < first_wave else 1, "model_id": model_id,
                 "state": "installed" if i < first_wave else states[i % 5]} for i, d in enumerate(ids, start)])
    return rid


def test_the_console_stays_usable_at_100000_devices(tmp_path, mosquitto, digits_bundle):
    """100,000 devices and a rollout of them all: the overview and the rollout page show the counts and one
    page each, filtered and paged by the server. The load times are printed (the goal is under 2 s each)."""
    from playwright.sync_api import sync_playwright

    n = 100_000
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        upload(url, digits_bundle)
        model_id = api.get(f"{url}/api/v1/models").json()[0]["id"]
        t0 = time.perf_counter()
        rid = _bulk_fleet(fs.sessions, model_id, n, first_wave=n // 10)
        print(f"\ninserted {n} devices and {n} targets in {time.perf_counter() - t0:.1f} s")
        with sync_playwright() as p:
            args = ["--no-sandbox"] if os.geteuid() == 0 else []
            browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{url}/")
                page.fill("input[name=token]", api.token or "")
                page.click("button[type=submit]")

                def load(path: str) -> float:
                    # from a blank page: the page before refreshes itself (meta refresh, 2-5 s), and at 100,000 devices
                    # on a loaded box that reload can start while this load waits, aborting it (net::ERR_ABORTED)
                    page.goto("about:blank")
                    t = time.perf_counter()
                    page.goto(f"{url}{path}", wait_until="load")
                    return time.perf_counter() - t

                took = {"rollout": load(f"/rollouts/{rid}")}
                summary = page.inner_text(".summary").replace("\n", " ")
                assert f"of {n} installed" in summary and "paused" in page.inner_text("h1"), summary
                waves = page.inner_text("#waves")
                assert "10000" in waves and "90000" in waves and "54000 ok · 18000 failed" in waves, waves
                assert page.locator("#targets tr").count() == 1 + 50  # a header and one page
                assert f"rows 1–50 of {n}" in page.inner_text(".pager")
                page.screenshot(path=str(ARTIFACTS / "rollout-100k.png"))
                took["rollout, failed, page 2"] = load(f"/rollouts/{rid}?state=failed&offset=50")
                assert "rows 51–100 of 18000" in page.inner_text(".pager")
                assert page.locator("#targets .pill.bad").count() == 50
                prev = page.get_attribute(".pager a[rel=prev]", "href")
                assert prev, "no link to the previous page"
                load(prev)
                assert "rows 1–50 of 18000" in page.inner_text(".pager")

                took["overview"] = load("/")
                summary = page.inner_text(".summary").replace("\n", " ")
                assert f"{n} devices" in summary and f"{n - n // 3 - 1} online" in summary, summary
                assert page.locator("#devices tr").count() == 1 + 50
                assert "bulk-000000" in page.inner_text("#devices")
                took["overview, filtered"] = load("/?group=g7&state=offline&q=99")
                matching = sum(1 for i in range(n) if i % 10 == 7 and i % 3 == 0 and "99" in f"bulk-{i:06d}")
                assert f"of {matching}" in page.inner_text(".pager")
                page.screenshot(path=str(ARTIFACTS / "overview-100k.png"))
            finally:
                browser.close()
        print("page loads at 100,000 devices: " + ", ".join(f"{k} {v:.2f} s" for k, v in took.items()))
