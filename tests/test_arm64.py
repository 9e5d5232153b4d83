"""The agent on 64-bit ARM, emulated: what `make test-arm64` runs (a Raspberry Pi's, a Graviton's CPU).

``../shared/tools/as-arm64`` runs Debian 12's own aarch64 Python 3.11.2 (Raspberry Pi OS Bookworm's) under
qemu user mode, in a venv holding this checkout's ``[agent]`` extra from aarch64 wheels (``as-arm64 init``,
which ``make test-arm64`` runs first). Here: an ``arm64-cpu`` bundle (LiteRT, INT8 with an FP32 variant: this
host cannot time an ARM core, so the device chooses) is built on this host natively, each precision verified by
the emulated agent on each ARM CPU model of ``EDGEFLEET_ARM64_CPUS``, and an emulated agent with the bundle
installed times both, serves one and answers OIP requests sent from this host over loopback.

Skipped unless ``EDGEFLEET_AS_ARM64`` names the tool (``make test-arm64`` sets it). Emulation is 10-50x
slower than native: nothing here is timed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import DIGITS, free_port

AS_ARM64 = os.environ.get("EDGEFLEET_AS_ARM64") or None
CPUS = [c.strip() for c in os.environ.get("EDGEFLEET_ARM64_CPUS", "cortex-a72,neoverse-n1").split(",") if c.strip()]
# what the emulated /proc/cpuinfo of each model says beyond the Cortex-A72's baseline (fp asimd crc32)
DOTPROD = {"cortex-a72": False, "cortex-a76": True, "neoverse-n1": True, "max": True}

pytestmark = [
    pytest.mark.skipif(AS_ARM64 is None, reason="the emulated aarch64 pass: `make test-arm64` runs it "
                                                "(as-arm64 init, then this file with EDGEFLEET_AS_ARM64 set)"),
    pytest.mark.timeout(1800),  # emulated, and the first build may install the tflite toolchain
]


# the emulated processes start outside the checkout: `python -c` from its root would import the checkout's edgefleet/
# (which holds the CLI only: the parts are mapped from their own folders by an install) instead of the emulated
# venv's wheel
OUTSIDE = Path(tempfile.gettempdir())


def arm(cpu: str, *argv: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    """Run ``argv`` (python or a console script of the emulated venv) on the emulated ARM ``cpu``."""
    assert AS_ARM64 is not None
    return subprocess.run(["bash", AS_ARM64, "run", *argv], env={**os.environ, "AS_ARM64_CPU": cpu}, cwd=OUTSIDE,
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def say(line: str) -> None:
    print(f"[arm64] {line}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def arm_bundle(tmp_path_factory) -> tuple[Path, dict]:
    """(bundle, manifest): digits for arm64-cpu, built here (x86) with the LiteRT toolchain, --precision auto. This
    host cannot time an ARM core, so the bundle carries int8 (its own engine) and fp32 (a variant) for the device
    to time."""
    from edgefleet.compiler import toolchain

    toolchain.ensure("tflite", say)
    out = tmp_path_factory.mktemp("arm64-bundles")
    # image preprocessing recorded, for the image endpoint: 8x8 gray, pixels / 255 (as in test_agent_oip)
    prep = out / "preprocess.yaml"
    prep.write_text("input: input\nheight: 8\nwidth: 8\ncolor: gray\nlayout: nchw\nscale: 0.00392156862745098\n")
    r = subprocess.run([sys.executable, "-m", "edgefleet.cli", "compile", str(DIGITS / "model.onnx"),
                        "--profile", "arm64-cpu", "--calibration", str(DIGITS / "calibration.npz"),
                        "--eval", str(DIGITS / "test.npz"), "--preprocess", str(prep), "--name", "digits",
                        "--version", "1.0.0", "--out", str(out), "--json"],
                       capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["manifest"]
    assert (m["profile"], m["backend"], m["precision"]) == ("arm64-cpu", "litert", "int8")
    assert m["precision_choice"]["mode"] == "device" and [v["precision"] for v in m["variants"]] == ["fp32"], m
    return out / "digits-1.0.0-arm64-cpu.tar", m


def test_the_emulated_python_is_debian_s_3_11_2_on_aarch64():
    r = arm(CPUS[0], "python", "-c", "import platform, sys; print(platform.machine(), sys.version.split()[0])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["aarch64", "3.11.2"]


# what headless Pi and Jetson images lack: X11, xcb, GL and glib (the sysroot has them for opencv-python)
NOT_ON_A_HEADLESS_BOX = ("libX", "libxcb", "libICE", "libSM", "libGL", "libEGL", "libOpenGL", "libglib-2.0",
                         "libgthread-2.0", "libgobject-2.0", "libgio-2.0", "libgmodule-2.0")


def test_the_agent_extra_imports_and_decodes_images_on_a_box_without_x11_or_gl(tmp_path):
    """The emulated venv (a fresh ``pip install .[agent]``) run on a copy of the sysroot without X11, GL and
    glib: one cv2, the headless one, imports, and the image endpoint's decoder reads a PNG."""
    assert AS_ARM64 is not None
    paths = dict(line.split(None, 1) for line in subprocess.run(
        ["bash", AS_ARM64, "path"], capture_output=True, text=True, check=True).stdout.splitlines())
    root, venv = Path(paths["sysroot"]), Path(paths["venv"])
    bare = tmp_path / "headless-root"
    r = subprocess.run(["cp", "-al", str(root), str(bare)], capture_output=True, text=True)
    if r.returncode != 0:  # another filesystem: a copy (about 90 MB)
        subprocess.run(["cp", "-a", str(root), str(bare)], check=True)
    removed = [p for p in bare.rglob("*.so*") if p.name.startswith(NOT_ON_A_HEADLESS_BOX) and not p.is_dir()]
    assert any(p.name.startswith("libX11") for p in removed) and any(p.name.startswith("libGL") for p in removed)
    for p in removed:
        p.unlink()
    probe = ("import ctypes, importlib.metadata as md, json, numpy as np\n"
             "gone = []\n"
             "for lib in ('libX11.so.6', 'libxcb.so.1', 'libGL.so.1', 'libgthread-2.0.so.0'):\n"
             "    try:\n"
             "        ctypes.CDLL(lib)\n"
             "    except OSError:\n"
             "        gone.append(lib)\n"
             "import cv2, edgefleet.agent.transports.image, edgefleet.agent.transports.http\n"
             "from edgefleet.protocol.preprocess import decode_image\n"
             "ok, png = cv2.imencode('.png', np.arange(64, dtype=np.uint8).reshape(8, 8) * 4)\n"
             "img = decode_image(png.tobytes(), 'probe')\n"
             "names = sorted(n for n in (d.metadata['Name'].lower() for d in md.distributions()) if 'opencv' in n)\n"
             "print(json.dumps({'gone': gone, 'cv2': names, 'shape': list(img.shape)}))\n")
    r = subprocess.run(["qemu-aarch64", "-L", str(bare), str(venv / "bin" / "python"), "-c", probe],
                       env={**os.environ, "QEMU_CPU": CPUS[0]}, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)  # not the checkout's root: its edgefleet/ would shadow the wheel's
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["gone"] == ["libX11.so.6", "libxcb.so.1", "libGL.so.1", "libgthread-2.0.so.0"], doc
    assert doc["cv2"] == ["opencv-python-headless"], doc
    assert doc["shape"][:2] == [8, 8], doc


def test_the_agent_verifies_tuf_signatures_with_cryptography_on_arm(tmp_path):
    """The agent's TUF client in the emulated ``pip install .[agent]`` venv refreshes and downloads from the fleet's
    repository served by this host over loopback, every Ed25519 check on cryptography's path, none on
    securesystemslib's pure-Python fallback (the probe of tests/test_signature_backend.py: which path ran, not how
    fast)."""
    from edgefleet.fleet.keys import KeyStore, init_keys
    from edgefleet.fleet.tuf_repo import Repository
    from tests.test_signature_backend import PROBE, TARGET, probe_argv
    from tests.test_tuf import Server

    init_keys(tmp_path / "keys")
    repo = Repository(tmp_path / "repo", KeyStore(tmp_path / "keys"))
    repo.init()
    blob = tmp_path / "probe.tar"
    blob.write_bytes(b"probe" * 1000)
    sha = repo.add_target(TARGET, blob, {"name": "probe", "version": "1.0.0", "profile": "arm64-cpu"})["sha256"]
    srv = Server(tmp_path / "repo")
    try:
        r = arm(CPUS[0], "python", "-c", PROBE, *probe_argv(tmp_path, srv, sha, "arm-client"), timeout_s=600)
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["sha256"] == sha
    assert doc["calls"]["cryptography"] >= 4 and doc["calls"]["pure_python"] == 0, doc
    say(f"{CPUS[0]:<12} TUF refresh + download: {doc['calls']['cryptography']} Ed25519 checks, all on cryptography")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("cpu", CPUS)
def test_an_arm64_cpu_bundle_computes_as_gated_on(cpu, precision, arm_bundle):
    bundle, manifest = arm_bundle
    m = manifest if precision == manifest["precision"] else next(
        v for v in manifest["variants"] if v["precision"] == precision)
    r = arm(cpu, "edgefleet", "verify", str(bundle), "--precision", precision, "--eval", str(DIGITS / "test.npz"),
            "--json")
    assert r.stdout, r.stderr
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["computes_as_gated"], doc
    assert doc["arch"] == "aarch64" and doc["cpu_ok"], doc
    assert ("asimddp" in doc["cpu_features"]) == DOTPROD.get(cpu, "asimddp" in doc["cpu_features"]), doc
    st = doc["selftest"]
    assert st["drift"] <= 1.0
    # the same top-1 as the compiler recorded (one image of slack for float summation order)
    assert abs(doc["top1"] - m["accuracy"]["candidate"]) <= 1 / doc["eval_samples"] + 1e-9, doc
    assert doc["drop_vs_fp32"] <= m["accuracy"]["max_drop"]
    say(f"{cpu:<12} {precision}: top-1 {doc['top1']:.4f} on {doc['eval_samples']} (compile-time "
        f"{m['accuracy']['candidate']:.4f}); self-test {st['samples']} samples, top-1 {st['top1']:.4f}, "
        f"drift {st['drift']:.2f}x tolerance")


# run on the emulated box: each extracted onnxruntime bundle on the OpenVINO engine, its own self-test, and its
# answers on the host's inputs (x86.npz, beside it) against the host's onnxruntime answers
OPENVINO_PROBE = """
import json, sys
sys.modules["onnxruntime"] = None  # hidden: the emulated venv is cached and may hold it; OpenVINO alone serves here
from pathlib import Path
import numpy as np
from edgefleet import engines
from edgefleet.agent.install.selftest import self_test
from edgefleet.agent.install.store import StagedModel
from edgefleet.protocol.manifest import parse_manifest
out = {"onnxruntime": engines.runtime_installed("onnxruntime")}
for d in map(Path, sys.argv[1:]):
    m = parse_manifest(json.loads((d / "manifest.json").read_text()))
    ref = np.load(d / "x86.npz")
    e = engines.load_bundle_engine(m, d / m.engine, 1, runtime="openvino")
    got = e.infer({"input": ref["input"]})[0]
    st = self_test(e, StagedModel(m, d, ""))
    e.close()
    out[m.precision] = {"device": e.device, "max_abs_diff": float(np.abs(got - ref["output"]).max()),
                        "top1_agreement": float((got.argmax(1) == ref["output"].argmax(1)).mean()),
                        "selftest": st.model_dump(mode="json")}
print(json.dumps(out))
"""


def test_openvino_runs_onnxruntime_bundles_on_arm_as_onnxruntime_does_here(tmp_path):
    """OpenVINO ships aarch64 wheels (issue 35): on the emulated ARM box with edgefleet[openvino] (onnxruntime,
    which aarch64's [agent] leaves out, hidden from the probe: ~/.cache/as-arm64's venv outlives a clone and an
    earlier pass may have installed it), the OpenVINO engine loads the compiler's digits FP32 and QDQ INT8
    files (x86-cpu bundles, built here), each passes its bundle's own self-test, and answers this host's onnxruntime
    gives on the same 64 images: FP32 within 1e-4, the same top-1. About 70 s on one CPU model (emulated)."""
    from edgefleet import engines
    from edgefleet.protocol.bundle import extract_bundle

    paths = subprocess.run(["bash", AS_ARM64 or "", "path"], capture_output=True, text=True, timeout=60).stdout
    venv = Path(next(line.split(None, 1)[1] for line in paths.splitlines() if line.startswith("venv")))
    if not list(venv.glob("lib/python3*/site-packages/openvino/__init__.py")):
        pytest.skip("openvino is not in the emulated venv (as-arm64 init with AS_ARM64_EXTRA including openvino)")
    with np.load(DIGITS / "test.npz") as npz:
        x = np.ascontiguousarray(npz["input"][:64], dtype=np.float32)
    dirs = []
    for precision in ("fp32", "int8"):
        r = subprocess.run([sys.executable, "-m", "edgefleet.cli", "compile", str(DIGITS / "model.onnx"),
                            "--profile", "x86-cpu", "--calibration", str(DIGITS / "calibration.npz"),
                            "--eval", str(DIGITS / "test.npz"), "--name", "digits", "--version", "1.0.0",
                            "--precision", precision, "--out", str(tmp_path / precision), "--json"],
                           capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr
        d = tmp_path / f"{precision}-bundle"
        m = extract_bundle(Path(json.loads(r.stdout)["bundle"]), d)
        e = engines.load_bundle_engine(m, d / m.engine, 1, runtime="onnxruntime")
        try:
            np.savez(d / "x86.npz", input=x, output=e.infer({"input": x})[0])
        finally:
            e.close()
        dirs.append(str(d))
    (tmp_path / "probe.py").write_text(OPENVINO_PROBE)
    r = arm(CPUS[0], "python", str(tmp_path / "probe.py"), *dirs)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["onnxruntime"] is False, doc  # hidden: OpenVINO alone serves these files in the probe
    for precision in ("fp32", "int8"):
        got = doc[precision]
        assert got["device"].startswith("OpenVINO") and got["selftest"]["drift"] <= 1.0, got
        assert got["top1_agreement"] >= (1.0 if precision == "fp32" else 0.95), got
        say(f"{CPUS[0]:<12} OpenVINO {precision}: self-test drift {got['selftest']['drift']:.2f}x, top-1 "
            f"{got['selftest']['top1']}; vs this host's onnxruntime: max abs {got['max_abs_diff']:.2g}, top-1 "
            f"agreement {got['top1_agreement']:.3f}")
    assert doc["fp32"]["max_abs_diff"] < 1e-4, doc


def test_an_emulated_arm_agent_answers_oip_requests_from_this_host(arm_bundle, tmp_path):
    """The agent runs as a device would (`edgefleet agent`, its store holding the bundle), on the first CPU model:
    it times the bundle's int8 and fp32 engines on its (emulated) cores and serves one; this host sends it tensors
    and PNGs over loopback. (Emulated timings say nothing about a real ARM core: only that the choice is made.)"""
    from tests.agent_harness import preinstall

    bundle, _ = arm_bundle
    data = tmp_path / "device"
    preinstall(data, bundle)
    port = free_port()
    log = tmp_path / "agent.log"
    with log.open("w") as err:
        proc = subprocess.Popen(["bash", AS_ARM64 or "", "run", "edgefleet", "agent", "--device-id", "arm-1",
                                 "--fleet", "http://127.0.0.1:9", "--data-dir", str(data), "--trust-on-first-use",
                                 "--http-host", "127.0.0.1", "--http-port", str(port)],
                                env={**os.environ, "AS_ARM64_CPU": CPUS[0]}, stdout=err, stderr=err,
                                stdin=subprocess.DEVNULL, cwd=OUTSIDE)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = _wait_ready(proc, url, log)
        assert ready, f"the emulated agent never became ready:\n{log.read_text()[-3000:]}"
        assert Path(os.readlink(f"/proc/{proc.pid}/exe")).name.startswith("qemu-aarch64")
        choice = httpx.get(f"{url}/v2/models/digits/config", timeout=60).json()["precision_choice"]
        assert choice["source"] == "device" and set(choice["items_per_second"]) == {"int8", "fp32"}, choice
        say(f"{CPUS[0]:<12} agent: timed {choice['items_per_second']} (emulated), serves {choice['precision']}")
        with np.load(DIGITS / "test.npz") as npz:
            x, labels = npz["input"][:16].astype(np.float32), npz["labels"][:16]
        r = httpx.post(f"{url}/v2/models/digits/infer", timeout=300, json={"inputs": [{
            "name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        assert out["shape"] == [16, 10]
        preds = np.asarray(out["data"]).reshape(16, 10).argmax(1)
        assert (preds == labels).mean() >= 0.9, (preds, labels)
        # the image endpoint: the headless cv2 decodes a PNG on ARM
        import cv2

        ok, png = cv2.imencode(".png", np.round(x[0, 0] * 255).astype(np.uint8))
        assert ok
        r = httpx.post(f"{url}/v2/models/digits/infer/image", content=png.tobytes(),
                       headers={"Content-Type": "image/png"}, timeout=300)
        assert r.status_code == 200, r.text
        assert int(np.argmax(r.json()["outputs"][0]["data"])) == int(preds[0])
        say(f"{CPUS[0]:<12} agent: answered /infer (16 images, top-1 {(preds == labels).mean():.4f}) and "
            f"/infer/image over loopback")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
    assert rc == 0, log.read_text()[-3000:]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, wait_s: float = 600) -> bool:
    """Poll /v2/health/ready until 200 (bounded: emulated start-up imports take a while); False if it exits."""
    import time

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return False
