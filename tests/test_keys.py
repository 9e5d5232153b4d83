"""Keys where a compromise of one server is not enough (``edgefleet keys create|rotate|revoke``).

The agent's own TUF client (agent.link.updater.BundleFetcher) downloads from the fleet's repository over
a real HTTP server on loopback. The attacker in these tests owns the fleet server: its key folder
(snapshot and timestamp keys) and its repository folder, and may write any file there.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgefleet.agent.errors import TrustError
from edgefleet.agent.link.updater import BundleFetcher
from edgefleet.fleet.errors import RepositoryError
from edgefleet.fleet.keys import (
    BUNDLES_ROLE,
    KeyStore,
    add_key,
    create_keys,
    init_keys,
    load_signer,
    revoke_key,
    rotate_key,
    sign_bundle,
)
from edgefleet.fleet.tuf_repo import Repository
from edgefleet.protocol.bundle import read_manifest, sha256_file
from tests.test_crash_random import record_figures
from tests.test_tuf import Server
from tests.test_tuf_bundles import rebundle

REPO = Path(__file__).resolve().parent.parent


def _custom(bundle: Path) -> dict:
    m = read_manifest(bundle)
    return {"name": m.name, "version": m.version, "profile": m.profile, "cpu_features": list(m.cpu_features)}


def _target(bundle: Path) -> str:
    m = read_manifest(bundle)
    return f"{m.name}/{m.version}/{m.profile}.tar"


def ci_publish(repo: Repository, ci_key: Path, bundle: Path) -> str:
    """What CI and the fleet do for a new bundle: CI signs the next bundles metadata, the fleet
    verifies and publishes it, then takes the bundle file."""
    target = _target(bundle)
    repo.publish_bundles(sign_bundle(ci_key, repo.current_bundles(), target, bundle, _custom(bundle)))
    repo.add_target(target, bundle, _custom(bundle))
    return target


def _client(tmp: Path, srv: Server, name: str, root: Path) -> BundleFetcher:
    return BundleFetcher(tmp / name, f"{srv.url}/metadata/", f"{srv.url}/targets/", root)


def _forge(repo_dir: Path, fleet_keys: Path, evil: Path, how: str) -> None:
    """The attacker, with only what the fleet server holds, publishes ``evil`` as digits 6.6.6:
    ``targets``: a new top-level targets metadata listing it (and no delegation), signed with the
    best key the fleet has; ``bundles``: a new bundles metadata listing it, same signing.
    Snapshot and timestamp are then re-signed with the fleet's genuine keys."""
    from tuf.api.metadata import Metadata, MetaFile, Snapshot, TargetFile, Targets, Timestamp
    from tuf.api.serialization.json import JSONSerializer

    md_dir = repo_dir / "metadata"
    ts = Metadata[Timestamp].from_file(str(md_dir / "timestamp.json"))
    snap = Metadata[Snapshot].from_file(str(md_dir / f"{ts.signed.snapshot_meta.version}.snapshot.json"))
    keys = KeyStore(fleet_keys)
    signer = keys.signer("targets") if keys.has("targets") else keys.signer("snapshot")  # the best it has
    digest = sha256_file(evil)
    target = "digits/6.6.6/x86-cpu.tar"
    (repo_dir / "targets" / "digits" / "6.6.6").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(evil, repo_dir / "targets" / "digits" / "6.6.6" / f"{digest}.x86-cpu.tar")
    tf = TargetFile.from_file(target, str(evil), ["sha256"])
    tf.unrecognized_fields["custom"] = {"name": "digits", "version": "6.6.6", "profile": "x86-cpu"}
    role = "targets.json" if how == "targets" else f"{BUNDLES_ROLE}.json"
    cur = snap.signed.meta.get(role)
    if how == "targets":
        forged = Metadata[Targets].from_file(str(md_dir / f"{cur.version}.targets.json"))  # type: ignore[union-attr]
        forged.signed.delegations = None
    else:
        forged = Metadata(Targets(expires=dt.datetime.now(dt.UTC) + dt.timedelta(days=30)))
    forged.signed.targets[target] = tf
    forged.signed.version = (cur.version if cur else 0) + 1
    forged.signatures.clear()
    forged.sign(signer)
    ser = JSONSerializer(compact=True)
    (md_dir / f"{forged.signed.version}.{role}").write_bytes(forged.to_bytes(ser))
    snap.signed.meta[role] = MetaFile(version=forged.signed.version)
    snap.signed.version += 1
    snap.signatures.clear()
    snap.sign(keys.signer("snapshot"))
    (md_dir / f"{snap.signed.version}.snapshot.json").write_bytes(snap.to_bytes(ser))
    ts.signed.snapshot_meta = MetaFile(version=snap.signed.version)
    ts.signed.version += 1
    ts.signatures.clear()
    ts.sign(keys.signer("timestamp"))
    (md_dir / "timestamp.json").write_bytes(ts.to_bytes(ser))


@pytest.fixture
def split(tmp_path, digits_bundle):
    """The split layout: the fleet folder holds only snapshot + timestamp keys."""
    fleet = create_keys(tmp_path / "keys")
    repo = Repository(tmp_path / "repo", KeyStore(fleet))
    repo.init()
    ci_key = tmp_path / "keys" / "ci" / f"{BUNDLES_ROLE}.key"
    target = ci_publish(repo, ci_key, digits_bundle)
    srv = Server(tmp_path / "repo")
    yield tmp_path, fleet, repo, ci_key, target, srv
    srv.close()


def test_create_puts_each_key_where_it_lives(tmp_path):
    fleet = create_keys(tmp_path / "k")
    assert sorted(p.name for p in fleet.glob("*.key")) == ["snapshot.key", "timestamp.key"]
    assert sorted(p.name for p in (tmp_path / "k" / "offline").glob("*.key")) == ["root.key", "targets.key"]
    assert [p.name for p in (tmp_path / "k" / "ci").glob("*.key")] == ["bundles.key"]
    for p in (tmp_path / "k").rglob("*.key"):
        assert oct(p.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("how", ["bundles", "targets"])
def test_attack_compromised_fleet_server_cannot_install_a_model_of_its_choosing(split, digits_bundle_v2, how):
    tmp, fleet, repo, ci_key, target, srv = split
    c = _client(tmp, srv, "agent", fleet / "root.json")
    assert c.fetch(target, sha256_file(repo.dir / "targets" / next(  # the genuine bundle installs
        p.relative_to(repo.dir / "targets").as_posix() for p in (repo.dir / "targets").rglob("*.tar")))).length > 0
    evil = rebundle(digits_bundle_v2, tmp / "evil.tar", version="6.6.6")
    with pytest.raises(RepositoryError, match="not signed by the CI key"):
        repo.add_target("digits/6.6.6/x86-cpu.tar", evil, {})  # the fleet's own code refuses, of course
    _forge(repo.dir, fleet, evil, how)  # so the attacker writes the metadata by hand
    with pytest.raises(TrustError, match=r"Unsigned|threshold|signature"):
        c.fetch("digits/6.6.6/x86-cpu.tar", sha256_file(evil))
    fresh = _client(tmp, srv, "fresh-agent", fleet / "root.json")  # a device that never saw the repo before
    with pytest.raises(TrustError, match=r"Unsigned|threshold|signature"):
        fresh.fetch("digits/6.6.6/x86-cpu.tar", sha256_file(evil))
    assert not any((tmp / "agent" / "downloads").iterdir())
    record_figures("attack", {"attack": f"compromised fleet server forges {how} metadata", "refused": True})


def test_control_the_same_attack_succeeds_when_the_fleet_holds_the_targets_key(tmp_path, digits_bundle,
                                                                                digits_bundle_v2):
    """Why the split matters (and proof the attack above is real): with 'keys init' the fleet server
    holds the targets key, and owning it is enough to ship any model."""
    init_keys(tmp_path / "keys")
    repo = Repository(tmp_path / "repo", KeyStore(tmp_path / "keys"))
    repo.init()
    repo.add_target(_target(digits_bundle), digits_bundle, _custom(digits_bundle))
    srv = Server(tmp_path / "repo")
    try:
        evil = rebundle(digits_bundle_v2, tmp_path / "evil.tar", version="6.6.6")
        _forge(repo.dir, tmp_path / "keys", evil, "targets")
        got = _client(tmp_path, srv, "agent", tmp_path / "keys" / "root.json").fetch(
            "digits/6.6.6/x86-cpu.tar", sha256_file(evil))
        assert sha256_file(got.path) == sha256_file(evil)
    finally:
        srv.close()


def test_root_rotation_reaches_an_agent_that_was_offline(split, digits_bundle_v2):
    tmp, fleet, repo, ci_key, target, srv = split
    c = _client(tmp, srv, "agent", fleet / "root.json")
    c.fetch(target, sha256_file(repo.dir / "targets" / next(
        p.relative_to(repo.dir / "targets").as_posix() for p in (repo.dir / "targets").rglob("*.tar"))))
    anchor = tmp / "anchor-root.json"  # what devices were given at enrollment: root v1
    shutil.copyfile(fleet / "roots" / "1.root.json", anchor)
    old_root_key = load_signer(tmp / "keys" / "offline" / "root.key", "root")
    # the agent is offline while the operator rotates the root key and both online keys (roots 2-4)
    for role in ("root", "timestamp", "snapshot"):
        rotate_key(tmp / "keys", role)
    # the fleet publishes them when it starts (or 'keys rotate --publish-to')
    Repository(tmp / "repo", KeyStore(fleet)).init()
    assert sorted(int(p.name.split(".")[0]) for p in (repo.dir / "metadata").glob("*.root.json")) == [1, 2, 3, 4]
    v2 = rebundle(digits_bundle_v2, tmp / "v2.tar", version="2.0.0")
    t2 = ci_publish(repo, ci_key, v2)
    got = c.fetch(t2, sha256_file(v2))  # back online: it walks roots 2, 3, 4 and trusts the new keys
    assert sha256_file(got.path) == sha256_file(v2)
    from tuf.api.metadata import Metadata

    assert Metadata.from_file(str(tmp / "agent" / "metadata" / "root.json")).signed.version == 4
    fresh = _client(tmp, srv, "fresh", anchor)  # a device enrolled before all of it, first contact now
    assert fresh.fetch(t2, sha256_file(v2)).length == v2.stat().st_size
    # the retired root key alone can no longer move the root forward
    from tuf.api.metadata import Root

    forged = Metadata[Root].from_bytes((fleet / "root.json").read_bytes())
    forged.signed.version += 1
    forged.signatures.clear()
    forged.sign(old_root_key)
    with pytest.raises(RepositoryError, match="not signed by the old and the new root keys"):
        repo.publish_root(forged.to_bytes())


def test_revoked_ci_key_reaches_an_agent_that_was_offline(split, digits_bundle_v2):
    tmp, fleet, repo, ci_key, target, srv = split
    c = _client(tmp, srv, "agent", fleet / "root.json")
    c.fetch(target, sha256_file(next((repo.dir / "targets").rglob("*.tar"))))
    stolen = tmp / "stolen.key"
    shutil.copyfile(ci_key, stolen)  # the CI runner's key leaked
    # offline: the operator replaces the CI key; the fleet publishes the new top-level targets
    repo.publish_targets(rotate_key(tmp / "keys", BUNDLES_ROLE).read_bytes())
    assert ci_key.exists() and sha256_file(ci_key) != sha256_file(stolen)
    # the thief signs a bundle: the fleet refuses it, and even written by hand (fleet compromised too)
    evil = rebundle(digits_bundle_v2, tmp / "evil.tar", version="6.6.6")
    with pytest.raises(RepositoryError, match="not signed by a CI key"):
        repo.publish_bundles(sign_bundle(stolen, repo.current_bundles(), "digits/6.6.6/x86-cpu.tar", evil,
                                         _custom(evil)))
    # CI re-signs with the new key (everything published so far plus the new version)
    v2 = rebundle(digits_bundle_v2, tmp / "v2.tar", version="2.0.0")
    t2 = ci_publish(repo, ci_key, v2)
    got = c.fetch(t2, sha256_file(v2))  # the agent, back online, takes the new delegation
    assert sha256_file(got.path) == sha256_file(v2)
    _forge_with_ci_key(repo, fleet, stolen, evil)
    with pytest.raises(TrustError, match=r"Unsigned|threshold|signature"):
        c.fetch("digits/6.6.6/x86-cpu.tar", sha256_file(evil))
    record_figures("attack", {"attack": "bundle signed by a revoked CI key", "refused": True})


def _forge_with_ci_key(repo: Repository, fleet: Path, key: Path, evil: Path) -> None:
    """The fleet server and the revoked CI key, both in the attacker's hands."""
    from tuf.api.metadata import Metadata, MetaFile, Snapshot, Targets, Timestamp
    from tuf.api.serialization.json import JSONSerializer

    raw = sign_bundle(key, repo.current_bundles(), "digits/6.6.6/x86-cpu.tar", evil, _custom(evil))
    md = Metadata[Targets].from_bytes(raw)
    ser = JSONSerializer(compact=True)
    md_dir = repo.metadata_dir
    (md_dir / f"{md.signed.version}.{BUNDLES_ROLE}.json").write_bytes(raw)
    digest = sha256_file(evil)
    (repo.targets_dir / "digits" / "6.6.6").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(evil, repo.targets_dir / "digits" / "6.6.6" / f"{digest}.x86-cpu.tar")
    ts = Metadata[Timestamp].from_file(str(md_dir / "timestamp.json"))
    snap = Metadata[Snapshot].from_file(str(md_dir / f"{ts.signed.snapshot_meta.version}.snapshot.json"))
    snap.signed.meta[f"{BUNDLES_ROLE}.json"] = MetaFile(version=md.signed.version)
    snap.signed.version += 1
    snap.signatures.clear()
    snap.sign(KeyStore(fleet).signer("snapshot"))
    (md_dir / f"{snap.signed.version}.snapshot.json").write_bytes(snap.to_bytes(ser))
    ts.signed.snapshot_meta = MetaFile(version=snap.signed.version)
    ts.signed.version += 1
    ts.signatures.clear()
    ts.sign(KeyStore(fleet).signer("timestamp"))
    (md_dir / "timestamp.json").write_bytes(ts.to_bytes(ser))


def test_revoke_one_of_two_ci_keys(split, digits_bundle_v2):
    tmp, fleet, repo, ci_key, target, srv = split
    signed, second = add_key(tmp / "keys", BUNDLES_ROLE)
    repo.publish_targets(signed.read_bytes())
    repo.publish_targets(revoke_key(tmp / "keys", BUNDLES_ROLE, second).read_bytes())
    v2 = rebundle(digits_bundle_v2, tmp / "v2.tar", version="2.0.0")
    second_key = tmp / "keys" / "ci" / f"{BUNDLES_ROLE}-2.key"
    with pytest.raises(RepositoryError, match="not signed by a CI key"):
        repo.publish_bundles(sign_bundle(second_key, repo.current_bundles(), _target(v2), v2, _custom(v2)))
    t2 = ci_publish(repo, ci_key, v2)  # the first key still signs
    assert _client(tmp, srv, "agent", fleet / "root.json").fetch(t2, sha256_file(v2)).length > 0
    from tuf.api.metadata import Metadata

    from edgefleet.fleet.errors import KeyStoreError

    only = Metadata.from_bytes((fleet / "targets.json").read_bytes()).signed.delegations.roles[BUNDLES_ROLE].keyids[0]
    with pytest.raises(KeyStoreError, match="rotate"):
        revoke_key(tmp / "keys", BUNDLES_ROLE, only)  # never leaves the role without a key


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgefleet.cli", "keys", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_create_rotate_revoke(tmp_path, digits_bundle):
    r = _cli("create", str(tmp_path / "k"))
    assert r.returncode == 0, r.stderr
    assert "offline" in r.stdout and "snapshot" in r.stdout
    repo = Repository(tmp_path / "repo", KeyStore(tmp_path / "k" / "fleet"))
    repo.init()
    r = _cli("rotate", str(tmp_path / "k"), "timestamp", "--publish-to", str(tmp_path / "repo"))
    assert r.returncode == 0, r.stderr
    assert (repo.metadata_dir / "2.root.json").exists()
    r = _cli("revoke", str(tmp_path / "k"), "bundles", "0" * 64)
    assert r.returncode == 4 and "is not a bundles key" in r.stderr and "Traceback" not in r.stderr
    r = _cli("create", str(tmp_path / "k"))
    assert r.returncode == 4 and "--force" in r.stderr


def test_ci_signs_and_uploads_through_the_fleet_api(tmp_path, digits_bundle, mosquitto):
    """The user's path for the split layout: the fleet holds no bundles key, so a plain upload is refused
    with what to do; 'edgefleet fleet upload --sign-key' signs in CI and the fleet publishes it; metadata
    signed by another key is refused."""
    import os

    from tests.fleet_harness import api, running_fleet

    create_keys(tmp_path / "split")
    shutil.copytree(tmp_path / "split" / "fleet", tmp_path / "keys")  # what the fleet is started with
    ci_key = tmp_path / "split" / "ci" / f"{BUNDLES_ROLE}.key"
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        r = api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes(),
                     headers={"Content-Type": "application/x-tar"})
        assert r.status_code == 422 and "--sign-key" in r.json()["error"], r.text
        create_keys(tmp_path / "other")
        other = tmp_path / "other" / "ci" / f"{BUNDLES_ROLE}.key"
        current = api.get(f"{url}/api/v1/bundles/signed-metadata").content
        forged = sign_bundle(other, current, "digits/1.0.0/x86-cpu.tar", digits_bundle, _custom(digits_bundle))
        r = api.post(f"{url}/api/v1/bundles/signed-metadata", content=forged)
        assert r.status_code == 422 and "not signed by a CI key" in r.json()["error"], r.text
        env = {**os.environ, "EDGEFLEET_TOKEN": api.token or ""}
        cli = [sys.executable, "-m", "edgefleet.cli", "fleet", "upload", str(digits_bundle), "--fleet", url, "--json"]
        r = subprocess.run([*cli, "--sign-key", str(tmp_path / "nope.key")], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 4 and "no bundles key here" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = subprocess.run([*cli, "--sign-key", str(ci_key)], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["target"] == "digits/1.0.0/x86-cpu.tar"
        assert fs.repo.is_signed("digits/1.0.0/x86-cpu.tar")
        assert [m["version"] for m in api.get(f"{url}/api/v1/models").json()] == ["1.0.0"]
