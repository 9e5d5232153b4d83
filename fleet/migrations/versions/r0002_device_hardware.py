"""Release 2: each device's hardware (CPU features) and its own self-test figure.

Revision ID: 0002
"""

from alembic import op

from edgefleet.fleet.migrations import no_downgrade

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.execute("ALTER TABLE devices ADD COLUMN hardware JSON")
    op.execute("ALTER TABLE devices ADD COLUMN selftest JSON")


downgrade = no_downgrade
