"""Release 5: drift scores per device and telemetry record (issue 34, fleet.drift).

The table ``drift_scores`` and its indexes come from create_all, which runs before this (as rollout_waves did for
0003): an older database gains them with no statement here. The revision marks the schema that has them, so a fleet
of the previous release refuses this database instead of running without the table its rows need.

Revision ID: 0005
"""

from edgefleet.fleet.migrations import no_downgrade

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    pass  # drift_scores: created by fleet.db's models (create_all) before the upgrade runs


downgrade = no_downgrade
