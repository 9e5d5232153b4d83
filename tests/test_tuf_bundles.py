"""Bundle variants the security and crash tests publish, made from the compiled digits bundle; and
the checks that the variants themselves are what they claim (a broken helper would make the attack
tests pass for the wrong reason)."""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.protocol.bundle import extract_bundle, read_manifest, sha256_file, write_bundle
from edgefleet.protocol.manifest import MANIFEST_FILENAME, FileEntry

__all__ = ["rebundle", "write_raw_bundle"]


def rebundle(src: Path, out: Path, pad_bytes: int = 0, **changes: Any) -> Path:
    """A valid bundle like ``src`` with manifest fields changed (e.g. version=...); ``pad_bytes`` of
    seeded noise go into the self-test sample (listed, hashed) to make the bundle bigger."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        m = extract_bundle(src, d)
        files = dict(m.files)
        if pad_bytes:
            st = d / m.selftest
            with np.load(st, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            arrays["padding"] = np.random.default_rng(len(out.name)).integers(0, 255, pad_bytes, dtype=np.uint8)
            with st.open("wb") as f:
                np.savez(f, **arrays)  # type: ignore[arg-type]
            files[m.selftest] = FileEntry(sha256=sha256_file(st), size_bytes=st.stat().st_size)
        m = m.model_copy(update={**changes, "files": files})
        out.parent.mkdir(parents=True, exist_ok=True)
        return write_bundle(m, d, out)


def write_raw_bundle(src: Path, out: Path, edit: Any) -> Path:
    """Like ``src`` but with the manifest JSON passed through ``edit(dict) -> dict`` unchecked (for
    manifests this edgefleet would refuse to write)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        m = extract_bundle(src, d)
        doc = edit(json.loads(m.to_json()))
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            data = json.dumps(doc).encode()
            info = tarfile.TarInfo(MANIFEST_FILENAME)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            for name in sorted(m.files):
                tar.add(str(d / name), arcname=name)
    return out


def test_rebundle_changes_the_manifest_and_stays_valid(tmp_path, digits_bundle):
    out = rebundle(digits_bundle, tmp_path / "b.tar", pad_bytes=10_000, version="7.0.0")
    m = read_manifest(out)
    assert m.version == "7.0.0" and m.name == "digits"
    extract_bundle(out, tmp_path / "x")  # every file matches its hash
    assert out.stat().st_size > digits_bundle.stat().st_size + 10_000


def test_raw_bundle_carries_the_unchecked_manifest(tmp_path, digits_bundle):
    out = write_raw_bundle(digits_bundle, tmp_path / "r.tar", lambda d: {**d, "manifest_version": 99})
    with tarfile.open(out) as tar:
        f = tar.extractfile(MANIFEST_FILENAME)
        assert f is not None and json.loads(f.read())["manifest_version"] == 99
