"""Numbered migrations, tracked in PRAGMA user_version; run once at start, never per connection.

Each migration runs inside one BEGIN IMMEDIATE transaction that re-reads user_version
after taking the write lock, so several processes starting at once apply each migration
exactly once: the losers wait on the lock and then find nothing left to do.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from ..errors import LedgerCorrupt, LedgerUnavailable
from ..filemodes import private_dir
from . import db


def _script(name: str) -> Callable[[], str]:
    def read() -> str:
        return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    return read


#: (version, SQL script).  Append only; never edit a migration that has shipped.
MIGRATIONS: list[tuple[int, Callable[[], str]]] = [
    (1, _script("schema.sql")),
    (2, _script("schema_v2_obligations.sql")),  # delivery obligations, webhook secrets
    (3, _script("schema_v3_run_triggers.sql")),  # runs' triggers without per-row IN lists
    (4, _script("schema_v4_profile_slots.sql")),  # runs waiting for a slot of their profile
    (5, _script("schema_v5_retry_of.sql")),  # the run a retry is a new run of
    (6, _script("schema_v6_task_slots.sql")),  # runs waiting for a slot of their task
    (7, _script("schema_v7_not_before.sql")),  # delayed runs: not claimed before this time
    (8, _script("schema_v8_priority.sql")),  # run priority
    (9, _script("schema_v9_queue.sql")),  # the queue a run travels on
    (10, _script("schema_v10_schedules.sql")),  # schedules' durable state (pause, progress)
    (11, _script("schema_v11_broker_notify.sql")),  # PostgreSQL: NOTIFY of ready broker rows
    (12, _script("schema_v12_node_lock_keys.sql")),  # node lock keys, takeover reports
    (13, _script("schema_v13_obligations_page_seq.sql")),  # PostgreSQL: deliveries' order
]

LATEST_VERSION = MIGRATIONS[-1][0]


def split_statements(script: str) -> list[str]:
    """Split a script into statements; trigger bodies with inner ';' stay whole."""
    statements, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            if current.strip():
                statements.append(current.strip())
            current = ""
    if current.strip() and not all(
        part.strip().startswith("--") or not part.strip() for part in current.splitlines()
    ):
        raise ValueError("migration script ends with an incomplete statement")
    return statements


def current_version(conn: sqlite3.Connection) -> int:
    with db.ledger_errors():
        return db.dialect(conn).schema_version(conn)


def migrate(path: Path | str, *, synchronous: str = "FULL",
            busy_timeout_ms: int = 5000) -> int:
    """Bring the ledger at ``path`` (or a PostgreSQL URL) to LATEST_VERSION; return the
    version it was at."""
    if db.is_database_url(path):
        from . import db_postgresql_migrate  # the twins of these migrations
        return db_postgresql_migrate.migrate(str(path), [v for v, _ in MIGRATIONS],
                                             busy_timeout_ms=busy_timeout_ms)
    path = Path(path)
    private_dir(path.parent)
    conn = db.connect(path, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
    try:
        _switch_to_wal(conn, busy_timeout_ms / 1000)
        start = current_version(conn)
        if start > LATEST_VERSION:
            raise LedgerCorrupt(
                f"the ledger is at schema version {start}, newer than this runstile "
                f"({LATEST_VERSION}); upgrade runstile"
            )
        if start == LATEST_VERSION:
            return start  # current: no write transaction, no turn of the write lock
        for version, script in MIGRATIONS:
            with db.transaction(conn):
                if current_version(conn) >= version:
                    continue  # another process applied it while we waited for the lock
                for statement in split_statements(script()):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {int(version)}")
                conn.execute(
                    "INSERT INTO ledger_meta (name, value) VALUES ('schema_version', ?) "
                    "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (str(version),))
        return start
    finally:
        conn.close()


def _switch_to_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """WAL lets readers proceed while one writer commits; it is a property of the file,
    so setting it once here is enough for every later connection.

    The switch needs the file to itself, and SQLite answers "database is locked" at once
    (no busy handler) when another process is switching or migrating a fresh file at the
    same moment — several processes starting together do exactly that — so retry until
    the busy timeout instead of failing the start."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with db.ledger_errors():
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            break
        except LedgerUnavailable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)
    if str(mode).lower() != "wal":
        raise LedgerCorrupt(f"could not switch the ledger to WAL (got {mode!r})")


def is_current(conn: sqlite3.Connection) -> bool:
    return current_version(conn) == LATEST_VERSION
