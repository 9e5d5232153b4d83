"""Release 7: a device's presence bound (issue 33: a dropped offline will left a device shown online; fleet.presence).

``devices.presence_s``: how long the device counts as online without being heard from (a number of its telemetry
intervals, at least the fleet's floor); ``devices.presence_until``: until when (unix seconds). Both start empty: a
device gets them with its next telemetry record, and until then its will alone takes it offline, as before.

Revision ID: 0007
"""

from alembic import op

from edgefleet.fleet.migrations import no_downgrade

revision = "0007"
down_revision = "0006"

STATEMENTS = (
    "ALTER TABLE devices ADD COLUMN presence_s FLOAT",
    "ALTER TABLE devices ADD COLUMN presence_until FLOAT",
)


def upgrade() -> None:
    for stmt in STATEMENTS:
        op.execute(stmt)


downgrade = no_downgrade
