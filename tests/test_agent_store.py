"""The model store: a crash at any point leaves the old model or the new one, never half of one."""

import json

import pytest

from edgefleet.agent.errors import TrustError
from edgefleet.agent.install.store import ModelStore
from edgefleet.protocol.bundle import sha256_file


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


# -- the trusted record: highest version + sha256 of every model ever installed, on disk --------------------
def _record(root):
    s = ModelStore(root)
    s.recover()
    return {n: (seen.version, seen.sha256) for n, seen in s.trusted.models.items()}


def test_the_record_keeps_every_model_ever_installed(tmp_path, digits_bundle, digits_bundle_v2):
    from tests.test_agent_lifecycle import rebuild

    install(tmp_path, digits_bundle)
    install(tmp_path, digits_bundle_v2)
    other = rebuild(digits_bundle, tmp_path / "b.tar", "0.1.0", name="faces")
    install(tmp_path, other)
    s = ModelStore(tmp_path)
    s.recover()
    s.remove("digits")  # forgotten from disk, not from the record
    assert _record(tmp_path) == {"digits": ("1.1.0", sha256_file(digits_bundle_v2)),
                                 "faces": ("0.1.0", sha256_file(other))}
    doc = json.loads((tmp_path / "trusted.json").read_text())
    assert doc["models"]["digits"]["version"] == "1.1.0"


def test_the_store_refuses_to_commit_what_the_record_refuses(tmp_path, digits_bundle, digits_bundle_v2):
    from edgefleet.agent.errors import RefusedUpdate
    from tests.test_agent_lifecycle import rebuild

    install(tmp_path, digits_bundle_v2)
    install(tmp_path, rebuild(digits_bundle, tmp_path / "b.tar", "0.1.0", name="faces"))
    with pytest.raises(RefusedUpdate, match="downgrade"):
        install(tmp_path, digits_bundle)  # digits 1.0.0 after 1.1.0, while faces runs
    with pytest.raises(RefusedUpdate, match="other content"):
        install(tmp_path, rebuild(digits_bundle, tmp_path / "c.tar", "1.1.0"))
    assert installed(tmp_path) == ("faces", "0.1.0")


def test_a_store_from_before_the_record_migrates_from_its_state(tmp_path, digits_bundle, digits_bundle_v2):
    """A device upgraded in place has state.json but no trusted.json: it keeps refusing downgrades of the
    models it holds (the highest version of each, current or kept for rollback)."""
    from edgefleet.agent.errors import RefusedUpdate

    install(tmp_path, digits_bundle)
    install(tmp_path, digits_bundle_v2)
    s = ModelStore(tmp_path)
    s.recover()
    s.rollback("digits")  # even if 1.0.0 runs again after a local rollback, 1.1.0 was installed
    (tmp_path / "trusted.json").unlink(missing_ok=True)  # as before the record existed
    assert _record(tmp_path) == {"digits": ("1.1.0", sha256_file(digits_bundle_v2))}
    assert (tmp_path / "trusted.json").is_file()  # written at once: the record no longer depends on state.json
    (tmp_path / "state.json").write_text("{garbage")  # a lost state does not lose the record
    assert _record(tmp_path) == {"digits": ("1.1.0", sha256_file(digits_bundle_v2))}
    s = ModelStore(tmp_path)
    s.recover()
    assert s.trusted.check("digits", "1.0.0", sha256_file(digits_bundle)).action == "refuse"
    with pytest.raises(RefusedUpdate):
        s.commit(s.stage(digits_bundle, sha256_file(digits_bundle)), rollout_id=2)


def test_an_unreadable_record_refuses_every_update(tmp_path, digits_bundle, digits_bundle_v2):
    """Fail closed: an unreadable record must not read as 'nothing installed yet'."""
    from edgefleet.agent.errors import TrustError

    install(tmp_path, digits_bundle)
    (tmp_path / "trusted.json").write_text("{garbage")
    s = ModelStore(tmp_path)
    assert s.recover() is not None  # the installed model still serves
    assert s.trusted_error is not None and "trusted.json" in s.trusted_error
    with pytest.raises(TrustError, match=r"trusted\.json"):
        s.commit(s.stage(digits_bundle_v2, sha256_file(digits_bundle_v2)), rollout_id=2)
