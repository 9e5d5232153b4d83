"""Keys by URI: the root key in an encrypted file or on a PKCS#11 token (SoftHSM), files staying the default.

Each test rotates the root key of a split layout (``keys create``) to a key at a URI with the CLI, then signs the
next root with it alone (a revoke), and checks the chain as an agent does: each root version verified by the one
before it with python-tuf.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgefleet.fleet.keys import create_keys, revoke_key

SOFTHSM_LIB = next((p for p in ("/usr/lib/softhsm/libsofthsm2.so", "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
                                "/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so") if Path(p).exists()), None)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgefleet.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def verify_chain(fleet: Path) -> list[int]:
    """Each root version in fleet/roots verified by its predecessor (and itself), as TUF's client does."""
    from tuf.api.metadata import Metadata, Root

    roots = sorted(fleet.glob("roots/*.root.json"), key=lambda p: int(p.name.split(".")[0]))
    prev = Metadata[Root].from_bytes(roots[0].read_bytes())
    prev.signed.verify_delegate("root", prev.signed_bytes, prev.signatures)
    for p in roots[1:]:
        md = Metadata[Root].from_bytes(p.read_bytes())
        prev.signed.verify_delegate("root", md.signed_bytes, md.signatures)
        md.signed.verify_delegate("root", md.signed_bytes, md.signatures)
        prev = md
    return [int(p.name.split(".")[0]) for p in roots]


def _rotate_root_then_sign_alone(tmp_path: Path, uri: str, env: dict[str, str]) -> None:
    create_keys(tmp_path / "k")
    r = cli("keys", "rotate", str(tmp_path / "k"), "root", "--key-uri", uri, "--json", env=env)
    assert r.returncode == 0, r.stderr
    offline = tmp_path / "k" / "offline"
    assert not (offline / "root.key").exists() and (offline / "root.uri.json").exists()
    doc = json.loads((offline / "root.uri.json").read_text())
    assert doc["uri"] == uri and "private" not in json.dumps(doc)
    root = json.loads((tmp_path / "k" / "fleet" / "root.json").read_text())
    assert root["signed"]["roles"]["root"]["keyids"] == [doc["key"]["keyid"]]
    # the next root signed by the key at the URI alone: revoke one of two timestamp keys... simplest, a rotation
    old_ts = root["signed"]["roles"]["timestamp"]["keyids"][0]
    r = cli("keys", "rotate", str(tmp_path / "k"), "timestamp", env=env)
    assert r.returncode == 0, r.stderr
    assert verify_chain(tmp_path / "k" / "fleet") == [1, 2, 3]
    root3 = json.loads((tmp_path / "k" / "fleet" / "root.json").read_text())
    assert old_ts not in root3["signed"]["roles"]["timestamp"]["keyids"]
    assert [s["keyid"] for s in root3["signatures"]] == [doc["key"]["keyid"]]


def test_root_key_in_an_encrypted_file(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = tmp_path / "root-enc.pem"
    pem.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"correct horse")))
    assert b"ENCRYPTED" in pem.read_bytes()
    uri = f"encfile:{pem}"
    # no passphrase, a wrong one: one clear line each, nothing written
    create_keys(tmp_path / "bad")
    r = cli("keys", "rotate", str(tmp_path / "bad"), "root", "--key-uri", uri,
            env={"EDGEFLEET_KEY_PASSPHRASE": ""})
    assert r.returncode == 4 and "set $EDGEFLEET_KEY_PASSPHRASE" in r.stderr, r.stderr
    r = cli("keys", "rotate", str(tmp_path / "bad"), "root", "--key-uri", uri,
            env={"EDGEFLEET_KEY_PASSPHRASE": "wrong"})
    assert r.returncode == 4 and "cannot read its public key" in r.stderr, r.stderr
    assert (tmp_path / "bad" / "offline" / "root.key").exists()  # the old key is still in place
    _rotate_root_then_sign_alone(tmp_path, uri, {"EDGEFLEET_KEY_PASSPHRASE": "correct horse"})
    # a later signature without the passphrase is refused with the same clear line
    r = cli("keys", "revoke", str(tmp_path / "k"), "snapshot", "0" * 64, env={"EDGEFLEET_KEY_PASSPHRASE": ""})
    assert r.returncode == 4, r.stderr


@pytest.fixture
def softhsm(tmp_path):
    """A SoftHSM token (label edgefleet, user PIN 1234) with an ECDSA P-256 key pair at id 2 (securesystemslib's
    HSMSigner signs ECDSA P-256/P-384)."""
    if SOFTHSM_LIB is None or shutil.which("softhsm2-util") is None:
        pytest.skip("SoftHSM is not installed (Debian: apt-get install softhsm2; .ci/ensure-system-deps installs it)")
    pkcs11 = pytest.importorskip("pkcs11", reason="python-pkcs11 is not installed (edgefleet[dev] installs it)")
    from pkcs11.util.ec import encode_named_curve_parameters

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    conf = tmp_path / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {tokens}\nobjectstore.backend = file\nlog.level = ERROR\n")
    env = {"SOFTHSM2_CONF": str(conf), "PYKCS11LIB": SOFTHSM_LIB, "EDGEFLEET_HSM_PIN": "1234"}
    subprocess.run(["softhsm2-util", "--init-token", "--free", "--label", "edgefleet", "--pin", "1234", "--so-pin",
                    "5678"], env={**os.environ, **env}, check=True, capture_output=True)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        token = pkcs11.lib(SOFTHSM_LIB).get_token(token_label="edgefleet")
        with token.open(rw=True, user_pin="1234") as session:
            params = session.create_domain_parameters(pkcs11.KeyType.EC, {
                pkcs11.Attribute.EC_PARAMS: encode_named_curve_parameters("secp256r1")}, local=True)
            params.generate_keypair(store=True, id=b"\x02", label="edgefleet-root")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return env


def test_root_key_on_a_pkcs11_token(tmp_path, softhsm):
    _rotate_root_then_sign_alone(tmp_path, "hsm:2?label=edgefleet", softhsm)
    doc = json.loads((tmp_path / "k" / "offline" / "root.uri.json").read_text())
    assert doc["key"]["keytype"] == "ecdsa" and doc["key"]["scheme"] == "ecdsa-sha2-nistp256"
    # a wrong PIN: a clear error, no new root signed
    before = (tmp_path / "k" / "fleet" / "root.json").read_bytes()
    r = cli("keys", "rotate", str(tmp_path / "k"), "snapshot", env={**softhsm, "EDGEFLEET_HSM_PIN": "0000"})
    assert r.returncode == 4 and "PIN" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (tmp_path / "k" / "fleet" / "root.json").read_bytes() == before


def test_files_stay_the_default(tmp_path):
    fleet = create_keys(tmp_path / "k")
    assert (tmp_path / "k" / "offline" / "root.key").exists()
    ts = json.loads((fleet / "root.json").read_text())["signed"]["roles"]["snapshot"]["keyids"][0]
    with pytest.raises(Exception, match="would leave snapshot without enough keys"):
        revoke_key(tmp_path / "k", "snapshot", ts)
