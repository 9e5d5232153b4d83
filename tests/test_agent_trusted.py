"""The agent's update decisions: plain code, every branch."""

import pytest

from agent.trusted import Installed, decide

CUR = Installed("digits", "1.2.0", "a" * 64, "x86-cpu")
PROFILES = ("x86-cpu", "x86-cpu-vnni")


def test_first_install():
    assert decide(None, "digits", "1.0.0", "b" * 64, "x86-cpu", PROFILES).action == "install"


def test_same_bundle_is_kept():
    assert decide(CUR, "digits", "1.2.0", "a" * 64, "x86-cpu", PROFILES).action == "keep"


def test_newer_version_installs():
    assert decide(CUR, "digits", "1.10.0", "b" * 64, "x86-cpu", PROFILES).action == "install"


def test_downgrade_is_refused():
    d = decide(CUR, "digits", "1.1.9", "b" * 64, "x86-cpu", PROFILES)
    assert d.action == "refuse" and "downgrade" in d.reason


def test_same_version_other_content_is_refused():
    d = decide(CUR, "digits", "1.2.0", "b" * 64, "x86-cpu", PROFILES)
    assert d.action == "refuse" and "other content" in d.reason


def test_another_model_installs_whatever_its_version():
    assert decide(CUR, "faces", "0.1.0", "b" * 64, "x86-cpu", PROFILES).action == "install"


@pytest.mark.parametrize("profile", ["jetson-orin-nano", "arm64-cpu"])
def test_foreign_profile_is_refused(profile):
    d = decide(CUR, "digits", "2.0.0", "b" * 64, profile, PROFILES)
    assert d.action == "refuse" and profile in d.reason


def test_known_bad_bundle_is_not_retried():
    d = decide(CUR, "digits", "2.0.0", "b" * 64, "x86-cpu", PROFILES, frozenset({"b" * 64}))
    assert d.action == "refuse" and "already failed" in d.reason


# -- CPU features: a bundle whose profile promises more than this CPU has is refused --------------
def test_cpu_without_vnni_refuses_a_vnni_bundle():
    from agent.trusted import check_cpu

    d = check_cpu("x86-cpu-vnni", ("avx2", "avx512_vnni"), frozenset({"avx2", "fma"}))
    assert d.action == "refuse"
    assert "needs CPU features avx512_vnni" in d.reason and "x86-cpu" in d.reason


def test_cpu_with_the_features_accepts():
    from agent.trusted import check_cpu

    assert check_cpu("x86-cpu", ("avx2", "fma"), frozenset({"avx2", "fma", "avx512_vnni"})).action == "install"
    assert check_cpu("x86-cpu", (), frozenset()).action == "install"


def test_this_process_sees_its_cpu_through_cpuid():
    import platform

    from protocol.cpu import KNOWN_FEATURES, cpu_features

    feats = cpu_features()
    assert feats <= KNOWN_FEATURES
    if platform.machine() == "x86_64":
        assert "sse4_2" in feats  # every x86-64 CPU onnxruntime wheels support has it


def test_the_kernel_view_of_the_cpu_is_the_fallback():
    import platform

    from protocol.cpu import _proc_cpuinfo_flags, cpu_features

    if platform.machine() != "x86_64":
        pytest.skip("the x86 flag names are checked on x86-64")
    from tests.emulation import SESSION_CPU

    flags = _proc_cpuinfo_flags()
    assert "sse4_2" in flags
    if not SESSION_CPU:  # natively the kernel and CPUID agree, name for name (under qemu they do not)
        assert flags == cpu_features()
