"""The local socket's connections are shared between users (issue 30, finding 7).

Before, 32 idle connections of one user took every slot of the local socket and every other client was refused.
Now one user holds at most ``local_max_connections_per_user`` of them (half of ``local_max_connections`` by
default), and a connection with nothing in flight and no byte from its client for ``local_idle_timeout_s`` is
closed with ERROR 408.

The second user is a client process dropped to ``nobody`` whose group may connect to the socket (mode 0660): it
needs root to drop, and the test skips otherwise, saying why."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

from edgefleet.agent.transports.local_client import LocalClient, LocalError
from edgefleet.protocol import local as wire
from tests.agent_harness import preinstall, running_agent

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a client of another user needs root to drop to nobody")


def _infer_as(uid: int, path: str, x: np.ndarray, out) -> None:
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        with LocalClient(path, timeout_s=30) as c:
            out.put(("answered", c.infer("digits", {"input": x})["logits"].shape))
    except LocalError as e:
        out.put(("refused", e.status, e.message))
    except BaseException as exc:  # surfaced to the test
        out.put(("failed", repr(exc)))


def infer_as(uid: int, path: str, x: np.ndarray) -> tuple:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_infer_as, args=(uid, path, x, out))
    p.start()
    try:
        return out.get(timeout=60)
    finally:
        p.join(30)


def read_error(c: LocalClient) -> LocalError:
    """The ERROR frame the agent wrote before closing the connection."""
    data = b""
    while len(data) < wire.HEADER.size or len(data) < wire.HEADER.size + wire.unpack_header(
            data[:wire.HEADER.size], 1 << 20)[2]:
        chunk = c.sock.recv(4096)
        assert chunk, f"closed without a reason ({data!r})"
        data += chunk
    kind, _rid, length = wire.unpack_header(data[:wire.HEADER.size], 1 << 20)
    body = data[wire.HEADER.size:wire.HEADER.size + length]
    assert kind == wire.ERROR, kind
    return LocalError(struct.unpack_from("<H", body)[0], body[2:].decode())


@as_root
@pytest.mark.trust("one local user holding every connection of the local socket")
def test_one_users_connections_leave_room_for_another(tmp_path, digits_bundle, test_images):
    """root opens connections until it is refused (it holds them, idle); nobody still connects and is answered."""
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    x = np.ascontiguousarray(test_images[0][:4], np.float32)
    where = Path(tempfile.mkdtemp(prefix="edgefleet-share-"))  # pytest's own tmp folders are root's alone
    where.chmod(0o755)
    with running_agent(data, local_socket=where / "local.sock", local_max_connections=8) as (a, _url):
        os.chown(a.local_socket, 0, NOBODY)  # nobody's group may connect (mode 0660), as a second user would
        held: list[LocalClient] = []
        try:
            refused = None
            for _ in range(9):  # bounded: one more than the socket's total
                c = LocalClient(a.local_socket, timeout_s=30)
                held.append(c)
                try:
                    c.infer("digits", {"input": x})
                except LocalError as e:
                    refused = e
                    break
                except (BrokenPipeError, ConnectionResetError):  # refused before the request was written
                    refused = read_error(c)
                    break
            assert refused is not None and refused.status == 503, refused
            assert "this user (uid 0) holds 4 local connections" in refused.message
            assert "local_max_connections_per_user 4" in refused.message
            assert len(held) == 5  # four held (idle now), the fifth refused
            got = infer_as(NOBODY, str(a.local_socket), x)
            assert got == ("answered", (4, 10)), got
        finally:
            for c in held:
                c.close()
    shutil.rmtree(where, ignore_errors=True)


def test_an_idle_connection_is_closed_with_a_reason(tmp_path, digits_bundle, test_images):
    """A connection that sends nothing for local_idle_timeout_s gets ERROR 408 naming the setting, then EOF; one
    that keeps asking is served."""
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    x = np.ascontiguousarray(test_images[0][:4], np.float32)
    with running_agent(data, local_socket="local.sock", local_idle_timeout_s=0.5) as (a, _url):
        with LocalClient(a.local_socket, timeout_s=30) as idle:
            assert idle.infer("digits", {"input": x})["logits"].shape == (4, 10)
            head = b""
            while len(head) < wire.HEADER.size + 2:  # the ERROR frame, read as it arrives (bounded by timeout_s)
                chunk = idle.sock.recv(4096)
                assert chunk, "closed without a reason"
                head += chunk
            kind, rid, length = wire.unpack_header(head[:wire.HEADER.size], 1 << 20)
            body = head[wire.HEADER.size:]
            while len(body) < length:
                chunk = idle.sock.recv(4096)
                assert chunk
                body += chunk
            assert (kind, rid, struct.unpack_from("<H", body)[0]) == (wire.ERROR, 0, 408)
            assert b"local_idle_timeout_s" in body
            assert idle.sock.recv(4096) == b""  # then closed
        with LocalClient(a.local_socket, timeout_s=30) as busy:  # a new connection is served as before
            assert busy.infer("digits", {"input": x})["logits"].shape == (4, 10)
