"""``edgefleet demo``: a fleet, agents as separate processes, a compile and a rollout, on this machine.

:class:`LocalFleet` is also the harness of the end-to-end tests: real processes, a real broker,
HTTP on loopback only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgefleet.fleet.client import FleetClient, FleetClientError, FleetUnreachable
from edgefleet.fleet.schemas import Rollout
from edgefleet.progress import progress_bar
from edgefleet.protocol.exits import ExitCode, exit_for
from edgefleet.protocol.processes import stop_processes

__all__ = ["DemoOptions", "LocalFleet", "free_port", "infer_images", "run_demo"]

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "models" / "digits"
MARKER = ".edgefleet-demo-dir"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child: SIGTERM it if the demo process dies
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(args: list[str], log_path: Path, env_extra: dict[str, str] | None = None,
          launcher: list[str] | None = None) -> subprocess.Popen:
    """Run ``edgefleet ARGS`` in a child process; ``launcher`` prefixes the command (e.g. an emulator:
    ``["qemu-x86_64", "-cpu", "Haswell"]`` runs the child on an emulated AVX2-only CPU)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen([*(launcher or []), sys.executable, "-m", "edgefleet.cli", *args], stdout=log,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)


@dataclass
class AgentProc:
    device_id: str
    url: str
    proc: subprocess.Popen
    log: Path


@dataclass
class LocalFleet:
    work_dir: Path
    mqtt_url: str | None = None  # None: the fleet's embedded broker
    port: int = 0
    embedded_mqtt_port: int = 0
    telemetry_interval_s: float = 2.0
    fleet_proc: subprocess.Popen | None = None
    agents: dict[str, AgentProc] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def keys(self) -> Path:
        return self.work_dir / "keys"

    @property
    def client(self) -> FleetClient:
        token_file = self.work_dir / "fleet" / "admin-token"  # written by the fleet on its first start
        return FleetClient(self.url, token=token_file.read_text().strip() if token_file.exists() else None)

    def start(self, timeout_s: float = 60.0) -> None:
        from edgefleet.fleet.keys import init_keys

        self.work_dir.mkdir(parents=True, exist_ok=True)
        if not (self.keys / "root.json").exists():
            init_keys(self.keys)
        self.port = self.port or free_port()
        args = ["fleet", "serve", "--data-dir", str(self.work_dir / "fleet"), "--keys", str(self.keys),
                "--port", str(self.port), "-v"]
        if self.mqtt_url:
            args += ["--mqtt-url", self.mqtt_url]
        else:
            self.embedded_mqtt_port = self.embedded_mqtt_port or free_port()
            args += ["--embedded-mqtt-port", str(self.embedded_mqtt_port)]
        self.fleet_proc = spawn(args, self.work_dir / "logs" / "fleet.log")
        deadline = time.monotonic() + timeout_s
        while True:
            if self.fleet_proc.poll() is not None:
                raise RuntimeError(f"the fleet server exited with {self.fleet_proc.returncode}; see "
                                   f"{self.work_dir / 'logs' / 'fleet.log'}")
            try:
                if self.client.health().mqtt_connected:
                    return
            except FleetClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not become healthy in {timeout_s}s")
            time.sleep(0.2)

    def _needs_accounts(self) -> bool:
        """Does the fleet's broker need device credentials? (False when the fleet is down: nothing to ask.)"""
        try:
            return self.client.bootstrap().mqtt_auth
        except FleetUnreachable:
            return False

    def start_agent(self, device_id: str, extra: list[str] | None = None,
                    env: dict[str, str] | None = None, launcher: list[str] | None = None) -> AgentProc:
        port = free_port()
        log = self.work_dir / "logs" / f"agent-{device_id}.log"
        data_dir = self.work_dir / "agents" / device_id
        if not (data_dir / "mqtt-credentials.json").exists() and self._needs_accounts():
            # a broker with device accounts: the agent enrolls with a one-time token (in its environment,
            # not on its command line)
            token = self.client.enrollment_token(device_id, ttl_s=600).token
            env = {**(env or {}), "EDGEFLEET_ENROLL_TOKEN": token}
        args = ["agent", "--device-id", device_id, "--fleet", self.url, "--data-dir",
                str(data_dir), "--trusted-root", str(self.keys / "root.json"),
                "--http-port", str(port), "--telemetry-interval-s", str(self.telemetry_interval_s), "-v",
                *(extra or [])]
        a = AgentProc(device_id, f"http://127.0.0.1:{port}", spawn(args, log, env, launcher), log)
        self.agents[device_id] = a
        return a

    def wait_online(self, device_ids: list[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            online = {d.device_id for d in self.client.devices() if d.online}
            if set(device_ids) <= online:
                return
            for d in device_ids:
                a = self.agents.get(d)
                if a is not None and a.proc.poll() is not None:
                    raise RuntimeError(f"agent {d} exited with {a.proc.returncode}; see {a.log}")
            time.sleep(0.2)
        raise RuntimeError(f"devices not online after {timeout_s}s: {device_ids}")

    def wait_rollout(self, rollout_id: int, timeout_s: float = 120.0) -> Rollout:
        return self.client.wait_rollout(rollout_id, timeout_s, interval_s=0.2)

    def stop_agent(self, device_id: str, sig: int = signal.SIGTERM) -> None:
        a = self.agents.pop(device_id)
        stop_processes([a.proc], sig=sig)

    def stop(self) -> None:
        for d in list(self.agents):
            self.stop_agent(d)
        if self.fleet_proc is not None:
            stop_processes([self.fleet_proc])
            self.fleet_proc = None


def infer_images(url: str, model: str, images: np.ndarray, concurrency: int = 8,
                 timeout_s: float = 30.0) -> tuple[np.ndarray, list[float]]:
    """Send each image as its own request (so the agent's batcher has work); -> (predicted classes, latencies s)."""
    import httpx

    def one(client: httpx.Client, img: np.ndarray) -> tuple[int, float]:
        body = {"inputs": [{"name": "input", "shape": [1, *img.shape], "datatype": "FP32",
                            "data": img.reshape(-1).tolist()}]}
        t0 = time.perf_counter()
        r = client.post(f"{url}/v2/models/{model}/infer", json=body)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        logits = r.json()["outputs"][0]["data"]
        return int(np.argmax(logits)), dt

    with httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=concurrency)) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda img: one(client, img), images))
    return np.array([r[0] for r in results]), [r[1] for r in results]


@dataclass(frozen=True)
class DemoOptions:
    work_dir: Path
    agents: int = 3
    mqtt_url: str | None = None
    port: int = 0
    embedded_mqtt_port: int = 0
    keep_running: bool = True
    as_json: bool = False
    pipeline: bool = True  # step 7: the OCR pipeline (edgefleet.demo_ocr), when rapidocr-onnxruntime is installed


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# The demo's agents share this one box: their install trials (runtime, layout, batch: agent/install/trials.py) would
# time each other, not a device (three agents timing at once on 2 cores chose different layouts and took 20 s,
# issue 41), so each serves on one thread of onnxruntime with the batch sizes set, as an operator of such a box would
# set them. A real device times its own CPU at install and keeps the results for its restarts.
SHARED_BOX_CONFIG = "runtime: onnxruntime\nintra_op_threads: 1\ninstances: 1\nbatch_tuning: 'off'\n"


def _shared_box_config(work: Path, agents: int) -> Path:
    path = work / "agent-shared-box.yaml"
    path.write_text(f"# written by edgefleet demo: {agents} agents on one box (edgefleet/demo.py SHARED_BOX_CONFIG)\n"
                    + SHARED_BOX_CONFIG)
    return path


def run_demo(opts: DemoOptions) -> int:
    from edgefleet.compiler.compile import CompileOptions, compile_model
    from edgefleet.protocol.errors import EdgefleetError

    work = opts.work_dir.resolve()
    try:
        if work.exists():
            if not (work / MARKER).exists() and any(work.iterdir()):
                _say(f"error: {work} exists and is not a demo folder; pick another --work-dir")
                return ExitCode.INPUT
            shutil.rmtree(work)
        work.mkdir(parents=True)
        (work / MARKER).write_text("made by edgefleet demo; deleted and rebuilt by the next demo\n")
    except OSError as exc:
        _say(f"error: cannot prepare the demo folder {work}: {exc}; pick another --work-dir")
        return ExitCode.INPUT
    lf = LocalFleet(work, mqtt_url=opts.mqtt_url, port=opts.port, embedded_mqtt_port=opts.embedded_mqtt_port)
    step = "starting"
    try:
        step = "1/7 starting the fleet server"
        _say(step + ("" if opts.mqtt_url else " with its embedded MQTT broker"))
        lf.start()
        _say(f"    fleet on {lf.url}")
        step = "2/7 compiling models/digits/model.onnx for x86-cpu"
        _say(step + " (INT8 and FP32, accuracy gate, benchmark, keep the faster that passes)")
        result = compile_model(CompileOptions(
            model=DIGITS / "model.onnx", profile="x86-cpu", calibration=DIGITS / "calibration.npz",
            eval=DIGITS / "test.npz", out_dir=work / "dist", name="digits", version="1.0.0"), progress_bar)
        m = result.manifest
        acc = m.accuracy
        choice = m.precision_choice
        tops: dict[str, float] = {c.precision: c.top1 for c in choice.candidates
                                  if c.top1 is not None} if choice else {}
        _say("    top-1 on {} test images: {}".format(
            acc.eval_samples, ", ".join(f"{p} {t:.4f}" for p, t in tops.items())))
        if choice is not None:
            _say(f"    chose {choice.reason}")
        step = "3/7 uploading the bundle"
        _say(step + " (published as a signed TUF target)")
        lf.client.upload(result.bundle)
        devices = [f"edge-{i + 1:02d}" for i in range(opts.agents)]
        step = f"4/7 registering and starting {len(devices)} agents"
        _say(step + " as separate processes" + ("" if opts.mqtt_url else
                                                   ", each enrolled with a one-time token for its own MQTT account"))
        shared = _shared_box_config(work, len(devices))
        for d in devices:
            lf.client.register(d, {"site": "demo"})
            lf.start_agent(d, ["--config", str(shared)])
        lf.wait_online(devices)
        step = "5/7 rolling digits 1.0.0 out"
        _say(step + " (TUF download, verify, install, self-test on the device's CPU, swap)")
        t0 = time.monotonic()
        r = lf.wait_rollout(lf.client.rollout("digits", "1.0.0", devices).id)
        rollout_s = time.monotonic() - t0
        if r.status != "succeeded":
            why = "; ".join(f"{t.device_id}: {t.state} {t.error or ''}".strip() for t in r.targets or [])
            _say(f"error: rollout #{r.id} {r.status}: {why} (logs in {work / 'logs'})")
            return ExitCode.ROLLOUT
        step = "6/7 sending the 359 test images through every agent"
        _say(step + ", one request per image")
        with np.load(DIGITS / "test.npz") as npz:
            images, labels = npz["input"], npz["labels"]
        rows = []
        fleet_devices = {d.device_id: d for d in lf.client.devices()}
        for d in devices:
            pred, lat = infer_images(lf.agents[d].url, "digits", images)
            lat_ms = np.array(lat) * 1000
            st = fleet_devices[d].selftest
            rows.append({"device": d, "version": fleet_devices[d].running_version,
                         "inference_url": lf.agents[d].url, "images": len(images),
                         "accuracy_served": round(float((pred == labels).mean()), 4),
                         "selftest_top1": st.top1 if st else None, "selftest_drift": st.drift if st else None,
                         "latency_p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
                         "latency_p95_ms": round(float(np.percentile(lat_ms, 95)), 2)})
        step = "7/7 the OCR pipeline: PP-OCRv4's text detector and recognizer as one model"
        ocr: dict[str, object] = {"skipped": "--no-pipeline"}
        if opts.pipeline:
            from edgefleet.demo_ocr import run_ocr_step

            _say(step + " (compile-pipeline, roll out, read pages on every agent)")
            ocr = run_ocr_step(lf, devices, work, _say, progress_bar)
        summary = {"model": "digits", "version": "1.0.0", "profile": "x86-cpu", "precision": m.precision,
                   "precision_reason": choice.reason if choice else None,
                   "int8_scheme": None if m.quantization is None else m.quantization.scheme,
                   "accuracy_at_compile": {"fp32": acc.reference, **tops, "shipped": acc.candidate},
                   "selftest_top1_at_compile": m.selftest_summary.top1 if m.selftest_summary else None,
                   "rollout": {"id": r.id, "status": r.status, "seconds": round(rollout_s, 2)},
                   "devices": rows, "pipeline": ocr, "console": f"{lf.url}/",
                   "admin_token_file": str(lf.work_dir / "fleet" / "admin-token")}
        if opts.as_json:
            print(json.dumps(summary, indent=2))
        else:
            print(f"\nedgefleet demo: digits 1.0.0, x86-cpu, {m.precision} "
                  f"(compile-time top-1: {', '.join(f'{p} {t:.4f}' for p, t in tops.items())})")
            if choice is not None:
                print(f"precision: {choice.reason}")
            print(f"rollout #{r.id} {r.status} on {len(devices)} devices in {rollout_s:.1f}s\n")
            build_st = summary["selftest_top1_at_compile"]
            print(f"{'device':<10} {'version':<8} {'images':>6} {'accuracy':>9} {'self-test':>9} {'p50 ms':>7} "
                  f"{'p95 ms':>7}  url")
            for row in rows:
                st_top1 = "–" if row["selftest_top1"] is None else f"{row['selftest_top1']:.4f}"
                print(f"{row['device']:<10} {row['version']:<8} {row['images']:>6} {row['accuracy_served']:>9.4f} "
                      f"{st_top1:>9} {row['latency_p50_ms']:>7.2f} {row['latency_p95_ms']:>7.2f}  "
                      f"{row['inference_url']}")
            if build_st is not None:
                print(f"(self-test: top-1 on the bundle's {m.selftest_summary.samples if m.selftest_summary else '?'} "
                      f"sample images, measured by each agent on its own CPU; {build_st:.4f} at compile time)")
            if "texts" in ocr:
                print(f"\nocr pipeline 1.0.0 ({', '.join(f'{n} {p}' for n, p in ocr['stages'].items())}) on "  # type: ignore[attr-defined]
                      f"{len(devices)} devices; what each read on two new pages:")
                for d, texts in ocr["texts"].items():  # type: ignore[attr-defined]
                    print(f"{d:<10} {texts}")
            token_file = lf.work_dir / "fleet" / "admin-token"
            print(f"\nconsole: {lf.url}/  (sign in with the admin token in {token_file})")
        sys.stdout.flush()
        if opts.keep_running:
            _say("the fleet and agents keep running; press Ctrl-C to stop them all")
            while all(a.proc.poll() is None for a in lf.agents.values()) and lf.fleet_proc is not None \
                    and lf.fleet_proc.poll() is None:
                time.sleep(0.5)
            _say("a process exited; stopping the demo")
        return ExitCode.OK
    except KeyboardInterrupt:
        _say("\nstopping…")
        return ExitCode.OK
    except EdgefleetError as exc:  # compile gate, bad profile, toolchain, the fleet: the error says what to do
        code, line = exit_for(exc)
        _say(f"\nerror in step {step}: {line}" + (f" (logs in {work / 'logs'})" if code is ExitCode.FLEET else ""))
        return code
    except (RuntimeError, OSError) as exc:
        _say(f"\nerror in step {step}: {exc} (logs in {work / 'logs'})")
        return ExitCode.INTERNAL
    except Exception as exc:  # never a traceback: one line, the step, and where to look
        _say(f"\nerror in step {step}: unexpected {type(exc).__name__}: {exc} (logs in {work / 'logs'}; "
             "please report this with the logs)")
        return ExitCode.INTERNAL
    finally:
        lf.stop()
