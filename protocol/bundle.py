"""Reading and writing bundle archives (stdlib only; shared by compiler, fleet and agent).

A bundle is an uncompressed tar holding ``manifest.json`` plus the files it lists, all at the top
level. Reading never trusts the archive, and the fleet (before it signs or stores a bundle) and the
agent (before it installs one) read it with the same code, :func:`_scan`: every member is a regular
file with a plain name (no ``/``, no ``..``, no links, no duplicates, ``manifest.json`` once), the
members are exactly ``manifest.json`` and the files the manifest lists, each with the size the
manifest says (at most :data:`MAX_BUNDLE_BYTES`), and every file's sha256 matches the manifest.

Extraction writes each member itself (``extractfile`` → a new file opened with ``O_EXCL`` and
``O_NOFOLLOW`` in the empty destination, mode 0644, hashed while written): it never calls
``TarFile.extract``, whose ``filter=`` argument Python 3.11.2 and 3.10.11 do not have.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from protocol.errors import ContractError
from protocol.manifest import MANIFEST_FILENAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest

__all__ = [
    "MAX_BUNDLE_BYTES",
    "MAX_MEMBERS",
    "BundleError",
    "check_bundle",
    "extract_bundle",
    "read_manifest",
    "sha256_file",
    "write_bundle",
]

MAX_BUNDLE_BYTES = 2 * 1024**3  # a bundle (and so any file in it) bigger than this is refused
MAX_MEMBERS = 256  # manifest, engine, self-test sample and a few more; a header flood stops here
_CHUNK = 1 << 20


class BundleError(ContractError):
    """The archive is not a well-formed bundle (tampered, truncated, or not a bundle at all)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def write_bundle(manifest: Manifest, src_dir: Path, out_path: Path) -> Path:
    """Write ``manifest.json`` and the files it lists (taken from ``src_dir``) into ``out_path``."""
    for name, entry in manifest.files.items():
        actual = sha256_file(src_dir / name)
        if actual != entry.sha256:
            raise BundleError(f"{src_dir / name}: sha256 {actual} does not match the manifest")
    tmp = out_path.with_name(out_path.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        data = manifest.to_json().encode()
        info = tarfile.TarInfo(MANIFEST_FILENAME)
        info.size = len(data)
        info.mtime = 0
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
        for name in sorted(manifest.files):
            ti = tar.gettarinfo(str(src_dir / name), arcname=name)
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.mode = 0, 0, 0, "", "", 0o644
            with (src_dir / name).open("rb") as f:
                tar.addfile(ti, f)
    tmp.replace(out_path)
    return out_path


# -- reading: one scanner for the fleet and the agent ----------------------------------------------
def _plain(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def _open(path: Path, label: str) -> tarfile.TarFile:
    try:
        size = path.stat().st_size
        if size > MAX_BUNDLE_BYTES:
            raise BundleError(f"{label}: {size} bytes exceeds the {MAX_BUNDLE_BYTES}-byte bundle limit")
        return tarfile.open(path, "r:")
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{label}: not a bundle archive (an uncompressed tar): {_reason(exc)}") from exc
    except OSError as exc:
        raise BundleError(f"{label}: cannot be read ({exc.strerror or type(exc).__name__})") from exc


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _members(tar: tarfile.TarFile, label: str) -> dict[str, tarfile.TarInfo]:
    """Every member's header, refused at the first that is not a plain, single, regular file."""
    members: dict[str, tarfile.TarInfo] = {}
    while True:
        ti = tar.next()
        if ti is None:
            return members
        name = ti.name
        if len(members) >= MAX_MEMBERS:
            raise BundleError(f"{label}: more than {MAX_MEMBERS} members")
        if not _plain(name):
            raise BundleError(f"{label}: member {name!r} is not a plain file name (absolute, '..' or a folder); "
                              "a bundle holds its files at the top level")
        if name in members:
            raise BundleError(f"{label}: duplicate member {name!r}")
        if ti.issym() or ti.islnk():
            kind = "symbolic" if ti.issym() else "hard"
            raise BundleError(f"{label}: member {name!r} is a {kind} link (to {ti.linkname!r}), not a regular file")
        if not ti.isreg() or ti.issparse():
            raise BundleError(f"{label}: member {name!r} is not a regular file")
        if ti.size > MAX_BUNDLE_BYTES:
            raise BundleError(f"{label}: member {name!r} of {ti.size} bytes exceeds the {MAX_BUNDLE_BYTES}-byte limit")
        members[name] = ti


def _scan(tar: tarfile.TarFile, label: str) -> tuple[Manifest, dict[str, tarfile.TarInfo], bytes]:
    """The manifest (its raw bytes too) and the file members, checked against each other; no file is read
    but the manifest (hashes are checked while the files are read: :func:`_read_files`)."""
    members = _members(tar, label)
    mti = members.pop(MANIFEST_FILENAME, None)
    if mti is None:
        raise BundleError(f"{label}: no {MANIFEST_FILENAME} in the bundle")
    if mti.size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{label}: {MANIFEST_FILENAME} of {mti.size} bytes exceeds the "
                          f"{MAX_MANIFEST_BYTES}-byte limit")
    f = tar.extractfile(mti)
    assert f is not None  # a regular file
    raw = f.read(MAX_MANIFEST_BYTES + 1)
    manifest = parse_manifest(raw, source=f"{label}!{MANIFEST_FILENAME}")
    for name, entry in sorted(manifest.files.items()):
        if entry.size_bytes > MAX_BUNDLE_BYTES:
            raise BundleError(f"{label}: {MANIFEST_FILENAME} gives {name!r} size_bytes {entry.size_bytes}, over the "
                              f"{MAX_BUNDLE_BYTES}-byte bundle limit")
    extra = sorted(set(members) - set(manifest.files))
    if extra:
        raise BundleError(f"{label}: unexpected member(s) not listed in {MANIFEST_FILENAME}: "
                          f"{', '.join(repr(n) for n in extra)}")
    missing = sorted(set(manifest.files) - set(members))
    if missing:
        raise BundleError(f"{label}: files listed in the manifest are missing: {', '.join(repr(n) for n in missing)}")
    for name, ti in members.items():
        want = manifest.files[name].size_bytes
        if ti.size != want:
            raise BundleError(f"{label}: {name!r} has {ti.size} bytes, the manifest says {want} bytes")
    return manifest, members, raw


def _read_files(tar: tarfile.TarFile, manifest: Manifest, members: dict[str, tarfile.TarInfo], label: str,
                open_out: Callable[[str], IO[bytes]] | None = None) -> None:
    """Read every listed file once, in archive order: its sha256 must be the manifest's; ``open_out(name)``
    (if given) returns the binary file each one is written to while it is read."""
    for name, ti in sorted(members.items(), key=lambda kv: kv[1].offset):
        entry = manifest.files[name]
        src = tar.extractfile(ti)
        assert src is not None
        h, n = hashlib.sha256(), 0
        out = open_out(name) if open_out is not None else None
        try:
            while n < ti.size:
                chunk = src.read(min(_CHUNK, ti.size - n))
                if not chunk:
                    raise BundleError(f"{label}: {name!r} is truncated ({n} of {ti.size} bytes)")
                h.update(chunk)
                n += len(chunk)
                if out is not None:
                    out.write(chunk)
        finally:
            if out is not None:
                out.close()
        if h.hexdigest() != entry.sha256:
            raise BundleError(f"{label}: {name!r} sha256 {h.hexdigest()} does not match the manifest ({entry.sha256})")


@contextmanager
def _reading(label: str, what: str) -> Iterator[None]:
    """A tar error (truncated, damaged) while reading the archive: a BundleError naming the archive only."""
    try:
        yield
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{label}: damaged bundle archive while {what} ({_reason(exc)})") from exc


def read_manifest(path: Path, *, label: str | None = None) -> Manifest:
    """The validated manifest of a bundle whose members are what it lists (names, types, sizes), without
    reading the files themselves (:func:`check_bundle` hashes them as well)."""
    lbl = str(path) if label is None else label
    with _open(path, lbl) as tar:
        with _reading(lbl, "reading its headers"):
            return _scan(tar, lbl)[0]


def check_bundle(path: Path, *, profiles: Collection[str] | None = None, label: str | None = None) -> Manifest:
    """Validate the whole archive without extracting it: what :func:`extract_bundle` checks, and (given
    ``profiles``) that the manifest's hardware profile is one of them. ``label`` names the archive in error
    messages (default: its path; the fleet passes a name that does not show its own folders).

    Raises BundleError (or SchemaError / UnsupportedVersionError for the manifest): a ContractError.
    """
    lbl = str(path) if label is None else label
    with _open(path, lbl) as tar:
        with _reading(lbl, "reading its headers"):
            manifest, members, _ = _scan(tar, lbl)
        if profiles is not None and manifest.profile not in profiles:
            raise BundleError(f"{lbl}: hardware profile {manifest.profile!r} is not one this fleet knows "
                              f"({', '.join(sorted(profiles)) or 'none'})")
        with _reading(lbl, "reading its files"):
            _read_files(tar, manifest, members, lbl)
    return manifest


def extract_bundle(path: Path, dest: Path, *, label: str | None = None) -> Manifest:
    """Check the archive as :func:`check_bundle` does and write its files into the empty folder ``dest``
    (created if missing), each hashed while written, mode 0644.

    Raises BundleError on any unexpected member, a missing file or a hash mismatch, after removing what it
    wrote; a file already in ``dest`` is never written through or replaced.
    """
    lbl = str(path) if label is None else label
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise BundleError(f"{dest}: the folder to extract {lbl} into is not empty")
    written: list[str] = []
    dfd = os.open(dest, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        def open_out(name: str) -> IO[bytes]:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            try:
                if os.open in os.supports_dir_fd:
                    fd = os.open(name, flags, 0o644, dir_fd=dfd)
                else:  # name is plain (checked): it stays inside dest
                    fd = os.open(dest / name, flags, 0o644)
            except FileExistsError as exc:
                raise BundleError(f"{dest}: {name!r} appeared while extracting {lbl}; refusing to replace it") \
                    from exc
            written.append(name)
            try:
                os.fchmod(fd, 0o644)  # exactly, whatever the umask
            except BaseException:
                os.close(fd)
                raise
            return os.fdopen(fd, "wb")

        try:
            with _open(path, lbl) as tar:
                with _reading(lbl, "reading its headers"):
                    manifest, members, raw = _scan(tar, lbl)
                with open_out(MANIFEST_FILENAME) as f:
                    f.write(raw)
                with _reading(lbl, "reading its files"):
                    _read_files(tar, manifest, members, lbl, open_out)
        except BaseException:
            for name in written:
                try:
                    if os.unlink in os.supports_dir_fd:
                        os.unlink(name, dir_fd=dfd)
                    else:
                        os.unlink(dest / name)
                except OSError:
                    pass
            raise
    finally:
        os.close(dfd)
    return manifest
