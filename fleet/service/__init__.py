"""The fleet's operations, independent of HTTP and MQTT, one service per area:

- ``devices.DeviceService``: the registry (registration, selectors, decommission, listings and counts)
- ``models.ModelService``: bundle upload (checked, signed into the TUF repository) and the builds held
- ``rollouts.RolloutService``: rollouts as the API sees them (the state machine is fleet.rollout's engine)
- ``ingest.IngestService``: what devices send over MQTT (statuses, reports, telemetry), in batches

``FleetService`` builds them over one database, repository and publisher and answers each verb with its area's own
method (``service.register_device`` is ``service.device_service.register_device``): the server, the routes and
the tests hold one object.
"""

from __future__ import annotations

from sqlalchemy.orm import sessionmaker

from edgefleet.fleet.audit import Rejections
from edgefleet.fleet.rollout import RolloutEngine
from edgefleet.fleet.service.common import (
    MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_TAG_CHARS,
    MAX_TAGS,
    Publisher,
    check_labels,
)
from edgefleet.fleet.service.devices import DeviceService
from edgefleet.fleet.service.ingest import REPORT_CLOCK_AHEAD_S, IngestService
from edgefleet.fleet.service.models import ModelService
from edgefleet.fleet.service.rollouts import RolloutService
from edgefleet.fleet.tuf_repo import Repository

__all__ = ["MAX_LABELS", "MAX_LABEL_KEY_CHARS", "MAX_LABEL_VALUE_CHARS", "MAX_TAGS", "MAX_TAG_CHARS",
           "REPORT_CLOCK_AHEAD_S", "DeviceService", "FleetService", "IngestService", "ModelService", "Publisher",
           "RolloutService", "check_labels"]


class FleetService:
    def __init__(self, sessions: sessionmaker, repo: Repository, publisher: Publisher,
                 accept_unknown_devices: bool = True, owner: str | None = None):
        self.sessions = sessions
        self.repo = repo
        self.publisher = publisher
        self.rejections = Rejections()
        self.rollouts = RolloutEngine(sessions, publisher, owner)
        known: set[str] = set()  # device ids this replica knows are in the database
        self.device_service = d = DeviceService(sessions, known)
        self.model_service = m = ModelService(sessions, repo)
        self.rollout_service = r = RolloutService(sessions, publisher, self.rollouts)
        self.ingest_service = i = IngestService(sessions, self.rollouts, self.rejections, known,
                                                accept_unknown_devices)
        # the verbs, each its area's own bound method
        self.register_device, self.register_devices, self.update_device = \
            d.register_device, d.register_devices, d.update_device
        self.decommission_device, self.device_enrolled, self.device_audit = \
            d.decommission_device, d.device_enrolled, d.device_audit
        self.get_device, self.list_devices, self.find_devices, self.devices_by_id = \
            d.get_device, d.list_devices, d.find_devices, d.devices_by_id
        self.list_groups, self.device_counts, self.device_telemetry, self.counts, self.telemetry_count = \
            d.list_groups, d.device_counts, d.device_telemetry, d.counts, d.telemetry_count
        self.upload_bundle, self.list_models = m.upload_bundle, m.list_models
        self.create_rollout, self.rollout_action, self.republish_desired = \
            r.create_rollout, r.rollout_action, r.republish_desired
        self.list_rollouts, self.get_rollout, self.rollout_targets, self.audit_log = \
            r.list_rollouts, r.get_rollout, r.rollout_targets, r.audit_log
        self.handle_status, self.handle_statuses, self.handle_reported, self.handle_reports = \
            i.handle_status, i.handle_statuses, i.handle_reported, i.handle_reports
        self.handle_telemetry, self.store_telemetry = i.handle_telemetry, i.store_telemetry
        self.handle_retained_statuses = i.handle_retained_statuses
