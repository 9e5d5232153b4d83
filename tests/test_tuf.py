"""The fleet's TUF repository and the agent's TUF client, over a real HTTP server on loopback.
Each attack TUF defends against has its own test: the agent must refuse, never install."""

from __future__ import annotations

import datetime as dt
import functools
import http.server
import shutil
import threading
from pathlib import Path

import pytest

from edgefleet.agent.errors import FetchError, TrustError
from edgefleet.agent.link.updater import BundleFetcher
from edgefleet.fleet.keys import KeyStore, init_keys
from edgefleet.fleet.tuf_repo import Repository
from edgefleet.protocol.bundle import sha256_file

TARGET = "digits/1.0.0/x86-cpu.tar"


class Server:
    def __init__(self, root: Path):
        handler = functools.partial(_Quiet, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def world(tmp_path, digits_bundle):
    init_keys(tmp_path / "keys")
    repo = Repository(tmp_path / "repo", KeyStore(tmp_path / "keys"))
    repo.init()
    repo.add_target(TARGET, digits_bundle, {"name": "digits", "version": "1.0.0", "profile": "x86-cpu"})
    srv = Server(tmp_path / "repo")
    yield tmp_path, repo, srv
    srv.close()


def client(tmp_path: Path, srv: Server, name: str = "client", root: Path | None = None) -> BundleFetcher:
    return BundleFetcher(tmp_path / name, f"{srv.url}/metadata/", f"{srv.url}/targets/",
                         root or tmp_path / "keys" / "root.json")


def test_download_verifies_and_returns_signed_custom(world, digits_bundle):
    tmp, repo, srv = world
    got = client(tmp, srv).fetch(TARGET, sha256_file(digits_bundle))
    assert sha256_file(got.path) == sha256_file(digits_bundle)
    assert got.custom.version == "1.0.0"


def test_attack_tampered_bundle_on_the_server(world, digits_bundle):
    tmp, repo, srv = world
    stored = next((tmp / "repo" / "targets" / "digits" / "1.0.0").glob("*.x86-cpu.tar"))
    data = bytearray(stored.read_bytes())
    data[5000] ^= 1
    stored.write_bytes(bytes(data))
    with pytest.raises(TrustError, match="LengthOrHashMismatch"):
        client(tmp, srv).fetch(TARGET, sha256_file(digits_bundle))


def test_attack_endless_data(world, digits_bundle):
    """More bytes than the signed length: the download stops at the bound; a FetchError, which the installer
    retries with backoff (a proxy in the path may be at fault, not the fleet)."""
    tmp, repo, srv = world
    stored = next((tmp / "repo" / "targets" / "digits" / "1.0.0").glob("*.x86-cpu.tar"))
    stored.write_bytes(stored.read_bytes() + b"\0" * 1_000_000)
    with pytest.raises(FetchError, match="DownloadLengthMismatchError"):
        client(tmp, srv).fetch(TARGET, sha256_file(digits_bundle))


def test_attack_rollback_of_metadata(world, digits_bundle, digits_bundle_v2):
    tmp, repo, srv = world
    old_ts = (tmp / "repo" / "metadata" / "timestamp.json").read_bytes()
    repo.add_target("digits/1.1.0/x86-cpu.tar", digits_bundle_v2, {"name": "digits", "version": "1.1.0"})
    c = client(tmp, srv)
    c.fetch(TARGET, sha256_file(digits_bundle))  # the client has now seen the newer timestamp
    (tmp / "repo" / "metadata" / "timestamp.json").write_bytes(old_ts)  # an attacker replays the old one
    with pytest.raises(TrustError, match="BadVersionNumber"):
        c.fetch(TARGET, sha256_file(digits_bundle))


def test_attack_freeze_expired_timestamp(world, digits_bundle, monkeypatch):
    tmp, repo, srv = world
    import edgefleet.fleet.tuf_repo as tr

    monkeypatch.setitem(tr.EXPIRY, "timestamp", dt.timedelta(seconds=-60))
    repo.refresh_expiring(margin=10.0)  # re-signs with a timestamp that is already expired
    with pytest.raises(TrustError, match="Expired"):
        client(tmp, srv).fetch(TARGET, sha256_file(digits_bundle))


def test_attack_repository_signed_with_other_keys(world, digits_bundle):
    tmp, repo, srv = world
    init_keys(tmp / "evil-keys")
    evil = Repository(tmp / "evil-repo", KeyStore(tmp / "evil-keys"))
    evil.init()
    evil.add_target(TARGET, digits_bundle, {"name": "digits"})
    evil_srv = Server(tmp / "evil-repo")
    try:
        with pytest.raises(TrustError, match=r"Unsigned|signature|threshold"):
            client(tmp, evil_srv, name="victim").fetch(TARGET, sha256_file(digits_bundle))
    finally:
        evil_srv.close()


def test_mqtt_message_lying_about_the_hash(world, digits_bundle_v2):
    tmp, repo, srv = world
    with pytest.raises(TrustError, match="signed metadata says"):
        client(tmp, srv).fetch(TARGET, sha256_file(digits_bundle_v2))


def test_unknown_target(world):
    tmp, repo, srv = world
    with pytest.raises(TrustError, match="not in the fleet's signed targets"):
        client(tmp, srv).fetch("digits/9.9.9/x86-cpu.tar", "0" * 64)


def test_fleet_down_is_a_fetch_error_to_retry(world, digits_bundle):
    tmp, repo, srv = world
    c = client(tmp, srv)
    srv.close()
    with pytest.raises(FetchError):
        c.fetch(TARGET, sha256_file(digits_bundle))


def test_a_version_is_never_replaced_in_place(world, digits_bundle_v2):
    tmp, repo, srv = world
    from edgefleet.fleet.errors import RepositoryError

    with pytest.raises(RepositoryError, match="already exists with different content"):
        repo.add_target(TARGET, digits_bundle_v2, {})


def test_repository_refuses_other_keys_on_restart(world):
    tmp, repo, srv = world
    init_keys(tmp / "other-keys")
    from edgefleet.fleet.errors import RepositoryError

    with pytest.raises(RepositoryError, match="created with other keys"):
        Repository(tmp / "repo", KeyStore(tmp / "other-keys")).init()


def test_keys_init_refuses_to_overwrite(tmp_path):
    init_keys(tmp_path / "k")
    from edgefleet.fleet.errors import KeyStoreError

    with pytest.raises(KeyStoreError, match="--force"):
        init_keys(tmp_path / "k")
    assert oct((tmp_path / "k" / "root.key").stat().st_mode & 0o777) == "0o600"
    shutil.rmtree(tmp_path / "k")


def test_a_restart_clears_what_a_kill_between_write_and_rename_left(world):
    """atomic_write's temp files ('.NAME.XXXX.tmp'), left by a SIGKILL between the write and the rename, go at the
    next start (tests/test_crash_random found '.trusted-time.json.xor42_8c.tmp' after one); other files stay."""
    tmp_path, _repo, srv = world
    state = tmp_path / "client"
    client(tmp_path, srv)
    left = [state / ".trusted-time.json.xor42_8c.tmp", state / "metadata" / ".root.json.ab12cd.tmp"]
    for p in left:
        p.write_bytes(b"partial")
    kept = state / "metadata" / "notes.txt"
    kept.write_bytes(b"not ours to remove")
    client(tmp_path, srv)
    assert [p for p in left if p.exists()] == [] and kept.exists()
