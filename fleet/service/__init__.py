"""The fleet's operations, independent of HTTP and MQTT, one service per area:

- ``devices.DeviceService``: the registry (registration, selectors, decommission, listings and counts; its SQL is
  fleet.queries.devices)
- ``models.ModelService``: bundle upload (checked, signed into the TUF repository) and the builds held
- ``rollouts.RolloutService``: rollouts as the API sees them (the state machine is fleet.rollout's driver)
- ``ingest.IngestService``: what devices send over MQTT (statuses, reports, telemetry), in batches

``FleetService`` builds the four over one database, repository and publisher and holds them, with the rollout
driver they share: callers name the area, ``service.devices.register_device(...)``,
``service.rollouts.get_rollout(...)``, ``service.models.upload_bundle(...)``, ``service.ingest.store_telemetry(...)``;
``service.driver`` is the state machine (``tick``, leases, drift). The services of devices, models and rollouts
answer with the API's schema models (fleet.schemas).
"""

from __future__ import annotations

from sqlalchemy.orm import sessionmaker

from ..audit import Rejections
from ..rollout import RolloutDriver
from ..tuf_repo import Repository
from .common import (
    MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_TAG_CHARS,
    MAX_TAGS,
    Publisher,
    check_labels,
)
from .devices import DeviceService
from .ingest import REPORT_CLOCK_AHEAD_S, IngestService
from .models import ModelService
from .rollouts import RolloutService

__all__ = ["MAX_LABELS", "MAX_LABEL_KEY_CHARS", "MAX_LABEL_VALUE_CHARS", "MAX_TAGS", "MAX_TAG_CHARS",
           "REPORT_CLOCK_AHEAD_S", "DeviceService", "FleetService", "IngestService", "ModelService", "Publisher",
           "RolloutService", "check_labels"]


class FleetService:
    """The fleet's four area services over one database, repository and publisher (and the driver they share)."""

    def __init__(self, sessions: sessionmaker, repo: Repository, publisher: Publisher,
                 accept_unknown_devices: bool = True, owner: str | None = None):
        self.sessions = sessions
        self.repo = repo
        self.publisher = publisher
        self.rejections = Rejections()
        self.driver = RolloutDriver(sessions, publisher, owner)
        known: set[str] = set()  # device ids this replica knows are in the database
        self.devices = DeviceService(sessions, known)
        self.models = ModelService(sessions, repo)
        self.rollouts = RolloutService(sessions, publisher, self.driver)
        self.ingest = IngestService(sessions, self.driver, self.rejections, known, accept_unknown_devices)
