"""Release 3: registry selectors, rollouts in waves with gates and leases, per-target gate figures.

New tables (rollout_waves, audit_log, api_tokens, ...) come from create_all before this runs; a release-2
rollout becomes one wave of all its targets, its counters counted once here.

Revision ID: 0003
"""

from alembic import op

from edgefleet.fleet.migrations import no_downgrade

revision = "0003"
down_revision = "0002"

STATEMENTS = (
    "ALTER TABLE devices ADD COLUMN group_name VARCHAR(64)",
    "ALTER TABLE devices ADD COLUMN tags JSON",
    "ALTER TABLE devices ADD COLUMN profile VARCHAR(64)",
    "CREATE INDEX IF NOT EXISTS ix_devices_group_name ON devices (group_name)",
    "ALTER TABLE rollouts ADD COLUMN model_name VARCHAR(64)",
    "ALTER TABLE rollouts ADD COLUMN model_version VARCHAR(32)",
    "ALTER TABLE rollouts ADD COLUMN spec JSON",
    "ALTER TABLE rollouts ADD COLUMN current_wave INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE rollouts ADD COLUMN created_by VARCHAR(64)",
    "ALTER TABLE rollouts ADD COLUMN reason TEXT",
    "ALTER TABLE rollouts ADD COLUMN lease_owner VARCHAR(64)",
    "ALTER TABLE rollouts ADD COLUMN lease_until TIMESTAMP",
    "UPDATE rollouts SET model_name = (SELECT name FROM models WHERE models.id = rollouts.model_id), "
    "model_version = (SELECT version FROM models WHERE models.id = rollouts.model_id), spec = '{}'",
    "ALTER TABLE rollout_targets ADD COLUMN wave INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE rollout_targets ADD COLUMN model_id INTEGER",
    "ALTER TABLE rollout_targets ADD COLUMN previous_model_id INTEGER",
    "ALTER TABLE rollout_targets ADD COLUMN p99_before FLOAT",
    "ALTER TABLE rollout_targets ADD COLUMN p99_after FLOAT",
    "ALTER TABLE rollout_targets ADD COLUMN tele_requests BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE rollout_targets ADD COLUMN tele_errors BIGINT NOT NULL DEFAULT 0",
    "UPDATE rollout_targets SET model_id = (SELECT model_id FROM rollouts WHERE rollouts.id = "
    "rollout_targets.rollout_id)",
    "CREATE INDEX IF NOT EXISTS ix_rollout_targets_wave ON rollout_targets (rollout_id, wave)",
    "CREATE INDEX IF NOT EXISTS ix_rollout_targets_device ON rollout_targets (device_id)",
    "INSERT INTO rollout_waves (rollout_id, idx, size, soak_s, state, n_installed, n_failed, started_at) "
    "SELECT r.id, 0, (SELECT count(*) FROM rollout_targets t WHERE t.rollout_id = r.id), 0, "
    "CASE WHEN r.status = 'in_progress' THEN 'installing' ELSE 'passed' END, "
    "(SELECT count(*) FROM rollout_targets t WHERE t.rollout_id = r.id AND t.state = 'installed'), "
    "(SELECT count(*) FROM rollout_targets t WHERE t.rollout_id = r.id AND t.state = 'failed'), "
    "r.created_at FROM rollouts r",
)


def upgrade() -> None:
    for stmt in STATEMENTS:
        op.execute(stmt)


downgrade = no_downgrade
