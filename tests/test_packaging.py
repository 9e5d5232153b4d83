"""The agent stays light: importing it never loads the compiler's or the fleet's dependencies."""

import subprocess
import sys

from tests.installs import loaded_after

HEAVY = ("fastapi", "sqlalchemy", "onnx", "amqtt", "sklearn", "edgefleet.compiler", "edgefleet.fleet")


def test_agent_imports_nothing_of_the_compiler_or_the_fleet():
    assert loaded_after("edgefleet.agent.daemon, edgefleet.engines.onnxruntime, edgefleet.cli", HEAVY) == []


def test_importing_the_packages_has_no_side_effects():
    code = ("import logging, edgefleet.protocol, edgefleet.compiler, edgefleet.fleet, edgefleet.agent, edgefleet; "
            "print(len(logging.getLogger().handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
PARTS = ("agent", "compiler", "engines", "fleet", "judge", "protocol")


def _declared() -> tuple[list[str], dict[str, str]]:
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return cfg["packages"], cfg["package-dir"]


def test_the_declared_packages_are_the_tree_and_each_folder_is_linked_under_edgefleet():
    """Every folder with an __init__.py under a part is declared (a new subpackage cannot be left out of the
    wheel), and edgefleet/<part> points at <part>/, so a checkout imports the names a wheel installs."""
    packages, dirs = _declared()
    tree = {"edgefleet"} | {
        "edgefleet." + ".".join(p.parent.relative_to(REPO).parts)
        for part in PARTS for p in (REPO / part).rglob("__init__.py")}
    assert sorted(packages) == sorted(tree)
    for part in PARTS:
        assert dirs[f"edgefleet.{part}"] == part
        assert (REPO / "edgefleet" / part).resolve() == (REPO / part).resolve()


def test_a_part_refuses_its_bare_folder_name():
    """`import agent` from the repository root would load a second copy of the agent's modules beside
    edgefleet.agent's (two batcher registries, two metric sets): each part refuses its bare name."""
    for part in PARTS:
        r = subprocess.run([sys.executable, "-c", f"import {part}"], cwd=REPO, capture_output=True, text=True)
        assert r.returncode != 0 and f"import edgefleet.{part}, not {part}" in r.stderr, r.stderr


def test_the_wheel_installs_one_top_level_name(tmp_path):
    """A user's own protocol.py, or another distribution's fleet package, can neither shadow nor be shadowed
    by ours: the wheel's top level is `edgefleet` alone (plus its .dist-info and the profiles' data files)."""
    import zipfile

    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("edgefleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"edgefleet"}
    for module in ("edgefleet/agent/transports/http.py", "edgefleet/fleet/migrations/versions/r0001_release_1.py",
                   "edgefleet/compiler/targets/onnxruntime.py", "edgefleet/agent/edgefleet-agent.service"):
        assert module in names
