"""Numbered migrations of a PostgreSQL ledger (docs/architecture.md, "Two dialects, one
ledger"): the twins of SQLite's, one file each in ledger/postgresql/NNNN_*.sql.

The versions are SQLite's own (ledger/migrations.py MIGRATIONS): a PostgreSQL file is
applied exactly when its SQLite twin is registered, so both engines are always at the
same schema version.  The version is the 'schema_version' row of ledger_meta (PostgreSQL
has no PRAGMA user_version).  Each migration runs in one write transaction, which takes
the ledger's writer lock and re-reads the version under it, so several processes
starting at once apply each migration exactly once; PostgreSQL's DDL is transactional, so
a migration that fails leaves nothing half-done.
"""

from __future__ import annotations

from importlib import resources

from ..errors import LedgerCorrupt
from . import db
from .db_postgresql import PgConnection
from .db_postgresql_dialect import POSTGRESQL


def script(version: int) -> str:
    """The PostgreSQL twin of SQLite's migration ``version``."""
    folder = resources.files(__package__).joinpath("postgresql")
    for entry in folder.iterdir():
        if entry.name.startswith(f"{version:04d}_") and entry.name.endswith(".sql"):
            return entry.read_text(encoding="utf-8")
    raise LookupError(f"no PostgreSQL twin of ledger migration {version}")


def current_version(conn: PgConnection) -> int:
    with db.ledger_errors():
        return POSTGRESQL.schema_version(conn)


def migrate(url: str, versions: list[int], *, busy_timeout_ms: int = 5000) -> int:
    """Bring the ledger at ``url`` to the last of ``versions``; return the version it was
    at."""
    conn = db.connect(url, busy_timeout_ms=busy_timeout_ms)
    pg = conn if isinstance(conn, PgConnection) else None
    assert pg is not None, "a PostgreSQL URL opens a PgConnection"
    try:
        start = current_version(pg)
        if start > versions[-1]:
            raise LedgerCorrupt(
                f"the ledger is at schema version {start}, newer than this runstile "
                f"({versions[-1]}); upgrade runstile")
        if start == versions[-1]:
            return start  # current: no write transaction, no turn of the writer lock
        for version in versions:
            with db.transaction(conn):
                if current_version(pg) >= version:
                    continue  # another process applied it while we waited for the lock
                pg.execute_script(script(version))
                conn.execute(
                    "INSERT INTO ledger_meta (name, value) VALUES ('schema_version', ?) "
                    "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (str(version),))
        return start
    finally:
        conn.close()
