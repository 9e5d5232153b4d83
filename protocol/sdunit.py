"""systemd unit files for the agent and the fleet (stdlib only): how a unit starts this installation's CLI, which
values a unit may hold, and writing one into place (never running systemctl)."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import ConfigError

__all__ = ["cli_command", "fill", "plain", "write_unit"]


def cli_command() -> str:
    """How systemd starts this installation's CLI: the ``edgefleet`` script of this environment, else
    ``python -m edgefleet`` (absolute paths: a unit has no PATH to search)."""
    exe = Path(sys.executable)
    script = exe.parent / "edgefleet"
    return str(script) if script.is_file() else f"{exe} -m edgefleet"


def plain(value: str, what: str) -> str:
    """``value`` if a unit line holds it as written; ConfigError naming ``what`` if systemd would misread it."""
    if any(c in value for c in "\n\r%$\\\"'") or " " in value:
        raise ConfigError(f"{what} {value!r} has characters a systemd unit would misread; use a plain path/name")
    return value


def fill(template: str, fields: dict[str, str]) -> str:
    """The unit template with each ``@KEY@`` of ``fields`` replaced by its value."""
    for key, value in fields.items():
        template = template.replace(key, value)
    return template


def write_unit(unit_text: str, unit_dir: Path, name: str) -> Path:
    """Write the unit ``name``.service atomically into ``unit_dir`` (mode 0644)."""
    from .fsutil import atomic_write

    if not unit_dir.is_dir():
        raise ConfigError(f"{unit_dir}: no such directory for the unit file")
    path = unit_dir / f"{name}.service"
    try:
        atomic_write(path, unit_text.encode())
        path.chmod(0o644)
    except PermissionError as exc:
        raise ConfigError(f"{path}: permission denied (run as root, or give --unit-dir)") from exc
    return path
