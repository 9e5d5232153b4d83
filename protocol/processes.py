"""Stopping child processes (stdlib only; used by the agent's tegrastats reader, the fleet's Mosquitto cluster,
the demo and the bench scripts): ask each to stop, give them a grace period together, kill and reap the rest."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable

__all__ = ["stop_processes"]

KILL_WAIT_S = 5.0  # after SIGKILL: the kernel ends it at once; this only bounds the reaping


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 10.0,
                   sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to each process still running, then wait up to ``grace_s`` (for all of them together) for
    them to exit; kill and reap whichever has not. Processes that already exited are only reaped."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(KILL_WAIT_S)
