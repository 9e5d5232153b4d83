"""The fleet checks a bundle archive before it signs or stores it, with the reader the agent installs with.

An operator (or a compromised CI job) uploads crafted archives over real HTTP to a fleet on loopback. Each
one carries a valid manifest but a bad archive (or a manifest built to crash the parser): every one must be
refused with 422, a JSON reason naming the problem, no server path in the body, and nothing signed or
stored afterwards. The same checks hold for the delegated layout, where CI signed the target first.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgefleet.protocol import bundle as bundle_mod
from edgefleet.protocol.bundle import BundleError, extract_bundle
from edgefleet.protocol.errors import ContractError
from edgefleet.protocol.manifest import MANIFEST_FILENAME
from tests.conftest import running_mosquitto
from tests.fleet_harness import api, running_fleet


# -- crafted archives ------------------------------------------------------------------------------
@dataclass
class Member:
    name: str
    data: bytes = b""
    type: bytes = tarfile.REGTYPE
    linkname: str = ""


@dataclass
class Crafted:
    """A bundle as a list of tar members; ``manifest`` is written as the first member unless ``raw``."""

    manifest: dict[str, Any]
    members: list[Member] = field(default_factory=list)
    raw_manifest: bytes | None = None

    def write(self, out: Path) -> Path:
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            data = self.raw_manifest if self.raw_manifest is not None else json.dumps(self.manifest).encode()
            _add(tar, Member(MANIFEST_FILENAME, data))
            for m in self.members:
                _add(tar, m)
        return out


def _add(tar: tarfile.TarFile, m: Member) -> None:
    info = tarfile.TarInfo(m.name)  # addfile keeps the name as given: '/etc/x' stays absolute
    info.type = m.type
    info.mode = 0o644
    info.linkname = m.linkname
    info.size = len(m.data) if m.type == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(m.data) if m.type == tarfile.REGTYPE else None)


def _base(digits_bundle: Path, version: str) -> Crafted:
    """The compiled digits bundle, as members, with its own version (so each case is a new target)."""
    with tarfile.open(digits_bundle) as tar:
        files = {}
        for ti in tar.getmembers():
            f = tar.extractfile(ti)
            assert f is not None
            files[ti.name] = f.read()
    manifest = json.loads(files.pop(MANIFEST_FILENAME))
    manifest["version"] = version
    return Crafted(manifest, [Member(n, d) for n, d in sorted(files.items())])


def _member(c: Crafted, name: str) -> Member:
    return next(m for m in c.members if m.name == name)


def _traversal(c: Crafted) -> None:
    c.members.append(Member("../../x", b"owned\n"))


def _absolute(c: Crafted) -> None:
    c.members.append(Member("/etc/x", b"owned\n"))


def _symlink(c: Crafted) -> None:  # the self-test sample is a symlink to /etc/passwd
    st = c.manifest["selftest"]
    c.members = [m for m in c.members if m.name != st] + [Member(st, type=tarfile.SYMTYPE, linkname="/etc/passwd")]


def _hardlink(c: Crafted) -> None:
    st = c.manifest["selftest"]
    c.members = [m for m in c.members if m.name != st] + [Member(st, type=tarfile.LNKTYPE, linkname="/etc/passwd")]


def _hash_mismatch(c: Crafted) -> None:
    eng = _member(c, c.manifest["engine"])
    eng.data = eng.data[:-1] + bytes([eng.data[-1] ^ 1])  # same size, other bytes


def _size_mismatch(c: Crafted) -> None:
    c.manifest["files"][c.manifest["selftest"]]["size_bytes"] += 1


def _duplicate_manifest(c: Crafted) -> None:  # a second, also valid, manifest: tarfile's getmember takes the last
    c.members.append(Member(MANIFEST_FILENAME, json.dumps({**c.manifest, "version": "66.6.6"}).encode()))


def _huge_size(c: Crafted) -> None:
    c.manifest["files"][c.manifest["selftest"]]["size_bytes"] = 10**15


def _unknown_profile(c: Crafted) -> None:
    c.manifest["profile"] = "no-such-board"


def _extra_member(c: Crafted) -> None:
    c.members.append(Member("extra.bin", b"not listed\n"))


def _missing_file(c: Crafted) -> None:
    st = c.manifest["selftest"]
    c.members = [m for m in c.members if m.name != st]


def _deep_manifest(c: Crafted) -> None:
    depth = 100_000
    c.raw_manifest = b'{"manifest_version": 2, "x": ' + b"[" * depth + b"]" * depth + b"}"


# (case id, how to spoil the bundle, words one of which the reason must contain)
CASES: list[tuple[str, Callable[[Crafted], None], tuple[str, ...]]] = [
    ("traversal", _traversal, ("../../x",)),
    ("absolute", _absolute, ("/etc/x",)),
    ("symlink", _symlink, ("selftest.npz", "link", "regular file")),
    ("hardlink", _hardlink, ("selftest.npz", "link", "regular file")),
    ("hash-mismatch", _hash_mismatch, ("sha256",)),
    ("size-mismatch", _size_mismatch, ("bytes",)),
    ("duplicate-manifest", _duplicate_manifest, ("duplicate",)),
    ("size-bytes-1e15", _huge_size, ("size_bytes", "limit")),
    ("unknown-profile", _unknown_profile, ("no-such-board",)),
    ("extra-member", _extra_member, ("extra.bin",)),
    ("missing-file", _missing_file, ("missing",)),
    ("nested-100000", _deep_manifest, ("nested", "deep")),
]


# -- one fleet for the module (all-keys layout: it signs what it accepts) -------------------------------
@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path]]:
    tmp = tmp_path_factory.mktemp("upload-checks")
    with running_mosquitto(tmp) as broker, running_fleet(tmp, broker.url) as (fs, url):
        yield fs, url, tmp


def _published(fs: Any, url: str) -> dict[str, Any]:
    """What the fleet promises and keeps: its TUF metadata as served, the signed targets, the stored files."""
    stored = {str(p.relative_to(fs.repo.dir)): hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted(fs.repo.dir.rglob("*")) if p.is_file() and p.name != ".lock"}
    return {"timestamp": api.get(f"{url}/tuf/metadata/timestamp.json").content,
            "targets": sorted(fs.repo.targets()), "stored": stored,
            "models": api.get(f"{url}/api/v1/models").json()}


def _spoiled(bundle: Path, version: str, spoil: Callable[[Crafted], None], out: Path) -> Path:
    """``bundle`` rebuilt as ``version`` (a new target), spoilt by ``spoil``, written to ``out``."""
    crafted = _base(bundle, version)
    spoil(crafted)
    return crafted.write(out)


def _upload(url: str, archive: bytes) -> httpx.Response:
    return api.post(f"{url}/api/v1/bundles", content=archive, headers={"Content-Type": "application/x-tar"})


def _assert_refused(r: Any, words: tuple[str, ...], server_root: Path) -> str:
    assert r.status_code == 422, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    error = r.json()["error"]
    assert any(w in error for w in words), f"{error!r} names none of {words}"
    for leak in (str(server_root), "/tmp/", "upload-"):
        assert leak not in r.text, f"the reply shows a server path ({leak!r}): {r.text[:500]}"
    return str(error)


@pytest.mark.trust("an operator uploads a crafted archive for signing")
@pytest.mark.parametrize(("case", "spoil", "words"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_archive_is_refused_before_anything_is_signed(fleet, digits_bundle, tmp_path, case, spoil, words):
    fs, url, server_root = fleet
    bad = _spoiled(digits_bundle, f"9.{CASES.index((case, spoil, words))}.0", spoil, tmp_path / f"{case}.tar")
    before = _published(fs, url)
    r = _upload(url, bad.read_bytes())
    _assert_refused(r, words, server_root)
    assert _published(fs, url) == before, "a refused bundle changed the signed repository or the stored files"


def test_the_crafting_helper_makes_an_acceptable_bundle(fleet, digits_bundle, tmp_path):
    """The control: unspoilt, the same builder's archive is accepted (the refusals are for the spoiling)."""
    fs, url, _ = fleet
    ok = _base(digits_bundle, "8.0.0").write(tmp_path / "ok.tar")
    r = _upload(url, ok.read_bytes())
    assert r.status_code == 201, r.text
    assert "digits/8.0.0/x86-cpu.tar" in fs.repo.targets()


def test_absolute_and_traversal_names_survive_in_the_crafted_tar(digits_bundle, tmp_path):
    """tarfile keeps '/etc/x' and '../../x' as written (else those two cases would test nothing)."""
    c = _base(digits_bundle, "1.0.0")
    _traversal(c)
    _absolute(c)
    with tarfile.open(c.write(tmp_path / "names.tar")) as tar:
        assert {"../../x", "/etc/x"} <= set(tar.getnames())


# -- the same reader, without a fleet -------------------------------------------------------------------
@pytest.mark.parametrize(("case", "spoil", "words"), CASES, ids=[c[0] for c in CASES])
def test_the_agent_refuses_the_same_archives(digits_bundle, tmp_path, case, spoil, words):
    bad = _spoiled(digits_bundle, "1.0.0", spoil, tmp_path / f"{case}.tar")
    if case != "unknown-profile":  # the agent checks the profile against its CPU, later (agent.daemon)
        with pytest.raises(ContractError) as exc:  # BundleError, or SchemaError for the manifest
            extract_bundle(bad, tmp_path / "out")
        assert any(w in str(exc.value) for w in words), str(exc.value)
        assert not (tmp_path.parent / "x").exists() and not Path("/etc/x").exists()
    with pytest.raises(ContractError) as exc:
        bundle_mod.check_bundle(bad, profiles=["x86-cpu"])
    assert any(w in str(exc.value) for w in words), str(exc.value)


def test_extract_writes_each_member_itself(digits_bundle, tmp_path, monkeypatch):
    """Python 3.11.2 (Raspberry Pi OS) has no tar.extract(filter=...): extraction must not need it."""
    def old_extract(self, member, path="", set_attrs=True, *, numeric_owner=False):  # 3.11.2's signature
        raise AssertionError("extract_bundle called TarFile.extract")

    monkeypatch.setattr(tarfile.TarFile, "extract", old_extract)
    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extract)
    dest = tmp_path / "out"
    m = extract_bundle(digits_bundle, dest)
    with tarfile.open(digits_bundle) as tar:
        names = tar.getnames()
        expected = {n: tar.extractfile(n).read() for n in names}  # type: ignore[union-attr]
    assert sorted(os.listdir(dest)) == sorted(names) == sorted([*m.files, MANIFEST_FILENAME])
    for name, data in expected.items():
        p = dest / name
        st = p.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644, (name, oct(st.st_mode))
        assert p.read_bytes() == data
    for name, entry in m.files.items():
        assert hashlib.sha256((dest / name).read_bytes()).hexdigest() == entry.sha256


def test_extract_refuses_a_destination_with_a_planted_symlink(digits_bundle, tmp_path):
    """A file already in dest (here a symlink where the engine goes) is never written through."""
    dest = tmp_path / "out"
    dest.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (dest / "model.onnx").symlink_to(victim)
    with pytest.raises(BundleError):
        extract_bundle(digits_bundle, dest)
    assert victim.read_bytes() == b"keep me"


# -- headers tarfile would choke on: walked and refused before tarfile parses anything ----------------------
def _ext(kind: bytes, data: bytes, name: str = "././@PaxHeader") -> bytes:
    """One extended header (pax 'x'/'g', GNU 'L'/'K', Solaris 'X') with ``data`` as written, padded."""
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.mode = kind, len(data), 0o644
    return ti.tobuf(tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % 512)


def _record(key: str, value: bytes) -> bytes:
    """A pax record, ``"%d %s=%s\\n"``, whose length counts itself."""
    body = b" " + key.encode() + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def _retype(archive: bytes, kind: bytes) -> bytes:
    """The archive with its first member's type changed (checksum recomputed as tar writes it)."""
    block = bytearray(archive[:512])
    block[156:157] = kind
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block) + archive[512:]


CVE_2024_6232 = _ext(tarfile.XHDTYPE, b"0" * 120_000)  # a pax header of 120,000 digits: 122 KB in all

# (case id, the hostile archive made from a valid one's bytes, words one of which the reason must contain)
HEADER_CASES: list[tuple[str, Callable[[bytes], bytes], tuple[str, ...]]] = [
    ("pax-120000-digits", lambda ok: CVE_2024_6232 + ok, ("pax extended header",)),
    ("pax-global-120000-digits", lambda ok: _ext(tarfile.XGLTYPE, b"0" * 120_000) + ok, ("pax global header",)),
    ("pax-8000-digit-value", lambda ok: _ext(tarfile.XHDTYPE, _record("comment", b"1" * 8000)) + ok, ("digits",)),
    ("gnu-long-name-1mib", lambda ok: _ext(tarfile.GNUTYPE_LONGNAME, b"a" * 2**20, "././@LongLink") + ok,
     ("GNU long name",)),
    ("pax-chain-2000", lambda ok: _ext(tarfile.XHDTYPE, _record("mtime", b"1")) * 2000 + ok, ("second pax",)),
    ("pax-malformed", lambda ok: _ext(tarfile.XHDTYPE, b"99 path=x\n") + ok, ("malformed",)),
    ("solaris-extended", lambda ok: _ext(b"X", _record("path", b"x")) + ok, ("Solaris",)),
    ("contiguous-file", lambda ok: _retype(ok, tarfile.CONTTYPE), ("contiguous", "regular file")),
    ("fifo", lambda ok: _retype(ok, tarfile.FIFOTYPE), ("FIFO", "regular file")),
    ("gnu-sparse", lambda ok: _retype(ok, tarfile.GNUTYPE_SPARSE), ("sparse", "regular file")),
]


@pytest.fixture(scope="module")
def ok_archive(digits_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], bytes]:
    """A valid bundle's bytes, for a version of the caller's (each upload is a new target)."""
    tmp = tmp_path_factory.mktemp("ok-archives")
    return lambda version: _base(digits_bundle, version).write(tmp / f"{version}.tar").read_bytes()


@pytest.mark.trust("an operator uploads an archive whose headers stall or confuse tarfile")
@pytest.mark.parametrize(("case", "make", "words"), HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_an_archive_tarfile_would_choke_on_is_refused_at_upload(fleet, ok_archive, case, make, words):
    fs, url, server_root = fleet
    bad = make(ok_archive(f"7.{[c[0] for c in HEADER_CASES].index(case)}.0"))
    before = _published(fs, url)
    r = _upload(url, bad)
    _assert_refused(r, words, server_root)
    assert _published(fs, url) == before, "a refused bundle changed the signed repository or the stored files"


@pytest.mark.parametrize(("case", "make", "words"), HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_the_agent_refuses_the_same_headers(ok_archive, tmp_path, case, make, words):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(make(ok_archive("1.0.0")))
    for read in (lambda: extract_bundle(bad, tmp_path / "out"), lambda: bundle_mod.check_bundle(bad)):
        with pytest.raises(BundleError) as exc:
            read()
        assert any(w in str(exc.value) for w in words), str(exc.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.trust("an operator uploads the CVE-2024-6232 archive while the fleet is probed")
def test_the_cve_2024_6232_shape_is_refused_while_health_keeps_answering(fleet, ok_archive):
    """122 KB whose first member is a pax header of 120,000 digits: tarfile before 3.11.10 / 3.12.6 spends 15-40 s
    of CPU in one regex, holding the GIL, and then accepts the bundle behind it. The fleet refuses it unparsed, and
    every health probe sent meanwhile is answered (each waits at most 10 s; before, they waited out the regex)."""
    fs, url, server_root = fleet
    replies: list[httpx.Response] = []
    upload = threading.Thread(target=lambda: replies.append(api.post(
        f"{url}/api/v1/bundles", content=CVE_2024_6232 + ok_archive("7.99.0"),
        headers={"Content-Type": "application/x-tar"})))
    upload.start()
    probes = []
    while upload.is_alive() or len(probes) < 3:
        probes.append(httpx.get(f"{url}/api/v1/health", timeout=10).status_code)
    upload.join()
    assert probes and set(probes) == {200}, probes
    error = _assert_refused(replies[0], ("pax extended header",), server_root)
    assert "120000 bytes" in error and str(bundle_mod.MAX_EXTENDED_HEADER_BYTES) in error, error


def test_small_pax_headers_as_tar_tools_write_them_are_accepted(fleet, digits_bundle, tmp_path):
    """The control: GNU tar's and bsdtar's pax records (fractional times, extended attributes) on every member,
    a global header as ``git archive`` writes one, and a long-name header: accepted and readable by the agent."""
    fs, url, _ = fleet
    crafted = _base(digits_bundle, "7.98.0")
    out = tmp_path / "pax.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": "52fdfc072182654f163f5f0f9a621d729566c74d"}) as tar:
        for m in [Member(MANIFEST_FILENAME, json.dumps(crafted.manifest).encode()), *crafted.members]:
            info = tarfile.TarInfo(m.name)
            info.size, info.mode = len(m.data), 0o644
            info.pax_headers = {"mtime": "1764140000.123456789", "atime": "1764140000.5",
                                "SCHILY.xattr.user.origin": "ci-runner-7"}
            tar.addfile(info, io.BytesIO(m.data))
    raw = out.read_bytes()
    assert raw[156:157] == tarfile.XGLTYPE and raw.count(b"SCHILY.xattr") == len(crafted.members) + 1
    long_named = _ext(tarfile.GNUTYPE_LONGNAME, MANIFEST_FILENAME.encode() + b"\0") + raw[512 * 2:]
    assert bundle_mod.check_bundle(out).version == "7.98.0"
    r = _upload(url, raw)
    assert r.status_code == 201, r.text
    (tmp_path / "long.tar").write_bytes(long_named)
    assert bundle_mod.check_bundle(tmp_path / "long.tar").version == "7.98.0"


# -- roles by content: what each file is, not what the manifest calls it ------------------------------------
def _swap_variant(c: Crafted) -> None:
    """The v4 manifest's fp32 variant names its .npz sample as its engine and its ONNX engine as its sample."""
    v = c.manifest["variants"][0]
    v["engine"], v["selftest"] = v["selftest"], v["engine"]


def _swap_own(c: Crafted) -> None:
    c.manifest["engine"], c.manifest["selftest"] = c.manifest["selftest"], c.manifest["engine"]


def _sample_without_expected(c: Crafted) -> None:
    """The self-test sample is an .npz, but of something else (no expected:<output>)."""
    buf = io.BytesIO()
    import numpy as np

    np.savez(buf, **{"input:input": np.zeros((1, 1, 8, 8), np.float32)})
    m = _member(c, c.manifest["selftest"])
    m.data = buf.getvalue()
    c.manifest["files"][m.name] = {"sha256": hashlib.sha256(m.data).hexdigest(), "size_bytes": len(m.data)}


ROLE_CASES = [
    ("v4-variant-roles-swapped", _swap_variant, ("fp32 engine 'selftest-fp32.npz'", "zip archive")),
    ("own-roles-swapped", _swap_own, ("engine 'selftest-fp32.npz'", "engine 'selftest.npz'")),
    ("sample-without-expected", _sample_without_expected, ("expected:",)),
]


@pytest.mark.trust("an operator uploads a v4 bundle whose engine and self-test roles are swapped")
@pytest.mark.parametrize(("case", "spoil", "words"), ROLE_CASES, ids=[c[0] for c in ROLE_CASES])
def test_a_bundle_whose_files_do_not_fit_their_roles_is_refused(fleet, two_precision_bundle, tmp_path, case, spoil,
                                                                 words):
    fs, url, server_root = fleet
    bad = _spoiled(two_precision_bundle, f"6.{[c[0] for c in ROLE_CASES].index(case)}.0", spoil,
                   tmp_path / f"{case}.tar")
    before = _published(fs, url)
    r = _upload(url, bad.read_bytes())
    _assert_refused(r, words, server_root)
    assert _published(fs, url) == before
    # the agent's verify (extract) and the signing side (fleet.keys.sign_bundle checks with check_bundle)
    with pytest.raises(BundleError) as exc:
        extract_bundle(bad, tmp_path / "out")
    assert any(w in str(exc.value) for w in words), str(exc.value)
    assert not any((tmp_path / "out").iterdir()), "a refused bundle left files behind"


def test_the_compiler_does_not_write_a_bundle_whose_roles_are_swapped(two_precision_bundle, tmp_path):
    from edgefleet.protocol.bundle import write_bundle

    m = extract_bundle(two_precision_bundle, tmp_path / "files")
    v = m.variants[0]
    swapped = m.model_copy(update={"variants": (v.model_copy(update={"engine": v.selftest, "selftest": v.engine}),)})
    with pytest.raises(BundleError, match=r"fp32 engine 'selftest-fp32.npz' is a zip archive"):
        write_bundle(swapped, tmp_path / "files", tmp_path / "swapped.tar")
    assert not (tmp_path / "swapped.tar").exists()
    assert bundle_mod.check_bundle(write_bundle(m, tmp_path / "files", tmp_path / "ok.tar")).variants  # the control


# -- delegated layout: CI signed the target, the fleet still checks the file ---------------------------
def _ci_sign_unchecked(key: Path, current: bytes, target: str, bundle: Path, custom: dict[str, Any]) -> bytes:
    """What a CI job that skips the checks would publish (fleet.keys.sign_bundle checks first)."""
    from tuf.api.metadata import Metadata, TargetFile, Targets
    from tuf.api.serialization.json import JSONSerializer

    from edgefleet.fleet.keys import BUNDLES_ROLE, load_signer

    md = Metadata[Targets].from_bytes(current)
    tf = TargetFile.from_file(target, str(bundle), ["sha256"])
    tf.unrecognized_fields["custom"] = custom
    md.signed.targets[target] = tf
    md.signed.version += 1
    md.signatures.clear()
    md.sign(load_signer(key, BUNDLES_ROLE))
    return bytes(md.to_bytes(JSONSerializer(compact=True)))


def test_a_bundle_ci_signed_is_still_checked_before_the_fleet_stores_it(tmp_path, digits_bundle, mosquitto):
    import shutil

    from edgefleet.fleet.errors import KeyStoreError
    from edgefleet.fleet.keys import BUNDLES_ROLE, create_keys, sign_bundle

    create_keys(tmp_path / "split")
    shutil.copytree(tmp_path / "split" / "fleet", tmp_path / "keys")
    ci_key = tmp_path / "split" / "ci" / f"{BUNDLES_ROLE}.key"
    bad = _spoiled(digits_bundle, "9.9.9", _traversal, tmp_path / "bad.tar")
    target = "digits/9.9.9/x86-cpu.tar"
    custom = {"name": "digits", "version": "9.9.9", "profile": "x86-cpu"}
    with running_fleet(tmp_path, mosquitto.url) as (fs, url):
        current = api.get(f"{url}/api/v1/bundles/signed-metadata").content
        with pytest.raises((BundleError, KeyStoreError), match=r"\.\./\.\./x"):
            sign_bundle(ci_key, current, target, bad, custom)  # the CI side refuses to sign it
        r = api.post(f"{url}/api/v1/bundles/signed-metadata",
                     content=_ci_sign_unchecked(ci_key, current, target, bad, custom))
        assert r.status_code == 201, r.text
        before = _published(fs, url)
        r = _upload(url, bad.read_bytes())
        _assert_refused(r, ("../../x",), tmp_path)
        after = _published(fs, url)
        assert after == before and not any(k.startswith("targets/") for k in after["stored"]), after["stored"]


def test_a_self_test_sample_of_outputs_named_with_slashes_fits_its_role():
    """Paddle's and TensorFlow's exports name tensors with '/' (PP-OCR's angle classifier: save_infer_model/
    scale_0.tmp_1): its self-test member is 'expected:save_infer_model/scale_0.tmp_1.npy', a name numpy reads,
    not a path anything extracts. It fits the self-test role; a member that is not an array still does not."""
    import zipfile
    from types import SimpleNamespace

    import numpy as np

    from edgefleet.protocol.roles import selftest_problem

    m = SimpleNamespace(inputs=[SimpleNamespace(name="x")],
                        outputs=[SimpleNamespace(name="save_infer_model/scale_0.tmp_1")])
    buf = io.BytesIO()
    np.savez(buf, **{"input:x": np.zeros((1, 3), np.float32),
                     "expected:save_infer_model/scale_0.tmp_1": np.zeros((1, 2), np.float32)})
    assert selftest_problem(buf, len(buf.getvalue()), m) is None  # type: ignore[arg-type]
    with zipfile.ZipFile(buf, "a") as z:
        z.writestr("notes/readme.txt", "hello")
    assert "not .npy arrays" in (selftest_problem(buf, len(buf.getvalue()), m) or "")  # type: ignore[arg-type]
