import json

import pytest

from edgefleet.protocol.bundle import BundleError, extract_bundle, read_manifest
from edgefleet.protocol.errors import SchemaError, UnsupportedVersionError
from edgefleet.protocol.manifest import MANIFEST_VERSION, parse_manifest, version_key


@pytest.fixture
def manifest_dict(digits_bundle):
    return read_manifest(digits_bundle).model_dump(mode="json")


def test_round_trip(manifest_dict):
    m = parse_manifest(json.dumps(manifest_dict))
    # gated on labels: no version-3 content, but its drift reference (version 6); without it, version-2 agents read it
    assert m.manifest_version == 6 and m.drift is not None
    assert parse_manifest({**manifest_dict, "drift": None, "manifest_version": 2}).drift is None
    assert m.inputs[0].shape == (-1, 1, 8, 8)
    assert m.precision == "int8" and m.backend == "onnxruntime"
    assert set(m.files) == {"model.onnx", "selftest.npz"}


def test_unknown_key_is_named(manifest_dict):
    manifest_dict["colour"] = "blue"
    with pytest.raises(SchemaError, match=r"bundle/manifest.json: unknown key 'colour'"):
        parse_manifest(manifest_dict, source="bundle/manifest.json")


def test_nested_unknown_key_is_named(manifest_dict):
    manifest_dict["accuracy"]["bonus"] = 1
    with pytest.raises(SchemaError, match=r"unknown key 'accuracy.bonus'"):
        parse_manifest(manifest_dict)


def test_missing_key_is_named(manifest_dict):
    del manifest_dict["precision"]
    with pytest.raises(SchemaError, match=r"missing key 'precision'"):
        parse_manifest(manifest_dict)


def test_newer_manifest_is_refused_with_advice(manifest_dict):
    manifest_dict["manifest_version"] = MANIFEST_VERSION + 1
    manifest_dict["new_field"] = True
    with pytest.raises(UnsupportedVersionError, match="upgrade the agent"):
        parse_manifest(manifest_dict)


def test_batch_dimension_must_be_dynamic(manifest_dict):
    manifest_dict["inputs"][0]["shape"] = [4, 1, 8, 8]
    with pytest.raises(SchemaError, match="batch"):
        parse_manifest(manifest_dict)


def test_bad_sha_and_unlisted_engine(manifest_dict):
    manifest_dict["files"]["model.onnx"]["sha256"] = "xyz"
    with pytest.raises(SchemaError, match="sha256"):
        parse_manifest(manifest_dict)


def test_file_names_cannot_escape_the_bundle(manifest_dict):
    manifest_dict["files"]["../evil"] = manifest_dict["files"]["model.onnx"]
    with pytest.raises(SchemaError, match="plain name"):
        parse_manifest(manifest_dict)


def test_not_json():
    with pytest.raises(SchemaError, match="not valid JSON"):
        parse_manifest(b"{nope")


def test_version_order():
    assert version_key("1.2.10") > version_key("1.2.9")
    with pytest.raises(ValueError):
        version_key("1.2")


def test_tampered_bundle_file_is_caught(digits_bundle, tmp_path):
    import tarfile

    bad = tmp_path / "bad.tar"
    with tarfile.open(digits_bundle) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name == "model.onnx":
                data = data[:-1] + bytes([data[-1] ^ 1])
            import io

            dst.addfile(m, io.BytesIO(data))
    with pytest.raises(BundleError, match="sha256"):
        extract_bundle(bad, tmp_path / "out")


def test_truncated_bundle(digits_bundle, tmp_path):
    bad = tmp_path / "trunc.tar"
    bad.write_bytes(digits_bundle.read_bytes()[:1000])
    with pytest.raises(BundleError):
        extract_bundle(bad, tmp_path / "out")


def test_not_a_bundle(tmp_path):
    p = tmp_path / "x.tar"
    p.write_bytes(b"hello")
    with pytest.raises(BundleError, match="not a bundle"):
        read_manifest(p)


def test_deeply_nested_manifest_is_a_schema_error_not_a_crash():
    deep = b'{"manifest_version": 2, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(SchemaError, match="nested deeper"):
        parse_manifest(deep, source="m.json")
    with pytest.raises(SchemaError, match="limit"):
        parse_manifest(b" " * (2 * 1024**2) + b"{}")


def test_deeply_nested_or_huge_profile_is_a_schema_error(tmp_path):
    from edgefleet.protocol.profile import load_profile

    (tmp_path / "deep.yaml").write_text("[" * 50_000 + "]" * 50_000)
    with pytest.raises(SchemaError, match="nested too deeply"):
        load_profile(str(tmp_path / "deep.yaml"))
    (tmp_path / "big.yaml").write_text("# pad\n" * 100_000)
    with pytest.raises(SchemaError, match="limit"):
        load_profile(str(tmp_path / "big.yaml"))


def test_a_task_gate_needs_version_3_and_is_left_out_of_older_manifests(manifest_dict):
    """Version 3 carries accuracy.task; a manifest without one is written without the key (a version-2 agent,
    which refuses unknown keys, reads it), and one with it says version 3 (older agents: 'upgrade')."""
    m = parse_manifest(json.dumps(manifest_dict))
    assert '"task"' not in m.to_json()
    task = {"task": "ctc", "source": "declared", "output": "logits", "metric": "exact_string_agreement",
            "value": 1.0, "criteria": [{"name": "exact_string_agreement", "value": 1.0, "bound": 0.95,
                                        "kind": "min", "passed": True}], "passed": True}
    manifest_dict["accuracy"]["task"] = task
    manifest_dict.update(drift=None, manifest_version=2)  # its drift reference aside (version 6), a version-2 manifest
    with pytest.raises(SchemaError, match="needs manifest_version 3"):
        parse_manifest(manifest_dict)
    manifest_dict["manifest_version"] = MANIFEST_VERSION
    assert parse_manifest(manifest_dict).accuracy.task is not None
    task["passed"] = False
    with pytest.raises(SchemaError, match="passed does not agree"):
        parse_manifest(manifest_dict)
