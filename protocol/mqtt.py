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

import itertools
import json
import re
from typing import Annotated, Any, Literal, TypeVar

import pydantic_core
from pydantic import BaseModel, Field, ValidationError

from ._strict import StrictModel
from .drift import DriftCounts
from .errors import SchemaError, UnsupportedVersionError
from .window import MaintenanceWindow

__all__ = [
    "MAX_COUNT",
    "MAX_LATENCY_MS",
    "MAX_MESSAGE_BYTES",
    "MAX_OBJECT_KEYS",
    "MAX_TS",
    "MESSAGE_VERSION",
    "DesiredState",
    "DownloadFigures",
    "MessageError",
    "MessageVersionError",
    "PrecisionTiming",
    "ReportedState",
    "RuntimeChoice",
    "RuntimeTiming",
    "SelfTestResult",
    "ServingChoice",
    "StageFigures",
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
MAX_OBJECT_KEYS = 64  # keys of any one object in a message (its models have at most 22)
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


# -- every number in a message has a finite range, refused here if outside it, not at an insert or in a sum -----
# (floats: NaN and infinities are refused by StrictModel). Integers that name things (ids, seqs, sizes) fit a
# database's BIGINT (SQLite's INTEGER). Counters are per record, and small enough that the fleet can add up
# millions of them in a 64-bit integer or a double without overflow or loss.
MAX_INT = 2**62
MAX_ID = 2**31  # ids of the fleet's rows (a rollout's): its id columns are 32-bit INTEGERs on PostgreSQL
MAX_COUNT = 2**40  # requests, errors, batches, samples in one record: > 300 million a second over an hour
MAX_TS = 2.0**34  # unix seconds (the year 2514); a box without a clock sends small ones, never negative
MAX_DURATION_S = 30 * 86400.0  # an interval, an install
MAX_LATENCY_MS = 86_400_000.0  # one day
MAX_PERCENT = 100.0 * 4096  # a process's CPU: 100 per core
MAX_MB = 2.0**40  # memory figures in MiB
MAX_RATE = 1e12  # items per second


class _Message(StrictModel):
    v: int = MESSAGE_VERSION
    device_id: str
    ts: float = Field(ge=0.0, le=MAX_TS)  # unix seconds


class DesiredState(_Message):
    """What the fleet wants a device to run. ``model`` None means: run nothing new."""

    kind: Literal["desired"] = "desired"
    rollout_id: int | None = Field(ge=1, lt=MAX_ID)
    model: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    version: str = Field(pattern=r"^[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}$")
    target: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*/[0-9.]+/[a-z0-9][a-z0-9._-]*\.tar$")  # TUF target path
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(gt=0, lt=MAX_INT)
    # "shadow": load the model next to the active one, mirror a sample of live requests to it off the
    # request path and report how well it agrees (Telemetry.shadow); keep serving the active model
    mode: Literal["shadow"] | None = None
    # the rollout's cap on the bundle download's rate (None: none); the box takes the lower of it and its own
    download_max_bytes_per_s: int | None = Field(default=None, ge=4096, le=10_000_000_000)
    # the device's maintenance window (protocol.window): download at once, install only inside it, judged on the
    # time the box trusts; None: install at once (no window, or the rollout is urgent)
    install_window: MaintenanceWindow | None = None


class SelfTestResult(StrictModel):
    """The bundle's self-test as the device ran it on its own CPU (compare with the manifest's
    ``selftest_summary`` and accuracy, measured on the build host)."""

    samples: int = Field(gt=0, lt=MAX_COUNT)
    top1: float | None = Field(default=None, ge=0.0, le=1.0)  # against the sample's labels
    top1_agreement: float | None = Field(default=None, ge=0.0, le=1.0)  # argmax equal to the build's outputs
    drift: float = Field(ge=0.0, le=1e9)  # worst |device - build| / tolerance over the outputs; above 1 fails


class Timing(StrictModel):
    """Items per second the device measured at one batch size (on its own cores, in turns with serving)."""

    batch_size: int = Field(gt=0, lt=MAX_COUNT)
    items_per_s: float = Field(ge=0.0, le=MAX_RATE)


class PrecisionTiming(StrictModel):
    """One precision of the bundle, timed on the device at install."""

    precision: Literal["fp32", "fp16", "int8", "bf16"]
    items_per_s: float = Field(ge=0.0, le=MAX_RATE)  # geometric mean over ``timings``: what the choice compares
    timings: tuple[Timing, ...] = Field(default=(), max_length=32)


RuntimeName = Literal["onnxruntime", "openvino", "litert", "tensorrt"]


class RuntimeTiming(StrictModel):
    """One runtime that can run the bundle's engine file, timed on the device at install
    (agent/install/runtime_choice.py)."""

    runtime: RuntimeName
    items_per_s: float = Field(ge=0.0, le=MAX_RATE)  # geometric mean over ``timings``: what the choice compares
    timings: tuple[Timing, ...] = Field(default=(), max_length=32)


class RuntimeChoice(StrictModel):
    """The runtime serving the version (``only``: the one installed here that runs it; ``device``: the fastest
    as timed here; ``operator``: the agent's config), with the figures it was chosen by."""

    runtime: RuntimeName
    source: Literal["only", "device", "operator"]
    runtimes: tuple[RuntimeTiming, ...] = Field(default=(), max_length=8)


class ServingChoice(StrictModel):
    """How the device serves the version it installed, and how it chose that on its own CPU: the precision
    (``bundle``: the one engine the bundle has, or the compiler's choice; ``device``: the fastest of the
    bundle's passing precisions as timed here; ``operator``: the agent's config), the largest batch formed
    (``measured`` here, set by the ``operator``, or ``off``) and the layout (instances x threads per instance)."""

    precision: Literal["fp32", "fp16", "int8", "bf16"]
    precision_source: Literal["bundle", "device", "operator"]
    precisions: tuple[PrecisionTiming, ...] = Field(default=(), max_length=8)
    max_batch_size: int = Field(gt=0, lt=MAX_COUNT)
    batch_source: Literal["measured", "operator", "off"]
    batch_timings: tuple[Timing, ...] = Field(default=(), max_length=32)
    instances: int = Field(gt=0, le=1024)
    threads: int = Field(gt=0, le=1024)
    layout_source: Literal["measured", "operator", "default"] = "default"
    # the runtime serving it (issue 35); left out when unset, so a fleet of the previous release reads the rest
    runtime: RuntimeChoice | None = None


class ReportedState(_Message):
    kind: Literal["reported"] = "reported"
    state: Literal["downloading", "installing", "installed", "failed", "rolled_back", "shadowing"]
    rollout_id: int | None = Field(ge=1, lt=MAX_ID)
    model: str | None = Field(max_length=64)
    version: str | None = Field(max_length=32)
    running_model: str | None = Field(max_length=64)
    running_version: str | None = Field(max_length=32)
    error: str | None = None
    install_s: float | None = Field(default=None, ge=0.0, le=MAX_DURATION_S)
    selftest: SelfTestResult | None = None  # with state "installed", for the model just installed
    # with state "installed": how the device serves it (precision, batch sizes and layout, chosen on its own CPU).
    # Left out when unset, so a fleet of the previous release, which forbids unknown keys, reads the rest
    serving: ServingChoice | None = None


class LatencySummary(StrictModel):
    p50_ms: float | None = Field(ge=0.0, le=MAX_LATENCY_MS)
    p95_ms: float | None = Field(ge=0.0, le=MAX_LATENCY_MS)
    p99_ms: float | None = Field(ge=0.0, le=MAX_LATENCY_MS)
    max_ms: float | None = Field(ge=0.0, le=MAX_LATENCY_MS)


class DeviceSummary(StrictModel):
    """The box itself, not the agent process: whole-box CPU, memory, hottest thermal zone."""

    cpu_percent: float | None = Field(default=None, ge=0.0, le=MAX_PERCENT)
    memory_used_mb: float | None = Field(default=None, ge=0.0, le=MAX_MB)
    memory_total_mb: float | None = Field(default=None, ge=0.0, le=MAX_MB)
    temperature_c: float | None = Field(default=None, ge=-273.15, le=1000.0)


class ShadowFigures(StrictModel):
    """A candidate running in shadow, since it was loaded: how often its answers agree with the active
    model's on the same live requests (top-1 for class scores), the worst absolute difference, its p99. For a
    pipeline (agent/core/shadow.py's PipelineShadow): samples are images, top1_agreement the share of the serving
    pipeline's end answers the candidate keeps (boxes at IoU 0.5 read the same), max_abs_error its worst score gap."""

    model: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    version: str = Field(pattern=r"^[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}$")
    samples: int = Field(ge=0, lt=MAX_COUNT)  # summed over a wave by the fleet
    top1_agreement: float | None = Field(default=None, ge=0.0, le=1.0)
    max_abs_error: float | None = Field(default=None, ge=0.0)  # any finite float: compared, never summed
    p99_ms: float | None = Field(default=None, ge=0.0, le=MAX_LATENCY_MS)


class StageFigures(StrictModel):
    """One stage of a pipeline over a telemetry interval (the agent serves the pipeline as one model; the record's
    own figures are the whole pipeline's): the pipeline requests that used the stage, those that failed in it,
    their time in it (its queue and runtime, ms) and the batches it ran (a reader's batch: crops)."""

    calls: int = Field(ge=0, lt=MAX_COUNT)
    errors: int = Field(ge=0, lt=MAX_COUNT)
    latency: LatencySummary
    batches: int = Field(ge=0, lt=MAX_COUNT)
    batch_size_mean: float | None = Field(default=None, ge=0.0, le=MAX_COUNT)
    batch_size_max: int | None = Field(default=None, ge=0, lt=MAX_COUNT)


class DownloadFigures(StrictModel):
    """The bundle download in progress when the record was made (agent/link/resume.py): bytes kept of the signed
    length, the current attempt's rate, the time left at that rate (None: not known yet), tries after the first."""

    target: str = Field(max_length=256)
    bytes_done: int = Field(ge=0, lt=MAX_INT)
    bytes_total: int = Field(gt=0, lt=MAX_INT)
    bytes_per_s: float = Field(ge=0.0, le=MAX_RATE)
    eta_s: float | None = Field(default=None, ge=0.0, le=MAX_DURATION_S)
    resumes: int = Field(default=0, ge=0, lt=MAX_COUNT)


class Telemetry(_Message):
    kind: Literal["telemetry"] = "telemetry"
    # (stream, seq) identifies a record: stream is random per spool (a re-imaged device starts a new
    # one), seq counts up within it and survives restarts; the fleet drops duplicates by the pair
    stream: str = Field(pattern=r"^[0-9a-f]{16}$")
    seq: int = Field(ge=0, lt=MAX_INT)
    interval_s: float = Field(ge=0.0, le=MAX_DURATION_S)
    model: str | None = Field(max_length=64)
    version: str | None = Field(max_length=32)
    requests: int = Field(ge=0, lt=MAX_COUNT)  # counters of this record's interval, summed by the fleet
    errors: int = Field(ge=0, lt=MAX_COUNT)
    latency: LatencySummary
    batches: int = Field(ge=0, lt=MAX_COUNT)
    batch_size_mean: float | None = Field(ge=0.0, le=MAX_COUNT)
    batch_size_max: int | None = Field(ge=0, lt=MAX_COUNT)
    cpu_percent: float = Field(ge=0.0, le=MAX_PERCENT)
    rss_mb: float = Field(ge=0.0, le=MAX_MB)
    dropped: int | None = Field(default=None, ge=0, lt=MAX_INT)  # records this stream's full spool dropped, in total
    device: DeviceSummary | None = None  # the box itself; left out by agents that have no sample yet
    shadow: ShadowFigures | None = None  # while a candidate runs in shadow
    # how the model it serves now runs: precision, batch sizes and layout as the device chose them (at install,
    # and again at each start: a restart may choose differently, and sends no install report)
    serving: ServingChoice | None = None
    # this interval's answers of the model it serves, counted in its manifest's drift bins (protocol.drift); left
    # out when the model has no drift reference, so a fleet of the previous release reads the rest
    drift: DriftCounts | None = None
    # a pipeline's stages by name (manifest version 7), each over this interval; left out for a single model, so a
    # fleet of the previous release reads the rest
    stages: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")], StageFigures] | None = Field(
        default=None, max_length=8)
    # the box's clock minus the time it trusts (the fleet's signed time, agent/link/clock.py), when past the agent's
    # tolerance (2 days fast: +172800); left out otherwise, so a fleet of the previous release reads the rest
    clock_skew_s: float | None = Field(default=None, ge=-MAX_TS, le=MAX_TS)
    # a bundle download in progress; left out otherwise, so a fleet of the previous release reads the rest
    download: DownloadFigures | None = None


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
    report_ts: float | None = Field(default=None, ge=0.0, le=MAX_TS)


class StatusMessage(_Message):
    kind: Literal["status"] = "status"
    state: Literal["online", "offline"]
    agent_version: str | None = Field(default=None, max_length=32)
    inference_url: str | None = Field(default=None, max_length=256)
    arch: str | None = Field(default=None, max_length=32)
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


class MessageError(SchemaError):
    """A message that breaks its schema. ``document`` is the message as parsed when it was a JSON object (else
    None), so that a caller can read what identifies it (a telemetry record's stream and seq) without parsing
    the payload a second time."""

    def __init__(self, source: str, problems: list[str], document: dict[str, Any] | None = None):
        super().__init__(source, problems)
        self.document = document


class MessageVersionError(UnsupportedVersionError):
    """A message of a newer protocol version than this code reads; ``document`` as in MessageError."""

    def __init__(self, message: str, document: dict[str, Any]):
        super().__init__(message)
        self.document = document


MAX_NAMED = 5  # of the unknown keys or other problems of one message, named in its one-line error


def _names(keys: list[str], total: int) -> str:
    """The first few of ``total`` names, each cut to 40 characters."""
    shown = ", ".join(repr(k[:40]) for k in keys[:MAX_NAMED])
    return shown + (f" and {total - MAX_NAMED} more" if total > MAX_NAMED else "")


def _shape_problem(data: Any) -> str | None:
    """Nesting past MAX_MESSAGE_DEPTH, an object wider than MAX_OBJECT_KEYS or a NUL character in a string,
    anywhere: one iterative pass over the parsed message, no recursion, so that validation never meets thousands of
    keys (each one an error). NUL: no field admits it, and PostgreSQL's text cannot store it (a report that held one
    failed its whole batch there)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_MESSAGE_DEPTH:
            return f"nested deeper than {MAX_MESSAGE_DEPTH} levels"
        if isinstance(value, dict):
            if len(value) > MAX_OBJECT_KEYS:
                return (f"the object at '{where or '(document)'}' has {len(value)} keys; a message's objects have "
                        f"at most {MAX_OBJECT_KEYS}")
            for k, v in value.items():
                if "\x00" in k or (isinstance(v, str) and "\x00" in v):
                    key = f"{where}.{k[:40]}" if where else k[:40]
                    return f"the string at {key!r} holds a NUL character (\\u0000), which no field admits"
            stack.extend((v, depth + 1, f"{where}.{k[:40]}" if where else k[:40]) for k, v in value.items()
                         if isinstance(v, (dict, list)))
        else:  # a list
            if any(isinstance(v, str) and "\x00" in v for v in value):
                return f"a string in {where or '(document)'!r} holds a NUL character (\\u0000), which no field admits"
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value) if isinstance(v, (dict, list)))
    return None


def _problems(exc: ValidationError) -> list[str]:
    """The problems of a message in a few lines whatever their number: unknown keys counted with the first few
    named, then the first few others."""
    unknown: list[str] = []
    other: list[str] = []
    for err in exc.errors(include_url=False, include_context=False, include_input=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(document)"
        if err["type"] == "extra_forbidden":
            unknown.append(loc)
        elif len(other) < MAX_NAMED:
            other.append(f"missing key '{loc}'" if err["type"] == "missing" else f"key '{loc}': {err['msg']}")
    out = [f"{len(unknown)} unknown key{'s' if len(unknown) > 1 else ''}: {_names(unknown, len(unknown))}"
           ] if unknown else []
    rest = exc.error_count() - len(unknown) - len(other)
    return out + other + ([f"and {rest} more problems"] if rest > 0 else [])


def decode(model: type[T], payload: bytes, source: str) -> T:
    """One message, bounded in size, nesting, width and work: parsed once (pydantic-core's parser), its shape
    checked in one pass, then validated; refused with a MessageError (a SchemaError) in one line, or an
    UnsupportedVersionError. The cost is proportional to the bytes, not to how many problems they hold."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise MessageError(source, [f"{len(payload)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"])
    try:
        # strings not cached: a message of thousands of distinct keys would only churn pydantic-core's cache
        data: Any = pydantic_core.from_json(payload, cache_strings=False)
    except ValueError as exc:  # not JSON, not UTF-8, or deeper than pydantic-core's own limit (~200)
        reason = str(exc)
        if "recursion limit" in reason:
            raise MessageError(source, [f"nested deeper than {MAX_MESSAGE_DEPTH} levels"]) from exc
        raise MessageError(source, [f"not valid JSON: {reason[:200]}"]) from exc
    if not isinstance(data, dict):
        raise MessageError(source, [f"expected a mapping at the top level, got {type(data).__name__}"])
    if isinstance(data.get("v"), int) and data["v"] > MESSAGE_VERSION:
        raise MessageVersionError(f"{source}: message version {data['v']} is newer than {MESSAGE_VERSION}", data)
    unknown = data.keys() - model.model_fields.keys()
    if unknown:  # checked first: a wide message is refused without walking or validating it
        first = list(itertools.islice((k for k in data if k in unknown), MAX_NAMED))
        raise MessageError(source, [f"{len(unknown)} unknown key{'s' if len(unknown) > 1 else ''}: "
                                    f"{_names(first, len(unknown))}"], data)
    problem = _shape_problem(data)
    if problem is not None:
        raise MessageError(source, [problem], data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise MessageError(source, _problems(exc), data) from exc


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """``mqtt://host[:1883]`` or ``mqtts://host[:8883]`` (TLS) -> (host, port)."""
    from urllib.parse import urlsplit

    from .errors import ConfigError

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
