"""Fleet errors.

    FleetError
    ├── NotFound            a device, model or rollout the request names does not exist (HTTP 404)
    ├── Conflict            the request clashes with what is stored (HTTP 409)
    ├── BadRequest          the operator's request or upload is malformed (HTTP 400/413/422)
    ├── Unauthorized        no bearer token, or one the fleet does not know (HTTP 401)
    ├── Forbidden           the token's role may not do this (HTTP 403)
    ├── DeviceInputRejected a device sent something the fleet will not act on (MQTT; counted, logged once)
    ├── KeyStoreError       signing keys missing or unreadable (operator set-up)
    └── RepositoryError     the TUF repository on disk is inconsistent (internal)
"""

from __future__ import annotations

from ..protocol.errors import EdgefleetError

__all__ = ["BadRequest", "Conflict", "DeviceInputRejected", "FleetError", "Forbidden", "KeyStoreError", "NotFound",
           "RepositoryError", "Unauthorized"]


class FleetError(EdgefleetError):
    status_code = 500


class NotFound(FleetError):
    status_code = 404


class Conflict(FleetError):
    status_code = 409


class BadRequest(FleetError):
    status_code = 400

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


class Unauthorized(FleetError):
    status_code = 401


class Forbidden(FleetError):
    status_code = 403


class DeviceInputRejected(FleetError):
    """``kind`` groups the counter (e.g. ``report_not_a_target``); the message names the device."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class KeyStoreError(FleetError):
    pass


class RepositoryError(FleetError):
    pass
