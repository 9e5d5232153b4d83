"""The README a newcomer reads and the docs it points to: every relative link resolves, and the README stays short
(issue 31: a README read in five minutes, the reference in docs/, measured figures in bench/README.md)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_the_readme_is_short_and_points_to_every_doc():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in text, f"README does not point to docs/{doc.name}"


# a repository file named in a code span, e.g. `judge/tasks.py`: the top-level folders, files with a known ending
FILE_SPAN = re.compile(r"`((?:agent|compiler|engines|fleet|protocol|judge|edgefleet|bench|tests|docs|models|profiles"
                       r"|deploy|scripts)/[\w./-]+\.(?:py|md|yaml|yml|toml|json|sh|service))`")


def test_every_repository_file_the_readme_and_docs_name_exists():
    """A file named in `code` is where a reader goes next: one that moved (the judge left compiler/) is a dead end."""
    missing = [f"{page.relative_to(REPO)}: {name}" for page in PAGES
               for name in FILE_SPAN.findall(page.read_text(encoding="utf-8")) if not (REPO / name).exists()]
    assert not missing, missing
