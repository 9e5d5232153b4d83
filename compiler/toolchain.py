"""Isolated toolchain environments for build tools that cannot share edgefleet's environment.

onnx2tf needs TensorFlow and pins old numpy and onnx, so it must never be installed beside edgefleet.
Each toolchain gets its own virtual environment under ``$EDGEFLEET_TOOLCHAIN_DIR`` (default
``~/.cache/edgefleet/toolchains``), in a folder named after the toolchain and a hash of its pinned
requirement list and Python version: changing a pin makes a new folder, never a half-upgraded one.
The compiler runs the tools as subprocesses of that environment's Python (:func:`python`).

An environment counts as installed only once its status file (``edgefleet-toolchain.json``: the pins,
the versions that landed, the install time and size) is written, which is the last step of an install;
a folder without one is a broken install and is rebuilt. Installs are serialised by a lock file, so
two builds starting at once do not install twice.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError, ToolchainError

__all__ = ["TOOLCHAINS", "ToolchainSpec", "ToolchainStatus", "ensure", "install", "last_meaningful_line",
           "python", "run_tool", "spec", "status", "toolchain_root"]

STATUS_FILE = "edgefleet-toolchain.json"
STATUS_FORMAT = 1
PIP_TIMEOUT_S = 1800.0  # the whole pip install; TensorFlow alone is a ~600 MB download
PROBE_TIMEOUT_S = 300.0  # importing the tool once after install (TensorFlow takes seconds to import)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ToolchainSpec:
    name: str
    description: str
    requirements: tuple[str, ...]  # exact pins, installed together with the environment's own pip
    versions_of: tuple[str, ...]  # distributions whose installed versions the status file records
    smoke_test: str  # Python run in the environment after install; must exit 0
    size_hint: str  # for the "not installed" message


# Resolved together on Python 3.11 (pip's resolver, no conflicts). onnx2tf 1.29.24 itself pins
# tensorflow, tf-keras, onnx, onnxruntime, numpy and protobuf exactly; keras, which TensorFlow only
# bounds from below, is pinned too so a later release cannot change the environment under the same hash.
# tensorflow-cpu is not in the list although it resolves: onnx2tf and tf-keras require the
# ``tensorflow`` distribution, and tensorflow-cpu would unpack a second copy over the same package folder.
TOOLCHAINS: dict[str, ToolchainSpec] = {
    "tflite": ToolchainSpec(
        name="tflite",
        description="onnx2tf + TensorFlow: ONNX to LiteRT (TFLite) conversion and full-integer quantization",
        requirements=(
            "onnx2tf==1.29.24",
            "tensorflow==2.19.0",
            "tf-keras==2.19.0",
            "keras==3.15.1",
            "onnx==1.19.1",
            "onnxruntime==1.23.0",
            "onnx-graphsurgeon==0.5.8",
            "sng4onnx==2.0.1",
            "psutil==5.9.5",
            "ai-edge-litert==2.1.0",
            "numpy==1.26.4",
            "protobuf==4.25.5",
        ),
        versions_of=("onnx2tf", "tensorflow", "tf-keras", "keras", "onnx", "onnxruntime", "ai-edge-litert",
                     "numpy"),
        smoke_test="import onnx2tf, tensorflow, tf_keras",
        size_hint="about 2.6 GB from PyPI, a minute or more",
    ),
}


@dataclass(frozen=True)
class ToolchainStatus:
    name: str
    installed: bool
    path: Path
    requirements: tuple[str, ...]
    versions: dict[str, str] = field(default_factory=dict)
    python_version: str | None = None
    installed_at: str | None = None  # ISO 8601, UTC
    install_seconds: float | None = None
    size_bytes: int | None = None
    stale: tuple[Path, ...] = ()  # environments of this toolchain made from other pins: safe to delete

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "installed": self.installed, "path": str(self.path),
                "requirements": list(self.requirements), "versions": self.versions,
                "python_version": self.python_version, "installed_at": self.installed_at,
                "install_seconds": self.install_seconds, "size_bytes": self.size_bytes,
                "stale": [str(p) for p in self.stale]}


def toolchain_root() -> Path:
    base = os.environ.get("EDGEFLEET_TOOLCHAIN_DIR")
    return Path(base) if base else Path.home() / ".cache" / "edgefleet" / "toolchains"


def spec(name: str) -> ToolchainSpec:
    try:
        return TOOLCHAINS[name]
    except KeyError:
        raise InputError(f"unknown toolchain {name!r}; known: {', '.join(sorted(TOOLCHAINS))}") from None


def _base_python() -> str:
    """The interpreter the environments are made from: edgefleet's own (the pins were resolved for it)."""
    return os.environ.get("EDGEFLEET_TOOLCHAIN_PYTHON") or sys.executable


def _python_version(py: str) -> str:
    if py == sys.executable:
        return f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        out = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"EDGEFLEET_TOOLCHAIN_PYTHON={py} does not run: {exc}") from exc
    return out.stdout.strip()


def _env_dir(s: ToolchainSpec, pyver: str) -> Path:
    digest = hashlib.sha256("\n".join([f"python{pyver}", *s.requirements]).encode()).hexdigest()[:12]
    return toolchain_root() / f"{s.name}-{digest}"


def _venv_python(env: Path) -> Path:
    return env / "bin" / "python"


def status(name: str) -> ToolchainStatus:
    """What is installed for toolchain ``name`` with the current pins (no I/O beyond reading files)."""
    s = spec(name)
    env = _env_dir(s, _python_version(_base_python()))
    stale = tuple(sorted(p for p in toolchain_root().glob(f"{s.name}-*") if p.is_dir() and p != env))
    doc = _read_status(env)
    if doc is None or tuple(doc.get("requirements", ())) != s.requirements or not _venv_python(env).exists():
        return ToolchainStatus(name=s.name, installed=False, path=env, requirements=s.requirements, stale=stale)
    return ToolchainStatus(
        name=s.name, installed=True, path=env, requirements=s.requirements,
        versions=dict(doc.get("versions", {})), python_version=doc.get("python_version"),
        installed_at=doc.get("installed_at"), install_seconds=doc.get("install_seconds"),
        size_bytes=doc.get("size_bytes"), stale=stale)


def python(name: str) -> Path:
    """The Python of the installed toolchain ``name``; a one-line ToolchainError if it is not installed."""
    st = status(name)
    if not st.installed:
        s = spec(name)
        raise ToolchainError(f"the {name} toolchain ({s.description.split(':')[0]}) is not installed: run "
                             f"`edgefleet toolchain install {name}` ({s.size_hint})")
    return _venv_python(st.path)


def ensure(name: str, progress: Progress | None = None) -> ToolchainStatus:
    """The toolchain's status, installing it first if it is missing."""
    st = status(name)
    return st if st.installed else install(name, progress)


def install(name: str, progress: Progress | None = None, force: bool = False) -> ToolchainStatus:
    """Create the environment and install the pinned requirements with its own pip."""
    say = progress or (lambda _msg: None)
    s = spec(name)
    base = _base_python()
    pyver = _python_version(base)
    env = _env_dir(s, pyver)
    env.parent.mkdir(parents=True, exist_ok=True)
    with _locked(env.with_name(f".{env.name}.lock"), say):
        if not force and (st := status(name)).installed:  # another process may have installed it meanwhile
            say(f"{name} toolchain already installed at {env}")
            return st
        t0 = time.monotonic()
        if env.exists():
            say(f"removing the incomplete environment at {env}")
            shutil.rmtree(env)
        say(f"creating a virtual environment at {env} (Python {pyver})")
        run_tool([base, "-m", "venv", str(env)], timeout_s=300, what="creating the virtual environment")
        py = str(_venv_python(env))
        say(f"installing {len(s.requirements)} pinned packages with pip: {', '.join(s.requirements)}")
        run_tool([py, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--only-binary=:all:",
              *s.requirements], timeout_s=PIP_TIMEOUT_S, what="pip install", say=say, log=env / "pip-install.log")
        say(f"checking that the {name} toolchain imports")
        run_tool([py, "-c", s.smoke_test], timeout_s=PROBE_TIMEOUT_S, what="importing the installed toolchain")
        versions = json.loads(run_tool(
            [py, "-c", "import importlib.metadata as m, json, sys; "
                       "print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))", *s.versions_of],
            timeout_s=60, what="reading the installed versions").strip().splitlines()[-1])
        seconds = round(time.monotonic() - t0, 1)
        size = _tree_size(env)
        _write_status(env, {
            "format": STATUS_FORMAT, "name": s.name, "requirements": list(s.requirements), "versions": versions,
            "python_version": pyver,
            "installed_at": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
            "install_seconds": seconds, "size_bytes": size})
        say(f"{name} toolchain installed in {seconds:.0f} s, {size / 1e9:.2f} GB: "
            + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return status(name)


@contextlib.contextmanager
def _locked(path: Path, say: Progress) -> Iterator[None]:
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another process is installing this toolchain; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_SHOWN = ("Collecting", "Downloading", "Installing collected", "Successfully", "ERROR")


def run_tool(cmd: list[str], timeout_s: float, what: str, say: Progress | None = None, log: Path | None = None,
             env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run ``cmd`` with its output captured (stdout and stderr merged, written to ``log`` if given),
    forwarding pip's milestones to ``say``; kill its whole process group after ``timeout_s``. A failure
    is a ToolchainError naming the last meaningful line of the output."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace", env=env, cwd=cwd, start_new_session=True)
    except OSError as exc:
        raise ToolchainError(f"{what} failed: {exc}") from exc
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the tool's own children too (onnx2tf runs onnxsim)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if say is not None and line.lstrip().startswith(_SHOWN):
                say(line.strip())
        code = proc.wait()
    finally:
        timer.cancel()
    out = "".join(lines)
    if log is not None:
        log.write_text(out, encoding="utf-8")
    if timed_out.is_set():
        raise ToolchainError(f"{what} did not finish in {timeout_s:.0f} s")
    if code != 0:
        raise ToolchainError(f"{what} failed (exit {code}): {last_meaningful_line(out)}")
    return out


def last_meaningful_line(output: str) -> str:
    """The line of a tool's output that says what went wrong (ANSI colours stripped): the last one that
    starts with ``ERROR`` (onnx2tf's and pip's own reports), else the last Python exception line, else the
    last non-blank line."""
    lines = [ln for ln in (re.sub(r"\x1b\[[0-9;]*m", "", raw).strip() for raw in output.splitlines()) if ln]
    for pattern in (r"^ERROR\b", r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b"):
        for ln in reversed(lines):
            if re.match(pattern, ln):
                return ln[:500]
    return lines[-1][:500] if lines else "no output"


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                total += st.st_size
    return total


def _read_status(env: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((env / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == STATUS_FORMAT else None


def _write_status(env: Path, doc: dict[str, Any]) -> None:
    tmp = env / f".{STATUS_FILE}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, env / STATUS_FILE)
