"""Release 1: the schema every later revision starts from (its tables are created by create_all).

Revision ID: 0001
"""

from edgefleet.fleet.migrations import no_downgrade

revision = "0001"
down_revision = None


def upgrade() -> None:
    pass  # a fresh database gets every table from fleet.db's models; an old one already has these


downgrade = no_downgrade
