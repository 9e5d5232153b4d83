"""The agent's signature checks run on ``cryptography`` in the install the agent really gets.

securesystemslib lists ``cryptography`` as optional: without it, an Ed25519 check silently takes a vendored
pure-Python path (38x slower, and tested by no test here, since every test venv gets ``cryptography`` through
``[compiler]``). So ``edgefleet[agent]`` must install it. This runs the agent's own TUF client
(``BundleFetcher``: refresh root -> timestamp -> snapshot -> targets, then download a target) in a subprocess
that sees only the ``[agent]`` closure of this venv, against the fleet's repository on a real HTTP server on
loopback, and records which of securesystemslib's two Ed25519 paths each signature check took (no timing).
``tests/test_arm64.py`` runs the same probe in the emulated aarch64 venv that ``pip install .[agent]`` made.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgefleet.fleet.keys import KeyStore, init_keys
from edgefleet.fleet.tuf_repo import Repository
from tests.installs import closure, run_as_installed, run_without
from tests.test_tuf import Server

TARGET = "probe/1.0.0/x86-cpu.tar"

# argv: state dir, metadata URL, targets URL, trusted root.json, target path, its sha256. Prints which Ed25519
# path securesystemslib took, counted by wrapping its two private helpers (the fast one calls cryptography).
PROBE = r"""
import json, sys
from pathlib import Path
from securesystemslib.signer import _key
calls = {"cryptography": 0, "pure_python": 0}
def counted(name, fn):
    def wrapper(*a, **kw):
        calls[name] += 1
        return fn(*a, **kw)
    return wrapper
_key.SSlibKey._verify = counted("cryptography", _key.SSlibKey._verify)
_key.SSlibKey._verify_ed25519_fallback = counted("pure_python", _key.SSlibKey._verify_ed25519_fallback)
from edgefleet.agent.link.updater import BundleFetcher
state, meta, targets, root, target, sha = sys.argv[1:7]
got = BundleFetcher(Path(state), meta, targets, Path(root)).fetch(target, sha)
print(json.dumps({"calls": calls, "sha256": got.sha256,
                  "cryptography_loaded": "cryptography" in sys.modules}))
"""


@pytest.fixture
def repo(tmp_path: Path):
    init_keys(tmp_path / "keys")
    repo = Repository(tmp_path / "repo", KeyStore(tmp_path / "keys"))
    repo.init()
    blob = tmp_path / "probe.tar"
    blob.write_bytes(b"not a bundle: TUF checks length and hashes, the agent the archive" * 64)
    info = repo.add_target(TARGET, blob, {"name": "probe", "version": "1.0.0", "profile": "x86-cpu"})
    srv = Server(tmp_path / "repo")
    yield tmp_path, srv, info["sha256"]
    srv.close()


def probe_argv(tmp: Path, srv: Server, sha: str, name: str) -> list[str]:
    return [str(tmp / name), f"{srv.url}/metadata/", f"{srv.url}/targets/", str(tmp / "keys" / "root.json"),
            TARGET, sha]


def test_the_agent_extra_installs_cryptography():
    assert "cryptography" in closure("agent")
    assert {"securesystemslib", "tuf"} <= closure("agent")


def test_an_agent_only_install_verifies_tuf_signatures_with_cryptography(repo):
    tmp, srv, sha = repo
    r = run_as_installed(("agent",), PROBE, *probe_argv(tmp, srv, sha, "agent-only"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["sha256"] == sha
    # root, timestamp, snapshot and targets each checked at least once; every check on the fast path
    assert doc["calls"]["cryptography"] >= 4 and doc["calls"]["pure_python"] == 0, doc
    assert doc["cryptography_loaded"], doc


def test_the_probe_sees_the_pure_python_path_when_cryptography_is_missing(repo):
    """The probe can fail: with cryptography not importable, the same fetch verifies (slowly) on the fallback."""
    tmp, srv, sha = repo
    r = run_without(["cryptography"], PROBE, *probe_argv(tmp, srv, sha, "no-cryptography"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["calls"]["pure_python"] >= 4 and doc["calls"]["cryptography"] == 0, doc
