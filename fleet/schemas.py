"""The fleet REST API's responses (``/api/v1``), one model per kind of answer.

The server declares them as its endpoints' ``response_model`` (so ``/openapi.json`` names them and every
answer is validated against them on the way out); the CLI client (``fleet.client``) parses answers into
them. Imports only pydantic and ``protocol``, so an agent-only install can run the CLI.

Unknown keys are ignored, not refused: a newer fleet may add a field without breaking an older CLI (the
client only shows what it reads; it acts on nothing it does not know). The parts that are the bundle
manifest's own (accuracy, quantization, precision choice) or a device's message (telemetry) are the
protocol's models and follow the protocol's version rules.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..protocol import manifest as pm
from ..protocol import mqtt as proto
from ..protocol.window import MaintenanceWindow

__all__ = [
    "MAX_OFFSET",
    "MAX_PAGE",
    "AuditEntry",
    "Bootstrap",
    "Device",
    "DeviceBatchResult",
    "DeviceCounts",
    "Enrolled",
    "EnrollmentToken",
    "Error",
    "Gate",
    "Group",
    "Health",
    "ModelBuild",
    "Published",
    "Rollout",
    "RolloutTarget",
    "SignedMetadata",
    "Stats",
    "TelemetryRecord",
    "Token",
    "TokenCreated",
    "Wave",
]


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, protected_namespaces=())


class Error(ApiModel):
    """Every error answer (4xx, 5xx): the reason in one line."""

    error: str


class Health(ApiModel):
    status: Literal["ok", "degraded"]  # "ok" only while MQTT messages can reach the database
    mqtt_connected: bool
    mqtt_restarts: int
    ingest_restarts: int
    ingest_backlog: int
    problems: list[str]


class Bootstrap(ApiModel):
    """What an agent needs to find the broker and the TUF repository."""

    mqtt_url: str
    tuf_metadata_url: str
    tuf_targets_url: str
    mqtt_auth: bool  # True: agents need credentials (POST /api/v1/enroll with a token)


class TimeStatement(ApiModel):
    """What the fleet signs: its time for a device's nonce (protocol.signed_time)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    type: str = Field(alias="_type")  # "edgefleet-time"
    nonce: str
    time: str  # UTC, "YYYY-MM-DDTHH:MM:SSZ"


class TimeSignature(ApiModel):
    keyid: str
    sig: str


class SignedTime(ApiModel):
    """The fleet's time, signed with the TUF timestamp role's key over the canonical JSON of ``signed``."""

    signed: TimeStatement
    signatures: list[TimeSignature]


class Enrolled(Bootstrap):
    """A device's MQTT account, returned once, with what /api/v1/bootstrap says."""

    device_id: str
    mqtt_username: str
    mqtt_password: str


class DeviceBatchResult(ApiModel):
    registered: int  # devices new to the fleet
    updated: int  # devices it already knew


class EnrollmentToken(ApiModel):
    device_id: str
    token: str  # one-time; the fleet keeps only its hash
    expires_in_s: float


class DesiredModel(ApiModel):
    model: str
    version: str
    rollout_id: int | None


class Hardware(ApiModel):
    arch: str | None
    cpu_features: list[str]


class BuildFigures(ApiModel):
    """What the compiler measured for the build a device self-tested."""

    profile: str
    precision: str
    top1: float | None
    accuracy: float
    metric: str
    eval_samples: int


class DeviceSelfTest(ApiModel):
    """The self-test a device ran on its own CPU (protocol.mqtt.SelfTestResult) next to the build's figures."""

    model: str | None
    version: str | None
    samples: int | None = None
    top1: float | None = None
    top1_agreement: float | None = None
    drift: float | None = None
    build: BuildFigures | None = None
    # the precision, batch sizes and layout the device chose on its own CPU at that install
    serving: proto.ServingChoice | None = None


class TelemetryRecord(proto.Telemetry):
    """A telemetry record as the device sent it (protocol.mqtt.Telemetry)."""

    model_config = ConfigDict(extra="ignore")


class Device(ApiModel):
    device_id: str
    labels: dict[str, str]
    registered_via: str  # "api" or "mqtt" (seen before anyone registered it)
    online: bool
    last_seen: str | None  # ISO 8601, UTC
    agent_version: str | None
    inference_url: str | None
    running_model: str | None
    running_version: str | None
    last_state: str | None  # its last report's state, or "decommissioned"
    last_error: str | None
    desired: DesiredModel | None
    telemetry: TelemetryRecord | None  # the newest record
    hardware: Hardware | None
    selftest: DeviceSelfTest | None
    group: str | None
    tags: list[str]
    profile: str | None


class Group(ApiModel):
    group: str
    devices: int
    online: int


class DeviceCounts(ApiModel):
    """The whole fleet's devices, counted in the database: the console's summary, and /api/v1/stats's counts."""

    devices: int
    online: int
    failing: int = 0  # their last report failed or rolled back (the console's; 0 where not counted)
    telemetry_rows: int = 0  # telemetry records stored (/api/v1/stats; 0 where not counted)


class Window(ApiModel):
    """A group's or a device's maintenance window (fleet.windows)."""

    scope: Literal["group", "device"]
    name: str
    window: MaintenanceWindow


class ModelBuild(ApiModel):
    """An uploaded bundle: one model version built for one hardware profile, a signed TUF target."""

    id: int
    name: str
    version: str
    profile: str
    backend: str
    precision: str
    target: str  # TUF target path
    sha256: str
    size_bytes: int
    accuracy: pm.AccuracyReport
    uploaded_at: str | None
    cpu_features: list[str]
    quantization: pm.QuantizationInfo | None
    precision_choice: pm.PrecisionChoice | None
    selftest_summary: pm.SelfTestSummary | None


class Stats(ApiModel):
    rejected: dict[str, int]  # rejected input by kind
    devices: int
    online: int
    telemetry_rows: int
    replica: dict[str, Any] | None = None  # what this replica handled from MQTT


class Gate(ApiModel):
    name: str
    value: float | None  # None: no figures yet
    threshold: float
    passed: bool
    detail: str


class Wave(ApiModel):
    index: int
    size: int
    soak_s: float
    state: str
    installed: int
    failed: int
    started_at: str | None
    soak_until: str | None
    gates: list[Gate] | None  # once judged
    gates_live: list[Gate] | None = None  # while installing, soaking or shadowing: the figures so far


class RolloutTarget(ApiModel):
    device_id: str
    state: str
    error: str | None
    wave: int
    updated_at: str | None
    # the profile of the bundle this device is sent: its own, or its profile's cpu_fallback (e.g. arm64-cpu for a
    # Jetson while the version has no TensorRT bundle)
    bundle_profile: str | None = None
    # the bundle download in progress, from the device's newest telemetry (bytes, rate, ETA); None otherwise
    download: proto.DownloadFigures | None = None


class Rollout(ApiModel):
    id: int
    model: str
    version: str
    profile: str  # the first target's build
    profiles: list[str]
    status: str
    reason: str | None
    created_by: str | None
    created_at: str | None
    finished_at: str | None
    current_wave: int
    spec: dict[str, Any]  # waves, soak, gates, shadow, on_failure... as created
    counts: dict[str, int]  # devices by state
    waves: list[Wave]
    # set while the rollout driver cannot evaluate this rollout (e.g. its stored figures or spec cannot be read): why,
    # and since when (ISO 8601, UTC). The driver retries it with a growing pause; the other rollouts go on. Cleared
    # once it advances again or an operator changes its state (pause, abort, rollback)
    engine_error: str | None = None
    engine_error_at: str | None = None
    targets: list[RolloutTarget] | None = None  # left out by lists and with ?targets=false
    # with ?targets_limit= (and targets_offset=, targets_state=): ``targets`` is that page (by device id)
    # and this is how many targets match the state filter in all; unset when every target is sent
    targets_total: int | None = None


# -- paging (query parameters, not bodies) ----------------------------------------------------------
# GET /api/v1/devices?limit=&offset=&group=&state=&q=: a list of Device, by id. Without ``limit`` every
# matching device (today's answer); ``limit`` is 0..MAX_PAGE, ``offset`` 0..MAX_OFFSET; ``group`` exact, ``state`` a
# last report's state or "online"/"offline", ``q`` a substring of the device id. The answer's
# ``X-Total-Count`` header says how many devices match in all.
# GET /api/v1/rollouts/{id}?targets_limit=&targets_offset=&targets_state=: one page of its targets (above).
MAX_PAGE = 1000
MAX_OFFSET = 10**9  # any ``offset``/``targets_offset`` above is refused (422)


class AuditEntry(ApiModel):
    id: int
    ts: str | None
    actor: str
    action: str
    rollout_id: int | None
    device_id: str | None
    detail: dict[str, Any] | None


class Token(ApiModel):
    name: str
    role: str
    created_by: str | None
    created_at: str
    revoked: bool


class TokenCreated(ApiModel):
    name: str
    role: str
    token: str  # in this answer only; the fleet keeps its SHA-256


class SignedMetadata(ApiModel):
    """TUF metadata as signed (the ``bundles`` role's)."""

    signed: dict[str, Any]
    signatures: list[dict[str, Any]] = Field(max_length=1000)


class Published(ApiModel):
    published: bool
