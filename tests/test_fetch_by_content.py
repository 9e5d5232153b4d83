"""Fetching a bundle by content (issue 43.3, agent/link/by_content.py): a box that holds a file with the hash a new
bundle's manifest names copies it instead of downloading it; the rest of the archive comes by byte ranges from a real
fleet, through a counting loopback proxy (tests/cutting_proxy.py), and the whole file still verifies against its
signed length and hash. The box's installed model is the first bundle extracted as the store keeps it
(``models/<dir>/manifest.json`` and its files)."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgefleet.agent.errors import DownloadCut, FetchError
from edgefleet.agent.link.by_content import installed_files
from edgefleet.agent.link.updater import BundleFetcher
from edgefleet.protocol.bundle import extract_bundle, read_manifest, sha256_file
from tests.cutting_proxy import CuttingProxy

PAD_BYTES = 1_500_000
HTTP_HEAD_BYTES = 1536  # an answer's status line and headers: the fleet's are ~980 B, its Content-Security-Policy most


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, digits_bundle) -> Iterator[tuple[str, Path, dict[str, tuple[str, str, Path]]]]:
    """(fleet URL, root.json, version -> (target, sha256, bundle)): 1.1.0, 1.2.0 (1.1.0's files, another manifest)
    and 1.3.0 (1.1.0's model, another self-test sample: one file of two changed)."""
    from tests.conftest import running_mosquitto
    from tests.fleet_harness import api, running_fleet
    from tests.test_tuf_bundles import rebundle

    tmp = tmp_path_factory.mktemp("fleet")
    v11 = rebundle(digits_bundle, tmp / "a.tar", pad_bytes=PAD_BYTES, version="1.1.0")
    v12 = rebundle(v11, tmp / "b.tar", version="1.2.0")
    v13 = rebundle(digits_bundle, tmp / "c-other-seed.tar", pad_bytes=PAD_BYTES, version="1.3.0")
    with running_mosquitto(tmp) as broker, running_fleet(tmp, broker.url) as (_fs, url):
        got = {}
        for b in (v11, v12, v13):
            up = api.post(f"{url}/api/v1/bundles", content=b.read_bytes())
            assert up.status_code == 201, up.text
            got[up.json()["version"]] = (up.json()["target"], up.json()["sha256"], b)
        yield url, tmp / "keys" / "root.json", got


def _box(tmp: Path, fleet, installed: Path, port: int) -> BundleFetcher:
    url, root, _ = fleet
    models = tmp / "store" / "models"
    extract_bundle(installed, models / "digits-1.1.0")
    base = f"http://127.0.0.1:{port}"
    return BundleFetcher(tmp / "tuf", f"{url}/tuf/metadata/", f"{base}/tuf/targets/", root,
                         held_files=lambda: installed_files(models))


def _held_data(old: Path, new: Path) -> int:
    """The bytes of ``new``'s archive that are data (with its padding) of files ``old`` holds by hash."""
    held = {e.sha256 for e in read_manifest(old).files.values()}
    files = read_manifest(new).files
    with tarfile.open(new) as tar:
        return sum(-(-m.size // 512) * 512 for m in tar.getmembers() if m.name in files
                   and files[m.name].sha256 in held)


def _changed_bytes(old: Path, new: Path) -> int:
    a, b = read_manifest(old).files, read_manifest(new).files
    return sum(e.size_bytes for n, e in b.items() if n not in a or a[n].sha256 != e.sha256)


@pytest.mark.parametrize(("version", "what"), [("1.2.0", "a changed manifest"), ("1.3.0", "one file of two changed")])
def test_a_new_version_downloads_only_what_the_box_does_not_hold(tmp_path, fleet, version, what):
    """Before: every new version downloaded the whole bundle (1.56 MB here, whatever changed)."""
    target, sha, bundle = fleet[2][version]
    old = fleet[2]["1.1.0"][2]
    proxy = CuttingProxy(int(fleet[0].rsplit(":", 1)[1]))
    port = proxy.start()
    try:
        got = _box(tmp_path, fleet, old, port).fetch(target, sha)
    finally:
        proxy.stop()
    size = bundle.stat().st_size
    assert sha256_file(got.path) == sha and got.length == size
    changed = _changed_bytes(old, bundle)
    print(f"{what}: {proxy.down_bytes} of {size} B fetched ({100 * proxy.down_bytes / size:.1f}%), "
          f"{changed} B of files changed")
    assert proxy.down_bytes <= changed + 0.05 * size, (proxy.down_bytes, changed, size)
    # tighter: the archive less the held files' data (headers, the manifest, what changed, the tail), plus an HTTP
    # head per request. Before: each header's read ran 8 KiB on into the held file after it, and the manifest's
    # read fetched again what the first header's had: ~23 KiB for nothing here
    need = size - _held_data(old, bundle)
    print(f"  {proxy.connections} requests; the archive less the held files' data: {need} B")
    assert proxy.down_bytes <= need + HTTP_HEAD_BYTES * proxy.connections, (proxy.down_bytes, need)


def test_a_cut_while_assembling_resumes_and_a_changed_held_file_is_fetched(tmp_path, fleet):
    target, sha, bundle = fleet[2]["1.3.0"]
    old = fleet[2]["1.1.0"][2]
    proxy = CuttingProxy(int(fleet[0].rsplit(":", 1)[1]), cut_every=400_000, max_cuts=2)
    port = proxy.start()
    box = _box(tmp_path, fleet, old, port)
    model = next(p for p in (tmp_path / "store" / "models" / "digits-1.1.0").iterdir() if p.suffix == ".onnx")
    model.write_bytes(model.read_bytes()[:-1] + b"\0")  # the held copy no longer has its content: fetched
    errors: list[FetchError] = []
    try:
        for _ in range(6):
            try:
                got = box.fetch(target, sha)
                break
            except FetchError as exc:
                errors.append(exc)
        else:
            raise AssertionError(errors)
    finally:
        proxy.stop()
    assert sha256_file(got.path) == sha
    assert errors and all(isinstance(e, DownloadCut) for e in errors)
