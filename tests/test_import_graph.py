"""The house's import graph (issue 31): no import circles between modules, and no import running back up a floor.

Floors, bottom up: ``protocol`` (the contract) -> ``engines`` and ``judge`` -> ``compiler``, ``agent``, ``fleet``
(the three parts, which never import each other) -> ``edgefleet`` (the CLI and the demo). Imports inside
functions count too: a lazy import still ties two modules together.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLOOR = {"protocol": 0, "engines": 1, "judge": 1, "compiler": 2, "agent": 2, "fleet": 2, "cli": 3}


def _folders() -> dict[str, str]:
    """Import name -> folder, as pyproject.toml's [tool.setuptools.package-dir] maps them for the wheel and the
    editable install (edgefleet.agent is agent/): the one place that says where a module lives."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for package, folder in _folders().items():
        for p in (REPO / folder).rglob("*.py"):
            rel = p.relative_to(REPO / folder).with_suffix("")
            parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            mods[".".join([package, *parts])] = p
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in mods] or [base]
            for t in targets:
                while t and t not in mods:  # 'import edgefleet.agent.transports.http' names that module
                    t = t.rpartition(".")[0]
                if t and t != name and t != "edgefleet":
                    edges[name].add(t)
    return edges


def _part(module: str) -> str:
    s = module.split(".")
    return s[1] if len(s) > 1 and s[1] in FLOOR else "cli"


def test_no_import_runs_back_up_a_floor():
    up = [f"{a} -> {b}" for a, bs in _graph().items() for b in bs
          if _part(a) != _part(b) and FLOOR[_part(b)] >= FLOOR[_part(a)]]
    assert not up, up


def test_no_import_circles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def _python_files() -> list[Path]:
    """The repository's Python files (what git tracks or would track: not .venv, build/ or caches)."""
    import subprocess

    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [REPO / line for line in out.splitlines() if (REPO / line).is_file()]


def test_every_part_is_imported_by_its_one_name():
    """`edgefleet.agent`, never the folder's bare name: from the repository root (or under pytest, which puts the
    root on sys.path) `import agent` would load a second copy of the agent's modules beside edgefleet.agent's (two
    batcher registries, two metric sets), and the wheel has no such name. Imports, and the module names handed to
    mock.patch, importlib.import_module or `python -m`, in every Python file of the repository."""
    bare = {folder for package, folder in _folders().items() if package != folder}
    found = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in ("patch", "import_module") and isinstance(node.args[0].value, str):
                    names = [node.args[0].value]
            elif isinstance(node, (ast.List, ast.Tuple)):  # [python, "-m", "agent.daemon", ...]
                items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                names = [str(b) for a, b in itertools.pairwise(items) if a == "-m" and b]
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in bare]
    assert not found, found


def test_agent_core_imports_no_other_room():
    """The agent's core (agent/core/: host, batching, the pipeline runner, metrics, drift, shadow) is the agent's
    bottom floor (issue 42): it imports none of the agent's transports, install or link, lazily or not. What it
    needs from them moves down into the core (agent.core.request.InferRequest) or comes in as a callable."""
    rooms = ("edgefleet.agent.transports", "edgefleet.agent.install", "edgefleet.agent.link")
    graph = _graph()
    core = [m for m in _modules() if m.startswith("edgefleet.agent.core.") or m == "edgefleet.agent.core"]
    assert len(core) >= 5, core  # the rule reads the real folder
    up = [f"{a} -> {b}" for a in core for b in sorted(graph.get(a, ()))
          if any(b == r or b.startswith(r + ".") for r in rooms)]
    assert not up, up


def _by_position(path: Path, node: ast.ImportFrom) -> list[Path | None]:
    """The files a relative import names when read by the importing file's place in the repository, as a tool that
    knows nothing of package-dir reads it (an editor without the venv, a drawing of the imports)."""
    base = path.parent
    for _ in range(node.level - 1):
        base = base.parent
    if node.module:
        base = base.joinpath(*node.module.split("."))
    found: list[Path | None] = []
    for a in node.names:
        cands = (base / a.name / "__init__.py", base / f"{a.name}.py", base / "__init__.py", base.with_suffix(".py"))
        found.append(next((c for c in cands if c.is_file()), None))
    return found


def test_imports_across_parts_name_the_file_by_its_place():
    """One path per module, for tools too (issue 42): the parts name each other relatively, climbing to the package
    root (``from ...protocol import mqtt`` in agent/core/), so the file a relative import names by its place in the
    repository is the file the wheel's package-dir mapping gives, and a tool that reads imports by position draws
    the arrows between parts. Absolute ``edgefleet.<part>`` imports stay only where a file is not loaded as a
    package module (Alembic's migration scripts, loaded by path) and in ``edgefleet/`` (the CLI and the demo, whose
    package is not a folder of the parts)."""
    mods = _modules()
    by_name = {p: n for n, p in mods.items()}
    absolute, wrong = [], []
    for name, path in mods.items():
        rel = path.relative_to(REPO).parts
        if rel[0] == "edgefleet" or rel[-2:-1] == ("versions",):
            continue
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not node.level:
                parts = (node.module or "").split(".")
                if parts[0] == "edgefleet" and (len(parts) > 1 or any(a.name in FLOOR for a in node.names)):
                    absolute.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module}")
                continue
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            for target in _by_position(path, node):
                got = by_name.get(target) if target else None
                if got is None or not (got == base or got.startswith(base + ".")):
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {base} is {got} by position")
    assert not absolute, absolute
    assert not wrong, wrong
