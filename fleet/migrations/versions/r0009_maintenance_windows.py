"""Release 9: maintenance windows of device groups and devices (issue 43.4, protocol.window).

The table ``maintenance_windows`` comes from create_all, which runs before this (as wave_series did for 0008): an
older database gains it with no statement here, empty (no device has a window: installs go ahead at once, as
before). The revision marks the schema that has it, so a fleet of the previous release refuses this database.

Revision ID: 0009
"""

from edgefleet.fleet.migrations import no_downgrade

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    pass  # maintenance_windows: created by fleet.db's models (create_all) before the upgrade runs


downgrade = no_downgrade
