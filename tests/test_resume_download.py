"""Resumed bundle downloads (issue 43): the fleet's TUF target route answers one byte range (fleet/ranges.py), and the
agent's TUF client goes on from the bytes it kept (agent/link/resume.py) through a loopback proxy that cuts the link
(tests/cutting_proxy.py), a fresh BundleFetcher (an agent restart) for each try. A real fleet, a real Mosquitto."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edgefleet.agent.errors import DownloadCut, FetchError, TrustError
from edgefleet.agent.link.updater import BundleFetcher, FetchedBundle
from edgefleet.fleet.ranges import RangeNotSatisfiable, parse_range
from edgefleet.protocol.bundle import sha256_file
from edgefleet.protocol.mqtt import DesiredState
from tests.cutting_proxy import CuttingProxy

PAD_BYTES = 1_500_000  # the bundle: the digits model and this much self-test padding (~1.6 MB)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, digits_bundle) -> Iterator[tuple[str, Path, str, str, Path]]:
    """(fleet URL, its root.json, the bundle's target path, its sha256, the bundle)."""
    from tests.conftest import running_mosquitto
    from tests.fleet_harness import api, running_fleet
    from tests.test_tuf_bundles import rebundle

    tmp = tmp_path_factory.mktemp("fleet")
    big = rebundle(digits_bundle, tmp / "big.tar", pad_bytes=PAD_BYTES, version="1.1.0")
    with running_mosquitto(tmp) as broker, running_fleet(tmp, broker.url) as (_fs, url):
        up = api.post(f"{url}/api/v1/bundles", content=big.read_bytes())
        assert up.status_code == 201, up.text
        yield url, tmp / "keys" / "root.json", up.json()["target"], up.json()["sha256"], big, (_fs, broker)


def _target_url(fleet) -> str:
    url, _root, target, sha, _big, _ = fleet
    d, _, base = target.rpartition("/")
    return f"{url}/tuf/targets/{d}/{sha}.{base}"


def _client(state: Path, fleet, port: int | None = None, **kw) -> BundleFetcher:
    url, root, *_ = fleet
    base = f"http://127.0.0.1:{port}" if port else url
    return BundleFetcher(state, f"{base}/tuf/metadata/", f"{base}/tuf/targets/", root, **kw)


def _fetch_until_whole(state: Path, fleet, port: int, tries: int, **kw) -> tuple[FetchedBundle, list[FetchError]]:
    """Fetch with a fresh client (an agent restart) each try until the bundle is whole; the errors on the way."""
    _url, _root, target, sha, _big, _ = fleet
    errors: list[FetchError] = []
    for _ in range(tries):
        try:
            return _client(state, fleet, port, **kw).fetch(target, sha), errors
        except FetchError as exc:
            errors.append(exc)
    raise AssertionError(f"not whole after {tries} tries: {[str(e)[:120] for e in errors[-3:]]}")


def test_the_target_route_answers_one_range_and_refuses_the_rest(fleet):
    url = _target_url(fleet)
    whole = fleet[4].read_bytes()
    plain = httpx.get(url, timeout=30)
    assert plain.status_code == 200 and plain.headers["accept-ranges"] == "bytes" and plain.content == whole
    part = httpx.get(url, headers={"Range": "bytes=1000-"}, timeout=30)
    assert part.status_code == 206 and part.content == whole[1000:]
    assert part.headers["content-range"] == f"bytes 1000-{len(whole) - 1}/{len(whole)}"
    mid = httpx.get(url, headers={"Range": "bytes=10-19"}, timeout=30)
    assert mid.status_code == 206 and mid.content == whole[10:20]
    tail = httpx.get(url, headers={"Range": "bytes=-5"}, timeout=30)
    assert tail.status_code == 206 and tail.content == whole[-5:]
    for bad in (f"bytes={len(whole)}-", "bytes=0-1,5-9", "items=0-1", "bytes=9-1", "bytes=" + "1" * 200 + "-"):
        r = httpx.get(url, headers={"Range": bad}, timeout=30)
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(whole)}", (bad, r.status_code)


def test_range_parsing_is_bounded_and_exact():
    assert (parse_range("bytes=0-", 10).start, parse_range("bytes=0-", 10).end) == (0, 9)
    assert parse_range("bytes=5-100", 10).length == 5
    assert parse_range("bytes=-100", 10).start == 0
    for bad in ("bytes=10-", "bytes=-0", "bytes=-", "bytes=1-2, 3-4", "bytes=a-b", "x" * 101):
        with pytest.raises(RangeNotSatisfiable):
            parse_range(bad, 10)


def test_a_download_cut_every_300_kb_resumes_across_restarts_and_moves_the_bundle_about_once(tmp_path, fleet):
    """Before: the first cut was 'TUF verification failed: LengthOrHashMismatchError' (a TrustError), no partial file
    was kept, and no try could ever get past the first cut. Now each cut is a DownloadCut (a FetchError, retried),
    a fresh client picks up the partial file, and the bundle arrives whole, checked against its signed hash."""
    size = fleet[4].stat().st_size
    proxy = CuttingProxy(int(fleet[0].rsplit(":", 1)[1]), cut_every=300_000)
    port = proxy.start()
    try:
        got, errors = _fetch_until_whole(tmp_path / "agent", fleet, port, tries=20)
    finally:
        proxy.stop()
    assert sha256_file(got.path) == fleet[3] and got.length == size
    assert len(errors) >= size // 300_000 - 1 and all(isinstance(e, DownloadCut) for e in errors), errors[:3]
    assert not any(isinstance(e, TrustError) for e in errors)
    assert proxy.down_bytes <= 1.1 * size + 200_000  # the bundle about once, plus the metadata on each try
    assert list((tmp_path / "agent" / "partial").iterdir()) == []  # the partial went once used


def test_a_server_that_ignores_ranges_costs_a_restart_not_a_corrupt_file(tmp_path, fleet):
    size = fleet[4].stat().st_size
    proxy = CuttingProxy(int(fleet[0].rsplit(":", 1)[1]), cut_every=700_000, max_cuts=1, strip_range=True)
    port = proxy.start()
    try:
        got, errors = _fetch_until_whole(tmp_path / "agent", fleet, port, tries=5)
    finally:
        proxy.stop()
    assert sha256_file(got.path) == fleet[3]
    assert len(errors) == 1 and isinstance(errors[0], DownloadCut)
    assert proxy.down_bytes >= size + 600_000  # the cut's bytes were downloaded again: a restart from byte 0


def test_a_link_that_drips_a_little_per_connection_stays_refused(tmp_path, fleet):
    """Each connection brings 2000 bytes after a 0.3 s wait, then is cut: every attempt alone is short of the speed
    guard's 1 s grace, so only a guard that spans the resumes refuses it; then the partial starts over."""
    proxy = CuttingProxy(int(fleet[0].rsplit(":", 1)[1]), cut_every=2000, head_delay_s=0.3)
    port = proxy.start()
    errors: list[FetchError] = []
    _url, _root, target, sha, _big, _ = fleet
    state = tmp_path / "agent"
    try:
        for _ in range(12):
            client = _client(state, fleet, None, grace_s=1.0, min_bytes_per_s=100_000)
            client.targets_url = f"http://127.0.0.1:{port}/tuf/targets/"  # metadata direct; the bundle drips
            with pytest.raises(FetchError) as caught:
                client.fetch(target, sha)
            errors.append(caught.value)
    finally:
        proxy.stop()
    slow = [e for e in errors if "SlowRetrievalError" in str(e)]
    assert slow and not any(isinstance(e, TrustError) for e in errors)
    assert client.partials.have(sha) < 12 * 2000  # dropped when refused: never the whole bundle


def test_caps_combine_and_the_desired_state_bounds_its_cap(tmp_path, fleet):
    c = _client(tmp_path / "a", fleet, max_bytes_per_s=50_000, min_bytes_per_s=2048)
    assert (c.pace_bytes_per_s(0), c.pace_bytes_per_s(20_000), c.pace_bytes_per_s(90_000)) == (50_000, 20_000, 50_000)
    assert c.pace_bytes_per_s(1) == 4096  # never under twice the slow-retrieval minimum
    assert _client(tmp_path / "b", fleet).pace_bytes_per_s(0) == 0
    ok = {"device_id": "edge-1", "ts": 1.0, "rollout_id": 1, "model": "digits", "version": "1.1.0",
          "target": "digits/1.1.0/x86-cpu.tar", "sha256": "0" * 64, "size_bytes": 10}
    assert DesiredState.model_validate({**ok, "download_max_bytes_per_s": 100_000}).download_max_bytes_per_s == 100_000
    assert DesiredState.model_validate(ok).download_max_bytes_per_s is None
    for bad in (0, 4095, 10**11):
        with pytest.raises(ValueError):
            DesiredState.model_validate({**ok, "download_max_bytes_per_s": bad})


def test_a_rollouts_download_cap_goes_out_with_its_desired_state(fleet):
    """RolloutSpec.download_max_bytes_per_s reaches the device in DesiredState (the agent paces at the lower of it
    and its own download_max_bytes_per_s)."""
    import paho.mqtt.client as mqtt

    from edgefleet.fleet.rollout.spec import RolloutSpec
    from edgefleet.protocol import mqtt as proto
    from tests.waiting import wait_for

    fs, broker = fleet[5]
    device = "edge-paced"
    fs.service.devices.register_device(device)
    got: list[bytes] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    c.on_message = lambda _c, _u, msg: got.append(msg.payload)
    c.connect("127.0.0.1", broker.port)
    c.subscribe(proto.topic(device, "desired"))
    c.loop_start()
    try:
        fs.service.rollouts.create_rollout("digits", "1.1.0", [device],
                                           spec=RolloutSpec(download_max_bytes_per_s=50_000))
        wait_for(lambda: got, 30, "the desired state")
    finally:
        c.loop_stop()
        c.disconnect()
    assert DesiredState.model_validate_json(got[-1]).download_max_bytes_per_s == 50_000


def test_the_pacer_holds_a_download_to_its_rate_on_a_clock_it_is_given():
    """resume.Pacer with a fake clock that moves only when it sleeps: 2 MiB in 64 KiB reads at 100 kB/s take the
    time the rate says, less the one second of bytes the bucket starts with; no cap never sleeps."""
    from edgefleet.agent.link.resume import Pacer

    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = Pacer(100_000, clock=lambda: now[0], sleep=sleep)
    for _ in range(32):
        pacer.take(65_536)
    assert round(now[0], 6) == round((32 * 65_536 - 100_000) / 100_000, 6)
    free = Pacer(0, clock=lambda: now[0], sleep=sleep)
    n = len(slept)
    for _ in range(32):
        free.take(65_536)
    assert len(slept) == n
