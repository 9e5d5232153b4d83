"""The agent stays light: importing it never loads the compiler's or the fleet's dependencies; the wheel holds the
tree's modules once, under one top-level name, and runs installed."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.installs import loaded_after

HEAVY = ("fastapi", "sqlalchemy", "onnx", "amqtt", "sklearn", "edgefleet.compiler", "edgefleet.fleet")


def test_agent_imports_nothing_of_the_compiler_or_the_fleet():
    assert loaded_after("edgefleet.agent.daemon, edgefleet.engines.onnxruntime, edgefleet.cli", HEAVY) == []


def test_importing_the_packages_has_no_side_effects():
    code = ("import logging, edgefleet.protocol, edgefleet.compiler, edgefleet.fleet, edgefleet.agent, edgefleet; "
            "print(len(logging.getLogger().handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"


REPO = Path(__file__).resolve().parent.parent


def _folders() -> dict[str, str]:
    """Import name -> folder: pyproject.toml's [tool.setuptools.package-dir] (edgefleet.agent is agent/)."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _tree() -> set[str]:
    """The wheel's paths of the tree's modules: each .py file of a package (a folder with an __init__.py, its parents
    up to a mapped folder too) under a mapped folder; agent/core/host.py is edgefleet/agent/core/host.py."""
    paths = set()
    for name, folder in _folders().items():
        for p in (REPO / folder).rglob("*.py"):
            rel = p.relative_to(REPO / folder)
            if all((REPO / folder / d / "__init__.py").is_file() for d in [Path(*rel.parts[:i]) for i in
                                                                           range(len(rel.parts))]):
                paths.add("/".join([*name.split("."), *rel.parts]))
    return paths


def test_no_module_has_a_second_path():
    """The repository holds each module once: no symbolic links (tracked or not), so tracebacks, docs, grep and a
    clone on a file system without links all name agent/core/host.py, never edgefleet/agent/core/host.py."""
    out = subprocess.run(["git", "ls-files", "-s", "--cached"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert [line for line in out.splitlines() if line.startswith("120000")] == []
    links = [p for top in {*_folders().values(), "tests", "bench"} for p in (REPO / top).rglob("*") if p.is_symlink()]
    assert links == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The checkout's wheel, built as a user would (`pip wheel .`, which builds in the checkout's build/)."""
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("edgefleet-*.whl")
    return whl


def test_the_wheel_installs_one_top_level_name(wheel):
    """A user's own protocol.py, or another distribution's fleet package, can neither shadow nor be shadowed
    by ours: the wheel's top level is `edgefleet` alone (plus its .dist-info and the profiles' data files)."""
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"edgefleet"}


def test_the_wheel_holds_the_tree_and_nothing_else(wheel):
    """Every module of every package under a mapped folder is in the wheel (a new subpackage cannot be left out:
    setup.py reads the packages from the tree), and no module that is not in the tree (one moved or removed since
    an earlier build, left in build/lib) ships; the package data too."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n for n in names if n.endswith(".py")} == _tree()
    for data in ("edgefleet/agent/edgefleet-agent.service", "edgefleet/fleet/edgefleet-fleet.service",
                 "edgefleet/fleet/templates/base.html"):
        assert data in names


def test_the_installed_wheel_runs_its_command_and_imports_each_part(wheel, tmp_path):
    """Installed (pip install --target, outside the repository), the wheel's own files serve its console script and
    every part: nothing of it is read from the checkout."""
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (entry,) = (target / "bin").iterdir()  # one console script
    assert entry.name == "edgefleet"
    import configparser

    (dist,) = target.glob("edgefleet-*.dist-info")
    ep = configparser.ConfigParser()
    ep.read(dist / "entry_points.txt")
    assert list(ep["console_scripts"]) == ["edgefleet"]
    module, _, func = ep["console_scripts"]["edgefleet"].partition(":")
    parts = [name for name in _folders() if name != "edgefleet"]
    code = (f"import sys, importlib; sys.path.insert(0, {str(target)!r}); "
            f"mods = [importlib.import_module(m) for m in {[module, *parts]!r}]; "
            f"print([m.__file__ for m in mods]); sys.argv = ['edgefleet', '--help']; getattr(mods[0], {func!r})()")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    files, _, usage = r.stdout.partition("\n")
    assert files.count(str(target)) == 1 + len(parts) and str(REPO) not in files, files
    assert "usage: edgefleet" in usage
