"""Typed contracts of the fleet: the REST API's responses are named models in its OpenAPI and every answer
parses into them; the TUF target's custom fields are one model written by the fleet and read by the agent."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from edgefleet.fleet import schemas
from edgefleet.protocol.errors import SchemaError
from edgefleet.protocol.tuf_target import TargetCustom
from tests.fleet_harness import api, running_fleet


def _names_a_model(schema: dict) -> bool:
    """A ``$ref`` to a component, or an array of them: never ``{}`` or a bare object."""
    if "$ref" in schema:
        return True
    return schema.get("type") == "array" and "$ref" in schema.get("items", {})


def test_every_api_endpoint_declares_a_named_response_model(tmp_path, mosquitto):
    with running_fleet(tmp_path, mosquitto.url) as (_, url):
        doc = api.get(f"{url}/openapi.json", token=None).json()
    checked = []
    for path, ops in doc["paths"].items():
        if not path.startswith("/api/v1/"):
            continue
        for method in ("get", "post"):
            if method not in ops:
                continue
            ok = {code: r for code, r in ops[method]["responses"].items() if code.startswith("2")}
            assert ok, f"{method.upper()} {path} documents no success response"
            for code, r in ok.items():
                schema = r.get("content", {}).get("application/json", {}).get("schema", {})
                assert _names_a_model(schema), f"{method.upper()} {path} {code}: schema {schema}"
            errors = ops[method]["responses"].get("4XX", {})
            assert errors.get("content", {}).get("application/json", {}).get("schema") \
                == {"$ref": "#/components/schemas/Error"}, f"{method.upper()} {path}: errors undocumented"
            assert "422" not in ops[method]["responses"], "FastAPI's 422 shape is not what this API sends"
            checked.append((method, path))
    assert len(checked) >= 20, checked
    for name in ("Device", "Rollout", "ModelBuild", "Health", "TelemetryRecord", "AuditEntry", "Error"):
        assert name in doc["components"]["schemas"], name


def test_answers_parse_into_the_models_and_keep_their_shape(tmp_path, mosquitto, digits_bundle):
    """The models say exactly what the server sends: parsing and dumping an answer gives it back unchanged."""
    with running_fleet(tmp_path, mosquitto.url) as (_, url):
        assert api.post(f"{url}/api/v1/bundles", content=digits_bundle.read_bytes()).status_code == 201
        assert api.post(f"{url}/api/v1/devices", json={"device_id": "cam-1", "group": "lab"}).status_code == 201
        rid = api.post(f"{url}/api/v1/rollouts", json={"model": "digits", "version": "1.0.0",
                                                       "devices": ["cam-1"]}).json()["id"]
        answers = {
            "/api/v1/health": schemas.Health, "/api/v1/bootstrap": schemas.Bootstrap,
            "/api/v1/devices": list[schemas.Device], "/api/v1/devices/cam-1": schemas.Device,
            "/api/v1/groups": list[schemas.Group], "/api/v1/models": list[schemas.ModelBuild],
            "/api/v1/stats": schemas.Stats, "/api/v1/rollouts": list[schemas.Rollout],
            f"/api/v1/rollouts/{rid}": schemas.Rollout, f"/api/v1/rollouts/{rid}?targets=false": schemas.Rollout,
            f"/api/v1/rollouts/{rid}/audit": list[schemas.AuditEntry], "/api/v1/audit": list[schemas.AuditEntry],
            "/api/v1/tokens": list[schemas.Token],
        }
        for path, model in answers.items():
            r = api.get(f"{url}{path}")
            assert r.status_code == 200, (path, r.text)
            ta: TypeAdapter = TypeAdapter(model)
            parsed = ta.validate_python(r.json())
            assert ta.dump_python(parsed, mode="json", exclude_unset=True) == r.json(), path
        r = api.get(f"{url}/api/v1/rollouts/{rid}?targets=false").json()
        assert "targets" not in r and all("gates_live" not in w or w["gates_live"] for w in r["waves"])
        assert "replica" in api.get(f"{url}/api/v1/stats").json()  # this server reports on its replica
        r = api.get(f"{url}/api/v1/devices/nobody")
        assert r.status_code == 404 and schemas.Error.model_validate(r.json()).error.startswith("no device")


# -- the TUF target's custom fields --------------------------------------------------------------------
GOOD = {"name": "digits", "version": "1.0.0", "profile": "x86-cpu", "backend": "onnxruntime", "precision": "int8",
        "cpu_features": ["avx2"]}


def test_target_custom_round_trips_what_the_fleet_signs(digits_bundle):
    from edgefleet.fleet.keys import bundle_target
    from edgefleet.protocol.bundle import read_manifest

    m = read_manifest(digits_bundle)
    path, custom = bundle_target(m)
    assert path == "digits/1.0.0/x86-cpu.tar"
    assert isinstance(custom, TargetCustom)
    assert (custom.name, custom.version, custom.profile) == ("digits", "1.0.0", "x86-cpu")
    assert custom.cpu_features == tuple(m.cpu_features)
    assert TargetCustom.parse(custom.signed_fields(), "target") == custom


def test_target_custom_from_before_cpu_features_is_read():
    old = {k: v for k, v in GOOD.items() if k != "cpu_features"}
    assert TargetCustom.parse(old, "target").cpu_features is None


@pytest.mark.parametrize("bad", [
    {**GOOD, "min_agent_version": "2.0.0"},  # a field of a newer fleet: refused, not ignored
    {k: v for k, v in GOOD.items() if k != "profile"},
    {**GOOD, "name": "x" * 10_000},
    {**GOOD, "cpu_features": ["avx2"] * 1000},
    {**GOOD, "cpu_features": "avx2"},
    {**GOOD, "version": 1},
    None,
    [],
])
def test_target_custom_refuses_what_it_does_not_know(bad):
    with pytest.raises(SchemaError) as exc:
        TargetCustom.parse(bad, "signed target digits/1.0.0/x86-cpu.tar")
    assert "digits/1.0.0/x86-cpu.tar" in str(exc.value)
    if isinstance(bad, dict) and "min_agent_version" in bad:
        assert "unknown key 'min_agent_version'" in str(exc.value)


def test_target_custom_of_older_signers_is_read():
    """CI signers and repositories from before backend, precision and CPU features were recorded."""
    got = TargetCustom.parse({"name": "digits", "version": "6.6.6", "profile": "x86-cpu"}, "target")
    assert got.backend is None and got.precision is None and got.cpu_features is None
    assert got.signed_fields() == {"name": "digits", "version": "6.6.6", "profile": "x86-cpu"}


def test_agent_refuses_a_target_with_custom_fields_it_does_not_know(tmp_path, digits_bundle):
    """Signed by the fleet, but with a field of a newer fleet: the agent refuses before downloading, naming it
    (an ignored field could be a requirement it does not meet). What the fleet writes today is read."""
    from edgefleet.agent.errors import TrustError
    from edgefleet.agent.link.updater import BundleFetcher
    from edgefleet.fleet.keys import KeyStore, bundle_target, init_keys
    from edgefleet.fleet.tuf_repo import Repository
    from edgefleet.protocol.bundle import read_manifest, sha256_file
    from tests.test_tuf import Server

    init_keys(tmp_path / "keys")
    repo = Repository(tmp_path / "repo", KeyStore(tmp_path / "keys"))
    repo.init()
    path, custom = bundle_target(read_manifest(digits_bundle))
    repo.add_target(path, digits_bundle, custom.signed_fields())
    newer = "digits/2.0.0/x86-cpu.tar"
    repo.add_target(newer, digits_bundle, {**custom.signed_fields(), "version": "2.0.0", "min_agent_version": "9"})
    srv = Server(tmp_path / "repo")
    try:
        fetcher = BundleFetcher(tmp_path / "agent", f"{srv.url}/metadata/", f"{srv.url}/targets/",
                                tmp_path / "keys" / "root.json")
        seen: list[TargetCustom] = []
        got = fetcher.fetch(path, sha256_file(digits_bundle), precheck=seen.append)
        assert got.custom == custom == seen[0]
        with pytest.raises(TrustError, match="unknown key 'min_agent_version'"):
            fetcher.fetch(newer, sha256_file(digits_bundle), precheck=seen.append)
        assert len(seen) == 1 and not list((tmp_path / "agent" / "downloads").iterdir())  # nothing downloaded
    finally:
        srv.close()
