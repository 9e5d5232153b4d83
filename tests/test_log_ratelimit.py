"""Repeated errors are rate-limited in the log (issue 45.6): one line of a kind, then one line with its count per
interval, so a peer who can make a process log cannot fill its disk (the issue saw 67 MB in 40 s of asyncio's
"socket.accept() out of system resource" tracebacks from a fleet out of descriptors).

Through real processes: an agent started by the command line, flooded over its local socket with frames it must
refuse (each logged before, one line per connection), and an asyncio listener at its descriptor limit with the
product's logging set up (protocol.lograte.install): thousands of tracebacks in seconds before. The filter's rules
are checked with a hand-moved clock."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from edgefleet.protocol import local as wire
from edgefleet.protocol.lograte import BURST, RateLimitFilter
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
FLOOD = 300
COUNTED = re.compile(r"\[([\d,]+) like this in the last \d+ s, not shown; the last\]$")


def _refused(path: Path) -> bool:
    """One connection sending a frame with a bad magic: True once the agent answered and closed it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(b"XXXX" + wire.pack(wire.INFER, 1, b"")[4:])
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data[4:6] == bytes([wire.VERSION, wire.ERROR])


def test_an_agent_flooded_with_refused_frames_logs_one_line_and_a_count(tmp_path):
    """300 connections, each a bad frame the agent refuses and logs (at INFO, -v): before, 300 lines; now the first
    five (BURST), and one line counting the 295 others (the last of them shown)."""
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"device_id: cam-7\nfleet_url: http://127.0.0.1:9\ndata_dir: {tmp_path / 'data'}\n"
                   "trust_on_first_use: true\nhttp_port: 0\nlocal_socket: local.sock\nlocal_max_connections: 4\n")
    path = tmp_path / "data" / "local.sock"
    proc = subprocess.Popen([sys.executable, "-m", "edgefleet", "agent", "--config", str(cfg), "-v"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: path.exists() and _refused(path), 60, "the agent's local socket refusing a bad frame",
                 retry_on=(ConnectionRefusedError, FileNotFoundError))
        assert all(_refused(path) for _ in range(FLOOD - 1))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [ln for ln in err.splitlines() if "not an edgefleet local frame" in ln]
    counts = [COUNTED.search(ln) for ln in lines]
    # every refusal accounted for: shown, or counted in a line of its own (one interval of 10 s here: 5 + 1 lines;
    # a slow run may span two)
    assert len(lines) - sum(map(bool, counts)) + sum(int(m[1].replace(",", "")) for m in counts if m) == FLOOD, lines
    assert BURST + 1 <= len(lines) <= 2 * (BURST + 1), "\n".join(lines[:20])
    assert lines[-1].endswith("s, not shown; the last]"), lines


ACCEPT_FLOOD = textwrap.dedent("""
    import asyncio, logging, resource, sys
    from edgefleet.protocol import lograte
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if sys.argv[1] == "install":
        lograte.install()
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    async def main():
        async def handle(reader, writer):
            await reader.read()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until the test says

    asyncio.run(main())
""")


RETRIES_S = 2.5  # asyncio retries a failed accept after 1 s: the time in which its retries fail again (under test)


def test_an_asyncio_listener_out_of_descriptors_logs_once(tmp_path):
    """100 connections to a listener with 48 descriptors: asyncio's accept fails with EMFILE, and again at each
    retry. Before (measured here, without install): about 4,000 'out of system resource' tracebacks in 6 s, one per
    failed accept of its 100-accept loop; now at most BURST (5) lines and one counting the others."""
    proc = subprocess.Popen([sys.executable, "-c", ACCEPT_FLOOD, "install"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        reader.start()
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]
        wait_for(lambda: any("out of system resource" in ln for ln in lines), 30, "the listener out of descriptors")
        time.sleep(RETRIES_S)
        proc.communicate("stop\n", timeout=60)
        reader.join(30)
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(lines)
    failures = [ln for ln in lines if "socket.accept() out of system resource" in ln]
    assert 1 <= len(failures) <= 2 * (BURST + 1), err[-3000:]  # about one a second now (asyncio's retry)
    assert len(err) < 20_000, len(err)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _logger(name: str, flt: RateLimitFilter) -> tuple[logging.Logger, list[str]]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger(name)
    log.propagate = False
    log.handlers[:] = [Keep()]
    log.handlers[0].addFilter(flt)
    log.addFilter(flt)  # on both: judged once
    log.setLevel(logging.INFO)
    return log, seen


def test_the_filter_keeps_a_burst_of_a_kind_per_interval_and_counts_the_rest():
    clock = Clock()
    flt = RateLimitFilter(10.0, clock, burst=2)
    log, seen = _logger("tests.lograte.kinds", flt)

    def refuse(peer: str) -> None:  # one place in the code
        log.warning("client %s refused: %s", peer, "too many")

    for i in range(1000):
        refuse(f"peer-{i}")  # one kind, whatever its arguments
    assert seen == ["client peer-0 refused: too many", "client peer-1 refused: too many"]
    log.warning("another template")  # another kind passes
    clock.now = 10.5
    log.warning("something else")  # the first record after the interval tells its count
    assert seen[-2:] == ["client peer-999 refused: too many [998 like this in the last 10 s, not shown; the last]",
                         "something else"]
    refuse("peer-x")  # a new interval: passes
    for _ in range(3):
        refuse("peer-y")
    clock.now = 14
    flt.flush()  # at exit: the count not told yet
    assert seen[-3:] == ["client peer-x refused: too many", "client peer-y refused: too many",
                         "client peer-y refused: too many [2 like this in the last 4 s, not shown; the last]"], seen
    assert len(seen) == 8


def test_an_exception_is_a_kind_by_its_type_and_where_it_was_raised():
    clock = Clock()
    flt = RateLimitFilter(10.0, clock, burst=1)
    log, seen = _logger("tests.lograte.exc", flt)

    def fail(kind: type[Exception], n: int) -> None:
        raise kind(f"number {n}")

    for n in range(50):
        for kind in (ValueError, KeyError):
            try:
                fail(kind, n)
            except Exception:
                log.exception("a request failed")
    assert len(seen) == 2, seen  # one line per exception type, not one per request


def test_the_kinds_remembered_are_bounded():
    clock = Clock()
    flt = RateLimitFilter(10.0, clock, max_kinds=8, burst=1)
    log, seen = _logger("tests.lograte.bound", flt)
    for i in range(100):
        clock.now = i * 0.01
        log.warning(f"message {i}")  # a template of its own each time: 100 kinds
    assert len(seen) == 100 and len(flt._seen) <= 8
