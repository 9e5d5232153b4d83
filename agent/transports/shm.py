"""Triton's system shared-memory extension: clients on the box pass tensors by reference.

A client creates a POSIX shared-memory object (``shm_open``; ``tritonclient.utils.shared_memory``), registers a
*region* of it under a name (``key`` is the object's name, e.g. ``/cam0_input``; ``offset`` and ``byte_size`` say
which bytes), then names the region in an infer request's input or output parameters
(``shared_memory_region``, ``shared_memory_byte_size``, ``shared_memory_offset``) instead of sending the bytes.

Every region answers to its owner. A region is registered by a user (agent/transports/peer.py tells the client's); a
caller (a view, :meth:`SharedMemory.as_caller`, one per connection or call) sees it in a listing, names it in an
infer request as an input, has outputs written into it, or unregisters it only if it is that user, or a user
the kernel's owner/group/mode rules let use the object for that use (read: list and inputs; write: outputs),
or, to unregister, the object's owner or root. Anything else is refused with 403 by name; a listing leaves out
what the caller may not read, and "unregister all" removes only the caller's own. Without this, another local
user listed a region over HTTP, ran inference on its bytes, wrote outputs into its 0600 object and removed it.

Bounded like every other input: at most ``max_per_client`` regions per client (HTTP and gRPC: one user on one
peer address; the local socket: one connection), ``max_regions`` in all and ``max_bytes`` registered
in all; a region not used for ``idle_timeout_s`` is unregistered (checked at every shared-memory call and infer
that names a region, and by :meth:`SharedMemory.sweep`), and every region is closed at shutdown. Names and keys
are validated (a key is one file name under /dev/shm: no path, no ``..``, no symlink followed); an object is
opened read-write when the agent may (outputs can be written to it), otherwise read-only.

The agent never maps a client's object: it reads inputs with ``preadv`` and writes outputs with ``pwrite`` on its
descriptor. A mapping faults (SIGBUS, which kills the process) on a page the object no longer has, and a client
can truncate its object at any moment, also between a size check and the copy; a read past the end is merely
short, and is refused by name ("was truncated below region"). Before an output is written the object's size is
checked too (a write past the end would grow the object back); if a client truncates it in between, the write
lands in the regrown object and nothing faults. Input bytes are copied out of the object before the request is
queued, so a client that rewrites, truncates or unlinks its object meanwhile cannot change or break a batch; one
unlinked keeps its descriptor (and its bytes) until it is unregistered.
"""

from __future__ import annotations

import copy
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import PayloadTooLarge, RequestError
from .peer import Peer, PeerCell

__all__ = ["NotPermitted", "Region", "SharedMemory"]


class NotPermitted(RequestError):
    """A caller used a region it may not (another user's, beyond what the kernel would let it do)."""

    status_code = 403

_SWEEP_EVERY_S = 1.0
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_KEY = re.compile(r"/[A-Za-z0-9_.\-]{1,200}")


@dataclass(eq=False)
class Region:
    """One registered region: its object's descriptor, who may use it for what (the kernel's rules for the object,
    as its registering user's), and its bytes read through the descriptor. :class:`SharedMemory` holds them."""

    name: str
    key: str
    offset: int  # of the region in the object, bytes
    byte_size: int
    client: str
    scope: str | None  # None: HTTP's and gRPC's (Triton's global names); else the one connection that may use it
    fd: int  # the object, opened read-write when the agent's user may, else read-only
    writable: bool  # outputs may be written into it: the agent's user and the client may both write it
    read_only_why: str = ""  # why not, when not
    uid: int | None = None  # the user who registered it (None: the agent itself)
    rw: bool = False  # the agent holds it read-write
    last_used: float = field(default_factory=time.monotonic)

    def status(self) -> dict[str, object]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    @classmethod
    def open(cls, root: Path, name: str, key: str, offset: int, byte_size: int, client: str, scope: str | None,
             peer: Peer) -> Region:
        """Region ``name``: bytes ``offset``..``offset + byte_size`` of the object ``key`` under ``root``, opened for
        ``client``, whose user is ``peer``, as far as that user could use it (SharedMemory.register)."""
        path = root / key[1:]
        # O_NONBLOCK: a FIFO opened read-only would wait for a writer (on the event loop, holding the lock); for a
        # regular file it changes nothing (fstat below refuses anything else)
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                fd = os.open(path, os.O_RDWR | flags)
                rw = True
            except PermissionError:
                fd = os.open(path, os.O_RDONLY | flags)
                rw = False
        except FileNotFoundError:
            raise RequestError(f"shared-memory region {name!r}: no shared-memory object {key!r} on this box "
                               "(shm_open it first)") from None
        except OSError as exc:
            raise RequestError(f"shared-memory region {name!r}: cannot open {key!r}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RequestError(f"shared-memory region {name!r}: {key!r} is not a shared-memory object")
            if offset + byte_size > st.st_size:
                raise RequestError(f"shared-memory region {name!r}: offset {offset} + byte_size {byte_size} is beyond "
                                   f"the end of {key!r} ({st.st_size} bytes)")
            may_read, may_write = peer.may(st)
            if not may_read:  # the agent would read it for a client that may not: a confused deputy
                raise RequestError(f"shared-memory region {name!r}: this client (uid {peer.uid}) may not read {key!r} "
                                   f"(owner uid {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):o}); "
                                   "the agent uses an object only as far as its client could itself")
        except BaseException:
            os.close(fd)
            raise
        why = "" if rw and may_write else "the agent's user may not write it" if not rw else \
            f"this client (uid {peer.uid}) may not write it"
        return cls(name, key, offset, byte_size, client, scope, fd, rw and may_write, why, uid=peer.uid, rw=rw)

    def refusal(self, caller: PeerCell | None, use: str) -> str | None:
        """Why ``caller`` (None: the agent itself) may not ``use`` ("read", "write" or "remove") this region; None: it
        may."""
        if caller is None:
            return None
        peer = caller.get()
        if peer.uid is None:
            return "this client's user cannot be told (a process on this box, over the local socket or loopback)"
        if peer.uid == self.uid:
            return None  # its own (outputs: self.writable says, check_writable)
        st = os.fstat(self.fd)
        if use == "remove":
            if peer.uid in (0, self.uid, st.st_uid):
                return None
            return (f"only the user who registered it (uid {self.uid}), the object's owner (uid {st.st_uid}) or root "
                    "may unregister it")
        may_read, may_write = peer.may(st)
        if (may_read if use == "read" else may_write and self.rw):  # write: and the agent holds it read-write
            return None
        return (f"this client (uid {peer.uid}) may not {use} {self.key!r} (owner uid {st.st_uid}, group {st.st_gid}, "
                f"mode {stat.S_IMODE(st.st_mode):o})")

    def check(self, caller: PeerCell | None, use: str, what: str) -> None:
        why = self.refusal(caller, use)
        if why is not None:
            raise NotPermitted(f"{what}: shared-memory region {self.name!r} was registered by another user (uid "
                               f"{self.uid}); {why}")

    def check_writable(self, caller: PeerCell | None, what: str) -> None:
        """Outputs may be written into it for ``caller``, or RequestError."""
        if caller is not None and caller.get().uid != self.uid:
            return  # another user's region, which SharedMemory._live let it write (refusal): the kernel's rule for it
        if not self.writable:
            raise RequestError(f"{what}: outputs cannot be written into shared-memory object {self.key!r}: "
                               f"{self.read_only_why}; give outputs a region both may write")

    def truncated(self, what: str) -> RequestError:
        return RequestError(f"{what}: shared-memory object {self.key!r} was truncated below region {self.name!r}")

    def pread(self, offset: int, size: int, dtype: np.dtype, shape: tuple[int, ...] | list[int], what: str,
              max_bytes: int) -> np.ndarray:
        """A copy of the ``size`` bytes at ``offset`` in the region, read through its descriptor (never a mapping: a
        truncated object gives a short read, not a fault), as an array of ``shape``; at most ``max_bytes``."""
        if size > max_bytes:  # before the buffer: a region may be far bigger than one request may be
            raise PayloadTooLarge(f"{what}: {size} bytes from shared-memory region {self.name!r} exceed the "
                                  f"{max_bytes}-byte limit of one request (max_body_bytes)")
        out = np.empty(size, np.uint8)
        if os.preadv(self.fd, [out.data], self.offset + offset) != size:
            raise self.truncated(what)
        return out.view(dtype).reshape(shape)

    def close(self) -> None:
        os.close(self.fd)


class SharedMemory:
    """The registered system shared-memory regions. Thread-safe (HTTP on the event loop, gRPC on its threads)."""

    def __init__(self, max_per_client: int = 16, max_regions: int = 64, max_bytes: int = 1 << 30,
                 idle_timeout_s: float = 600.0, root: Path = Path("/dev/shm"), max_read_bytes: int = 1 << 62):
        self.max_per_client, self.max_regions, self.max_bytes = max_per_client, max_regions, max_bytes
        # one input read from a region, at most (the agent's max_body_bytes): refused before anything is allocated
        self.max_read_bytes = max_read_bytes
        self.idle_timeout_s = idle_timeout_s
        self.root = root
        self._regions: dict[str, Region] = {}  # by name, or "scope:name" for a scoped region
        self._lock = threading.Lock()
        self.scope: str | None = None
        self.caller: PeerCell | None = None  # who uses this view; None: the agent itself (no check)
        self._swept_at = 0.0

    def as_caller(self, caller: PeerCell) -> SharedMemory:
        """A view of the same registry (and scope) for one client: each use of a region through it is checked
        against ``caller``'s user (module docstring)."""
        view = copy.copy(self)
        view.caller = caller
        return view

    def scoped(self, scope: str) -> SharedMemory:
        """A view of the same registry whose regions only it sees (one local-socket connection,
        agent/transports/local.py): its names cannot collide with anyone else's, and no one else can read or write its
        regions."""
        view = copy.copy(self)  # the same dict, lock and bounds
        view.scope = scope
        return view

    def _key(self, name: str) -> str:
        return name if self.scope is None else f"{self.scope}:{name}"  # ':' is never in a name (_NAME)

    def _get(self, name: str) -> Region | None:
        r = self._regions.get(self._key(name))
        return r if r is not None and r.scope == self.scope else None

    @property
    def enabled(self) -> bool:
        return self.max_regions > 0 and self.max_per_client > 0

    @property
    def registered_bytes(self) -> int:
        return sum(r.offset + r.byte_size for r in self._regions.values())

    # -- registry --------------------------------------------------------------------------------
    def register(self, name: object, key: object, offset: object, byte_size: object, client: str,
                 peer: Peer | None = None) -> None:
        """Register ``key``'s bytes ``offset``..``offset + byte_size`` as region ``name`` for ``client`` (a label
        for the per-client limit), whose user is ``peer`` (agent/transports/peer.py; None: this process's own user). The
        object is used only as far as that user could use it: read if it may read it, outputs written into it only
        if it may write it."""
        if not self.enabled:
            raise RequestError("system shared memory is off on this agent (max_shm_regions 0)")
        peer = Peer.me() if peer is None else peer
        if peer.uid is None:
            raise RequestError(f"shared-memory regions are for processes on this box, over the local socket or a "
                               f"loopback connection whose user the agent can tell; this client ({client}) is not "
                               "one (system shared memory is never shared across machines)")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(f"shared-memory region name {str(name)[:80]!r}: 1-128 of [A-Za-z0-9_.-]")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key in ("/.", "/.."):
            raise RequestError(f"shared-memory key {str(key)[:80]!r}: a POSIX shared-memory name, '/' then 1-200 "
                               "of [A-Za-z0-9_.-] (an object in /dev/shm, no path)")
        for what, v in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RequestError(f"shared-memory region {name!r}: {what} must be a byte count, got {v!r}")
        assert isinstance(offset, int) and isinstance(byte_size, int)
        if byte_size == 0:
            raise RequestError(f"shared-memory region {name!r}: byte_size must be at least 1")
        with self._lock:
            self._sweep_locked(time.monotonic())
            if self._key(name) in self._regions:
                raise RequestError(f"shared-memory region {name!r} is already registered; unregister it first")
            mine = sum(1 for r in self._regions.values() if r.client == client)
            if mine >= self.max_per_client:
                raise RequestError(f"this client ({client}) holds {mine} shared-memory regions, the most allowed "
                                   f"(max_shm_regions_per_client {self.max_per_client}); unregister some first")
            if len(self._regions) >= self.max_regions:
                raise RequestError(f"{len(self._regions)} shared-memory regions are registered, the most allowed "
                                   f"(max_shm_regions {self.max_regions}); retry after some are unregistered")
            if self.registered_bytes + offset + byte_size > self.max_bytes:
                raise RequestError(f"registering {offset + byte_size} bytes would exceed max_shm_bytes "
                                   f"({self.max_bytes}; {self.registered_bytes} registered now)")
            self._regions[self._key(name)] = Region.open(self.root, name, key, offset, byte_size, client, self.scope,
                                                          peer)

    def unregister(self, name: str | None = None) -> None:
        """One region, or every region of this scope the caller may unregister (``name`` None). An unknown name is
        not an error (as in Triton); another user's region is (NotPermitted)."""
        with self._lock:
            if name is None:
                keys = [k for k, r in self._regions.items() if r.scope == self.scope and
                        r.refusal(self.caller, "remove") is None]
            else:
                r = self._get(name)
                if r is not None:
                    r.check(self.caller, "remove", "unregister")
                keys = [] if r is None else [self._key(name)]
            for k in keys:
                self._regions.pop(k).close()

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        with self._lock:
            self._sweep_locked(time.monotonic())
            if name is None:  # what this caller may read
                return [r.status() for _, r in sorted(self._regions.items()) if r.scope == self.scope and
                        r.refusal(self.caller, "read") is None]
            r = self._get(name)
            if r is None:
                raise RequestError(f"no shared-memory region {name!r} is registered")
            r.check(self.caller, "read", "status")
            return [r.status()]

    def sweep(self) -> int:
        """Unregister the regions idle for longer than ``idle_timeout_s``; -> how many."""
        with self._lock:
            return self._sweep_locked(time.monotonic())

    def _sweep_due(self, now: float) -> None:
        """Sweep (lock held) if the last sweep is ``_SWEEP_EVERY_S`` old: a use of a region is a hot path."""
        if now - self._swept_at > _SWEEP_EVERY_S:
            self._sweep_locked(now)

    def _sweep_locked(self, now: float) -> int:
        self._swept_at = now
        stale = [n for n, r in self._regions.items() if now - r.last_used > self.idle_timeout_s]
        for n in stale:
            self._regions.pop(n).close()
        return len(stale)

    def close(self) -> None:
        """Every region, of every scope."""
        with self._lock:
            for r in self._regions.values():
                r.close()
            self._regions.clear()

    # -- tensors ---------------------------------------------------------------------------------
    def _use(self, name: object, offset: object, size: int, what: str, use: str) -> Region:
        """The region ``name`` for ``size`` bytes at ``offset``, checked. Every other region idle too long is swept
        at most every ``_SWEEP_EVERY_S`` here (a use is a hot path); this one is checked each time."""
        if not isinstance(name, str):
            raise RequestError(f"{what}: shared_memory_region must be a region name, got {name!r}")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise RequestError(f"{what}: shared_memory_offset must be a byte count, got {offset!r}")
        now = time.monotonic()
        self._sweep_due(now)
        return self._live(name, offset, size, what, now, use)

    def _live(self, name: str, offset: int, size: int, what: str, now: float, use: str) -> Region:
        """The registered, not idle-expired region ``name`` holding ``size`` bytes at ``offset``, which this view's
        caller may ``use`` ("read": inputs; "write": outputs) (marked used)."""
        r = self._get(name)
        if r is not None and now - r.last_used > self.idle_timeout_s:
            self._regions.pop(self._key(name)).close()
            r = None
        if r is None:
            raise RequestError(f"{what}: no shared-memory region {name!r} is registered"
                               + ("" if self.scope is None else " on this connection"))
        if self.caller is not None:
            r.check(self.caller, use, what)
        if offset + size > r.byte_size:
            raise RequestError(f"{what}: bytes {offset}..{offset + size} are beyond shared-memory region {name!r} "
                               f"({r.byte_size} bytes)")
        r.last_used = now
        return r

    def read(self, name: object, offset: object, size: int, dtype: np.dtype, shape: list[int],
             what: str) -> np.ndarray:
        """A copy of ``size`` bytes at ``offset`` in region ``name`` as an array (the client owns the region)."""
        with self._lock:
            r = self._use(name, offset, size, what, "read")
            assert isinstance(name, str) and isinstance(offset, int)
            return r.pread(offset, size, dtype, shape, what, self.max_read_bytes)

    def gather(self, reads: Sequence[tuple[str, int, int, np.dtype, tuple[int, ...], str]],
               outputs: Sequence[tuple[str, int, int, str]]) -> list[np.ndarray]:
        """``read`` of each of ``reads`` (region, offset, size, dtype, shape, what) and ``check_output`` of each of
        ``outputs`` (region, offset, size, what), all under one hold of the lock: a cached request's shared memory
        (agent.transports.kserve.RequestTemplate), whose names and offsets were type-checked when it was first decoded.
        The same checks and errors otherwise."""
        now = time.monotonic()
        with self._lock:
            self._sweep_due(now)
            got = [self._live(name, offset, size, what, now, "read").pread(offset, size, dtype, shape, what,
                                                                           self.max_read_bytes)
                   for name, offset, size, dtype, shape, what in reads]
            for name, offset, size, what in outputs:
                self._live(name, offset, size, what, now, "write").check_writable(self.caller, what)
        return got

    def check_output(self, name: object, offset: object, size: object, what: str) -> tuple[str, int, int]:
        """Validate an output's placement -> (region, offset, byte_size); the output's own size is checked later."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise RequestError(f"{what}: shared_memory_byte_size must be a positive byte count, got {size!r}")
        with self._lock:
            # the object's size is checked by scatter(), when the output is written
            self._use(name, offset, size, what, "write").check_writable(self.caller, what)
        assert isinstance(name, str) and isinstance(offset, int)
        return name, offset, size

    def write(self, name: str, offset: int, size: int, data: np.ndarray, what: str) -> int:
        """Write ``data`` (C-contiguous, little-endian) into region ``name`` -> its byte count."""
        self.scatter(((name, offset, size, data, what),))
        return data.nbytes

    def scatter(self, writes: Sequence[tuple[str, int, int, np.ndarray, str]]) -> None:
        """``write`` of each (region, offset, size, data, what), under one hold of the lock, each with ``pwrite``
        after one fstat per region (a truncated object is refused by name rather than grown back): a request's
        outputs, checked by check_output when it was decoded and again here."""
        for _, _, size, data, what in writes:
            if data.nbytes > size:
                raise RequestError(f"{what}: the output is {data.nbytes} bytes; shared_memory_byte_size gives it "
                                   f"{size}")
        now = time.monotonic()
        with self._lock:
            self._sweep_due(now)
            sizes: dict[int, int] = {}
            for name, offset, _, data, what in writes:
                n = data.nbytes
                r = self._live(name, offset, n, what, now, "write")
                r.check_writable(self.caller, what)
                st = sizes.get(r.fd)
                if st is None:
                    st = sizes[r.fd] = os.fstat(r.fd).st_size
                start = r.offset + offset
                if st < start + n:
                    raise r.truncated(what)
                # a write, not a mapping: truncated after the fstat above, the object grows back; nothing faults
                if os.pwrite(r.fd, data.reshape(-1).view(np.uint8).data, start) != n:
                    raise RequestError(f"{what}: could not write {n} bytes into shared-memory object {r.key!r}")

