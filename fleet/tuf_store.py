"""Where the fleet's TUF repository keeps its files: a folder, or the fleet's database.

    DirStore   metadata/<name> and targets/<path> under a folder (one fleet, or replicas sharing a volume);
               writers serialised by a file lock
    SqlStore   tables ``tuf_metadata``, ``tuf_targets`` and ``tuf_target_chunks`` (1 MiB chunks) in the fleet's
               own database: replicas share nothing but the database and the broker. On PostgreSQL writers
               are serialised by an advisory lock, so any replica may publish and every replica serves

The tables live in their own SQLAlchemy metadata, created on any fleet database without touching its
migrations (as ``fleet.enroll`` does). Integrity never rests on the store: everything in it is signed
TUF metadata or a target whose hash that metadata pins, and the agent verifies both.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

from sqlalchemy import BigInteger, Engine, Integer, LargeBinary, String, delete, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from ..protocol.fsutil import atomic_write

__all__ = ["CHUNK_BYTES", "DirStore", "SqlStore", "TufStore"]

CHUNK_BYTES = 1 << 20
_LOCK_KEY = 0x7475665F726570  # "tuf_rep": the advisory lock every replica's repository writer takes


class TufStore(Protocol):
    def read(self, name: str) -> bytes | None:
        """A metadata file by name ("timestamp.json", "3.snapshot.json"), or None."""

    def write(self, name: str, data: bytes) -> None: ...

    def names(self, suffix: str) -> list[str]:
        """Metadata names ending with ``suffix``."""

    def has_target(self, rel: str) -> bool: ...

    def put_target(self, rel: str, src: Path) -> None:
        """Store ``src`` as target file ``rel`` (content-addressed: never replaced once there)."""

    def target(self, rel: str) -> tuple[int, Iterator[bytes]] | Path | None:
        """A stored target: its path on disk, or (size, chunks); None if absent."""

    def lock(self) -> AbstractContextManager[None]:
        """Serialise writers (across processes and replicas that share the store)."""


class DirStore:
    def __init__(self, directory: Path):
        self.dir = directory
        self.metadata_dir = directory / "metadata"
        self.targets_dir = directory / "targets"

    def init(self) -> None:
        self.metadata_dir.mkdir(parents=True, exist_ok=True)
        self.targets_dir.mkdir(parents=True, exist_ok=True)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.metadata_dir / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        atomic_write(self.metadata_dir / name, data)

    def names(self, suffix: str) -> list[str]:
        return [p.name for p in self.metadata_dir.glob(f"*{suffix}")]

    def has_target(self, rel: str) -> bool:
        return (self.targets_dir / rel).is_file()

    def put_target(self, rel: str, src: Path) -> None:
        dest = self.targets_dir / rel
        if dest.exists():
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)

    def target(self, rel: str) -> Path | None:
        p = (self.targets_dir / rel).resolve()
        if not p.is_relative_to(self.targets_dir.resolve()) or not p.is_file() or p.name.startswith("."):
            return None
        return p

    def metadata_path(self, name: str) -> Path | None:
        p = (self.metadata_dir / name).resolve()
        if not p.is_relative_to(self.metadata_dir.resolve()) or not p.is_file() or p.name.startswith("."):
            return None
        return p

    @contextmanager
    def lock(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class _Base(DeclarativeBase):
    pass


class _Metadata(_Base):
    __tablename__ = "tuf_metadata"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class _Target(_Base):
    __tablename__ = "tuf_targets"
    path: Mapped[str] = mapped_column(String(500), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    chunks: Mapped[int] = mapped_column(Integer)  # written last: a target with all its chunks stored


class _Chunk(_Base):
    __tablename__ = "tuf_target_chunks"
    path: Mapped[str] = mapped_column(String(500), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class SqlStore:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self._local = threading.Lock()  # SQLite (tests, one process): threads of this process

    def init(self) -> None:
        _Base.metadata.create_all(self.engine)

    def read(self, name: str) -> bytes | None:
        with self.sessions() as s:
            return s.scalar(select(_Metadata.data).where(_Metadata.name == name))

    def write(self, name: str, data: bytes) -> None:
        with self.sessions.begin() as s:
            row = s.get(_Metadata, name)
            if row is None:
                s.add(_Metadata(name=name, data=data))
            else:
                row.data = data

    def names(self, suffix: str) -> list[str]:
        with self.sessions() as s:
            return list(s.scalars(select(_Metadata.name).where(_Metadata.name.endswith(suffix))))

    def has_target(self, rel: str) -> bool:
        with self.sessions() as s:
            return s.get(_Target, rel) is not None

    def put_target(self, rel: str, src: Path) -> None:
        if self.has_target(rel):
            return
        h = hashlib.sha256()
        n = size = 0
        with self.sessions.begin() as s:  # one transaction: a crash leaves no half-stored target
            s.execute(delete(_Chunk).where(_Chunk.path == rel))
            with src.open("rb") as f:
                for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
                    s.add(_Chunk(path=rel, idx=n, data=chunk))
                    s.flush()
                    s.expunge_all()  # keep at most one chunk in memory
                    h.update(chunk)
                    size += len(chunk)
                    n += 1
            s.add(_Target(path=rel, size=size, sha256=h.hexdigest(), chunks=n))

    def target(self, rel: str) -> tuple[int, Iterator[bytes]] | None:
        with self.sessions() as s:
            row = s.get(_Target, rel)
            if row is None:
                return None
            size, chunks = row.size, row.chunks

        def stream() -> Iterator[bytes]:
            for i in range(chunks):  # one chunk (1 MiB) in memory at a time
                with self.sessions() as s:
                    data = s.scalar(select(_Chunk.data).where(_Chunk.path == rel, _Chunk.idx == i))
                if data is None:
                    raise OSError(f"target {rel}: chunk {i} of {chunks} is missing")
                yield data

        return size, stream()

    @contextmanager
    def lock(self) -> Iterator[None]:
        with self._local:
            if self.engine.dialect.name != "postgresql":
                yield
                return
            with self.engine.connect() as conn:  # a session-level advisory lock, held on this connection
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _LOCK_KEY})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
                    conn.commit()
