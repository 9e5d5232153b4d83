"""Release 4: a device's newest report time (older reports are dropped) and a rollout's engine error (issue 30).

Revision ID: 0004
"""

from alembic import op

from edgefleet.fleet.migrations import no_downgrade

revision = "0004"
down_revision = "0003"

STATEMENTS = (
    "ALTER TABLE devices ADD COLUMN last_report_ts FLOAT",
    "ALTER TABLE rollouts ADD COLUMN engine_error TEXT",
    "ALTER TABLE rollouts ADD COLUMN engine_error_at TIMESTAMP",
)


def upgrade() -> None:
    for stmt in STATEMENTS:
        op.execute(stmt)


downgrade = no_downgrade
