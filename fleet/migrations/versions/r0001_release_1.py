"""Release 1: the schema every later revision starts from (its tables are created by create_all).

Revision ID: 0001
"""

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # a fresh database gets every table from fleet.db's models; an old one already has these


def downgrade() -> None:
    raise NotImplementedError("the fleet does not downgrade its database; restore a backup")
