"""The systemd units that ``edgefleet agent install-service`` and ``edgefleet fleet install-service`` write, read as
the tests check them: their ``Key=Value`` lines, and systemd's own verdict on the file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["unit_fields", "verify_unit"]


def unit_fields(text: str) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in text.splitlines() if "=" in ln and not ln.startswith("#"))


def verify_unit(unit: Path) -> None:
    """``systemd-analyze verify`` finds nothing wrong with ``unit`` (a User this box lacks aside); the calling test is
    skipped, saying so, where systemd-analyze is not installed."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit's syntax was not checked by systemd")
    check = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    bad = [ln for ln in check.stderr.splitlines() if unit.name in ln and "User" not in ln]
    assert not bad, check.stderr
