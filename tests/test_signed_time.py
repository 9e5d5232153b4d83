"""The fleet's signed time (protocol/signed_time.py) and the time the agent trusts (agent/link/clock.py).

The statement is checked with the timestamp role's keys of a real root (``edgefleet keys create``); the agent's
TUF client asks a real HTTP server on loopback for it, also after the timestamp key was rotated while it was
offline. The clock itself is plain code with its wall and monotonic clocks passed in.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tuf.api.metadata import Metadata, Root

from edgefleet.agent.errors import TrustError
from edgefleet.agent.link.clock import TrustedClock, load_floor, save_floor
from edgefleet.agent.link.updater import BundleFetcher
from edgefleet.fleet.keys import KeyStore, create_keys, init_keys, rotate_key
from edgefleet.fleet.tuf_repo import Repository
from edgefleet.protocol.bundle import sha256_file
from edgefleet.protocol.errors import SchemaError
from edgefleet.protocol.signed_time import MAX_DOCUMENT_BYTES, describe_skew, sign_time, verify_time
from tests.test_keys import ci_publish

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 11, 29, 4, 0, tzinfo=UTC)
DAY_S = 86400.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[KeyStore, Root]:
    d = tmp_path_factory.mktemp("time-keys")
    init_keys(d)
    return KeyStore(d), Metadata[Root].from_bytes((d / "root.json").read_bytes()).signed


def _doc(keys: KeyStore, nonce: str, when: dt.datetime = NOW, role: str = "timestamp") -> dict:
    return sign_time(keys.signer(role), when, nonce)


def test_a_signed_time_verifies_with_the_timestamp_role(keys):
    ks, root = keys
    nonce = secrets.token_hex(16)
    assert verify_time(json.dumps(_doc(ks, nonce)).encode(), root, nonce) == NOW


@pytest.mark.parametrize(("change", "why"), [
    (lambda d, ks: d, "another nonce"),  # verified against a nonce other than the one it answers
    (lambda d, ks: {**d, "signed": {**d["signed"], "time": "2020-01-01T00:00:00Z"}}, "not signed by 1"),
    (lambda d, ks: _doc(ks, d["signed"]["nonce"], role="snapshot"), "not signed by 1"),  # another role's key
    (lambda d, ks: {**d, "signed": {**d["signed"], "extra": 1}}, "exactly _type"),
    (lambda d, ks: {**d, "signatures": []}, "1-16 signatures"),
    (lambda d, ks: {**d, "signatures": [{"keyid": "x"}]}, "unreadable"),
    (lambda d, ks: {**d, "signed": {**d["signed"], "time": "tomorrow"}}, "unreadable"),
    (lambda d, ks: {**d, "pad": "x" * MAX_DOCUMENT_BYTES}, "limit"),
])
def test_a_signed_time_that_is_not_the_fleets_answer_to_this_nonce_is_refused(keys, change, why):
    ks, root = keys
    nonce = secrets.token_hex(16)
    doc = change(_doc(ks, nonce), ks)
    asked = secrets.token_hex(16) if why == "another nonce" else nonce
    with pytest.raises(SchemaError, match=why):
        verify_time(json.dumps(doc).encode(), root, asked)


def test_a_malformed_nonce_is_not_signed(keys):
    with pytest.raises(ValueError, match="32-64 lowercase hex"):
        sign_time(keys[0].signer("timestamp"), NOW, "../../x")


class _Clocks:
    def __init__(self, wall: dt.datetime):
        self.wall, self.mono = wall.timestamp(), 1000.0

    def advance(self, s: float) -> None:
        self.wall += s
        self.mono += s


def _clock(local: dt.datetime, floor: dt.datetime | None = None) -> tuple[TrustedClock, _Clocks]:
    c = _Clocks(local)
    return TrustedClock(floor, 300.0, wall=lambda: c.wall, monotonic=lambda: c.mono), c


def test_a_clock_two_days_fast_trusts_the_signed_time_carried_forward():
    clock, c = _clock(NOW + dt.timedelta(days=2))
    clock.observe_signed(NOW)
    c.advance(60)
    r = clock.reading()
    assert (r.trusted, r.source, r.skew_s) == (NOW + dt.timedelta(seconds=60), "signed", 2 * DAY_S)


def test_a_clock_within_the_tolerance_is_used():
    clock, c = _clock(NOW + dt.timedelta(seconds=30))
    clock.observe_signed(NOW)
    assert clock.reading().trusted == NOW + dt.timedelta(seconds=30)


def test_never_earlier_than_the_floor():
    floor = NOW + dt.timedelta(hours=1)
    clock, c = _clock(NOW - dt.timedelta(days=400), floor)
    r = clock.reading()  # no signed time this run: the floor, and the clock behind it reported
    assert (r.trusted, r.source, r.skew_s) == (floor, "floor", -(400 * DAY_S + 3600))
    clock.observe_signed(NOW)  # a signed time older than the floor does not move it back
    assert clock.reading().trusted == floor and clock.floor == floor
    fresh, _ = _clock(NOW)  # nothing known but the local clock: no skew claimed
    assert (fresh.reading().source, fresh.reading().skew_s) == ("local", None)


def test_the_floor_survives_a_restart_and_a_torn_file_is_none(tmp_path):
    save_floor(tmp_path / "t.json", NOW)
    assert load_floor(tmp_path / "t.json") == NOW
    (tmp_path / "t.json").write_text('{"floor_unix_s": "nan"')
    assert load_floor(tmp_path / "t.json") is None
    assert load_floor(tmp_path / "missing.json") is None


def test_describe_skew():
    assert describe_skew(2 * DAY_S) == "2.0 days ahead of"
    assert describe_skew(-400 * DAY_S) == "400.0 days behind"
    assert describe_skew(720) == "12 min ahead of"


# -- the agent's TUF client and a rotated timestamp key --------------------------------------------------
class _TimeAndRepo(http.server.BaseHTTPRequestHandler):
    """Files of a TUF repository, and /api/v1/time signed with whatever timestamp key the fleet folder holds now."""

    repo: Path
    fleet_keys: Path

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/api/v1/time":
            nonce = query.removeprefix("nonce=")
            body = json.dumps(sign_time(KeyStore(self.fleet_keys).signer("timestamp"), dt.datetime.now(UTC),
                                        nonce)).encode()
        else:
            f = self.repo / path.lstrip("/")
            body = f.read_bytes() if f.is_file() else b""
            if not f.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def rotating(tmp_path, digits_bundle) -> Iterator[tuple[Path, Path, type[_TimeAndRepo], str, str]]:
    fleet = create_keys(tmp_path / "keys")
    repo = Repository(tmp_path / "repo", KeyStore(fleet))
    repo.init()
    target = ci_publish(repo, tmp_path / "keys" / "ci" / "bundles.key", digits_bundle)
    handler = type("H", (_TimeAndRepo,), {"repo": tmp_path / "repo", "fleet_keys": fleet})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield tmp_path, fleet, handler, f"http://127.0.0.1:{srv.server_port}", target
    finally:
        srv.shutdown()
        srv.server_close()


def _client(tmp: Path, url: str, root: Path) -> BundleFetcher:
    return BundleFetcher(tmp / "agent", f"{url}/metadata/", f"{url}/targets/", root, time_url=f"{url}/api/v1/time")


def test_a_time_signed_with_a_rotated_timestamp_key_is_verified_after_walking_the_roots(rotating, digits_bundle):
    tmp, fleet, _handler, url, target = rotating
    anchor = tmp / "anchor.json"
    anchor.write_bytes((fleet / "root.json").read_bytes())  # root v1, what the device was given
    rotate_key(tmp / "keys", "timestamp")
    Repository(tmp / "repo", KeyStore(fleet)).init()  # the fleet publishes root v2 and re-signs with the new key
    c = _client(tmp, url, anchor)
    with pytest.raises(TrustError, match="not signed by"):
        c.check_time()  # root v1 does not know the new key
    got = c.fetch(target, sha256_file(digits_bundle))  # walks to root v2, then verifies the time
    assert got.length == digits_bundle.stat().st_size
    assert c.clock.reading().source == "signed"
    assert load_floor(tmp / "agent" / "trusted-time.json") is not None


def test_a_time_signed_by_a_stranger_is_refused(rotating, digits_bundle):
    tmp, fleet, handler, url, target = rotating
    init_keys(tmp / "stranger")
    handler.fleet_keys = tmp / "stranger"  # the server signs its time with keys the device's root never named
    with pytest.raises(TrustError, match="not signed by 1 of the timestamp role's keys"):
        _client(tmp, url, fleet / "root.json").fetch(target, sha256_file(digits_bundle))
