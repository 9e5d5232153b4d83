"""One record per runtime (issue 31.4): each engine module declares its runtime once (``RUNTIME = Runtime(...)``), and
the engine registry, the compiler's build targets and its pipeline read that record. Before, a runtime was listed in
the engines' ``_REGISTRY``, again in an if-chain in compiler/targets/__init__.py, and the pipeline branched on backend
names."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from edgefleet import engines
from edgefleet.compiler.errors import ToolchainError
from edgefleet.compiler.targets import get_target
from edgefleet.engines.base import Runtime
from edgefleet.protocol.manifest import Backend
from edgefleet.protocol.profile import load_profile

REPO = Path(__file__).resolve().parent.parent
RUNTIME_NAMES = ("onnxruntime", "litert", "tensorrt", "openvino")


def test_the_registry_the_manifest_and_the_targets_agree():
    records = {name: engines.record(name) for name in engines.RUNTIMES}
    assert all(isinstance(r, Runtime) and r.name == name for name, r in records.items())
    building = {name for name, r in records.items() if r.target}
    assert set(engines.KINDS) == set(typing.get_args(Backend)) == building
    for kind in engines.KINDS:
        target = get_target(kind)  # imports the class the record names
        assert type(target).__module__ == records[kind].target.partition(":")[0]
        assert records[kind].suffix.startswith(".") and records[kind].backend == kind
    for name, r in records.items():  # a runtime without a target runs a backend's files: that backend has one
        assert r.backend in engines.KINDS and (r.target == "") == (r.suffix == "") == (name not in engines.KINDS)
        assert r.extra == engines.EXTRAS[name] and r.precisions and r.modules


def test_a_backend_without_a_build_target_is_a_toolchain_error_naming_those_with_one():
    for backend in ("openvino", "tvm"):  # a runtime of another backend's files; no runtime at all
        with pytest.raises(ToolchainError, match="no build target for backend") as exc:
            get_target(backend)
        assert all(kind in str(exc.value) for kind in engines.KINDS)


def test_every_shipped_profile_is_served_by_a_record():
    """A profile's backend, accelerator and precisions are each served by a runtime of that backend."""
    for path in sorted((REPO / "hw-profiles").glob("*.yaml")):
        profile = load_profile(path.stem)
        serving = [engines.record(r) for r in engines.runtimes_for(profile.backend)]
        assert any(profile.accelerator in r.accelerators for r in serving), path.name
        for precision in profile.precisions:
            assert engines.runtimes_for(profile.backend, precision), (path.name, precision)


def test_no_backend_name_is_branched_on_outside_its_runtime_modules():
    """The compiler and the registry ask a record or a target's capabilities, never compare with a runtime's name
    (a constant naming the fp32 reference's runtime is not a branch)."""
    names = "|".join(RUNTIME_NAMES)
    branch = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']""")
    own = {f"{name}.py" for name in RUNTIME_NAMES}
    found = []
    for path in [*sorted((REPO / "compiler").rglob("*.py")), REPO / "engines" / "__init__.py"]:
        if path.parent.name == "targets" and path.name in own:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if branch.search(line):
                found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_pipeline_and_bf16_ask_the_build_target_and_the_registry_not_a_runtime_by_name():
    """The float fallback quantizes through the build target (BuildTarget.prepare_float and
    build_int8_keeping_float), not by importing one runtime's target module; the runtime that runs and gates bf16 is
    the registry's (engines.runtimes_for(backend, "bf16")), not a name written in compiler/bf16.py. The one name
    left is the fp32 reference's runtime, a named constant."""
    imports = re.compile(rf"compiler\.targets\.({'|'.join(RUNTIME_NAMES)})\b")
    literal = re.compile(rf"""["']({'|'.join(RUNTIME_NAMES)})["']""")
    found = []
    for path in (*sorted((REPO / "compiler" / "compile").glob("*.py")), REPO / "compiler" / "bf16.py"):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if imports.search(line) or (literal.search(line) and not line.startswith("REFERENCE_RUNTIME = ")):
                found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
    # what the QDQ target provides for the fallback
    target = get_target("onnxruntime")
    assert target.qdq_int8_min_opset is not None
    assert callable(target.prepare_float) and callable(target.build_int8_keeping_float)


def test_the_bf16_runtime_is_the_one_the_registry_lists():
    from edgefleet.compiler import bf16

    profile = load_profile("x86-cpu-bf16")
    assert bf16.runtime(profile) == engines.runtimes_for(profile.backend, "bf16")[0]
    # its version goes in a bf16 bundle's toolchain and the build cache's key, under its distribution's name
    rt = engines.record(bf16.runtime(profile) or "")
    if engines.runtime_installed(rt.name):
        assert set(bf16.toolchain_versions(["bf16"], profile)) <= set(rt.modules)
        assert bf16.toolchain_versions(["int8"], profile) == {}
    assert bf16.cache_key(load_profile("x86-cpu")) == {}
    # a CPU that has the instructions: the build host can gate bf16 exactly when that runtime says it runs bf16 here
    if engines.runtime_installed(rt.name):
        able = bf16.host_cannot_run_bf16(profile, have=frozenset({"avx512_bf16"}))
        assert (able is None) == rt.engine.cpu_runs("bf16"), able
