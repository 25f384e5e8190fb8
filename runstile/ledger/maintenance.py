"""`runstile db check` and `db backup`: integrity, invariants and consistent copies."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ..filemodes import private_dir, private_file
from . import db, migrations
from .states import NON_TERMINAL, sql_list


def check(conn: sqlite3.Connection) -> dict[str, Any]:
    """Integrity and invariant report; ``ok`` is False if anything is wrong."""
    d = db.dialect(conn)
    with db.ledger_errors():
        problems = d.integrity_problems(conn)
        version = migrations.current_version(conn)
        if version != migrations.LATEST_VERSION:
            problems.append(f"schema version {version}, expected {migrations.LATEST_VERSION}")
        else:
            drift = conn.execute(
                "SELECT p.id, p.active_runs, COUNT(r.seq) FROM profiles p LEFT JOIN runs r "
                f"ON r.profile_id = p.id AND r.status IN {sql_list(NON_TERMINAL)} "
                "GROUP BY p.id HAVING p.active_runs != COUNT(r.seq)").fetchall()
            problems += [f"profile {p!r}: active_runs {a} but {c} unfinished runs"
                         for p, a, c in drift]
            orphans = conn.execute(
                "SELECT COUNT(*) FROM idempotency_keys k LEFT JOIN runs r ON r.id = k.run_id "
                "WHERE r.id IS NULL").fetchone()[0]
            if orphans:
                problems.append(f"{orphans} idempotency keys name a missing run")
            problems += _impossible_rows(conn)
        counts = {}
        if version == migrations.LATEST_VERSION:
            for table in ("profiles", "api_keys", "runs", "idempotency_keys", "dispatches",
                          "events", "key_tombstones", "run_tombstones"):
                counts[table] = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            counts["runs_by_status"] = dict(conn.execute(
                "SELECT status, COUNT(*) FROM runs GROUP BY status").fetchall())
        storage = d.storage_report(conn)
    return {"ok": not problems, "problems": problems, "schema_version": version,
            **storage, "counts": counts}


#: JSON columns runstile reads back (a replayed step's result, an event, a run's input
#: and result): (table, column, columns naming the row).
_JSON_COLUMNS = (("journal", "result", "run_id, position"), ("events", "data", "run_id, seq"),
                 ("runs", "input", "id, NULL"), ("runs", "result", "id, NULL"))


def _impossible_rows(conn: sqlite3.Connection, limit: int = 20) -> list[str]:
    """Rows the schema's CHECKs allow but runstile never writes (the ledger was edited
    or damaged): a journal for a run that never started (the claim writes run.started
    before any journal row), and JSON that does not parse."""
    problems = [f"run {run_id}: journal rows, but the run never started" for (run_id,) in
                conn.execute("SELECT DISTINCT j.run_id FROM journal j WHERE NOT EXISTS "
                             "(SELECT 1 FROM events e WHERE e.run_id = j.run_id AND "
                             f"e.type = 'run.started') LIMIT {limit}")]
    for table, column, names in _JSON_COLUMNS:
        invalid = db.dialect(conn).json_invalid(column)
        if invalid is None:
            continue
        rows = conn.execute(f"SELECT {names} FROM {table} WHERE {column} IS NOT NULL AND "
                            f"{invalid} LIMIT {limit}").fetchall()
        problems += [f"{table} {a}{'' if b is None else f' #{b}'}: {column} is not JSON"
                     for a, b in rows]
    return problems


def fold_wal(path: Path | str) -> None:
    """Fold the WAL into the main file (a TRUNCATE checkpoint), so that after a clean stop
    the main file alone is complete.  Raises LedgerUnavailable when it cannot.  A
    PostgreSQL ledger (a URL) has no WAL of runstile's to fold: nothing to do."""
    if db.is_database_url(path):
        return
    conn = db.connect(path, busy_timeout_ms=1000)
    try:
        with db.ledger_errors():
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def backup_ledger(target: Path | str, path: Path, *,
                  busy_timeout_ms: int = 5000) -> tuple[dict[str, Any], str]:
    """`runstile db backup`: a consistent copy of the ledger at ``target`` written to
    ``path``, through a ``.partial`` file beside it renamed at the end, so an old backup
    survives a failed new one.  An SQLite file through SQLite's backup API; a PostgreSQL
    ledger through pg_dump (ledger/db_postgresql_dump.py).  Returns what was written, as
    `--json` says it and as a few words for a person."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        if db.is_database_url(target):
            from . import db_postgresql_dump  # psycopg and pg_dump only for PostgreSQL
            size = db_postgresql_dump.dump(str(target), partial)
            partial.replace(path)
            return ({"path": str(path), "bytes": size, "format": "pg_dump-custom"},
                    f"{size} bytes, pg_dump custom format: restore with pg_restore")
        conn = db.connect(target, busy_timeout_ms=busy_timeout_ms)
        try:
            pages = backup(conn, partial)
        finally:
            conn.close()
        partial.replace(path)
        return {"path": str(path), "pages": pages}, f"{pages} pages"
    finally:
        partial.unlink(missing_ok=True)


def backup(conn: sqlite3.Connection, target: Path) -> int:
    """Online, consistent copy through SQLite's backup API; returns the page count."""
    private_dir(target.parent)
    private_file(target)  # a copy of every tenant's data: 0600 like the ledger
    with db.ledger_errors():
        dest = sqlite3.connect(str(target))
        try:
            conn.backup(dest)
            pages: int = dest.execute("PRAGMA page_count").fetchone()[0]
        finally:
            dest.close()
    return pages
