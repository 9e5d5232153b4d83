"""Device telemetry: what the box itself is doing, beside the agent's own request figures.

    psutil        CPU load (whole box and this process), memory, the data disk's free space, load average
    sysfs         thermal zones, <root>/class/thermal/thermal_zone*/{type,temp} (millidegrees C); every
                  Linux box has them, a Jetson names its CPU, GPU, SoC and board sensors there
    tegrastats    Jetson's own monitor: RAM, per-core load, GPU (GR3D) load, temperatures, power rails;
                  read from a long-running ``tegrastats --interval`` whose latest line is kept
    NVML          discrete NVIDIA GPUs through ``pynvml`` (nvidia-ml-py) when it imports

Parsers are plain functions of text (tested with fixture text); the sampler only gathers. Every source is
optional: a missing one is left out of the sample, never an error.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...protocol.processes import stop_processes

__all__ = ["DeviceSampler", "DeviceStats", "GpuStats", "TegraStats", "parse_tegrastats", "read_thermal_zones"]

log = logging.getLogger("edgefleet.agent.telemetry")

MAX_ZONES = 64  # a box with more thermal zones than this is reporting garbage
MAX_LINE_BYTES = 4096  # one tegrastats line


def read_thermal_zones(sysfs_root: Path) -> dict[str, float]:
    """Temperature (degrees C) per thermal zone type, e.g. {"cpu-thermal": 47.5, "gpu-thermal": 45.0}. Zones
    that cannot be read (some report EINVAL or EIO while their sensor sleeps) are left out; a repeated type
    gets a suffix (``acpitz``, ``acpitz.1``)."""
    base = sysfs_root / "class" / "thermal"
    out: dict[str, float] = {}
    try:
        zones = sorted(base.glob("thermal_zone*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    except OSError:
        return out
    for zone in zones[:MAX_ZONES]:
        try:
            kind = (zone / "type").read_text(encoding="ascii", errors="replace").strip() or zone.name
            millideg = int((zone / "temp").read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            continue
        if millideg <= -273_000:  # "no reading" markers some drivers use
            continue
        name, n = kind, 1
        while name in out:
            name, n = f"{kind}.{n}", n + 1
        out[name] = millideg / 1000.0
    return out


@dataclass(frozen=True)
class TegraStats:
    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    cpu_percent: tuple[float | None, ...] = ()  # per core; None: the core is off
    gpu_percent: float | None = None  # GR3D_FREQ
    temperatures_c: dict[str, float] = field(default_factory=dict)  # cpu, gpu, soc0, tj, ...
    power_mw: dict[str, int] = field(default_factory=dict)  # rail -> current draw (VDD_IN, VDD_CPU_GPU_CV, ...)


_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_GR3D = re.compile(r"\bGR3D_FREQ (\d+)%")
_TEMP = re.compile(r"\b([A-Za-z][\w-]*)@(-?\d+(?:\.\d+)?)C\b")
# JetPack 5/6: "VDD_IN 5042mW/5042mW"; JetPack 4: "POM_5V_IN 3542/3542"
_POWER = re.compile(r"\b((?:VDD|POM|VIN)_[A-Z0-9_]+) (\d+)(?:mW)?/(\d+)(?:mW)?")


def parse_tegrastats(line: str) -> TegraStats:
    """One line of ``tegrastats`` output (JetPack 4 to 6 formats)."""
    ram = _RAM.search(line)
    cores: list[float | None] = []
    cpu = _CPU.search(line)
    if cpu:
        for item in cpu[1].split(","):
            item = item.strip()
            m = re.match(r"(\d+)%", item)
            cores.append(float(m[1]) if m else None)  # "off" for a parked core
    gr3d = _GR3D.search(line)
    temps = {m[1].lower(): float(m[2]) for m in _TEMP.finditer(line) if float(m[2]) > -200}
    power = {m[1]: int(m[2]) for m in _POWER.finditer(line)}
    return TegraStats(ram_used_mb=int(ram[1]) if ram else None, ram_total_mb=int(ram[2]) if ram else None,
                      cpu_percent=tuple(cores), gpu_percent=float(gr3d[1]) if gr3d else None,
                      temperatures_c=temps, power_mw=power)


@dataclass(frozen=True)
class GpuStats:
    """One NVIDIA GPU as NVML reports it."""

    index: int
    name: str
    utilization_percent: float
    memory_used_mb: float
    memory_total_mb: float
    temperature_c: float | None
    power_w: float | None


def read_nvml(nvml: Any) -> list[GpuStats]:
    """GPUs through an initialised ``pynvml`` module (passed in, so a test can hand over its own)."""
    out = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        name = nvml.nvmlDeviceGetName(h)
        util = nvml.nvmlDeviceGetUtilizationRates(h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        try:
            temp: float | None = float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        except nvml.NVMLError:
            temp = None
        try:
            power: float | None = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW
        except nvml.NVMLError:
            power = None
        out.append(GpuStats(i, name.decode() if isinstance(name, bytes) else str(name), float(util.gpu),
                            round(mem.used / 2**20, 1), round(mem.total / 2**20, 1), temp, power))
    return out


@dataclass(frozen=True)
class DeviceStats:
    cpu_percent: float  # the whole box, since the previous sample
    memory_used_mb: float
    memory_total_mb: float
    load_avg_1m: float | None
    disk_free_mb: float | None  # of the agent's data directory
    temperatures_c: dict[str, float]  # thermal zones
    tegrastats: TegraStats | None = None
    gpus: tuple[GpuStats, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _TegrastatsReader:
    """``tegrastats --interval MS`` in the background; ``latest`` is its last line, parsed."""

    def __init__(self, binary: Path, interval_ms: int):
        self.latest: TegraStats | None = None
        self._proc = subprocess.Popen([str(binary), "--interval", str(interval_ms)], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self._thread = threading.Thread(target=self._read, name="tegrastats", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        while True:
            raw = self._proc.stdout.readline(MAX_LINE_BYTES)
            if not raw:
                return
            self.latest = parse_tegrastats(raw.decode("utf-8", errors="replace"))

    def close(self) -> None:
        stop_processes([self._proc], grace_s=5)
        self._thread.join(5)


class DeviceSampler:
    """Gathers a :class:`DeviceStats` on demand; ``close()`` stops tegrastats."""

    def __init__(self, data_dir: Path, sysfs_root: Path = Path("/sys"), tegrastats: Path | None = None,
                 interval_s: float = 10.0):
        import psutil

        self._psutil = psutil
        self._data_dir = data_dir
        self._sysfs_root = sysfs_root
        psutil.cpu_percent(None)  # the first call starts the interval
        self._tegra: _TegrastatsReader | None = None
        if tegrastats is not None and tegrastats.is_file():
            try:
                self._tegra = _TegrastatsReader(tegrastats, max(100, int(interval_s * 1000)))
            except OSError as exc:
                log.warning("cannot run %s: %s", tegrastats, exc)
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # not installed, or no NVIDIA driver (pynvml.NVMLError)
            log.debug("no NVML: %s", exc)

    def sample(self) -> DeviceStats:
        ps = self._psutil
        mem = ps.virtual_memory()
        try:
            disk: float | None = round(ps.disk_usage(str(self._data_dir)).free / 2**20, 1)
        except OSError:
            disk = None
        try:
            load: float | None = round(ps.getloadavg()[0], 2)
        except (OSError, AttributeError):
            load = None
        gpus: tuple[GpuStats, ...] = ()
        if self._nvml is not None:
            try:
                gpus = tuple(read_nvml(self._nvml))
            except Exception as exc:  # pynvml.NVMLError: a GPU fell off the bus, a driver reload
                log.warning("NVML: %s", exc)
        return DeviceStats(cpu_percent=round(ps.cpu_percent(None), 1), memory_used_mb=round(mem.used / 2**20, 1),
                           memory_total_mb=round(mem.total / 2**20, 1), load_avg_1m=load, disk_free_mb=disk,
                           temperatures_c=read_thermal_zones(self._sysfs_root),
                           tegrastats=self._tegra.latest if self._tegra else None, gpus=gpus)

    def close(self) -> None:
        if self._tegra is not None:
            self._tegra.close()
            self._tegra = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
