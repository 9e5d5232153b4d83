"""Running the fleet server as a systemd service: its unit file (``edgefleet fleet install-service``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..protocol.sdunit import cli_command, fill, plain, write_unit

__all__ = ["SERVICE_NAME", "install_unit", "render_unit"]

SERVICE_NAME = "edgefleet-fleet"
UNIT_TEMPLATE = "edgefleet-fleet.service"  # package data beside this module
_WRITTEN = ("mosquitto_password_file", "mosquitto_fleet_password_file", "mosquitto_acl_file")  # files it rewrites


def render_unit(serve_args: list[str], serve: argparse.Namespace, workdir: Path, user: str = "edgefleet") -> str:
    """The unit running ``edgefleet fleet serve SERVE_ARGS`` (already parsed into ``serve``) from ``workdir`` (where
    relative paths in them lead), as ``user``, writing only its data dir and the Mosquitto files it names."""
    from importlib import resources

    template = resources.files("edgefleet.fleet").joinpath(UNIT_TEMPLATE).read_text(encoding="utf-8")
    data = (workdir / serve.data_dir).resolve()
    written = [data, *((workdir / getattr(serve, k)).resolve().parent for k in _WRITTEN if getattr(serve, k))]
    for value, what in ((str(workdir), "working directory"), (user, "user"),
                        *((str(p), "a folder it writes") for p in written), *((a, "option") for a in serve_args)):
        plain(value, what)
    return fill(template, {"@NAME@": SERVICE_NAME, "@EXEC@": cli_command(), "@ARGS@": " ".join(serve_args),
                           "@WORKDIR@": str(workdir), "@USER@": user,
                           "@DATA_ACCESS@": "ReadWritePaths=" + " ".join(dict.fromkeys(map(str, written)))})


def install_unit(unit_text: str, unit_dir: Path) -> Path:
    """Write the unit atomically into ``unit_dir`` (never runs systemctl)."""
    return write_unit(unit_text, unit_dir, SERVICE_NAME)
