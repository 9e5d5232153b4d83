"""The fleet database's schema history as Alembic revisions (``versions/``), run by ``fleet.db.make_engine``.

Revision ``0001`` is release 1's schema, ``0002`` adds release 2's device columns, ``0003`` release 3's
registry selectors and rollouts in waves. A schema change is a new revision here (plain DDL that keeps
every row on SQLite and PostgreSQL), plus the model change in ``fleet/db.py``. Databases written
before Alembic record their version in ``edgefleet_meta.schema_version``: they are stamped with the
matching revision first, then upgraded like any other.
"""


def no_downgrade() -> None:
    """Every revision's ``downgrade`` (``downgrade = no_downgrade``): the fleet only moves its schema forward."""
    raise NotImplementedError("the fleet does not downgrade its database; restore a backup")
