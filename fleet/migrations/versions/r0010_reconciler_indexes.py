"""Release 10: partial indexes on the targets the reconciler reads back (issue 44, fleet.reconcile).

``rollout_targets (rollout_id, wave, updated_at) WHERE state IN ('pending', 'downloading', 'installing')``: a
running wave's targets still waiting for a report, oldest first; ``rollout_targets (updated_at) WHERE state =
'rolling_back'``: the targets being rolled back, oldest first. The reconciler reads the oldest few hundred of each
every half second; without them each read scanned every target of every rollout (17 ms a call at 50,000 devices on
PostgreSQL, growing with the fleet and with each rollout kept). They hold only unfinished targets, so they stay small
whatever the rollouts' history. A fresh database has them from create_all; this adds them to an older one (on
PostgreSQL the table is locked against writes while they are built: seconds for a million targets).

Revision ID: 0010
"""

import sqlalchemy as sa
from alembic import op

from edgefleet.fleet.migrations import no_downgrade

revision = "0010"
down_revision = "0009"

WAITING = "state IN ('pending', 'downloading', 'installing')"  # as fleet.db's TARGET_WAITING, frozen here
ROLLING_BACK = "state = 'rolling_back'"


def upgrade() -> None:
    for name, columns, where in (("ix_rollout_targets_waiting", ["rollout_id", "wave", "updated_at"], WAITING),
                                 ("ix_rollout_targets_rolling_back", ["updated_at"], ROLLING_BACK)):
        op.create_index(name, "rollout_targets", columns, if_not_exists=True,
                        postgresql_where=sa.text(where), sqlite_where=sa.text(where))


downgrade = no_downgrade
