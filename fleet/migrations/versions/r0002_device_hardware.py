"""Release 2: each device's hardware (CPU features) and its own self-test figure.

Revision ID: 0002
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE devices ADD COLUMN hardware JSON")
    op.execute("ALTER TABLE devices ADD COLUMN selftest JSON")


def downgrade() -> None:
    raise NotImplementedError("the fleet does not downgrade its database; restore a backup")
