"""Release 8: each rollout wave's telemetry over time (issue 34.5, fleet.series).

The tables ``wave_series`` (a wave's records of one minute, ten minutes or an hour summed, by model version) and
``wave_drift_bins`` (their drift counts, one row per feature and bin) come from create_all, which runs before this (as
drift_scores did for 0005): an older database gains them with no statement here. They start empty: a wave's charts
begin with the first telemetry stored after the upgrade. The revision marks the schema that has them, so a fleet of
the previous release refuses this database instead of running without the tables its ingest writes.

Revision ID: 0008
"""

from edgefleet.fleet.migrations import no_downgrade

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    pass  # wave_series, wave_drift_bins: created by fleet.db's models (create_all) before the upgrade runs


downgrade = no_downgrade
