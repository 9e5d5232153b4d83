"""The client of the fleet's REST API: stdlib HTTP (urllib) and the response models of ``fleet.schemas``, so an
agent-only install can run the CLI (``edgefleet fleet ...``, ``edgefleet rollout ...``) and the simulator.

Errors (all ``FleetClientError``, the CLI's exit 6):

    FleetClientError
    ├── FleetUnreachable  the fleet could not be reached, or did not answer in time (transport)
    ├── FleetHTTPError    the fleet answered with an error status; the message is the server's
    └── FleetBadAnswer    the fleet answered 2xx with something this client cannot read (too big, not JSON,
                          not the documented model: a fleet of another version?)
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from ..protocol import jsonlimits
from ..protocol.errors import ContractError, EdgefleetError
from ..protocol.exits import ExitCode
from . import schemas as s

__all__ = ["FleetBadAnswer", "FleetClient", "FleetClientError", "FleetHTTPError", "FleetUnreachable"]

T = TypeVar("T")
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a rollout of 100,000 devices with its targets is ~10 MB
MAX_ERROR_BYTES = 64 * 1024
ROLLOUT_ACTIONS = ("pause", "resume", "abort", "rollback")


class FleetClientError(EdgefleetError):
    """Talking to the fleet failed."""

    exit_code = ExitCode.FLEET


class FleetUnreachable(FleetClientError):
    """The fleet server could not be reached (transport)."""


class FleetHTTPError(FleetClientError):
    """The fleet answered with an error status; the message is the server's."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


class FleetBadAnswer(FleetClientError):
    """The fleet answered with something this client cannot read."""


class FleetClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0, token: str | None = None):
        self.base = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token or os.environ.get("EDGEFLEET_TOKEN")  # the fleet's API token (Bearer)

    # -- transport ----------------------------------------------------------------------------------
    def _raw(self, method: str, path: str, body: bytes | None = None,
             content_type: str = "application/json") -> bytes:
        req = urllib.request.Request(f"{self.base}{path}", data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", content_type)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = bytes(r.read(MAX_ANSWER_BYTES + 1))
        except urllib.error.HTTPError as exc:
            raise FleetHTTPError(exc.code, _error_message(exc.read(MAX_ERROR_BYTES))) from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, DNS, TLS, timeout
            raise FleetUnreachable(f"cannot reach the fleet at {self.base}: {exc}; is 'edgefleet fleet serve' "
                                   "running there?") from exc
        if len(raw) > MAX_ANSWER_BYTES:
            raise FleetBadAnswer(f"{method} {path}: the answer exceeds {MAX_ANSWER_BYTES} bytes")
        return raw

    def _call(self, answer: type[T] | Any, method: str, path: str, doc: Any = None, *, body: bytes | None = None,
              content_type: str = "application/json") -> T:
        """``method path`` with ``doc`` as JSON (or ``body`` as is), the answer parsed into ``answer``."""
        if doc is not None:
            body = json.dumps(doc).encode()
        raw = self._raw(method, path, body, content_type)
        try:
            data = jsonlimits.loads(raw, source=f"the fleet's answer to {method} {path}", max_bytes=MAX_ANSWER_BYTES)
            return TypeAdapter(answer).validate_python(data)  # type: ignore[no-any-return]
        except ContractError as exc:
            raise FleetBadAnswer(str(exc)) from exc
        except ValidationError as exc:
            raise FleetBadAnswer(f"the fleet's answer to {method} {path} is not this client's "
                                 f"{getattr(answer, '__name__', answer)} (a fleet of another version?): "
                                 f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from exc

    # -- the API ----------------------------------------------------------------------------------
    def health(self) -> s.Health:
        return self._call(s.Health, "GET", "/api/v1/health")

    def bootstrap(self) -> s.Bootstrap:
        return self._call(s.Bootstrap, "GET", "/api/v1/bootstrap")

    def upload(self, bundle: Path, sign_key: Path | None = None) -> s.ModelBuild:
        """Upload a bundle. With ``sign_key`` (the compiler CI's ``bundles`` key, for a fleet that does not
        sign): first sign it into the fleet's current bundles metadata, here, and publish that."""
        if sign_key is not None:
            from ..protocol.bundle import read_manifest
            from .keys import bundle_target, sign_bundle

            target, custom = bundle_target(read_manifest(bundle))
            current = self._raw("GET", "/api/v1/bundles/signed-metadata")
            signed = sign_bundle(sign_key, current, target, bundle, custom.signed_fields())
            self._call(s.Published, "POST", "/api/v1/bundles/signed-metadata", body=signed)
        return self._call(s.ModelBuild, "POST", "/api/v1/bundles", body=bundle.read_bytes(),
                          content_type="application/x-tar")

    def register(self, device_id: str, labels: dict[str, str] | None = None) -> s.Device:
        return self._call(s.Device, "POST", "/api/v1/devices", {"device_id": device_id, "labels": labels})

    def devices(self) -> list[s.Device]:
        return self._call(list[s.Device], "GET", "/api/v1/devices")

    def device(self, device_id: str) -> s.Device:
        return self._call(s.Device, "GET", f"/api/v1/devices/{_seg(device_id)}")

    def telemetry(self, device_id: str, limit: int = 50) -> list[s.TelemetryRecord]:
        return self._call(list[s.TelemetryRecord], "GET", f"/api/v1/devices/{_seg(device_id)}/telemetry?limit={limit}")

    def enrollment_token(self, device_id: str, ttl_s: float = 86400.0) -> s.EnrollmentToken:
        return self._call(s.EnrollmentToken, "POST", f"/api/v1/devices/{_seg(device_id)}/enrollment-token",
                          {"ttl_s": ttl_s})

    def enroll(self, token: str) -> s.Enrolled:
        """What a device does: trade a one-time enrollment token for its MQTT account."""
        return self._call(s.Enrolled, "POST", "/api/v1/enroll", {"token": token})

    def decommission(self, device_id: str) -> s.Device:
        return self._call(s.Device, "POST", f"/api/v1/devices/{_seg(device_id)}/decommission", {})

    def models(self) -> list[s.ModelBuild]:
        return self._call(list[s.ModelBuild], "GET", "/api/v1/models")

    def create_rollout(self, model: str, version: str, **spec: Any) -> s.Rollout:
        """POST /api/v1/rollouts: targets (``devices``, ``group``, ``tags``, ``profile``) and the spec (``waves``,
        ``soak_s``, ``gates``, ``shadow``, ``on_failure``...); None values are left out (the fleet's default)."""
        doc = {"model": model, "version": version, **{k: v for k, v in spec.items() if v is not None}}
        return self._call(s.Rollout, "POST", "/api/v1/rollouts", doc)

    def rollout(self, model: str, version: str, devices: list[str], profile: str | None = None) -> s.Rollout:
        """Roll ``version`` out to ``devices`` in one wave."""
        return self.create_rollout(model, version, devices=devices, profile=profile)

    def get_rollout(self, rollout_id: int, targets: bool = True) -> s.Rollout:
        return self._call(s.Rollout, "GET", f"/api/v1/rollouts/{rollout_id}?targets={str(targets).lower()}")

    def rollouts(self, limit: int = 100) -> list[s.Rollout]:
        return self._call(list[s.Rollout], "GET", f"/api/v1/rollouts?limit={limit}")

    def rollout_action(self, rollout_id: int, action: str) -> s.Rollout:
        if action not in ROLLOUT_ACTIONS:
            raise ValueError(f"unknown rollout action {action!r}: {', '.join(ROLLOUT_ACTIONS)}")
        return self._call(s.Rollout, "POST", f"/api/v1/rollouts/{rollout_id}/{action}")

    def rollout_audit(self, rollout_id: int) -> list[s.AuditEntry]:
        return self._call(list[s.AuditEntry], "GET", f"/api/v1/rollouts/{rollout_id}/audit")

    def windows(self) -> list[s.Window]:
        """GET /api/v1/windows: every group's and device's maintenance window."""
        return self._call(list[s.Window], "GET", "/api/v1/windows")

    def set_window(self, scope: str, name: str, window: dict[str, Any]) -> s.Window:
        """PUT /api/v1/windows/{scope}/{name}: give a group or a device (``scope``) its window (days, start,
        duration_min, tz), replacing the one it had."""
        return self._call(s.Window, "PUT", f"/api/v1/windows/{_seg(scope)}/{_seg(name)}", window)

    def delete_window(self, scope: str, name: str) -> None:
        """DELETE /api/v1/windows/{scope}/{name} (a FleetHTTPError 404 when it had none)."""
        self._raw("DELETE", f"/api/v1/windows/{_seg(scope)}/{_seg(name)}")

    def wait_rollout(self, rollout_id: int, timeout_s: float, interval_s: float = 0.5, targets: bool = True,
                     progress: Callable[[s.Rollout], None] | None = None) -> s.Rollout:
        """Poll until the rollout leaves ``in_progress`` or ``timeout_s`` passes (then it is returned as it is:
        the caller sees the status). ``progress`` is called with each status seen while it is in progress."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.get_rollout(rollout_id, targets)
            if r.status != "in_progress" or time.monotonic() >= deadline:
                return r
            if progress is not None:
                progress(r)
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def _seg(value: str) -> str:
    """One path segment, quoted (a device id with a '/' or '?' stays one segment)."""
    return urllib.parse.quote(value, safe="")


def _error_message(raw: bytes) -> str:
    """The server's ``{"error": ...}`` (FastAPI's own ``detail`` too), else the start of the body."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    msg = doc.get("error") or doc.get("detail") if isinstance(doc, dict) else None
    if msg is None:
        return raw.decode(errors="replace")[:500]
    return msg if isinstance(msg, str) else json.dumps(msg)
