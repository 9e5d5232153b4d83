"""Run code as an install with only some of edgefleet's extras would (``pip install edgefleet[agent]``).

The test venv holds every extra. To see what a box with fewer gets, a subprocess puts an import blocker at the
front of ``sys.meta_path``: every top-level module that belongs to an installed distribution outside the closure
of the named extras (their requirements, transitively, markers evaluated here) raises ModuleNotFoundError, as it
would if that distribution were not installed. Nothing of the code under test is mocked; optional imports inside
libraries (securesystemslib's ``cryptography``) take the branch they take on such a box.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

__all__ = ["CLI", "argv_as_installed", "blocked_modules", "closure", "run_as_installed", "run_without"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _project_requires() -> list[str]:
    """The checkout's requirements as metadata lines (``name; extra == "x"``): pyproject.toml, not the editable
    install's metadata, which is as old as the last ``pip install -e``."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the installed metadata
        return list(md.distribution("edgefleet").requires or [])
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for req in reqs:
            r = Requirement(req)
            marker = f'({r.marker}) and extra == "{extra}"' if r.marker else f'extra == "{extra}"'
            r.marker = None
            lines.append(f"{r}; {marker}")
    return lines


def closure(*extras: str) -> set[str]:
    """Normalised names of the distributions ``pip install edgefleet[extras]`` installs (as resolved in this venv;
    the project's own requirements from the checkout's pyproject.toml)."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("edgefleet", frozenset(extras))]
    done_extras: dict[str, set[str]] = {}
    while todo:
        name, want = todo.pop()
        key = _norm(name)
        had = done_extras.setdefault(key, set())
        if key in seen and want <= had:
            continue
        seen.add(key)
        had |= want
        if key == "edgefleet":
            requires = _project_requires()
        else:
            try:
                requires = md.distribution(name).requires or []
            except md.PackageNotFoundError:
                continue  # a requirement whose marker held but that is not installed here: nothing to block
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": e} for e in want] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return seen


def blocked_modules(*extras: str) -> set[str]:
    """Top-level modules of installed distributions outside ``closure(*extras)`` (never the project's own)."""
    keep = closure(*extras)
    blocked = set()
    for module, dists in md.packages_distributions().items():
        if not any(_norm(d) in keep for d in dists):
            blocked.add(module)
    return blocked


_PRELUDE = """
import importlib.abc, sys
_BLOCKED = frozenset({blocked!r})
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""


# the edgefleet command line, as code for the functions below
CLI = "from edgefleet.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"


def argv_as_installed(extras: tuple[str, ...], code: str, *argv: str) -> list[str]:
    """argv of ``python -c code argv...`` as on a box with only ``edgefleet[extras]`` (for Popen)."""
    return [sys.executable, "-c", _PRELUDE.format(blocked=sorted(blocked_modules(*extras))) + code, *argv]


def run_without(modules: Iterable[str], code: str, *argv: str, timeout_s: float = 120,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -c code argv...`` with the top-level ``modules`` not importable."""
    prelude = _PRELUDE.format(blocked=sorted(set(modules)))
    return subprocess.run([sys.executable, "-c", prelude + code, *argv], capture_output=True, text=True,
                          timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)


def run_as_installed(extras: tuple[str, ...], code: str, *argv: str, timeout_s: float = 120,
                     env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -c code argv...`` as on a box with only ``edgefleet[extras]`` installed."""
    return run_without(blocked_modules(*extras), code, *argv, timeout_s=timeout_s, env=env)


def loaded_after(imports: str, watched: Iterable[str]) -> list[str]:
    """Which of ``watched`` modules a fresh interpreter holds after ``import <imports>``: how a test shows that
    importing one part pulls in nothing of another."""
    code = f"import sys, {imports}; print([m for m in {tuple(watched)!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip())  # a list literal our own child printed

