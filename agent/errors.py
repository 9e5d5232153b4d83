"""Agent errors.

    AgentError
    ├── RequestError        a client's inference request is wrong (HTTP 400)
    │   ├── ModelNotFound   (404)
    │   └── PayloadTooLarge (413)
    ├── Unavailable         no model loaded, model being replaced, request expired (HTTP 503)
    │   └── QueueFull       the model's queue is full: retry after a moment (HTTP 429 + Retry-After)
    ├── InferenceFailed     the backend failed on a batch (HTTP 500); every request of the batch gets it
    ├── UpdateError         an update could not be installed; the running model keeps serving
    │   ├── TrustError      the repository's data failed verification (TUF, hashes, manifest)
    │   ├── FetchError      the fleet could not be reached or a download broke (retried)
    │   │   └── DownloadCut a download broke after it moved forward (resumed; not counted as a failed try)
    │   ├── RefusedUpdate   the update is verified but not acceptable (downgrade, wrong profile, a CPU
    │   │                   that lacks the instruction sets the bundle needs)
    │   └── SelfTestFailed  the new model loaded but gave wrong answers on its own sample
    ├── BackendError        a runtime could not load an engine
    └── NotInstalled        a feature asked for needs an extra this box lacks (HTTP 501, naming the extra)

Errors from onnxruntime, python-tuf and paho are translated at the boundary and raised ``from exc``.
"""

from __future__ import annotations

from ..protocol.errors import EdgefleetError

__all__ = [
    "AgentError",
    "BackendError",
    "DownloadCut",
    "FetchError",
    "InferenceFailed",
    "ModelNotFound",
    "NotInstalled",
    "PayloadTooLarge",
    "QueueFull",
    "RefusedUpdate",
    "RequestError",
    "SelfTestFailed",
    "TrustError",
    "Unavailable",
    "UpdateError",
]


class AgentError(EdgefleetError):
    pass


class RequestError(AgentError):
    status_code = 400


class ModelNotFound(RequestError):
    status_code = 404


class PayloadTooLarge(RequestError):
    status_code = 413


class Unavailable(AgentError):
    status_code = 503


class QueueFull(Unavailable):
    status_code = 429


class InferenceFailed(AgentError):
    status_code = 500


class UpdateError(AgentError):
    pass


class TrustError(UpdateError):
    pass


class FetchError(UpdateError):
    pass


class DownloadCut(FetchError):
    """A bundle download that moved its partial file forward before it broke: the retry resumes from there."""


class RefusedUpdate(UpdateError):
    pass


class SelfTestFailed(UpdateError):
    pass


class BackendError(UpdateError):
    pass


class NotInstalled(AgentError):
    """What was asked for needs an optional part of edgefleet this install lacks: the message names the extra."""

    status_code = 501
