"""Reading and writing bundle archives (stdlib only; shared by compiler, fleet and agent).

A bundle is an uncompressed tar holding ``manifest.json`` plus the files it lists, all at the top
level. Reading never trusts the archive, and the fleet (before it signs or stores a bundle) and the
agent (before it installs one) read it with the same code, :func:`_scan`: every member is a regular
file with a plain name (no ``/``, no ``..``, no links, no duplicates, ``manifest.json`` once), the
members are exactly ``manifest.json`` and the files the manifest lists, each with the size the
manifest says (at most :data:`MAX_BUNDLE_BYTES`), every file's sha256 matches the manifest, and each engine
and self-test sample is, by its content, what its role needs (:func:`protocol.roles.role_problem`: an .npz as the
engine is refused). :func:`write_bundle` checks the roles too, so the compiler never writes such a bundle.

Extraction writes each member itself (``extractfile`` → a new file opened with ``O_EXCL`` and
``O_NOFOLLOW`` in the empty destination, mode 0644, hashed while written): it never calls
``TarFile.extract``, whose ``filter=`` argument Python 3.11.2 and 3.10.11 do not have.

Before ``tarfile`` parses anything, :func:`_walk_headers` walks the archive's 512-byte headers itself, on
every Python the project admits (3.10 and up): the parser's own fix for CVE-2024-6232 (its pax-header
regexes are quadratic: a 122 KB archive costs 15-40 s of CPU, holding the GIL) is only in 3.11.10 and
3.12.6, and Debian 12 and JetPack ship older ones. Every header must have a valid checksum; a member is a
regular file (``0`` or NUL type) and nothing else (no links, folders, devices, FIFOs, contiguous or sparse
files, volume labels); before a member come at most one pax extended header (``x``), one pax global header
(``g``), one GNU long name (``L``) and one GNU long link name (``K``), each at most
:data:`MAX_EXTENDED_HEADER_BYTES` of well-formed records with no run of more than
:data:`MAX_PAX_DIGIT_RUN` digits (what makes the regexes slow), no sparse keys and no ``size`` in a
global header. The walk follows the same offsets ``tarfile`` will (a pax ``size`` included) and costs one
512-byte read a header.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, BinaryIO

from .errors import ContractError
from .manifest import MANIFEST_FILENAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .roles import Opener, role_problem

__all__ = [
    "MAX_BUNDLE_BYTES",
    "MAX_EXTENDED_HEADER_BYTES",
    "MAX_MEMBERS",
    "MAX_PAX_DIGIT_RUN",
    "BundleError",
    "check_bundle",
    "extract_bundle",
    "read_manifest",
    "sha256_file",
    "write_bundle",
]

MAX_BUNDLE_BYTES = 2 * 1024**3  # a bundle (and so any file in it) bigger than this is refused
MAX_MEMBERS = 256  # manifest, engine, self-test sample and a few more; a header flood stops here
# A pax ('x'/'g') or GNU long-name ('L'/'K') header's data. A bundle needs none (its names are plain and
# short; write_bundle writes none) or a few hundred bytes (GNU tar's and bsdtar's times and extended
# attributes); 120,000 digits of it are the CVE-2024-6232 shape. At this size and digit run tarfile's
# regexes cost well under a millisecond on any Python.
MAX_EXTENDED_HEADER_BYTES = 8 * 1024
MAX_PAX_DIGIT_RUN = 64  # the longest run of ASCII digits in a pax header's data (a length, a time: <= 30)
_CHUNK = 1 << 20
_BLOCK = 512
_REGULAR = (b"0", b"\0")
_EXTENDED = {b"x": "pax extended header", b"g": "pax global header", b"L": "GNU long name header",
             b"K": "GNU long link name header"}
_NOT_REGULAR = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device",
                b"5": "a folder", b"6": "a FIFO", b"7": "a contiguous file", b"S": "a GNU sparse file",
                b"V": "a GNU volume label", b"M": "a GNU multi-volume continuation", b"N": "a GNU old long name",
                b"D": "a GNU dump folder", b"X": "a Solaris extended header"}
_DIGIT_RUN = re.compile(rb"[0-9]{%d}" % (MAX_PAX_DIGIT_RUN + 1))


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
    _check_roles(manifest, lambda name: (src_dir / name).open("rb"),
                 {n: (src_dir / n).stat().st_size for n in manifest.files}, str(out_path))
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


@contextmanager
def _open(path: Path, label: str) -> Iterator[tarfile.TarFile]:
    """The archive opened once: its headers walked (:func:`_walk_headers`), then handed to ``tarfile``."""
    try:
        f = path.open("rb")
    except OSError as exc:
        raise BundleError(f"{label}: cannot be read ({exc.strerror or type(exc).__name__})") from exc
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BUNDLE_BYTES:
                raise BundleError(f"{label}: {size} bytes exceeds the {MAX_BUNDLE_BYTES}-byte bundle limit")
            _walk_headers(f, size, label)
            f.seek(0)
            tar = tarfile.open(fileobj=f, mode="r:")
        except (tarfile.TarError, EOFError) as exc:
            raise BundleError(f"{label}: not a bundle archive (an uncompressed tar): {_reason(exc)}") from exc
        except OSError as exc:
            raise BundleError(f"{label}: cannot be read ({exc.strerror or type(exc).__name__})") from exc
        with tar:
            yield tar


def _number(field: bytes) -> int:
    """A header's numeric field as tarfile reads it (octal, or GNU base-256); ValueError if it is neither."""
    if field[:1] == b"\x80":  # GNU base-256, positive
        return int.from_bytes(field[1:], "big")
    if field[:1] == b"\xff":
        raise ValueError("negative")
    text = field.split(b"\0", 1)[0].strip()
    if text and not text.isdigit():
        raise ValueError("not octal")
    return int(text or b"0", 8)


def _field_text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")


def _checksum_ok(block: bytes) -> bool:
    try:
        want = _number(block[148:156])
    except ValueError:
        return False
    rest = block[:148] + b" " * 8 + block[156:]
    unsigned = sum(rest)
    signed = sum(b - 256 if b > 127 else b for b in rest)
    return want in (unsigned, signed)


def _pax_records(data: bytes, what: str) -> dict[bytes, bytes]:
    """A pax header's ``"%d %s=%s\n"`` records, strictly (trailing NUL padding allowed)."""
    records: dict[bytes, bytes] = {}
    pos, end = 0, len(data.rstrip(b"\0"))
    while pos < end:
        space = data.find(b" ", pos, pos + 12)
        if space <= pos or not data[pos:space].isdigit():
            raise ValueError(f"{what}: byte {pos} does not start a '<length> <key>=<value>\\n' record")
        length = int(data[pos:space])
        if length < space - pos + 4 or pos + length > end or data[pos + length - 1:pos + length] != b"\n":
            raise ValueError(f"{what}: the record at byte {pos} gives length {length}, which does not end at a newline "
                             "inside the header")
        key, eq, value = data[space + 1:pos + length - 1].partition(b"=")
        if not eq or not key:
            raise ValueError(f"{what}: the record at byte {pos} has no '<key>='")
        records[key] = value
        pos += length
    return records


def _walk_headers(f: BinaryIO, size: int, label: str) -> None:
    """Walk every header ``tarfile`` will parse, in its order and at its offsets, and refuse what a bundle
    never holds (see the module's docstring) before ``tarfile`` reads a byte of it."""
    offset, members = 0, 0
    pending: dict[bytes, int] = {}  # extended headers since the last member: type -> their offset
    pax_size: int | None = None  # an 'x' header's size for the next member
    pending_name: str | None = None
    while True:
        if offset >= size:
            block = b""
        else:
            f.seek(offset)
            block = f.read(_BLOCK)
        if not block.strip(b"\0"):  # the end of the archive, for tarfile too
            if pending:
                kind, at = next(iter(pending.items()))
                raise BundleError(f"{label}: the {_EXTENDED[kind]} at byte {at} is followed by no member")
            return
        damaged = f"{label}: not a bundle archive (an uncompressed tar): " if offset == 0 else f"{label}: "
        if len(block) < _BLOCK:
            raise BundleError(f"{damaged}truncated archive (a {len(block)}-byte header at byte {offset})")
        if not _checksum_ok(block):
            raise BundleError(f"{damaged}the header at byte {offset} is damaged (bad checksum)")
        kind = block[156:157]
        try:
            hsize = _number(block[124:136])
        except ValueError:
            raise BundleError(f"{damaged}the header at byte {offset} has an invalid size field") from None
        raw_name = _field_text(block[0:100])
        prefix = _field_text(block[345:500]) if block[257:263] == b"ustar\0" else ""
        name = pending_name or (f"{prefix}/{raw_name}" if prefix else raw_name)
        if kind in _EXTENDED:
            what = f"{label}: the {_EXTENDED[kind]} at byte {offset}"
            if kind in pending:
                raise BundleError(f"{what} is the second {_EXTENDED[kind]} for one member (the first is at byte "
                                  f"{pending[kind]}); a bundle needs at most one")
            if hsize > MAX_EXTENDED_HEADER_BYTES:
                raise BundleError(f"{what} has {hsize} bytes, over the {MAX_EXTENDED_HEADER_BYTES}-byte limit (a "
                                  "bundle needs none or a few hundred bytes: this is the CVE-2024-6232 shape that "
                                  "stalls Python's tarfile)")
            if offset + _BLOCK + hsize > size:
                raise BundleError(f"{what} runs past the end of the archive")
            data = f.read(hsize)
            if kind in (b"x", b"g"):
                records = _check_pax(data, kind, what)
                if kind == b"x":
                    pax_size = _pax_size(records, what)
                    if b"path" in records:
                        pending_name = records[b"path"].decode("utf-8", "replace")
            elif kind == b"L":
                pending_name = _field_text(data)
            pending[kind] = offset
            offset += _BLOCK + _blocks(hsize)
            continue
        if kind not in _REGULAR:
            what = _NOT_REGULAR.get(kind, f"of tar type {kind!r}")
            link = f" (to {_field_text(block[157:257])!r})" if kind in (b"1", b"2") else ""
            raise BundleError(f"{label}: member {name!r} is {what}{link}, not a regular file; a bundle holds "
                              "regular files only")
        if kind == b"\0" and raw_name.endswith("/"):  # tarfile reads this old-style 'name/' as a folder: no data
            raise BundleError(f"{label}: member {name!r} is a folder, not a regular file; a bundle holds regular "
                              "files only")
        members += 1
        if members > MAX_MEMBERS:
            raise BundleError(f"{label}: more than {MAX_MEMBERS} members")
        msize = hsize if pax_size is None else pax_size
        if msize > MAX_BUNDLE_BYTES:
            raise BundleError(f"{label}: member {name!r} of {msize} bytes exceeds the {MAX_BUNDLE_BYTES}-byte limit")
        offset += _BLOCK + _blocks(msize)
        pending, pax_size, pending_name = {}, None, None


def _blocks(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def _check_pax(data: bytes, kind: bytes, what: str) -> dict[bytes, bytes]:
    """A pax header's records, checked: no long digit run, well formed, no sparse keys, no global size."""
    run = _DIGIT_RUN.search(data)
    if run is not None:
        raise BundleError(f"{what} holds a run of more than {MAX_PAX_DIGIT_RUN} digits at byte {run.start()} (the "
                          "CVE-2024-6232 shape: Python's tarfile scans such runs in quadratic time)")
    try:
        records = _pax_records(data, what)
    except ValueError as exc:
        raise BundleError(f"{exc} (a malformed pax header)") from None
    if any(k.startswith(b"GNU.sparse.") for k in records):
        raise BundleError(f"{what} describes a sparse file; a bundle holds regular files only")
    if kind == b"g" and b"size" in records:
        raise BundleError(f"{what} sets 'size' for every later member; a bundle's global header may not")
    return records


def _pax_size(records: dict[bytes, bytes], what: str) -> int | None:
    """The member size an 'x' header sets (tarfile then finds the next header after that many bytes)."""
    size = records.get(b"size")
    if size is None:
        return None
    if not size.isdigit() or len(size) > 12:
        raise BundleError(f"{what} gives an invalid member size {size[:32]!r}")
    return int(size)


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
            _check_roles(manifest, lambda name: _member(tar, members[name]),
                         {n: ti.size for n, ti in members.items()}, lbl)
    return manifest


def _check_roles(manifest: Manifest, open_file: Opener, sizes: dict[str, int], label: str) -> None:
    problem = role_problem(manifest, open_file, sizes)
    if problem:
        raise BundleError(f"{label}: {problem}")


def _member(tar: tarfile.TarFile, ti: tarfile.TarInfo) -> IO[bytes]:
    f = tar.extractfile(ti)
    assert f is not None  # a regular file
    return f


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

        def open_in(name: str) -> IO[bytes]:  # a file this call wrote (name is plain: it stays inside dest)
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(name, flags, dir_fd=dfd) if os.open in os.supports_dir_fd else os.open(dest / name, flags)
            return os.fdopen(fd, "rb")

        try:
            with _open(path, lbl) as tar:
                with _reading(lbl, "reading its headers"):
                    manifest, members, raw = _scan(tar, lbl)
                with open_out(MANIFEST_FILENAME) as f:
                    f.write(raw)
                with _reading(lbl, "reading its files"):
                    _read_files(tar, manifest, members, lbl, open_out)
            _check_roles(manifest, open_in, {n: e.size_bytes for n, e in manifest.files.items()}, lbl)
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
