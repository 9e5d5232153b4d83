"""Shared fixtures: a real Mosquitto on a free port, keys, and the compiled digits bundle."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "models" / "digits"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float = 10.0) -> None:
    """Until something listens on 127.0.0.1:``port`` (bounded)."""
    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, timeout_s, f"something listening on 127.0.0.1:{port}")


@dataclass
class Mosquitto:
    port: int
    conf: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(binary).exists():
            pytest.fail("mosquitto is not installed: run 'bash .ci/run' or 'apt-get install mosquitto'")
        self.proc = subprocess.Popen([binary, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@contextmanager
def running_mosquitto(folder: Path, extra_conf: str = "") -> Iterator[Mosquitto]:
    """A stock Mosquitto on a free loopback port (anonymous, no persistence), its config in ``folder``;
    ``extra_conf``: more config lines (e.g. queue limits). Stopped on the way out."""
    port = free_port()
    conf = folder / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n{extra_conf}")
    m = Mosquitto(port, conf)
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A Mosquitto broker of the test's own, on a free loopback port."""
    with running_mosquitto(tmp_path) as m:
        yield m


@pytest.fixture(scope="session", autouse=True)
def _build_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The compiler's build cache of this test session (never the user's ~/.cache)."""
    import os

    old = os.environ.get("EDGEFLEET_CACHE_DIR")
    os.environ["EDGEFLEET_CACHE_DIR"] = str(tmp_path_factory.mktemp("edgefleet-cache"))
    yield
    if old is None:
        os.environ.pop("EDGEFLEET_CACHE_DIR", None)
    else:
        os.environ["EDGEFLEET_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def digits_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits model compiled for x86-cpu (static INT8), once per test session."""
    from edgefleet.compiler.compile import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("dist")
    result = compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="x86-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=out, name="digits", version="1.0.0", benchmark=False, precision="int8"))
    return result.bundle


@pytest.fixture(scope="session")
def digits_bundle_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edgefleet.compiler.compile import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("dist2")
    return compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="x86-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=out, name="digits", version="1.1.0", benchmark=False,
        precision="fp32")).bundle


@pytest.fixture(scope="session")
def two_precision_bundle(tmp_path_factory: pytest.TempPathFactory, digits_bundle: Path) -> Path:
    """digits 1.0.0 for x86-cpu carrying int8 (its own engine) and fp32 (a variant), laid out as the compiler writes
    a bundle for devices whose CPU it cannot time (test_litert checks the compiler does so for arm64-cpu on this
    host); assembled from two real x86-cpu builds so that an agent on this machine can run it."""
    import shutil

    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.protocol.bundle import extract_bundle, sha256_file, write_bundle
    from edgefleet.protocol.manifest import MANIFEST_VERSION, parse_manifest

    out = tmp_path_factory.mktemp("two-precisions")
    fp32 = compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="x86-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=out / "fp32", name="digits", version="1.0.0", benchmark=False,
        precision="fp32")).bundle
    own = extract_bundle(digits_bundle, out / "x-int8")
    other = extract_bundle(fp32, out / "x-fp32")
    work = out / "work"
    work.mkdir()
    shutil.copy(out / "x-int8" / own.engine, work / own.engine)
    shutil.copy(out / "x-int8" / own.selftest, work / own.selftest)
    shutil.copy(out / "x-fp32" / other.engine, work / "model-fp32.onnx")
    shutil.copy(out / "x-fp32" / other.selftest, work / "selftest-fp32.npz")
    data = own.model_dump(mode="json")
    data["manifest_version"] = MANIFEST_VERSION
    data["variants"] = [{"precision": "fp32", "engine": "model-fp32.onnx", "selftest": "selftest-fp32.npz",
                         "accuracy": other.accuracy.model_dump(mode="json"),
                         "selftest_summary": other.selftest_summary.model_dump(mode="json")
                         if other.selftest_summary else None}]
    data["files"] = {f.name: {"sha256": sha256_file(f), "size_bytes": f.stat().st_size} for f in work.iterdir()}
    data["precision_choice"] = {"mode": "device", "chosen": "int8", "candidates": [],
                                "reason": "device: int8 and fp32 pass the gate (assembled for the tests)"}
    return write_bundle(parse_manifest(data), work, out / "digits-1.0.0-x86-cpu.tar")


@pytest.fixture(scope="session")
def image_bundle(tmp_path_factory):
    """Digits compiled with recorded image preprocessing: 8x8 gray, pixels / 255 (the test set's pixels / 16,
    stored as 8-bit PNG values pixel * 255 / 16)."""
    from edgefleet.compiler.compile import CompileOptions, compile_model

    d = tmp_path_factory.mktemp("imgbundle")
    (d / "preprocess.yaml").write_text("input: input\nheight: 8\nwidth: 8\ncolor: gray\nlayout: nchw\n"
                                       "scale: 0.00392156862745098\n")
    return compile_model(CompileOptions(
        model=DIGITS / "model.onnx", profile="x86-cpu", calibration=DIGITS / "calibration.npz",
        eval=DIGITS / "test.npz", out_dir=d / "dist", name="digits", version="1.0.0", benchmark=False,
        precision="int8", preprocess=d / "preprocess.yaml")).bundle


@pytest.fixture(scope="session")
def test_images():
    import numpy as np

    with np.load(DIGITS / "test.npz") as npz:
        return npz["input"], npz["labels"]


@pytest.fixture
def sims():
    """Start simulated fleets (fleet.simulator) for the test; all are stopped after it."""
    from edgefleet.fleet.simulator import SimConfig, Simulator

    started: list[Simulator] = []

    def make(**kw) -> Simulator:
        s = Simulator(SimConfig(**kw))
        s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def postgres_db(name: str) -> str | None:
    """A fresh PostgreSQL database on 127.0.0.1:5432 (user postgres, trust auth), or None if unreachable. Under
    pytest-xdist each worker gets its own (``name`` + ``_gw0`` ...): two test files on two workers may ask for the
    same name, and each drops and recreates it. The name also carries a short hash of this checkout's path: two
    checkouts testing on one box at once (a clean clone's CI run beside a working tree's) would otherwise drop each
    other's database WITH (FORCE) mid-test."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        name = f"{name}_{worker}"
    name = f"{name}_{hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]}"
    try:
        import psycopg

        with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", connect_timeout=2) as conn:
            conn.autocommit = True
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    except Exception:
        return None


@pytest.fixture(params=["sqlite", "postgresql"])
def fleet_db(request) -> str | None:
    """The fleet's database for tests that must pass on both: None (SQLite in the data dir) or PostgreSQL."""
    if request.param == "sqlite":
        return None
    url = postgres_db("edgefleet_fleet_test")
    if url is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (user postgres, trust auth): the SQLite run "
                    "covers the same code")
    return url


# -- trust-boundary probes, counted by bench/reliability.py ------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "trust(what): an attack across a trust boundary; the test passing means it "
                                       "was refused (counted by bench/reliability.py)")
    config.addinivalue_line("markers", "serial: judges timings or the spread of events on this box; `make test` runs "
                                       "these after the parallel pass, alone (pytest -m serial)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("trust")
    if marker is None or report.when != "call" or not os.environ.get("EDGEFLEET_RELIABILITY_OUT"):
        return
    from tests.test_crash_random import record_figures

    what = marker.args[0] if marker.args else item.name
    params = getattr(item, "callspec", None)
    record_figures("trust", {"probe": f"{what} [{params.id}]" if params else what, "refused": report.passed})
