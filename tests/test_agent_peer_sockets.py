"""agent/transports/peer.py asks the kernel through one netlink socket per thread: a thread that ends closes its own,
and the process leaves none for the garbage collector or exit to find (each would be a ResourceWarning)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

PROBE = r"""
import json, os, socket, threading
from edgefleet.agent.transports.peer import tcp_peer


def netlink_fds():
    with open("/proc/net/netlink") as f:
        inodes = {line.split()[-1] for line in f.read().splitlines()[1:]}
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            fds.add(fd)
    return fds


srv = socket.create_server(("127.0.0.1", 0))
port = srv.getsockname()[1]
cli = socket.create_connection(("127.0.0.1", port))
conn, (host, cport) = srv.accept()
before = netlink_fds()
seen = {}


def ask():
    seen["uid"] = tcp_peer(host, cport, port, "127.0.0.1").uid
    seen["during"] = len(netlink_fds() - before)


threads = [threading.Thread(target=ask) for _ in range(3)]
for t in threads:
    t.start()
    t.join()
seen["after_threads"] = len(netlink_fds() - before)
seen["main_uid"] = tcp_peer(host, cport, port, "127.0.0.1").uid  # the main thread's own, left for exit
for s in (conn, cli, srv):
    s.close()
print(json.dumps(seen))
"""


def test_a_thread_that_asked_the_kernel_leaves_no_netlink_socket_behind():
    r = subprocess.run([sys.executable, "-X", "dev", "-W", "always::ResourceWarning", "-c", PROBE], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["during"] == 1, seen  # the lookup went through the kernel's sock_diag, on a socket of its own
    assert seen["uid"] == seen["main_uid"] is not None, seen
    assert seen["after_threads"] == 0, seen  # each ended thread's socket closed
    assert "ResourceWarning" not in r.stderr, r.stderr  # none left to the collector or to exit
