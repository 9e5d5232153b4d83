"""bf16 as a precision the compiler builds and gates like int8 (issue 35.2): the fp32 ONNX file tagged bf16, run by
OpenVINO with its bf16 hint, judged by the task-level gate against fp32, never labelled fp32, offered only by
profiles whose CPUs all run bf16 and only on a build host that runs it; no bf16 answer is shipped or served without
the gate's figures.

From the outside: the real compiler and OpenVINO on this CPU (avx512_bf16 here; the tests that need it skip with
the reason elsewhere), the CLI on an emulated Haswell (no AVX-512) for the host that cannot run bf16, a real fleet
on loopback for uploads, the agent's verify and precision choice on real engines.
"""

from __future__ import annotations

import copy
import json
import tarfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet import engines
from edgefleet.compiler.compile import CompileOptions, Measured, choose_precision, compile_model
from edgefleet.compiler.errors import AccuracyGateFailed
from edgefleet.protocol.bundle import check_bundle, extract_bundle, sha256_file, write_bundle
from edgefleet.protocol.errors import EdgefleetError, SchemaError
from edgefleet.protocol.manifest import BenchmarkPoint, parse_manifest
from edgefleet.protocol.profile import load_profile, profile_dir
from tests.conftest import DIGITS
from tests.emulation import needs_qemu, run_as_cpu
from tests.test_bundle_upload_checks import Crafted, Member, _assert_refused, _published, api, fleet  # noqa: F401

pytestmark = pytest.mark.timeout(300)

EXIT_GATE, EXIT_TOOLCHAIN = 3, 5


def _bf16_here() -> str | None:
    from edgefleet.compiler.bf16 import host_cannot_run_bf16

    return host_cannot_run_bf16(load_profile("x86-cpu-bf16"))


needs_bf16 = pytest.mark.skipif(_bf16_here() is not None, reason=f"this build host cannot run bf16: {_bf16_here()}")


def _compile(out: Path, precision: str, model: Path = DIGITS / "model.onnx", eval_: Path = DIGITS / "test.npz",
             calibration: Path | None = DIGITS / "calibration.npz", **kw) -> Path:
    return compile_model(CompileOptions(model=model, profile="x86-cpu-bf16", calibration=calibration, eval=eval_,
                                        out_dir=out, name=kw.pop("name", "digits"), version="1.0.0",
                                        precision=precision, **kw)).bundle


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory) -> Path:
    if _bf16_here() is not None:
        pytest.skip(f"this build host cannot run bf16: {_bf16_here()}")
    return _compile(tmp_path_factory.mktemp("bf16"), "bf16", benchmark=False)


# -- the profile states which precisions it allows ----------------------------------------------------------
def test_only_a_profile_that_promises_a_bf16_cpu_allows_bf16(tmp_path):
    assert "bf16" in load_profile("x86-cpu-bf16").precisions
    assert "avx512_bf16" in load_profile("x86-cpu-bf16").cpu_features
    assert "bf16" not in load_profile("x86-cpu-vnni").precisions  # Ice Lake: VNNI without BF16
    base = (profile_dir() / "x86-cpu-vnni.yaml").read_text().replace("name: x86-cpu-vnni", "name: custom")
    bad = tmp_path / "custom.yaml"
    bad.write_text(base.replace("precisions: [int8, fp32]", "precisions: [int8, bf16, fp32]"))
    with pytest.raises(SchemaError, match=r"bf16 needs CPUs with amx_bf16 or avx512_bf16.*add avx512_bf16"):
        load_profile(str(bad))
    amx = tmp_path / "amx.yaml"
    amx.write_text(base.replace("name: custom", "name: amx").replace("precisions: [int8, fp32]",
                                                                     "precisions: [int8, bf16, fp32]")
                   .replace("avx512_vnni]", "avx512_vnni, amx_bf16]"))
    assert "bf16" in load_profile(str(amx)).precisions
    arm = tmp_path / "arm.yaml"
    arm.write_text((profile_dir() / "arm64-cpu.yaml").read_text().replace("name: arm64-cpu", "name: arm")
                   .replace("precisions: [", "precisions: [bf16, "))
    with pytest.raises(SchemaError, match="bf16 is for x86_64 CPU profiles"):
        load_profile(str(arm))


# -- the real path: built, gated, tagged bf16, served as gated -----------------------------------------------
@needs_bf16
def test_a_bf16_build_is_the_fp32_file_gated_as_bf16_and_runs_bf16_as_gated(bf16_bundle, tmp_path):
    from edgefleet.agent.install.verify import verify_bundle

    m = extract_bundle(bf16_bundle, tmp_path)
    assert (m.precision, m.backend) == ("bf16", "onnxruntime") and m.manifest_version >= 5
    acc = m.accuracy
    assert (acc.candidate_precision, acc.reference_precision, acc.metric, acc.passed) == ("bf16", "fp32", "top1",
                                                                                           True)
    assert acc.eval_samples == 359 and acc.drop <= acc.max_drop
    cand = {c.precision: c for c in m.precision_choice.candidates}["bf16"]
    assert cand.passed and cand.top1 == acc.candidate and cand.metric == "top1"
    assert "openvino" in m.toolchain and "avx512_bf16" in m.cpu_features
    # the engine serves bf16 answers (not f32 under a bf16 label): OpenVINO bf16 differs from onnxruntime fp32 on
    # the same file, and reproduces the self-test sample the gate's engine wrote
    with np.load(tmp_path / m.selftest) as npz:
        x, expected, ref = npz["input:input"], npz["expected:logits"], npz["reference:logits"]
    served = engines.load_bundle_engine(m, tmp_path / m.engine, threads=2)
    try:
        assert served.kind == "openvino" and "(bf16, 2 threads)" in served.device, served.device
        got = served.infer({"input": x})[0]
    finally:
        served.close()
    assert np.abs(got - expected).max() <= 1e-3 + 0.02 * np.abs(expected).max()
    assert np.abs(expected - ref).max() > 1e-3, "bf16 answered exactly as fp32: the engine did not run bf16"
    with pytest.raises(engines.EngineLoadError, match="onnxruntime runtime does not run bf16"):
        engines.load_bundle_engine(m, tmp_path / m.engine, threads=1, runtime="onnxruntime")
    r = verify_bundle(bf16_bundle, threads=2)
    assert r.cpu_ok and r.computes_as_gated, (r.cpu_reason, r.selftest_error)


@needs_bf16
def test_auto_considers_bf16_and_records_its_gate_and_speed_figures(tmp_path):
    m = extract_bundle(_compile(tmp_path / "out", "auto"), tmp_path / "x")
    pc = m.precision_choice
    assert pc is not None and pc.mode == "auto"
    by = {c.precision: c for c in pc.candidates}
    assert set(by) == {"int8", "bf16", "fp32"}, pc
    bf = by["bf16"]
    assert bf.passed is True and bf.top1 is not None and bf.metric == "top1" and bf.drop is not None
    assert [p.batch_size for p in bf.speedup] == [1, 16] and all(p.speedup > 0 for p in bf.speedup)
    assert "bf16 is " in pc.reason and "of fp32 on this model" in pc.reason  # weighed like int8
    # whichever won, the shipped engine is labelled as what it is
    assert m.manifest_version >= (5 if m.precision == "bf16" else 2)
    assert m.accuracy.candidate_precision == m.precision


def test_auto_picks_bf16_where_it_passes_and_is_fastest():
    def pts(*s: float) -> tuple[BenchmarkPoint, ...]:
        return tuple(BenchmarkPoint(batch_size=b, reference_ms_p50=1.0, candidate_ms_p50=1 / x, speedup=x)
                     for b, x in zip((1, 16), s, strict=True))

    measured = [Measured("int8", True, "int8 ok", pts(1.2, 1.3)), Measured("bf16", True, "bf16 ok", pts(1.9, 2.1)),
                Measured("fp32", True, "fp32")]
    chosen, reason = choose_precision(measured, benchmarked=True)
    assert chosen == "bf16" and "passes the gate (bf16 ok)" in reason and "int8 is 1.20x" in reason
    failed = [measured[0], Measured("bf16", False, "bf16 top-1 0.90", pts(1.9, 2.1)), measured[2]]
    chosen, reason = choose_precision(failed, benchmarked=True)
    assert chosen == "int8" and "bf16 failed the accuracy gate (bf16 top-1 0.90)" in reason


# -- a bf16 engine that fails the gate is not shipped ---------------------------------------------------------
@pytest.fixture(scope="module")
def near_tied(tmp_path_factory) -> tuple[Path, Path]:
    """A classifier whose 256 logits differ by ~1e-3 of their size: bf16's 8-bit mantissa reorders them (f32 does
    not), so its top-1 agreement with fp32 falls far below the gate's 0.99."""
    d = tmp_path_factory.mktemp("tied")
    rng = np.random.default_rng(7)
    w = (rng.normal(size=(64, 1)) + 1e-3 * rng.normal(size=(64, 256))).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["input", "w"], ["logits"])], "tied",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 256])],
                              initializer=[numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), d / "model.onnx")
    np.savez(d / "data.npz", input=rng.normal(size=(256, 64)).astype(np.float32))
    return d / "model.onnx", d / "data.npz"


@needs_bf16
def test_a_bf16_engine_that_fails_the_gate_is_not_shipped(near_tied, tmp_path):
    model, data = near_tied
    kw = {"model": model, "eval_": data, "calibration": data, "name": "tied", "task": "classification",
          "benchmark": False}
    m = extract_bundle(_compile(tmp_path / "auto", "auto", **kw), tmp_path / "x")
    by = {c.precision: c for c in m.precision_choice.candidates}
    assert by["bf16"].passed is False and by["bf16"].top1 is not None and by["bf16"].top1 < 0.99, by["bf16"]
    assert "bf16" not in m.precisions and m.precision != "bf16"
    assert not any("bf16" in name for name in m.files), m.files
    with pytest.raises(AccuracyGateFailed, match="bf16 judged as classification"):
        _compile(tmp_path / "fixed", "bf16", **kw)
    assert not list((tmp_path / "fixed").glob("*.tar"))


def test_a_guessed_task_never_gates_bf16(near_tied, tmp_path):
    """Unnormalised [N, 256] logits: the task is not known for sure, so no bf16 engine is gated by a guess."""
    model, data = near_tied
    if _bf16_here() is not None:
        pytest.skip(f"this build host cannot run bf16: {_bf16_here()}")
    with pytest.raises(AccuracyGateFailed, match="no bf16 engine was gated: the task is not known for sure"):
        _compile(tmp_path / "o", "bf16", model=model, eval_=data, calibration=None, name="tied")


# -- a build host that cannot run bf16 --------------------------------------------------------------------------
@needs_qemu
def test_on_a_cpu_without_bf16_bf16_is_refused_and_auto_leaves_it_out(tmp_path):
    args = ("-m", "edgefleet.cli", "compile", str(DIGITS / "model.onnx"), "--profile", "x86-cpu-bf16",
            "--calibration", str(DIGITS / "calibration.npz"), "--eval", str(DIGITS / "test.npz"))
    r = run_as_cpu("Haswell", *args, "--precision", "bf16", "--out", str(tmp_path / "a"))
    assert r.returncode == EXIT_TOOLCHAIN, r.stderr[-2000:]
    assert ("cannot build bf16: the build host's CPU has neither amx_bf16 nor avx512_bf16" in r.stderr
            and "build bf16 on a CPU with avx512_bf16" in r.stderr), r.stderr[-2000:]
    assert not list((tmp_path / "a").glob("*.tar"))
    r = run_as_cpu("Haswell", *args, "--out", str(tmp_path / "b"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout)["manifest"]
    assert m["precision"] == "fp32"
    notes = {c["precision"]: c["note"] for c in m["precision_choice"]["candidates"]}
    assert notes["bf16"].startswith("not built: the build host's CPU has neither amx_bf16 nor avx512_bf16"), notes
    assert "bf16 not built" in m["precision_choice"]["reason"]


# -- no bf16 bundle without the gate's figures: refused at upload, at verify, by the agent -------------------------
def _spoil_relabelled(m: dict) -> None:  # an fp32 gate report under a bf16 label: no gate judged bf16
    m["accuracy"]["candidate_precision"] = "fp32"


def _spoil_no_choice(m: dict) -> None:  # the gate's figures dropped
    m["precision_choice"] = None


def _spoil_choice_unjudged(m: dict) -> None:
    for c in m["precision_choice"]["candidates"]:
        if c["precision"] == "bf16":
            c.update(top1=None, passed=None, metric=None, drop=None)


def _spoil_failed(m: dict) -> None:  # the gate said no
    acc = m["accuracy"]
    acc.update(candidate=round(acc["reference"] - 0.2, 6), drop=0.2, passed=False)


def _spoil_cpu(m: dict) -> None:  # would reach CPUs without bf16, where OpenVINO runs f32
    m["cpu_features"] = [f for f in m["cpu_features"] if f not in ("avx512_bf16", "amx_bf16")]


def _spoil_old_version(m: dict) -> None:  # an older agent must say 'upgrade', not serve bf16 as it understands
    m["manifest_version"] = 4
    m.pop("drift", None)  # version 6's, which needs 6 itself


SPOILS = [("relabelled", _spoil_relabelled, "not bf16 against fp32: no gate judged bf16"),
          ("no-figures", _spoil_no_choice, "no passing bf16 candidate with its gate figures"),
          ("unjudged", _spoil_choice_unjudged, "no passing bf16 candidate with its gate figures"),
          ("failed", _spoil_failed, "did not pass the accuracy gate"),
          ("cpu", _spoil_cpu, "promise neither"),
          ("version-4", _spoil_old_version, "needs manifest_version 5")]


def _crafted(bf16_bundle: Path, version: str, spoil) -> Crafted:
    with tarfile.open(bf16_bundle) as tar:
        files = {ti.name: tar.extractfile(ti).read() for ti in tar.getmembers()}  # type: ignore[union-attr]
    m = json.loads(files.pop("manifest.json"))
    m["version"] = version
    if spoil is not None:
        spoil(m)
    return Crafted(m, [Member(n, d) for n, d in sorted(files.items())])


@needs_bf16
@pytest.mark.parametrize(("case", "spoil", "words"), SPOILS, ids=[s[0] for s in SPOILS])
def test_a_bf16_bundle_without_a_gate_that_judged_it_is_refused_everywhere(bf16_bundle, tmp_path, case, spoil,
                                                                          words):
    from edgefleet.agent.install.verify import verify_bundle

    bad = _crafted(bf16_bundle, "1.0.0", spoil).write(tmp_path / f"{case}.tar")
    with pytest.raises(EdgefleetError, match=words):  # the reader both the fleet and the agent use
        check_bundle(bad)
    with pytest.raises(EdgefleetError, match=words):  # edgefleet verify: one line, exit 4
        verify_bundle(bad, threads=1)
    good = _crafted(bf16_bundle, "1.0.0", None)
    assert parse_manifest(good.manifest).precision == "bf16"  # the control: unspoilt, the same manifest parses


@needs_bf16
@pytest.mark.parametrize(("case", "spoil", "words"), SPOILS[:2], ids=[s[0] for s in SPOILS[:2]])
def test_the_fleet_refuses_to_sign_a_bf16_bundle_without_gate_figures(fleet, bf16_bundle, tmp_path,  # noqa: F811
                                                                      case, spoil, words):
    fs, url, root = fleet
    bad = _crafted(bf16_bundle, f"35.{SPOILS.index((case, spoil, words))}.0", spoil).write(tmp_path / "bad.tar")
    before = _published(fs, url)
    r = api.post(f"{url}/api/v1/bundles", content=bad.read_bytes(), headers={"Content-Type": "application/x-tar"})
    _assert_refused(r, (words,), root)
    assert _published(fs, url) == before
    ok = _crafted(bf16_bundle, f"35.{SPOILS.index((case, spoil, words)) + 10}.0", None).write(tmp_path / "ok.tar")
    r = api.post(f"{url}/api/v1/bundles", content=ok.read_bytes(), headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 201, r.text  # the control: the compiler's own bf16 bundle is accepted


# -- the agent: a bf16 variant only where the CPU runs it -------------------------------------------------------
@pytest.fixture(scope="module")
def fp32_with_bf16_variant(bf16_bundle, tmp_path_factory) -> Path:
    """digits for x86-cpu-bf16 with fp32 as its own engine and bf16 as a variant (the layout the compiler writes
    for devices it cannot time), assembled from two real builds."""
    out = tmp_path_factory.mktemp("variant")
    own = extract_bundle(_compile(out / "fp32", "fp32", benchmark=False), out / "x-fp32")
    other = extract_bundle(bf16_bundle, out / "x-bf16")
    work = out / "work"
    work.mkdir()
    for src, name in ((out / "x-fp32" / own.engine, own.engine), (out / "x-fp32" / own.selftest, own.selftest),
                      (out / "x-bf16" / other.engine, "model-bf16.onnx"),
                      (out / "x-bf16" / other.selftest, "selftest-bf16.npz")):
        (work / name).write_bytes(src.read_bytes())
    data = own.model_dump(mode="json")
    data["manifest_version"] = max(own.manifest_version, 5)
    data["variants"] = [{"precision": "bf16", "engine": "model-bf16.onnx", "selftest": "selftest-bf16.npz",
                         "accuracy": other.accuracy.model_dump(mode="json")}]
    data["files"] = {f.name: {"sha256": sha256_file(f), "size_bytes": f.stat().st_size} for f in work.iterdir()}
    data["precision_choice"] = {"mode": "device", "chosen": "fp32", "reason": "device (assembled for the tests)",
                                "candidates": [copy.deepcopy(c.model_dump(mode="json"))
                                               for c in other.precision_choice.candidates]}
    return write_bundle(parse_manifest(data), work, out / "digits-1.0.0-x86-cpu-bf16.tar")


@needs_bf16
def test_the_agent_times_a_bf16_variant_only_where_the_cpu_runs_it(fp32_with_bf16_variant, tmp_path):
    from edgefleet.agent.install.precision import pick_precision
    from edgefleet.agent.install.store import StagedModel

    m = extract_bundle(fp32_with_bf16_variant, tmp_path)
    staged = StagedModel(m, tmp_path, sha256_file(fp32_with_bf16_variant))
    loaded: list[str] = []

    def load(manifest):
        loaded.append(manifest.precision)
        return engines.load_bundle_engine(manifest, tmp_path / manifest.engine, threads=1)

    here = pick_precision(staged, "auto", load, max_batch_size=8)  # this CPU runs bf16: both are timed
    assert {t.precision for t in here.timings} == {"fp32", "bf16"} and here.source == "device", here
    haswell = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})
    loaded.clear()
    there = pick_precision(staged, "auto", load, max_batch_size=8, have=haswell)
    assert loaded == ["fp32"] and {t.precision for t in there.timings} == {"fp32"}, (loaded, there)
    assert there.staged.manifest.precision == "fp32"
    loaded.clear()
    pinned = pick_precision(staged, "bf16", load, max_batch_size=8, have=haswell)  # an operator's pin cannot force it
    assert pinned.staged.manifest.precision == "fp32" and pinned.source == "device", pinned
    assert "precision bf16: this CPU has neither amx_bf16 nor avx512_bf16" in pinned.note
    assert pick_precision(staged, "bf16", load, max_batch_size=8).source == "operator"  # where it runs, it is served

