"""The house's import graph (issue 31): no import circles between modules, and no import running back up a floor.

Floors, bottom up: ``protocol`` (the contract) -> ``engines`` and ``judge`` -> ``compiler``, ``agent``, ``fleet``
(the three parts, which never import each other) -> ``edgefleet`` (the CLI and the demo). Imports inside
functions count too: a lazy import still ties two modules together.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLOOR = {"protocol": 0, "engines": 1, "judge": 1, "compiler": 2, "agent": 2, "fleet": 2, "cli": 3}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top in ("protocol", "engines", "judge", "compiler", "agent", "fleet", "edgefleet"):
        for p in (REPO / top).rglob("*.py") if (REPO / top).is_dir() else ():
            rel = p.relative_to(REPO).with_suffix("")
            if top == "edgefleet" and rel.parts[1:2] and (REPO / top / rel.parts[1]).is_symlink():
                continue  # edgefleet/<part> links to the part's own folder, read once above
            parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            mods[".".join(parts) if top == "edgefleet" else "edgefleet." + ".".join(parts)] = p
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
                while t and t not in mods:  # 'import edgefleet.agent.server' names that module
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
