"""A pipeline in shadow of the serving pipeline, on a real agent (issue 34.3: "shadow waves compare the end
answers"). The agent serves PP-OCRv4 (tests/ocr_pipeline.py, FP32) as ocr 1.0.0; the fleet's desired state (mode
shadow) names a candidate, fetched over TUF from a real repository on loopback as a rollout's would be. Live pages
over HTTP are answered by 1.0.0 and mirrored to the candidate, whose END answers are compared with the serving
pipeline's (boxes matched at IoU 0.5, strings equal): a candidate whose recognizer's charset is upper-cased reads
most lines differently and keeps exactly the share of strings an independent FP32 run of both says it keeps; an
identical candidate keeps all (1.0); both in the ShadowFigures the telemetry carries. A single model shadowing a
pipeline, and a pipeline shadowing a single model, are refused with the reason."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from edgefleet.protocol import mqtt as proto
from tests.agent_harness import ocr_pipeline_or_skip, preinstall, running_agent
from tests.waiting import wait_for

ocr = ocr_pipeline_or_skip()
body, texts = ocr.body, ocr.texts

MAX_CROPS = 64


def spec(upper: bool = False):
    return ocr.ocr_spec(upper=upper, max_crops=MAX_CROPS)


class Repo:
    """A signed TUF repository on loopback holding bundles as the fleet publishes them, and the agent's fetcher."""

    def __init__(self, root: Path):
        from edgefleet.fleet.keys import KeyStore, init_keys
        from edgefleet.fleet.tuf_repo import Repository
        from tests.test_tuf import Server

        init_keys(root / "keys")
        self.root = root
        self.repo = Repository(root / "repo", KeyStore(root / "keys"))
        self.repo.init()
        self.server = Server(root / "repo")

    def add(self, bundle: Path) -> proto.DesiredState:
        """Publish ``bundle`` -> the desired state that shadows it."""
        from edgefleet.fleet.keys import bundle_target
        from edgefleet.protocol.bundle import read_manifest, sha256_file

        m = read_manifest(bundle)
        path, custom = bundle_target(m)
        self.repo.add_target(path, bundle, custom.signed_fields())
        return proto.DesiredState(device_id="dev-1", ts=time.time(), rollout_id=None, model=m.name,
                                  version=m.version, target=path, sha256=sha256_file(bundle),
                                  size_bytes=bundle.stat().st_size, mode="shadow")

    def fetcher(self, state_dir: Path):
        from edgefleet.agent.link.updater import BundleFetcher

        return BundleFetcher(state_dir, f"{self.server.url}/metadata/", f"{self.server.url}/targets/",
                             self.root / "keys" / "root.json")


@pytest.fixture(scope="module")
def world(tmp_path_factory, digits_bundle):
    from tests.test_agent_lifecycle import rebuild

    d = tmp_path_factory.mktemp("ocr-shadow")
    repo = Repo(d)
    bundles = {"1.0.0": ocr.ocr_bundle(d / "ocr-1.0.0.tar", "1.0.0", spec=spec()),
               "1.1.0": ocr.ocr_bundle(d / "ocr-1.1.0.tar", "1.1.0", spec=spec(upper=True)),  # reads differently
               "1.2.0": ocr.ocr_bundle(d / "ocr-1.2.0.tar", "1.2.0", spec=spec()),  # reads the same
               "single": rebuild(digits_bundle, d / "ocr-single.tar", "1.3.0", name="ocr")}  # a single model
    try:
        yield repo, bundles, {k: repo.add(b) for k, b in bundles.items()}
    finally:
        repo.server.close()


def expected(images: np.ndarray, upper: bool = False) -> list[list[str]]:
    ends = ocr.fp32_run(spec(upper), images)
    return [ocr.strings(ends, i) for i in range(len(images))]


def shadow(a, desired: proto.DesiredState) -> list[tuple[str, str | None]]:
    """Hand ``desired`` to the agent's installer as the daemon does -> the states it reported."""
    reports: list[tuple[str, str | None]] = []
    a._report = lambda state, d, error=None, **kw: reports.append((state, error))
    a.install(desired)
    return reports


def mirror(url: str, a, requests: list[np.ndarray]) -> list[list[str]]:
    """Each request over HTTP, one at a time, waiting until the shadow compared it (so none is skipped for the
    shadow being behind) -> every image's strings as the serving pipeline answered them."""
    served: list[list[str]] = []
    with httpx.Client(timeout=120) as c:
        for x in requests:
            sh = a.host.shadow
            before = sh.samples + sh.errors
            content, headers = body(x)
            r = c.post(f"{url}/v2/models/ocr/infer", content=content, headers=headers)
            assert r.status_code == 200, r.text
            assert r.json()["model_version"] == "1.0.0"  # the candidate answers nobody
            served += texts(r.json())
            wait_for(lambda sh=sh, n=before + len(x): sh.samples + sh.errors >= n, 120,
                     "the shadow comparing the mirrored request")
    return served


def shadow_records(a, version: str) -> list[proto.ShadowFigures]:
    spool = Path(a.config.data_dir) / "spool"
    out = []
    for p in sorted(spool.glob("[0-9]*.json")):
        try:
            t = proto.decode(proto.Telemetry, p.read_bytes(), str(p))
        except (OSError, proto.MessageError):  # being written
            continue
        if t.shadow is not None and t.shadow.version == version:
            out.append(t.shadow)
    return out


def test_a_candidate_pipeline_in_shadow_is_judged_on_its_end_answers(tmp_path, world):
    repo, bundles, desired = world
    data = tmp_path / "agent"
    preinstall(data, bundles["1.0.0"])
    requests = [ocr.pages(1, seed=300), ocr.pages(2, seed=301), ocr.pages(1, seed=302)]  # 4 pages, one of 2
    want = [s for x in requests for s in expected(x)]
    upper = [s for x in requests for s in expected(x, upper=True)]
    lines = sum(len(w) for w in want)
    kept = sum(a == b for w, u in zip(want, upper, strict=True) for a, b in zip(w, u, strict=True))
    assert lines >= 12 and [len(w) for w in want] == [len(u) for u in upper]  # same boxes, read differently
    assert kept < 0.5 * lines  # upper-casing changes most strings, or this test proves little
    with running_agent(data, shadow_sample_rate=1.0, max_batch_size=16, queue_timeout_ms=120_000) as (a, url):
        a.fetcher = repo.fetcher(tmp_path / "fetch")

        # a single model in shadow of the pipeline: refused, the pipeline serves on
        reports = shadow(a, desired["single"])
        assert [s for s, _ in reports][-1] == "failed", reports
        why = reports[-1][1] or ""
        assert "is a single model" in why and "ocr 1.0.0 serving here is a pipeline" in why, why
        assert a.host.shadow is None

        reports = shadow(a, desired["1.1.0"])  # reads every letter as a capital
        assert [s for s, _ in reports][-1] == "shadowing", reports
        assert mirror(url, a, requests) == want  # 1.0.0 answered every request
        f = a.host.shadow.figures()
        assert (f.model, f.version, f.samples, a.host.shadow.errors) == ("ocr", "1.1.0", 4, 0)
        assert f.top1_agreement == pytest.approx(kept / lines)  # exactly the strings both runs read alike
        print(f"\nshadow 1.1.0 (upper-cased charset): {kept} of {lines} strings kept; {f}")
        assert f.max_abs_error is not None and f.max_abs_error >= 0.0
        recs = wait_for(lambda: [r for r in shadow_records(a, "1.1.0") if r.samples == 4], 30,
                        "telemetry carrying the shadow's figures")
        assert recs[-1].top1_agreement == pytest.approx(kept / lines)

        reports = shadow(a, desired["1.2.0"])  # the same pipeline under another version; 1.1.0's shadow ends
        assert [s for s, _ in reports][-1] == "shadowing", reports
        assert mirror(url, a, requests) == want
        f = a.host.shadow.figures()
        assert (f.version, f.samples, f.top1_agreement) == ("1.2.0", 4, 1.0)
        assert f.max_abs_error is not None and f.max_abs_error < 1e-3, f
        print(f"shadow 1.2.0 (identical): {f}")
        wait_for(lambda: [r for r in shadow_records(a, "1.2.0") if r.samples == 4 and r.top1_agreement == 1.0],
                 30, "telemetry carrying the identical candidate's agreement of 1.0")


def test_a_pipeline_never_shadows_a_single_model(tmp_path, world, digits_bundle):
    from tests.test_agent_lifecycle import rebuild

    repo, _, desired = world
    data = tmp_path / "agent"
    preinstall(data, rebuild(digits_bundle, tmp_path / "single.tar", "1.0.0", name="ocr"))  # a single model
    with running_agent(data, shadow_sample_rate=1.0) as (a, _):
        a.fetcher = repo.fetcher(tmp_path / "fetch")
        reports = shadow(a, desired["1.2.0"])  # refused before its stages are loaded
        assert [s for s, _ in reports][-1] == "failed", reports
        why = reports[-1][1] or ""
        assert "ocr 1.2.0 is a pipeline and ocr 1.0.0 serving here is a single model" in why, why
        assert a.host.shadow is None and a.host.current is not None and a.host.current.manifest.version == "1.0.0"
