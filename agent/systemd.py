"""Running the agent as a systemd service: readiness notification (``Type=notify``) and the unit file."""

from __future__ import annotations

import logging
import math
import os
import socket
from pathlib import Path

from ..protocol.sdunit import cli_command, fill, plain, write_unit
from .config import AgentConfig

__all__ = ["SERVICE_NAME", "install_unit", "render_unit", "sd_notify"]

log = logging.getLogger("edgefleet.agent")


def sd_notify(message: str) -> bool:
    """Tell systemd (``Type=notify`` units) about the service: "READY=1", "STOPPING=1", "STATUS=...". A no-op
    outside systemd (no ``$NOTIFY_SOCKET``). Returns whether the message was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or address[0] not in "/@":
        return False
    if address[0] == "@":  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(address)
            s.sendall(message.encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


SERVICE_NAME = "edgefleet-agent"
UNIT_TEMPLATE = "edgefleet-agent.service"  # package data beside this module


def render_unit(config_path: Path, config: AgentConfig, user: str = "edgefleet",
                supplementary_groups: tuple[str, ...] = ("video", "render")) -> str:
    """The systemd unit for an agent run with ``config_path`` (already validated into ``config``).
    ``supplementary_groups``: on a Jetson the GPU device nodes belong to ``video`` and ``render``."""
    from importlib import resources

    template = resources.files("edgefleet.agent").joinpath(UNIT_TEMPLATE).read_text(encoding="utf-8")
    data = config.data_dir.resolve()
    if data.is_relative_to("/var/lib") and data != Path("/var/lib"):
        # systemd creates it owned by User= and makes it writable despite ProtectSystem=strict
        access = f"StateDirectory={data.relative_to('/var/lib')}\nStateDirectoryMode=0750"
    else:
        access = f"ReadWritePaths={data}"
    for value, what in ((str(config_path), "config path"), (str(data), "data_dir"), (user, "user")):
        plain(value, what)
    fields = {"@NAME@": SERVICE_NAME, "@EXEC@": cli_command(), "@CONFIG@": str(config_path), "@USER@": user,
              "@SUPPLEMENTARY_GROUPS@": f"SupplementaryGroups={' '.join(supplementary_groups)}"
              if supplementary_groups else "", "@STOP_TIMEOUT@": str(math.ceil(config.shutdown_grace_s) + 15),
              "@DATA_ACCESS@": access}
    return fill(template, fields)


def install_unit(unit_text: str, unit_dir: Path) -> Path:
    """Write the unit atomically into ``unit_dir`` (never runs systemctl)."""
    return write_unit(unit_text, unit_dir, SERVICE_NAME)
