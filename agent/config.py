"""Agent configuration: flags or a YAML file, parsed once into a frozen object; unknown keys are errors that
name the key and the nearest valid one.

    # /etc/edgefleet/agent.yaml
    device_id: cam-7
    fleet_url: https://fleet.example:8700
    data_dir: /var/lib/edgefleet-agent
    trusted_root: /etc/edgefleet/root.json
    max_batch_size: 8
"""

from __future__ import annotations

import difflib
import platform
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator

from ..protocol._strict import StrictModel, parse_document
from ..protocol.errors import ConfigError, SchemaError
from ..protocol.mqtt import device_id_ok

__all__ = ["AgentConfig", "default_profiles", "load_config"]


def default_profiles() -> tuple[str, ...]:
    """Profiles whose bundles this machine can run, judged by its architecture."""
    if platform.machine() in ("aarch64", "arm64"):
        return ("arm64-cpu", "jetson-orin-nano", "jetson-agx-orin")
    return ("x86-cpu", "x86-cpu-vnni")


class AgentConfig(StrictModel):
    device_id: str
    fleet_url: str  # e.g. http://127.0.0.1:8700
    data_dir: Path
    # the anchor of trust: root.json from 'edgefleet keys init' / 'keys create'. Without it the agent starts only
    # if it already holds a root (data_dir/tuf/metadata/root.json) or trust_on_first_use says to trust the
    # root the fleet serves the first time it connects
    trusted_root: Path | None = None
    trust_on_first_use: bool = False
    mqtt_url: str | None = None  # None: ask the fleet (/api/v1/bootstrap); mqtts://host:port for TLS
    # MQTT identity (agent/link/enroll.py): a one-time token from 'edgefleet fleet enroll DEVICE', traded once for
    # credentials kept in data_dir; or credentials given here. TLS: the broker's CA; mutual TLS: cert + key.
    enroll_token: str | None = None
    mqtt_username: str | None = None
    mqtt_password: str | None = None
    mqtt_ca_file: Path | None = None
    mqtt_cert_file: Path | None = None
    mqtt_key_file: Path | None = None
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8000, ge=0, le=65535)
    # HTTP connections (protocol/httpguard.py): at most this many at once (and below RLIMIT_NOFILE, 128 kept), of
    # them at most http_max_connections_per_peer from one address (None: half); a request head must arrive within
    # http_head_timeout_s, a keep-alive connection idle for http_idle_timeout_s is closed
    http_max_connections: int = Field(default=1024, ge=1, le=65536)
    http_max_connections_per_peer: int | None = Field(default=None, ge=1, le=65536)
    http_head_timeout_s: float = Field(default=10.0, gt=0, le=600)
    http_idle_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    profiles: tuple[str, ...] = Field(default_factory=default_profiles)
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    # auto: at each install the agent times its runtime at batch sizes 1, 2, 4, ... up to max_batch_size (each call
    # in turn with the version serving, about 2 s in all) and forms batches of at most the smallest size within 2%
    # of the best images/s; requests up to max_batch_size are still accepted. Setting max_batch_size (file or
    # flag) turns this off: the operator's size is used as it is. off: max_batch_size (default 16) as it is
    batch_tuning: Literal["auto", "off"] = "auto"
    # a bundle compiled where its devices' CPU could not be timed carries every precision that passed the gate.
    # auto: at install (and each start) the agent times them on its own cores and serves the faster
    # (agent/install/precision.py); bundle: serve the bundle's own engine untimed; fp32/fp16/int8: that one, if the
    # bundle has it
    precision: Literal["auto", "bundle", "fp32", "fp16", "int8", "bf16"] = "auto"
    # the runtime that executes an onnxruntime bundle's ONNX/QDQ file (agent/install/runtime_choice.py). auto: at
    # install (and each start) the agent times those installed here (onnxruntime, and OpenVINO with edgefleet[openvino])
    # on its own cores and serves the fastest that passes the bundle's self-test; onnxruntime / openvino: that one for
    # the bundles it runs (an install fails, naming the extra, where it is not installed); LiteRT, TensorRT and bf16
    # bundles run on the runtimes that run them (bf16: OpenVINO only)
    runtime: Literal["auto", "onnxruntime", "openvino"] = "auto"
    max_queue_delay_us: int = Field(default=0, ge=0, le=1_000_000)
    # a lone request of a CPU model whose lone calls take less than this runs on the event loop itself, not on the
    # inference thread (two thread hand-offs cost more: digits, pinned, 1 client: +36% req/s); 0: never
    inline_max_us: int = Field(default=100, ge=0, le=10_000)
    max_queue_size: int = Field(default=1024, ge=1)  # queued samples beyond this get 503
    queue_timeout_ms: int = Field(default=5000, ge=1)  # a request waiting longer than this gets 503
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)  # one request
    max_inflight_body_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)  # all requests being read at once
    # /infer/image: the memory one decode may take, worked out from the image's header before any decoder runs
    # (bigger images get 413), and how many decode at once (the rest wait up to queue_timeout_ms, then 503).
    # Images never take more than max_concurrent_image_decodes x max_image_decoded_bytes at once.
    max_image_decoded_bytes: int = Field(default=96 * 1024 * 1024, ge=64 * 1024)  # 96 MiB: a 16 MP photo
    max_concurrent_image_decodes: int = Field(default=2, ge=1, le=64)
    # and the work: a JPEG of more scans than this is refused with 413 before it decodes (each scan is a pass over
    # every block of the image, however few bytes it has; an encoder's progressive JPEG has about 10)
    max_image_scans: int = Field(default=100, ge=1, le=1000)
    intra_op_threads: int = Field(default=2, ge=1, le=256)
    shadow_sample_rate: float = Field(default=0.1, gt=0.0, le=1.0)  # live requests mirrored to a shadow candidate
    instances: int = Field(default=1, ge=1, le=16)  # backend instances per model, one inference thread each
    # CPU numbers (0-based, as `taskset -c` and /proc/cpuinfo count them) the inference threads run on; the event
    # loop and every other thread of the agent get the CPUs left. None: no pinning. On 2 cores: [1]. Each
    # instance's thread runs onnxruntime's work itself with intra_op_threads 1; with more, onnxruntime's extra
    # threads follow the thread that loads the session, which runs on these CPUs too (installs, warm-ups)
    inference_cpus: tuple[int, ...] | None = None
    # the Open Inference Protocol over gRPC (tritonclient.grpc) on http_host; None: off, 0: a free port
    grpc_port: int | None = Field(default=None, ge=0, le=65535)
    # its connections (agent/transports/grpc.py): at most this many at once (and at most a twelfth of RLIMIT_NOFILE);
    # one that sends no HTTP/2 preface and SETTINGS within grpc_handshake_timeout_s, or has no call in progress
    # for grpc_idle_timeout_s, is closed
    grpc_max_connections: int = Field(default=256, ge=1, le=65536)
    # of them, at most this many from one address (None: half the cap); at the cap the one with no call in progress
    # for the longest is closed for a new one
    grpc_max_connections_per_peer: int | None = Field(default=None, ge=1, le=65536)
    grpc_handshake_timeout_s: float = Field(default=10.0, gt=0, le=300)
    grpc_idle_timeout_s: float = Field(default=300.0, gt=0, le=86400)
    # Triton's system shared-memory extension (clients on the box pass tensors by reference, HTTP and gRPC): a
    # client (one local user over HTTP and gRPC together, whatever its source address; one connection of the local
    # socket) may hold this many regions, all clients together max_shm_regions and max_shm_bytes of mapped memory; a
    # region unused for shm_idle_timeout_s is unregistered. 0 regions: off
    max_shm_regions_per_client: int = Field(default=16, ge=0, le=4096)
    max_shm_regions: int = Field(default=64, ge=0, le=65536)
    max_shm_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)  # 1 GiB, all regions together
    shm_idle_timeout_s: float = Field(default=600.0, gt=0, le=86400)
    # the on-box socket (agent/transports/local.py, protocol/local.py): the Open Inference Protocol without HTTP over a
    # Unix socket at this path (relative: under data_dir), mode 0660; None: off. At most local_max_connections at once,
    # local_max_inflight requests in flight on each
    local_socket: Path | None = None
    local_max_connections: int = Field(default=32, ge=1, le=4096)
    # of them, at most this many one user's (None: half of local_max_connections), so one user's connections, idle
    # ones too, never lock the others out; a connection with nothing in flight and no byte from its client for
    # local_idle_timeout_s is closed (ERROR 408)
    local_max_connections_per_user: int | None = Field(default=None, ge=1, le=4096)
    local_idle_timeout_s: float = Field(default=300.0, gt=0, le=86400)
    # a frame (head and body) must arrive whole within this of its first byte, or the connection is closed (ERROR 408)
    local_frame_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    local_max_inflight: int = Field(default=256, ge=1, le=65536)
    telemetry_interval_s: float = Field(default=10.0, gt=0.05, le=3600)
    max_spool_records: int = Field(default=100_000, ge=10)
    install_retries: int = Field(default=5, ge=0)
    # slow retrieval: after this grace, a download averaging less than the minimum speed is aborted
    download_grace_s: float = Field(default=30.0, gt=0, le=3600)
    download_min_bytes_per_s: int = Field(default=2048, ge=0)
    # every answer from the fleet (bootstrap, metadata, a bundle) whole within this, plus its bound in bytes at
    # download_min_bytes_per_s (agent/link/fetch.py); a slower or longer answer ends the attempt, retried with backoff
    download_deadline_s: float = Field(default=60.0, gt=0, le=86400)
    # a bundle download's rate cap on this box (0: none; else at least 4096, and never below twice
    # download_min_bytes_per_s); a rollout's own cap (DesiredState.download_max_bytes_per_s) can only lower it
    download_max_bytes_per_s: int = Field(default=0, ge=0, le=10_000_000_000)
    # the local clock is trusted only within this of the fleet's signed time (agent/link/clock.py); past it, the skew
    # is logged and reported in telemetry (clock_skew_s)
    clock_tolerance_s: float = Field(default=300.0, gt=0, le=86400)
    # on SIGTERM: stop accepting, finish the requests in flight for at most this long, then stop
    shutdown_grace_s: float = Field(default=20.0, ge=0, le=600)
    # onnxruntime execution providers to ask for, best first; None: from the bundle's profile (gpu: TensorRT,
    # CUDA, CPU). Which one runs is read back from the session.
    onnxruntime_providers: tuple[str, ...] | None = None
    # device telemetry: thermal zones under <sysfs_root>/class/thermal; Jetson's tegrastats when it exists
    sysfs_root: Path = Path("/sys")
    tegrastats: Path | None = Path("/usr/bin/tegrastats")

    @field_validator("download_max_bytes_per_s")
    @classmethod
    def _pace(cls, v: int) -> int:
        if 0 < v < 4096:
            raise ValueError("a download rate cap is 0 (none) or at least 4096 bytes/s")
        return v

    @field_validator("device_id")
    @classmethod
    def _dev(cls, v: str) -> str:
        if not device_id_ok(v):
            raise ValueError("1-64 of [A-Za-z0-9_.-], starting with a letter or digit")
        return v

    @model_validator(mode="after")
    def _budget(self) -> AgentConfig:
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError("max_inflight_body_bytes must be at least max_body_bytes")
        if (self.mqtt_cert_file is None) != (self.mqtt_key_file is None):
            raise ValueError("mqtt_cert_file and mqtt_key_file go together (mutual TLS)")
        if self.mqtt_password is not None and self.mqtt_username is None:
            raise ValueError("mqtt_password needs mqtt_username")
        return self

    @field_validator("inference_cpus")
    @classmethod
    def _cpus(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("name at least one CPU (e.g. [1]), or leave the setting out")
        if any(c < 0 or c > 4095 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"CPU numbers must be distinct, 0..4095; got {list(v)}")
        return tuple(sorted(v))

    @field_validator("onnxruntime_providers")
    @classmethod
    def _providers(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        known = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
        for p in v or ():
            if p not in known:
                near = difflib.get_close_matches(p, known, n=1, cutoff=0.5)
                raise ValueError(f"unknown execution provider {p!r}" + (f" (did you mean {near[0]!r}?)" if near
                                                                        else f"; known: {', '.join(known)}"))
        if v is not None and not v:
            raise ValueError("name at least one provider, or leave the setting out")
        return v

    @field_validator("fleet_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


def load_config(path: Path | None, overrides: dict[str, object]) -> AgentConfig:
    """YAML file (optional) with command-line overrides on top (flags win)."""
    data: dict[str, object] = {}
    source = "command line"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"{path}: config file not found") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of settings")
        data.update({str(k).replace("-", "_"): v for k, v in (loaded or {}).items()})
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return parse_document(AgentConfig, data, source)
    except SchemaError as exc:
        problems = [re.sub(r"missing key '(\w+)'",
                           lambda m: f"missing setting '{m[1]}' (flag --{m[1].replace('_', '-')} or "
                                     f"key {m[1]} in --config)", p) for p in exc.problems]
        problems = [re.sub(r"^unknown key '([^']*)'$", lambda m: f"unknown key '{m[1]}' ({_nearest(m[1])})", p)
                    for p in problems]
        raise ConfigError(f"{exc.source}: {'; '.join(problems)}") from exc


def _nearest(key: str) -> str:
    known = sorted(AgentConfig.model_fields)
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6) or \
        [k for k in known if key in k or k in key][:1]
    return f"did you mean '{near[0]}'?" if near else f"valid keys: {', '.join(known)}"
