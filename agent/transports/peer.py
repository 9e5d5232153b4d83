"""Who is on the other end of a connection: the user a local client runs as, for system shared memory.

A shared-memory region makes the agent read a client's object (inputs) and write into it (outputs) with the
agent's own rights. Without a check, any process that reaches the agent -- every local user reaches the loopback
HTTP and gRPC ports -- could make it read or overwrite an object of another user the agent may open (a confused
deputy). So the agent uses an object only as far as the client could itself: it tells the client's user from the
connection (``SO_PEERCRED`` on the Unix socket; on loopback TCP the ``uid`` column of the client's own socket in
``/proc/net/tcp`` or ``tcp6``) and checks the object's owner, group and mode bits for that user, as the kernel
would (POSIX ACLs are not read: an object shared by ACL alone is refused). A client it cannot tell -- not on
loopback, or not found -- cannot register a region.

On loopback TCP the client's socket is asked of the kernel by its exact address (``NETLINK_SOCK_DIAG``, what
``ss`` uses: one lookup, about 25 us), and ``/proc/net/tcp`` is read only where that cannot answer (reading it
formats every socket of the box: 10-18 ms here). Only a live socket counts: a connection whose client end is
in ``TIME_WAIT`` (closed on both sides) shows uid 0 in both, and would otherwise be taken for root's. The
transports ask once per connection where they can (:class:`PeerCell`: HTTP keeps one per keep-alive connection,
the local socket one per connection; gRPC, which shows no connection, one per call that names shared memory).
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
import stat
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Peer", "PeerCell", "tcp_peer", "unix_peer"]

# TCP states of a socket a process still holds, as the kernel numbers them (include/net/tcp_states.h):
# ESTABLISHED, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING. Not TIME_WAIT (6), whose entry has no owner
# (uid 0), nor the listening and handshake states
_LIVE_STATES = frozenset({1, 4, 5, 8, 9, 11})
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR = 4, 20, 2
_NLMSG = struct.Struct("=IHHII")
_NO_COOKIE = struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)  # any interface; INET_DIAG_NOCOOKIE
_GROUPS_TTL_S = 5.0
_groups: dict[int, tuple[float, frozenset[int]]] = {}  # uid -> (until, its groups in the user database)


@dataclass(frozen=True)
class Peer:
    """A client's user: ``uid`` and the groups it belongs to (None: it could not be told)."""

    uid: int | None
    gids: frozenset[int] = frozenset()

    @classmethod
    def me(cls) -> Peer:
        """This process's own user (a call from inside the agent)."""
        return cls(os.geteuid(), frozenset((os.getegid(), *os.getgroups())))

    @classmethod
    def of_uid(cls, uid: int, gid: int | None = None) -> Peer:
        """``uid`` with its groups from the user database (its primary group, ``gid`` if given, and the
        supplementary ones); a uid without an entry keeps only ``gid``. The database's answer is kept for
        ``_GROUPS_TTL_S`` (reading it costs ~100 us: /etc/passwd and /etc/group), so a change of a user's groups
        counts here within that long."""
        now = time.monotonic()
        cached = _groups.get(uid)
        if cached is None or cached[0] < now:
            found: set[int] = set()
            try:
                entry = pwd.getpwuid(uid)
                found.update(os.getgrouplist(entry.pw_name, entry.pw_gid))
            except (KeyError, OSError):
                pass
            if len(_groups) >= 256:
                _groups.clear()
            cached = _groups[uid] = (now + _GROUPS_TTL_S, frozenset(found))
        return cls(uid, cached[1] if gid is None else cached[1] | {gid})

    def may(self, st: os.stat_result) -> tuple[bool, bool]:
        """-> (may read, may write) a file with ``st``'s owner, group and mode, as the kernel decides for this
        user (root: both)."""
        if self.uid is None:
            return False, False
        if self.uid == 0:
            return True, True
        mode = st.st_mode
        if st.st_uid == self.uid:
            return bool(mode & stat.S_IRUSR), bool(mode & stat.S_IWUSR)
        if st.st_gid in self.gids:
            return bool(mode & stat.S_IRGRP), bool(mode & stat.S_IWGRP)
        return bool(mode & stat.S_IROTH), bool(mode & stat.S_IWOTH)


class PeerCell:
    """A connection's user, looked up the first time it is needed and kept for the connection's life (a told
    user only: one that could not be told is asked again next time). ``shm_view``: the shared-memory registry's
    view for this caller, kept by the transport that made the cell."""

    __slots__ = ("_peer", "_resolve", "shm_view")

    def __init__(self, resolve: Callable[[], Peer] | Peer):
        if isinstance(resolve, Peer):
            self._peer: Peer | None = resolve if resolve.uid is not None else None
            self._resolve: Callable[[], Peer] = lambda: resolve
        else:
            self._peer, self._resolve = None, resolve
        self.shm_view: Any = None

    def get(self) -> Peer:
        peer = self._peer
        if peer is None:
            peer = self._resolve()
            if peer.uid is not None:
                self._peer = peer
        return peer


def unix_peer(uid: int, gid: int) -> Peer:
    """The client of a Unix socket, from its SO_PEERCRED."""
    return Peer.of_uid(uid, gid)


def _normal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _proc_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address | None, int]:
    """``/proc/net/tcp``'s "0100007F:1F90" (each 32-bit word in host order) -> (address, port)."""
    hexaddr, _, hexport = text.partition(":")
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(hexport, 16)


_diag = threading.local()  # one netlink socket per thread (HTTP on the loop, large bodies on worker threads)


class _DiagSocket:
    """A thread's netlink socket: closed when the thread ends (its thread-local state is dropped, and this with
    it) or at exit, never left to the garbage collector (a ResourceWarning)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG)
        self.sock.settimeout(1.0)
        weakref.finalize(self, self.sock.close)


def _diag_socket() -> socket.socket:
    held = getattr(_diag, "held", None)
    if held is None:
        held = _diag.held = _DiagSocket()
    return held.sock


def _diag_lookup(family: int, src: bytes, sport: int, dst: bytes, dport: int) -> tuple[int, int] | None:
    """The kernel's answer for the TCP socket ``src:sport`` -> ``dst:dport`` (inet_diag, an exact lookup) ->
    (state, uid); None: no such socket. OSError where the kernel offers no sock_diag."""
    req = (struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + struct.pack(">HH", sport, dport)
           + src.ljust(16, b"\0") + dst.ljust(16, b"\0") + _NO_COOKIE)
    sock = _diag_socket()
    seq = getattr(_diag, "seq", 0) + 1
    _diag.seq = seq
    try:
        sock.send(_NLMSG.pack(_NLMSG.size + len(req), _SOCK_DIAG_BY_FAMILY, 1, seq, 0) + req)  # NLM_F_REQUEST
        while True:
            data = sock.recv(65536)
            if len(data) < _NLMSG.size:
                raise OSError("short netlink answer")
            _length, kind, _flags, got, _pid = _NLMSG.unpack_from(data)
            if got == seq:
                break  # an answer to an earlier, timed-out question is dropped
    except OSError:
        _diag.held = None
        sock.close()
        raise
    if kind == _NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, _NLMSG.size)
        if err == 0 or -err == 2:  # ENOENT: no such socket
            return None
        raise OSError(-err, os.strerror(-err))
    state = data[_NLMSG.size + 1]
    uid = struct.unpack_from("=I", data, _NLMSG.size + 4 + 48 + 12)[0]  # inet_diag_msg: after id, expires, queues
    return state, uid


def _packed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple[int, bytes]:
    return (socket.AF_INET if ip.version == 4 else socket.AF_INET6), ip.packed


def _netlink_peer(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int,
                  servers: list[ipaddress.IPv4Address | ipaddress.IPv6Address], server_port: int) -> Peer | None:
    """The client socket by its exact address, towards each address the server may have been reached at (an
    IPv4 client also as an IPv4-mapped IPv6 socket) -> its user; Peer(None) for a socket no process holds; None
    where the kernel has no such socket at any of them."""
    for dst in servers:
        families = [(ip, dst)]
        if ip.version == 4 and dst.version == 4:
            families.append((ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed),
                             ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + dst.packed)))
        for src, to in families:
            if src.version != to.version:
                continue
            family, raw = _packed(src)
            found = _diag_lookup(family, raw, port, to.packed, server_port)
            if found is not None:
                state, uid = found
                return Peer.of_uid(uid) if state in _LIVE_STATES else Peer(None)
    return None


def tcp_peer(host: str | None, port: int | None, server_port: int | None, server_host: str | None = None,
             tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> Peer:
    """The client at ``host:port`` of this box's server on ``server_port`` (reached at ``server_host``, where
    known): its user, if it is a live loopback connection on this box (the ``uid`` of the client's socket, whose
    local end is ``host:port`` and remote end the server's port); else ``Peer(None)``."""
    ip = _normal(host) if host else None
    if ip is None or not ip.is_loopback or port is None or server_port is None:
        return Peer(None)
    known = _normal(server_host) if server_host else None
    exact = known is not None and known.is_loopback  # the server's own address of this connection
    servers = [known] if exact else []
    if ip not in servers:
        servers.append(ip)  # a loopback client's source address is usually the one it connected to
    try:
        told = _netlink_peer(ip, port, servers, server_port)  # type: ignore[arg-type]
    except OSError:  # no sock_diag here (an old or restricted kernel): /proc/net below
        told, exact = None, False
    if told is not None:
        return told
    if exact:  # the kernel knows no such connection: /proc/net would not either
        return Peer(None)
    for table in tables:
        try:
            with open(table, "rb") as f:  # bytes: no codec to look up (and import) on the way
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8:
                continue
            try:
                local, remote = _proc_address(fields[1].decode()), _proc_address(fields[2].decode())
                state = int(fields[3], 16)
            except ValueError:
                continue
            if local == (ip, port) and remote[1] == server_port:
                return Peer.of_uid(int(fields[7])) if state in _LIVE_STATES else Peer(None)
    return Peer(None)
