"""A small client for the fleet's REST API (stdlib only, so any install of edgefleet can use it)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from protocol.errors import EdgefleetError

__all__ = ["FleetClient", "FleetHTTPError", "FleetUnreachable"]


class FleetUnreachable(EdgefleetError):
    """The fleet server could not be reached (transport)."""


class FleetHTTPError(EdgefleetError):
    """The fleet answered with an error status; the message is the server's."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


class FleetClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0, token: str | None = None):
        import os

        self.base = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token or os.environ.get("EDGEFLEET_TOKEN")  # the fleet's API token (Bearer)

    def _call(self, method: str, path: str, body: bytes | None = None,
              content_type: str = "application/json") -> Any:
        return json.loads(self._raw(method, path, body, content_type) or b"null")

    def _raw(self, method: str, path: str, body: bytes | None = None,
             content_type: str = "application/json") -> bytes:
        req = urllib.request.Request(f"{self.base}{path}", data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", content_type)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                detail = json.loads(raw)
                msg = detail.get("error") or detail.get("detail") or raw.decode(errors="replace")
            except (ValueError, AttributeError):
                msg = raw.decode(errors="replace")[:500]
            raise FleetHTTPError(exc.code, msg if isinstance(msg, str) else json.dumps(msg)) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise FleetUnreachable(f"cannot reach the fleet at {self.base}: {exc}; is 'edgefleet fleet serve' "
                                   "running there?") from exc

    def get(self, path: str) -> Any:
        return self._call("GET", path)

    def post(self, path: str, doc: Any) -> Any:
        return self._call("POST", path, json.dumps(doc).encode())

    def health(self) -> dict[str, Any]:
        return self.get("/api/v1/health")

    def upload(self, bundle: Path, sign_key: Path | None = None) -> dict[str, Any]:
        """Upload a bundle. With ``sign_key`` (the compiler CI's ``bundles`` key, for a fleet that does not
        sign): first sign it into the fleet's current bundles metadata, here, and publish that."""
        if sign_key is not None:
            from fleet.keys import bundle_target, sign_bundle
            from protocol.bundle import read_manifest

            target, custom = bundle_target(read_manifest(bundle))
            current = self._raw("GET", "/api/v1/bundles/signed-metadata")
            signed = sign_bundle(sign_key, current, target, bundle, custom)
            self._call("POST", "/api/v1/bundles/signed-metadata", signed)
        return self._call("POST", "/api/v1/bundles", bundle.read_bytes(), "application/x-tar")

    def register(self, device_id: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        return self.post("/api/v1/devices", {"device_id": device_id, "labels": labels})

    def devices(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/devices")

    def models(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/models")

    def rollout(self, model: str, version: str, devices: list[str], profile: str | None = None) -> dict[str, Any]:
        return self.post("/api/v1/rollouts", {"model": model, "version": version, "devices": devices,
                                              "profile": profile})

    def get_rollout(self, rollout_id: int) -> dict[str, Any]:
        return self.get(f"/api/v1/rollouts/{rollout_id}")

    def rollouts(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/rollouts")
