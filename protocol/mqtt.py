"""MQTT topics and the messages that travel on them.

    edgefleet/v1/devices/<id>/desired    retained, fleet -> device: which model to run
    edgefleet/v1/devices/<id>/reported   retained, device -> fleet: install progress and result
    edgefleet/v1/devices/<id>/telemetry  device -> fleet, QoS 1, spooled on disk until acked
    edgefleet/v1/devices/<id>/ack        fleet -> device: these telemetry records are stored (or rejected)
    edgefleet/v1/devices/<id>/status     retained, device -> fleet; the last will says offline

Delivery: a broker's PUBACK only says the broker has a message, not that the fleet stored it (the
fleet may be resubscribing after a broker restart). So the agent deletes a spooled telemetry
record only when the fleet acks its ``seq``, and resends unacked records; the fleet stores each
(device, seq) once. Latest-state topics (desired, reported, status) are retained and republished
on every reconnect, so whichever side reconnects last still sees the current state.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from protocol import jsonlimits
from protocol._strict import StrictModel, parse_document
from protocol.errors import UnsupportedVersionError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MESSAGE_VERSION",
    "DesiredState",
    "PrecisionTiming",
    "ReportedState",
    "SelfTestResult",
    "ServingChoice",
    "StatusMessage",
    "Telemetry",
    "TelemetryAck",
    "Timing",
    "client_id",
    "decode",
    "device_id_ok",
    "device_id_problem",
    "encode",
    "parse_topic",
    "topic",
]

MESSAGE_VERSION = 1
PREFIX = "edgefleet/v1/devices"
MAX_MESSAGE_BYTES = 256 * 1024  # any message bigger than this is refused unread
MAX_MESSAGE_DEPTH = 16  # nesting levels of a message (its models need at most 5)
DEVICE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch
Kind = Literal["desired", "reported", "telemetry", "status", "ack"]
KINDS: tuple[str, ...] = ("desired", "reported", "telemetry", "status", "ack")


RESERVED_PREFIX = "edgefleet-"  # the fleet's own broker accounts live here (case-insensitive): never a device's


def device_id_problem(device_id: str) -> str | None:
    """Why ``device_id`` cannot name a device, or None if it can."""
    if not DEVICE_ID_RE.fullmatch(device_id):
        return f"device id {device_id!r} must be 1-64 of [A-Za-z0-9_.-], starting with a letter or digit"
    if device_id.lower().startswith(RESERVED_PREFIX):
        return (f"device id {device_id!r} is reserved: names starting with {RESERVED_PREFIX!r} belong to the "
                "fleet's own accounts; pick another name")
    return None


def device_id_ok(device_id: str) -> bool:
    return device_id_problem(device_id) is None


def client_id(device_id: str) -> str:
    """The MQTT client id a device connects with: its device id, bound to its account by the broker (Mosquitto's
    ``use_username_as_clientid``, the embedded broker's check); ``edgefleet-agent-<id>`` from older agents is
    still accepted for the same account (``fleet.acl.client_id_allowed``)."""
    return device_id


def topic(device_id: str, kind: Kind) -> str:
    if not device_id_ok(device_id):
        raise ValueError(f"device id {device_id!r} must be 1-64 of [A-Za-z0-9_.-] (no MQTT wildcards)")
    return f"{PREFIX}/{device_id}/{kind}"


def subscription(kind: Kind) -> str:
    return f"{PREFIX}/+/{kind}"


def parse_topic(t: str) -> tuple[str, str] | None:
    """(device_id, kind) for an edgefleet topic, or None."""
    parts = t.split("/")
    if len(parts) != 5 or "/".join(parts[:3]) != PREFIX or parts[4] not in KINDS:
        return None
    if not device_id_ok(parts[3]):
        return None
    return parts[3], parts[4]


# integers fit a database's BIGINT (SQLite's INTEGER): a bigger one is refused here, not at the insert
MAX_INT = 2**62


class _Message(StrictModel):
    v: int = MESSAGE_VERSION
    device_id: str
    ts: float  # unix seconds


class DesiredState(_Message):
    """What the fleet wants a device to run. ``model`` None means: run nothing new."""

    kind: Literal["desired"] = "desired"
    rollout_id: int | None = Field(ge=1, lt=MAX_INT)
    model: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    version: str = Field(pattern=r"^[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}$")
    target: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*/[0-9.]+/[a-z0-9][a-z0-9._-]*\.tar$")  # TUF target path
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(gt=0, lt=MAX_INT)
    # "shadow": load the model next to the active one, mirror a sample of live requests to it off the
    # request path and report how well it agrees (Telemetry.shadow); keep serving the active model
    mode: Literal["shadow"] | None = None


class SelfTestResult(StrictModel):
    """The bundle's self-test as the device ran it on its own CPU (compare with the manifest's
    ``selftest_summary`` and accuracy, measured on the build host)."""

    samples: int = Field(gt=0, lt=MAX_INT)
    top1: float | None = Field(default=None, ge=0.0, le=1.0)  # against the sample's labels
    top1_agreement: float | None = Field(default=None, ge=0.0, le=1.0)  # argmax equal to the build's outputs
    drift: float = Field(ge=0.0)  # worst |device - build| / tolerance over the outputs; above 1 fails


class Timing(StrictModel):
    """Items per second the device measured at one batch size (on its own cores, in turns with serving)."""

    batch_size: int = Field(gt=0, lt=MAX_INT)
    items_per_s: float = Field(ge=0.0)


class PrecisionTiming(StrictModel):
    """One precision of the bundle, timed on the device at install."""

    precision: Literal["fp32", "fp16", "int8"]
    items_per_s: float = Field(ge=0.0)  # geometric mean over ``timings``: what the choice compares
    timings: tuple[Timing, ...] = Field(default=(), max_length=32)


class ServingChoice(StrictModel):
    """How the device serves the version it installed, and how it chose that on its own CPU: the precision
    (``bundle``: the one engine the bundle has, or the compiler's choice; ``device``: the fastest of the
    bundle's passing precisions as timed here; ``operator``: the agent's config), the largest batch formed
    (``measured`` here, set by the ``operator``, or ``off``) and the layout (instances x threads per instance)."""

    precision: Literal["fp32", "fp16", "int8"]
    precision_source: Literal["bundle", "device", "operator"]
    precisions: tuple[PrecisionTiming, ...] = Field(default=(), max_length=8)
    max_batch_size: int = Field(gt=0, lt=MAX_INT)
    batch_source: Literal["measured", "operator", "off"]
    batch_timings: tuple[Timing, ...] = Field(default=(), max_length=32)
    instances: int = Field(gt=0, le=1024)
    threads: int = Field(gt=0, le=1024)
    layout_source: Literal["measured", "operator", "default"] = "default"


class ReportedState(_Message):
    kind: Literal["reported"] = "reported"
    state: Literal["downloading", "installing", "installed", "failed", "rolled_back", "shadowing"]
    rollout_id: int | None = Field(ge=1, lt=MAX_INT)
    model: str | None
    version: str | None
    running_model: str | None
    running_version: str | None
    error: str | None = None
    install_s: float | None = None
    selftest: SelfTestResult | None = None  # with state "installed", for the model just installed
    # with state "installed": how the device serves it (precision, batch sizes and layout, chosen on its own CPU).
    # Left out when unset, so a fleet of the previous release, which forbids unknown keys, reads the rest
    serving: ServingChoice | None = None


class LatencySummary(StrictModel):
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None


class DeviceSummary(StrictModel):
    """The box itself, not the agent process: whole-box CPU, memory, hottest thermal zone."""

    cpu_percent: float | None = Field(default=None, ge=0.0)
    memory_used_mb: float | None = Field(default=None, ge=0.0)
    memory_total_mb: float | None = Field(default=None, ge=0.0)
    temperature_c: float | None = Field(default=None, ge=-273.15, le=1000.0)


class ShadowFigures(StrictModel):
    """A candidate running in shadow, since it was loaded: how often its answers agree with the active
    model's on the same live requests (top-1 for class scores), the worst absolute difference, its p99."""

    model: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    version: str = Field(pattern=r"^[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}$")
    samples: int = Field(ge=0, lt=MAX_INT)
    top1_agreement: float | None = Field(default=None, ge=0.0, le=1.0)
    max_abs_error: float | None = Field(default=None, ge=0.0)
    p99_ms: float | None = Field(default=None, ge=0.0)


class Telemetry(_Message):
    kind: Literal["telemetry"] = "telemetry"
    # (stream, seq) identifies a record: stream is random per spool (a re-imaged device starts a new
    # one), seq counts up within it and survives restarts; the fleet drops duplicates by the pair
    stream: str = Field(pattern=r"^[0-9a-f]{16}$")
    seq: int = Field(ge=0, lt=MAX_INT)
    interval_s: float
    model: str | None
    version: str | None
    requests: int = Field(ge=0, lt=MAX_INT)
    errors: int = Field(ge=0, lt=MAX_INT)
    latency: LatencySummary
    batches: int = Field(ge=0, lt=MAX_INT)
    batch_size_mean: float | None
    batch_size_max: int | None = Field(ge=0, lt=MAX_INT)
    cpu_percent: float
    rss_mb: float
    dropped: int | None = Field(default=None, ge=0, lt=MAX_INT)  # records this stream's full spool dropped, in total
    device: DeviceSummary | None = None  # the box itself; left out by agents that have no sample yet
    shadow: ShadowFigures | None = None  # while a candidate runs in shadow
    # how the model it serves now runs: precision, batch sizes and layout as the device chose them (at install,
    # and again at each start: a restart may choose differently, and sends no install report)
    serving: ServingChoice | None = None


class TelemetryAck(_Message):
    """``seqs`` are stored. ``rejected`` could not be stored and never will be (the fleet cannot read
    them); the agent sets them aside on its disk instead of resending them forever. ``report_ts``: the
    report with that ``ts`` is stored."""

    kind: Literal["ack"] = "ack"
    stream: str
    seqs: tuple[int, ...] = Field(default=(), max_length=10_000)
    rejected: tuple[int, ...] = Field(default=(), max_length=10_000)
    reason: str | None = None
    # the ``ts`` of the device's report the fleet stored (an ack of a report, not of telemetry: ``stream`` is
    # then ""); an agent keeps sending its latest report until this acks it. Sent only in report acks, so an
    # older agent, which forbids the key, drops those alone and keeps its telemetry acks
    report_ts: float | None = None


class StatusMessage(_Message):
    kind: Literal["status"] = "status"
    state: Literal["online", "offline"]
    agent_version: str | None = None
    inference_url: str | None = None
    arch: str | None = None
    cpu_features: tuple[str, ...] | None = Field(default=None, max_length=64)  # CPUID, as the runtime sees it
    # the hardware profile (hw-profiles/<name>.yaml) the device runs as; the fleet picks its bundle by it
    profile: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")


T = TypeVar("T", bound=BaseModel)


def _compact(msg: BaseModel) -> dict[str, Any]:
    """The message as JSON data without the optional fields that are unset (None and defaulting to
    None), so that a fleet or agent of the previous release, which forbids keys it does not know,
    still reads the messages of this one as long as they carry nothing new."""
    data = msg.model_dump(mode="json")
    for name, field in type(msg).model_fields.items():
        value = getattr(msg, name)
        if value is None and not field.is_required() and field.default is None:
            del data[name]
        elif isinstance(value, BaseModel):
            data[name] = _compact(value)
    return data


def encode(msg: BaseModel) -> bytes:
    return json.dumps(_compact(msg), separators=(",", ":")).encode()


def decode(model: type[T], payload: bytes, source: str) -> T:
    # pydantic-core's parser, bounded in size and depth: the fleet decodes thousands of these a second
    data: Any = jsonlimits.loads(payload, source=source, max_bytes=MAX_MESSAGE_BYTES, max_depth=MAX_MESSAGE_DEPTH)
    if isinstance(data, dict) and isinstance(data.get("v"), int) and data["v"] > MESSAGE_VERSION:
        raise UnsupportedVersionError(f"{source}: message version {data['v']} is newer than {MESSAGE_VERSION}")
    return parse_document(model, data, source)


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """``mqtt://host[:1883]`` or ``mqtts://host[:8883]`` (TLS) -> (host, port)."""
    from urllib.parse import urlsplit

    from protocol.errors import ConfigError

    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ConfigError(f"MQTT URL {url!r} must look like mqtt://HOST:PORT (or mqtts://HOST:PORT for TLS)")
    try:
        port = parts.port or (8883 if parts.scheme == "mqtts" else 1883)
    except ValueError as exc:
        raise ConfigError(f"MQTT URL {url!r} has a bad port") from exc
    return parts.hostname, port


def mqtt_tls(url: str) -> bool:
    return url.startswith("mqtts://")
