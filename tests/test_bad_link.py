"""A rollout over a real bad link (issue 43.6): a real fleet, a real Mosquitto and a real agent whose every HTTP request
to the fleet (bootstrap, TUF metadata, the bundle) crosses a veth pair into a network namespace and back
(tests/bad_link.py: netem where the kernel has it, else tbf and a relay's delay), with the link set down and up
during the download and the relay cutting each connection after 600 KB. The bundle (~2 MB) installs, every cut is
retried as a network error (never a verification failure) and resumed, and the link carries the bundle about once.
Skipped where network namespaces are not allowed; bench/bad_link.py is the long run (20 MB at 1 Mbit/s)."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.bad_link import agent_behind_bad_link, namespaces_allowed
from tests.waiting import wait_for

WHY_NOT = namespaces_allowed()
PAD_BYTES = 2_000_000
LINK_CUTS = 3


@pytest.mark.skipif(WHY_NOT is not None, reason=f"needs network namespaces and root: {WHY_NOT}")
def test_a_bundle_installs_over_a_slow_lossy_link_cut_during_the_download(tmp_path, digits_bundle, caplog):
    from tests.agent_harness import served_version
    from tests.fleet_harness import api
    from tests.test_tuf_bundles import rebundle

    device = "edge-bad-link"
    caplog.set_level(logging.WARNING, logger="edgefleet.agent")
    big = rebundle(digits_bundle, tmp_path / "v110.tar", pad_bytes=PAD_BYTES, version="1.1.0")
    size = big.stat().st_size
    with agent_behind_bad_link(tmp_path, digits_bundle, big, device, 20, 60, rate="4mbit", delay_ms=25,
                               loss_pct=5, cut_every=600_000) as (fs, url, link, agent_url):
        before = link.proxy.down_bytes
        rid = fs.service.rollouts.create_rollout("digits", "1.1.0", [device]).id
        wait_for(lambda: link.proxy.down_bytes - before > 300_000, 60, "the bundle's first bytes")
        cutter = threading.Thread(target=lambda: [link.cut(1.0) for _ in range(LINK_CUTS)], daemon=True)
        cutter.start()
        seen: list[dict] = []  # the download's progress as `edgefleet rollout status --json` reads it
        pages: list[str] = []

        def installed() -> bool:
            t = api.get(f"{url}/api/v1/rollouts/{rid}").json()["targets"][0]
            if t.get("download"):
                seen.append(t["download"])
                if not pages:  # the device's console page, while it downloads
                    pages.append(api.get(f"{url}/devices/{device}").text)
            return served_version(agent_url) == "1.1.0"

        wait_for(installed, 240, "1.1.0 installed over the bad link")
        cutter.join(30)
        pages.append(api.get(f"{url}/devices/{device}").text)
        dropped = link.dropped()
    lines = [r.getMessage() for r in caplog.records if "fetch attempt" in r.getMessage()]
    assert len(lines) >= size // 600_000, lines  # the relay's cuts at least
    assert not any("verification" in s or "Mismatch" in s for s in lines), lines
    assert not [r for r in caplog.records if "TrustError" in r.getMessage() or "verification failed" in r.getMessage()]
    assert seen and all(d["bytes_total"] == size and 0 <= d["bytes_done"] <= size for d in seen), seen[-3:]
    assert len({d["bytes_done"] for d in seen}) > 1 and any(d["bytes_per_s"] > 0 and d["eta_s"] for d in seen)
    assert 'id="download"' in pages[0] and 'id="download"' not in pages[-1], pages[0][:300]  # during, after
    carried = link.proxy.down_bytes - before
    print(f"bad link ({link.emulation}): {size} B bundle, {carried} B carried, {len(lines)} retried cuts, "
          f"{link.proxy.cuts} relay cuts, {LINK_CUTS} link downs, {dropped} packets dropped")
    assert carried <= 1.1 * size + 200_000, (carried, size, link.emulation)  # the bundle once, plus metadata
