"""Release 6: an index on a rollout's targets by state (the console at 100,000 devices, issue 33).

``rollout_targets (rollout_id, state, device_id)``: a rollout's counts by state are read from the index alone, and
one page of its targets in one state (the console's filter) is the next 50 entries of it, where both scanned every
target of the rollout. A fresh database has it from create_all; this adds it to an older one (on PostgreSQL the
table is locked against writes while the index is built: seconds for a million targets).

Revision ID: 0006
"""

from alembic import op

from edgefleet.fleet.migrations import no_downgrade

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS ix_rollout_targets_state ON rollout_targets (rollout_id, state, device_id)")


downgrade = no_downgrade
