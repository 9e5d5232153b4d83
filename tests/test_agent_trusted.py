"""The agent's update decisions: plain code, every branch; the trusted record moves only forward, per model."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefleet.agent.errors import RefusedUpdate
from edgefleet.agent.install.trusted import Installed, TrustedRecord, decide

CUR = Installed("digits", "1.2.0", "a" * 64, "x86-cpu")
REC = TrustedRecord().advance("digits", "1.2.0", "a" * 64)
PROFILES = ("x86-cpu", "x86-cpu-vnni")


def test_first_install():
    assert decide(TrustedRecord(), None, "digits", "1.0.0", "b" * 64, "x86-cpu", PROFILES).action == "install"


def test_same_bundle_is_kept():
    assert decide(REC, CUR, "digits", "1.2.0", "a" * 64, "x86-cpu", PROFILES).action == "keep"


def test_newer_version_installs():
    assert decide(REC, CUR, "digits", "1.10.0", "b" * 64, "x86-cpu", PROFILES).action == "install"


def test_downgrade_is_refused():
    d = decide(REC, CUR, "digits", "1.1.9", "b" * 64, "x86-cpu", PROFILES)
    assert d.action == "refuse" and "downgrade" in d.reason


def test_same_version_other_content_is_refused():
    d = decide(REC, CUR, "digits", "1.2.0", "b" * 64, "x86-cpu", PROFILES)
    assert d.action == "refuse" and "other content" in d.reason


def test_a_model_never_installed_installs_whatever_its_version():
    assert decide(REC, CUR, "faces", "0.1.0", "b" * 64, "x86-cpu", PROFILES).action == "install"


def test_after_switching_models_an_older_build_of_the_first_is_refused():
    """The bug this replaces: the forward-only rule covered only the running model."""
    rec = REC.advance("faces", "0.1.0", "c" * 64)
    faces = Installed("faces", "0.1.0", "c" * 64, "x86-cpu")
    d = decide(rec, faces, "digits", "1.1.0", "b" * 64, "x86-cpu", PROFILES)
    assert d.action == "refuse" and "downgrade" in d.reason and "1.2.0" in d.reason
    d = decide(rec, faces, "digits", "1.2.0", "b" * 64, "x86-cpu", PROFILES)
    assert d.action == "refuse" and "other content" in d.reason
    # the very build recorded may come back (the fleet switches the device back to it)
    assert decide(rec, faces, "digits", "1.2.0", "a" * 64, "x86-cpu", PROFILES).action == "install"
    assert decide(rec, faces, "digits", "1.3.0", "b" * 64, "x86-cpu", PROFILES).action == "install"


def test_a_version_rolled_back_locally_is_kept_but_not_offered_again():
    """A local rollback runs an older version; the record still holds the newest: the fleet may not push the
    older one as new, but the build already running is simply kept."""
    old = Installed("digits", "1.1.0", "b" * 64, "x86-cpu")
    assert decide(REC, old, "digits", "1.1.0", "b" * 64, "x86-cpu", PROFILES).action == "keep"
    assert decide(REC, old, "digits", "1.0.0", "d" * 64, "x86-cpu", PROFILES).action == "refuse"


@pytest.mark.parametrize("profile", ["jetson-orin-nano", "arm64-cpu"])
def test_foreign_profile_is_refused(profile):
    d = decide(REC, CUR, "digits", "2.0.0", "b" * 64, profile, PROFILES)
    assert d.action == "refuse" and profile in d.reason


def test_known_bad_bundle_is_not_retried():
    d = decide(REC, CUR, "digits", "2.0.0", "b" * 64, "x86-cpu", PROFILES, frozenset({"b" * 64}))
    assert d.action == "refuse" and "already failed" in d.reason


# -- the record itself: one object, forward only, per model name -------------------------------------------
NAMES = st.sampled_from(["digits", "faces", "ocr"])
VERSIONS = st.builds(lambda a, b, c: f"{a}.{b}.{c}", st.integers(0, 2), st.integers(0, 2), st.integers(0, 11))
SHAS = st.sampled_from(["a" * 64, "b" * 64, "c" * 64])
OFFERS = st.lists(st.tuples(NAMES, VERSIONS, SHAS), max_size=40)


def vkey(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


@settings(max_examples=300, deadline=None)
@given(OFFERS)
def test_the_record_only_moves_forward_for_every_model(offers):
    """Against a reference model: per name, the highest version accepted and its sha256; an offer is
    accepted iff its version is higher, or equal with the same content."""
    rec = TrustedRecord()
    ref: dict[str, tuple[str, str]] = {}
    for name, version, sha in offers:
        seen = ref.get(name)
        expect = seen is None or vkey(version) > vkey(seen[0]) or (version == seen[0] and sha == seen[1])
        d = rec.check(name, version, sha)
        assert (d.action == "install") == expect, (ref, name, version, sha, d)
        if expect:
            new = rec.advance(name, version, sha)
            if seen is None or vkey(version) > vkey(seen[0]):
                ref[name] = (version, sha)
            assert new is not rec or ref.get(name) == seen
            rec = new
        else:
            assert ("downgrade" in d.reason) == (seen is not None and vkey(version) < vkey(seen[0]))
            with pytest.raises(RefusedUpdate):
                rec.advance(name, version, sha)
        assert {n: (s.version, s.sha256) for n, s in rec.models.items()} == ref


@settings(max_examples=200, deadline=None)
@given(OFFERS)
def test_the_record_survives_its_json_form(offers):
    rec = TrustedRecord()
    for offer in offers:
        if rec.check(*offer).action == "install":
            rec = rec.advance(*offer)
    again = TrustedRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert again == rec


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(NAMES, VERSIONS, SHAS), max_size=12))
def test_migration_takes_the_highest_version_of_each_model_on_disk(entries):
    """An agent upgraded in place has no record yet: it starts from the versions its store holds."""
    installed = [Installed(n, v, s, "x86-cpu") for n, v, s in entries]
    rec = TrustedRecord.from_installed(installed)
    for name in {n for n, _, _ in entries}:
        top = max((v for n, v, _ in entries if n == name), key=vkey)
        assert rec.models[name].version == top
        assert (name, top, rec.models[name].sha256) in entries
        for _, v, s in entries:
            if vkey(v) < vkey(top):
                assert rec.check(name, v, s).action == "refuse"
    assert set(rec.models) == {n for n, _, _ in entries}


@pytest.mark.parametrize("doc", [
    None, [], {"record_version": 1}, {"record_version": 2, "models": {}},
    {"record_version": 1, "models": {"digits": {"version": "1.0", "sha256": "a" * 64}}},
    {"record_version": 1, "models": {"digits": {"version": "1.0.0", "sha256": "xyz"}}},
    {"record_version": 1, "models": {"digits": {"version": "1.0.0"}}},
    {"record_version": 1, "models": {"digits": "1.0.0"}},
])
def test_a_malformed_record_is_an_error_not_an_empty_record(doc):
    with pytest.raises(ValueError):
        TrustedRecord.from_json(doc)


# -- CPU features: a bundle whose profile promises more than this CPU has is refused --------------
def test_cpu_without_vnni_refuses_a_vnni_bundle():
    from edgefleet.agent.install.trusted import check_cpu

    d = check_cpu("x86-cpu-vnni", ("avx2", "avx512_vnni"), frozenset({"avx2", "fma"}))
    assert d.action == "refuse"
    assert "needs CPU features avx512_vnni" in d.reason and "x86-cpu" in d.reason


def test_cpu_with_the_features_accepts():
    from edgefleet.agent.install.trusted import check_cpu

    assert check_cpu("x86-cpu", ("avx2", "fma"), frozenset({"avx2", "fma", "avx512_vnni"})).action == "install"
    assert check_cpu("x86-cpu", (), frozenset()).action == "install"


def test_this_process_sees_its_cpu_through_cpuid():
    import platform

    from edgefleet.protocol.cpu import KNOWN_FEATURES, cpu_features

    feats = cpu_features()
    assert feats <= KNOWN_FEATURES
    if platform.machine() == "x86_64":
        assert "sse4_2" in feats  # every x86-64 CPU onnxruntime wheels support has it


def test_the_kernel_view_of_the_cpu_is_the_fallback():
    import platform

    from edgefleet.protocol.cpu import _proc_cpuinfo_flags, cpu_features

    if platform.machine() != "x86_64":
        pytest.skip("the x86 flag names are checked on x86-64")
    from tests.emulation import SESSION_CPU

    flags = _proc_cpuinfo_flags()
    assert "sse4_2" in flags
    if not SESSION_CPU:  # natively the kernel and CPUID agree, name for name (under qemu they do not)
        assert flags == cpu_features()


# -- through the real store and the daemon's install decision ----------------------------------------------
def test_an_agent_that_switched_models_refuses_an_older_build_of_the_first(tmp_path, digits_bundle):
    """digits 1.1.0 ran, then the fleet moved the device to another model; a signed digits 1.0.0 is now
    offered again: refused as a downgrade before anything is downloaded, also after a restart."""
    from edgefleet.agent.config import AgentConfig
    from edgefleet.agent.daemon import Agent
    from edgefleet.protocol import mqtt as proto
    from edgefleet.protocol.bundle import sha256_file
    from tests.agent_harness import preinstall
    from tests.test_agent_lifecycle import rebuild

    data = tmp_path / "agent"
    preinstall(data, rebuild(digits_bundle, tmp_path / "d11.tar", "1.1.0"))
    preinstall(data, rebuild(digits_bundle, tmp_path / "b.tar", "1.0.0", name="faces"))  # faces runs now
    old = rebuild(digits_bundle, tmp_path / "d10.tar", "1.0.0")
    for _ in range(2):  # the record is on disk: a restarted agent refuses too
        agent = Agent(AgentConfig(device_id="dev-1", fleet_url="http://127.0.0.1:9", data_dir=data,
                                  trust_on_first_use=True, install_retries=0))
        agent.store.recover()
        assert agent.store.current is not None and agent.store.current.installed.name == "faces"
        reports: list[tuple[str, str | None]] = []
        agent._report = lambda state, desired, error=None, reports=reports, **kw: reports.append((state, error))  # type: ignore
        agent.install(proto.DesiredState(device_id="dev-1", ts=0.0, rollout_id=7, model="digits", version="1.0.0",
                                         target="digits/1.0.0/x86-cpu.tar", sha256=sha256_file(old),
                                         size_bytes=old.stat().st_size))
        assert [state for state, _ in reports] == ["failed"], reports  # nothing was downloaded
        why = reports[0][1] or ""
        assert "downgrade" in why and "1.1.0" in why, why
