from pathlib import Path

import pytest

from edgefleet.protocol.errors import SchemaError
from edgefleet.protocol.profile import load_profile, profile_dir

NAMES = ["x86-cpu", "x86-cpu-vnni", "x86-cpu-bf16", "jetson-orin-nano", "jetson-agx-orin", "arm64-cpu",
         "arm64-cpu-onnx"]


@pytest.mark.parametrize("name", NAMES)
def test_shipped_profiles_load(name):
    p = load_profile(name)
    assert p.name == name


def test_every_shipped_file_is_tested():
    assert sorted(p.stem for p in profile_dir().glob("*.yaml")) == sorted(NAMES)


def test_backends_match_the_architecture_doc():
    assert load_profile("x86-cpu").backend == "onnxruntime"
    assert load_profile("jetson-orin-nano").backend == "tensorrt"
    assert load_profile("arm64-cpu").backend == "litert"
    # the OCR pipeline's ARM profile: onnx2tf cannot convert PP-OCRv4, so ONNX files run by onnxruntime on aarch64
    assert load_profile("arm64-cpu-onnx").backend == "onnxruntime" and load_profile("arm64-cpu-onnx").arch == "aarch64"
    assert "int8" in load_profile("x86-cpu").precisions


def _write(tmp_path: Path, text: str, name: str = "custom") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


BASE = (profile_dir() / "x86-cpu.yaml").read_text().replace("name: x86-cpu", "name: custom")


def _refused(tmp_path: Path, text: str, match: str, name: str = "custom") -> None:
    """The profile ``text`` (in ``name``.yaml) does not load: SchemaError matching ``match``."""
    with pytest.raises(SchemaError, match=match):
        load_profile(str(_write(tmp_path, text, name)))


def test_unknown_key_names_file_and_key(tmp_path):
    p = _write(tmp_path, BASE + "turbo: true\n")
    with pytest.raises(SchemaError) as e:
        load_profile(str(p))
    assert str(p) in str(e.value) and "unknown key 'turbo'" in str(e.value)


def test_unknown_nested_key(tmp_path):
    _refused(tmp_path, BASE.replace("  per_channel: true", "  per_chanel: true"),
             r"unknown key 'quantization.per_chanel'")


def test_missing_key(tmp_path):
    _refused(tmp_path, BASE.replace("backend: onnxruntime\n", ""), r"missing key 'backend'")


def test_name_must_match_file(tmp_path):
    _refused(tmp_path, BASE, "must match the file name", name="other")


def test_fp16_on_cpu_is_refused(tmp_path):
    _refused(tmp_path, BASE.replace("precisions: [int8, fp32]", "precisions: [int8, fp16]"), "fp16 is for GPU")


def test_bad_yaml(tmp_path):
    _refused(tmp_path, "name: [unclosed\n", "not valid YAML")


def test_unknown_profile_lists_known():
    with pytest.raises(SchemaError, match="known profiles: arm64-cpu"):
        load_profile("no-such-board")


# -- what a profile promises about the CPU, and the INT8 scheme that follows from it ---------------
def test_x86_cpu_gets_a_scheme_that_cannot_saturate_on_avx2():
    scheme, why = load_profile("x86-cpu").int8_scheme()
    assert scheme == "u8s8_reduced" and "VNNI" in why
    assert load_profile("x86-cpu").cpu_features == ("avx2", "fma")


def test_the_vnni_profile_keeps_full_range():
    p = load_profile("x86-cpu-vnni")
    assert "avx512_vnni" in p.cpu_features and p.int8_scheme()[0] == "u8s8"


@pytest.mark.parametrize("name", ["arm64-cpu", "jetson-orin-nano", "jetson-agx-orin"])
def test_litert_and_tensorrt_profiles_quantize_symmetrically(name):
    scheme, why = load_profile(name).int8_scheme()
    assert scheme == "s8s8" and "int8 activations and int8 weights" in why


def test_full_range_on_a_profile_without_vnni_is_refused(tmp_path):
    _refused(tmp_path, BASE.replace("  calibration_method: minmax", "  calibration_method: minmax\n  scheme: u8s8"),
             r"saturates the 16-bit sums.*add avx512_vnni")


def test_u8u8_can_be_chosen_explicitly(tmp_path):
    p = _write(tmp_path, BASE.replace("  calibration_method: minmax", "  calibration_method: minmax\n  scheme: u8u8"))
    assert load_profile(str(p)).int8_scheme()[0] == "u8u8"


def test_unknown_cpu_feature_suggests_the_nearest(tmp_path):
    _refused(tmp_path, BASE.replace("cpu_features: [avx2, fma]", "cpu_features: [avx2, avx512vnni]"),
             "unknown CPU feature 'avx512vnni' \\(did you mean 'avx512_vnni'\\?\\)")


def test_profile_typo_suggests_the_nearest():
    with pytest.raises(SchemaError, match="did you mean 'x86-cpu'"):
        load_profile("x86-cpuu")
