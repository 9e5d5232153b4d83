"""The house's rooms stay small (issue 42): no module over 700 lines and no class over 25 methods, unless this file
names it with its reason.

Beside tests/test_import_graph.py, over the product's folders and bench/. A module's size is its lines; a class's,
the functions defined in its body (properties, dunders and async ones included; nested classes count apart). An
entry that is no longer over its bound fails too, so the lists hold only what is still over: whoever splits a
module or a class removes its entry.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("agent", "compiler", "engines", "fleet", "judge", "protocol", "edgefleet", "bench")
MAX_LINES = 700
MAX_METHODS = 25

# path -> why it is over MAX_LINES
MODULES_OVER: dict[str, str] = {}

# "path::Class" -> why it has more than MAX_METHODS methods
CLASSES_OVER: dict[str, str] = {}


@functools.cache
def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(lines per module, methods per class) over FOLDERS; classes as "path::Outer.Inner"."""
    modules: dict[str, int] = {}
    classes: dict[str, int] = {}

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                classes[f"{rel}::{name}"] = sum(
                    isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in child.body)
                visit(child, rel, name + ".")
            else:
                visit(child, rel, prefix)

    for top in FOLDERS:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            text = path.read_text(encoding="utf-8")
            modules[rel] = len(text.splitlines())
            visit(ast.parse(text), rel, "")
    return modules, classes


def _check(sizes: dict[str, int], bound: int, named: dict[str, str], what: str) -> None:
    over = {k: n for k, n in sizes.items() if n > bound}
    unnamed = sorted(f"{k}: {over[k]} {what}" for k in set(over) - set(named))
    assert not unnamed, f"over {bound} {what} with no reason named in {__name__}: {unnamed}"
    within = sorted(f"{k}: {sizes.get(k, 'gone')}" for k in set(named) - set(over))
    assert not within, f"within {bound} {what} now (or gone): remove their entries from {__name__}: {within}"


def test_no_module_over_700_lines_without_a_named_reason():
    _check(_sizes()[0], MAX_LINES, MODULES_OVER, "lines")


def test_no_class_over_25_methods_without_a_named_reason():
    _check(_sizes()[1], MAX_METHODS, CLASSES_OVER, "methods")
