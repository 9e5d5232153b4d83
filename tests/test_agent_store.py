"""The model store: a crash at any point leaves the old model or the new one, never half of one."""

import json

import pytest

from agent.errors import TrustError
from agent.store import ModelStore
from protocol.bundle import sha256_file


class Crash(BaseException):
    """Stands in for the process dying: not an Exception, so nothing catches it on the way out."""


def installed(store_root):
    s = ModelStore(store_root)
    e = s.recover()
    return None if e is None else (e.installed.name, e.installed.version)


def install(root, bundle, crash_at=None):
    def fault(point):
        if point == crash_at:
            raise Crash(point)

    s = ModelStore(root, fault=fault)
    s.recover()
    staged = s.stage(bundle, sha256_file(bundle))
    s.commit(staged, rollout_id=1)


def test_install_then_upgrade(tmp_path, digits_bundle, digits_bundle_v2):
    install(tmp_path, digits_bundle)
    assert installed(tmp_path) == ("digits", "1.0.0")
    install(tmp_path, digits_bundle_v2)
    assert installed(tmp_path) == ("digits", "1.1.0")
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["previous"]["installed"]["version"] == "1.0.0"


@pytest.mark.parametrize("point", ["extracted", "moved", "before_commit"])
def test_crash_before_commit_keeps_the_old_model(tmp_path, digits_bundle, digits_bundle_v2, point):
    install(tmp_path, digits_bundle)
    with pytest.raises(Crash):
        install(tmp_path, digits_bundle_v2, crash_at=point)
    assert installed(tmp_path) == ("digits", "1.0.0")
    s = ModelStore(tmp_path)
    entry = s.recover()
    s.load_manifest(entry, verify=True)  # every file of the old model is intact
    assert not list((tmp_path / "staging").iterdir())
    assert len(list((tmp_path / "models").iterdir())) == 1  # the half-installed one was collected


def test_crash_after_commit_gives_the_new_model(tmp_path, digits_bundle, digits_bundle_v2):
    install(tmp_path, digits_bundle)
    with pytest.raises(Crash):
        install(tmp_path, digits_bundle_v2, crash_at="after_commit")
    assert installed(tmp_path) == ("digits", "1.1.0")


def test_first_install_crash_leaves_nothing(tmp_path, digits_bundle):
    with pytest.raises(Crash):
        install(tmp_path, digits_bundle, crash_at="before_commit")
    assert installed(tmp_path) is None


def test_damaged_current_falls_back_to_previous(tmp_path, digits_bundle, digits_bundle_v2):
    install(tmp_path, digits_bundle)
    install(tmp_path, digits_bundle_v2)
    s = ModelStore(tmp_path)
    cur = s.recover()
    engine = tmp_path / "models" / cur.directory / "model.onnx"
    engine.write_bytes(engine.read_bytes()[:-10])  # bit rot / a half-written file
    assert installed(tmp_path) == ("digits", "1.0.0")


def test_garbled_state_file_starts_empty(tmp_path, digits_bundle):
    install(tmp_path, digits_bundle)
    (tmp_path / "state.json").write_text("{garbage")
    assert installed(tmp_path) is None


def test_tampered_bundle_is_not_staged(tmp_path, digits_bundle):
    bad = tmp_path / "bad.tar"
    import tarfile

    with tarfile.open(digits_bundle) as tar:
        member = tar.getmember("model.onnx")
    data = bytearray(digits_bundle.read_bytes())
    data[member.offset_data + member.size // 2] ^= 0xFF  # one bit flip inside the engine
    bad.write_bytes(bytes(data))
    s = ModelStore(tmp_path / "store")
    s.recover()
    with pytest.raises(TrustError):
        s.stage(bad, sha256_file(bad))
    assert not list((tmp_path / "store" / "models").iterdir())
    assert not list((tmp_path / "store" / "staging").iterdir())
