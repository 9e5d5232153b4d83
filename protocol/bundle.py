"""Reading and writing bundle archives (stdlib only; shared by compiler, fleet and agent).

A bundle is an uncompressed tar holding ``manifest.json`` plus the files it lists, all at the top
level. Reading never trusts the archive: members must be plain files with plain names, sizes are
bounded, and every file's sha256 must match the manifest.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from protocol.errors import ContractError
from protocol.manifest import MANIFEST_FILENAME, Manifest, parse_manifest

__all__ = ["MAX_BUNDLE_BYTES", "BundleError", "extract_bundle", "read_manifest", "sha256_file", "write_bundle"]

MAX_BUNDLE_BYTES = 2 * 1024**3  # a bundle bigger than this is refused
MAX_MANIFEST_BYTES = 1024**2


class BundleError(ContractError):
    """The archive is not a well-formed bundle (tampered, truncated, or not a bundle at all)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
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


def _open(path: Path) -> tarfile.TarFile:
    size = path.stat().st_size
    if size > MAX_BUNDLE_BYTES:
        raise BundleError(f"{path}: {size} bytes exceeds the {MAX_BUNDLE_BYTES}-byte bundle limit")
    try:
        return tarfile.open(path, "r:")
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{path}: not a bundle archive ({exc})") from exc


def read_manifest(path: Path) -> Manifest:
    """The validated manifest of a bundle, without extracting anything else."""
    try:
        return _read_manifest(path)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BundleError(f"{path}: damaged bundle archive ({exc})") from exc


def _read_manifest(path: Path) -> Manifest:
    with _open(path) as tar:
        try:
            member = tar.getmember(MANIFEST_FILENAME)
        except KeyError as exc:
            raise BundleError(f"{path}: no {MANIFEST_FILENAME} in the bundle") from exc
        if not member.isfile() or member.size > MAX_MANIFEST_BYTES:
            raise BundleError(f"{path}: {MANIFEST_FILENAME} is not a regular file under 1 MiB")
        f = tar.extractfile(member)
        assert f is not None  # isfile() checked above
        return parse_manifest(f.read(), source=f"{path}!{MANIFEST_FILENAME}")


def extract_bundle(path: Path, dest: Path) -> Manifest:
    """Extract into the empty folder ``dest`` and verify every file against the manifest.

    Raises BundleError on any unexpected member, a missing file or a hash mismatch.
    """
    try:
        return _extract(path, dest)
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"{path}: damaged bundle archive ({exc})") from exc


def _extract(path: Path, dest: Path) -> Manifest:
    manifest = read_manifest(path)
    expected = set(manifest.files) | {MANIFEST_FILENAME}
    dest.mkdir(parents=True, exist_ok=True)
    with _open(path) as tar:
        seen: set[str] = set()
        for member in tar.getmembers():
            if member.name not in expected or member.name in seen:
                raise BundleError(f"{path}: unexpected member {member.name!r}")
            if not member.isfile():
                raise BundleError(f"{path}: member {member.name!r} is not a regular file")
            if member.name != MANIFEST_FILENAME and member.size != manifest.files[member.name].size_bytes:
                raise BundleError(f"{path}: {member.name!r} has {member.size} bytes, manifest says "
                                  f"{manifest.files[member.name].size_bytes}")
            seen.add(member.name)
            tar.extract(member, dest, filter="data")
    missing = expected - seen
    if missing:
        raise BundleError(f"{path}: files listed in the manifest are missing: {sorted(missing)}")
    for name, entry in manifest.files.items():
        actual = sha256_file(dest / name)
        if actual != entry.sha256:
            raise BundleError(f"{path}: {name!r} sha256 {actual} does not match the manifest ({entry.sha256})")
    return manifest
