"""Who is on the other end of a connection: the user a local client runs as, for system shared memory.

A shared-memory region makes the agent read a client's object (inputs) and write into it (outputs) with the
agent's own rights. Without a check, any process that reaches the agent -- every local user reaches the loopback
HTTP and gRPC ports -- could make it read or overwrite an object of another user the agent may open (a confused
deputy). So the agent uses an object only as far as the client could itself: it tells the client's user from the
connection (``SO_PEERCRED`` on the Unix socket; on loopback TCP the ``uid`` column of the client's own socket in
``/proc/net/tcp`` or ``tcp6``) and checks the object's owner, group and mode bits for that user, as the kernel
would (POSIX ACLs are not read: an object shared by ACL alone is refused). A client it cannot tell -- not on
loopback, or not found -- cannot register a region.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import stat
import sys
from dataclasses import dataclass

__all__ = ["Peer", "tcp_peer", "unix_peer"]


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
        supplementary ones); a uid without an entry keeps only ``gid``."""
        gids = set() if gid is None else {gid}
        try:
            entry = pwd.getpwuid(uid)
            gids.update(os.getgrouplist(entry.pw_name, entry.pw_gid))
        except (KeyError, OSError):
            pass
        return cls(uid, frozenset(gids))

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


def tcp_peer(host: str | None, port: int | None, server_port: int | None,
             tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> Peer:
    """The client at ``host:port`` of this box's server on ``server_port``: its user, if it is a loopback
    connection on this box (the ``uid`` of the client's socket, whose local end is ``host:port`` and remote end
    the server's port); else ``Peer(None)``."""
    ip = _normal(host) if host else None
    if ip is None or not ip.is_loopback or port is None or server_port is None:
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
            except ValueError:
                continue
            if local == (ip, port) and remote[1] == server_port:
                return Peer.of_uid(int(fields[7]))
    return Peer(None)
