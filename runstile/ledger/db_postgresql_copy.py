"""`runstile db copy --to`: an SQLite ledger moved into an empty PostgreSQL one
(docs/operations.md, "Moving a ledger from SQLite to PostgreSQL").

What it guarantees, and how:

* **One instant of the source.**  Every table is read inside one SQLite read
  transaction, so the copy is the ledger as it stood at one moment even if something
  writes to it meanwhile.  And a copy is committed only if nothing did: the source's
  ``PRAGMA data_version`` (which moves with every commit of another connection) is read
  before the snapshot and after it ends, and a change refuses the copy.  A ledger still
  in use would go on admitting runs that the new ledger never sees.
* **All or nothing.**  The whole copy is one PostgreSQL transaction, holding the ledger's
  writer lock (db_postgresql.WRITER_LOCK): any failure, a refusal, a lost connection or a
  killed process leaves the target as empty as it was.
* **Never two ledgers merged.**  Every table of the target but ledger_meta must be empty,
  read under the writer lock.
* **Rows as they are.**  The ledger's triggers (profiles.active_runs kept by run inserts,
  callback obligations written by event inserts, dispatches' ids) would write a second
  time what the copied rows already hold, so the copy sets them aside with
  ``ALTER TABLE ... DISABLE TRIGGER USER`` inside its transaction and turns them back on
  before it commits (nobody else ever sees them off).  That needs the role to own the
  tables (the role that ran the migrations), not to be a superuser, which
  ``session_replication_role = replica`` would need; foreign keys, being system
  triggers, stay checked, so tables go in foreign-key order.
* **Counters carried over.**  Identity columns (runs.seq, recovery_reports.id,
  broker_messages.id) continue after the largest id ever given out: the larger of the
  copied maximum and SQLite's own AUTOINCREMENT counter (sqlite_sequence), which
  remembers ids of rows since deleted.  obligations.page_seq, the one identity SQLite
  has no column for (its rowid does that job there), is numbered by the COPY itself,
  the rows going in rowid order; its sequence too is set to the largest copied (an
  earlier copy rolled back may have used numbers: a gap, harmless in an order).
* **Counted twice.**  Each table's rows are counted in the source snapshot and in the
  target before the commit; any difference rolls the copy back.

Rows travel by COPY ... FROM STDIN (psycopg's ``copy``), read from SQLite in batches of
:data:`BATCH_ROWS`: memory stays flat however large the ledger.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ..errors import ConfigError, LedgerUnavailable, redact_url
from . import db, migrations
from .db_postgresql import WRITER_LOCK, classify

#: Rows read from SQLite at a time (and so held in memory at once).
BATCH_ROWS = 2000

#: Called after each batch with (table, rows of it copied so far).
Progress = Callable[[str, int], None]


@dataclass
class CopyReport:
    """Rows per table, (source, target), in the order they were copied."""

    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Identity sequences set: (table, column) -> the last value given out.
    sequences: dict[str, int] = field(default_factory=dict)
    #: Whether the planner's statistics were gathered after the commit (_analyze).
    analyzed: bool = False

    @property
    def ok(self) -> bool:
        return all(source == target for source, target in self.counts.values())


class CountMismatch(Exception):
    """The target's counts differ from the source's: the copy was rolled back."""

    def __init__(self, report: CopyReport) -> None:
        super().__init__("row counts differ between the source and the target")
        self.report = report


def copy_ledger(source: Path, url: str, *, busy_timeout_ms: int = 5000,
                progress: Progress | None = None) -> CopyReport:
    """Copy the SQLite ledger at ``source`` into the (empty) PostgreSQL ledger at ``url``.

    Raises ConfigError for a refusal (a target that holds a ledger, a source that changed
    during the copy, a role that does not own the tables), LedgerUnavailable when either
    side cannot be reached, CountMismatch when a table's counts differ."""
    migrations.migrate(source, busy_timeout_ms=busy_timeout_ms)
    migrations.migrate(url, busy_timeout_ms=busy_timeout_ms)
    src = db.connect(source, busy_timeout_ms=busy_timeout_ms, readonly=True)
    src.row_factory = None
    try:
        with _target(url, busy_timeout_ms) as tgt:
            report = _copy_all(src, tgt, progress)
    finally:
        src.close()
    report.analyzed = _analyze(url, list(report.counts), busy_timeout_ms)
    return report


def _analyze(url: str, tables: list[str], busy_timeout_ms: int) -> bool:
    """Give the planner the copied tables' statistics now, once the copy committed;
    False if that failed (the copy stands: autovacuum gathers them later).

    Until autovacuum's first ANALYZE (a minute or more away) the planner knows nothing of
    the rows: it can then look a run up through a partial index that holds the whole
    backlog instead of by its id, and an idempotency key through every key of its API
    key, which a copied ledger of millions of runs would pay on every claim and
    admission (docs/operations.md, "Moving a ledger from SQLite to PostgreSQL")."""
    statement = sql.SQL("ANALYZE {}").format(sql.SQL(", ").join(map(sql.Identifier, tables)))
    try:
        with psycopg.connect(url, autocommit=True,
                             connect_timeout=max(1, busy_timeout_ms // 1000)) as raw:
            raw.execute(statement)
    except psycopg.Error:
        return False
    return True


@contextlib.contextmanager
def _target(url: str, busy_timeout_ms: int) -> Iterator[psycopg.Connection[Any]]:
    """One session in one transaction holding the writer lock; committed only if the
    body returns."""
    try:
        raw = psycopg.connect(url, autocommit=True,
                              connect_timeout=max(1, busy_timeout_ms // 1000))
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"cannot reach {redact_url(url)}: "
                                f"{str(exc).strip().splitlines()[0]}") from None
    try:
        with _classified():
            raw.execute(f"SET lock_timeout = {int(busy_timeout_ms)}")
            raw.execute("BEGIN")
            raw.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))
        try:
            yield raw
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                raw.execute("ROLLBACK")
            raise
        with _classified():
            raw.execute("COMMIT")
    finally:
        raw.close()


@contextlib.contextmanager
def _classified() -> Iterator[None]:
    try:
        yield
    except pg_errors.InsufficientPrivilege as exc:
        raise ConfigError(
            "db copy must own the target's tables (the role that ran `runstile db "
            f"migrate` there) to hold their triggers during the copy: {exc}") from None
    except psycopg.Error as exc:
        translated = classify(exc)
        if translated is exc:
            raise
        raise translated from exc


def _copy_all(src: sqlite3.Connection, tgt: psycopg.Connection[Any],
              progress: Progress | None) -> CopyReport:
    """The copy proper, inside the target's transaction (see the module's docstring)."""
    with db.ledger_errors():
        before = src.execute("PRAGMA data_version").fetchone()[0]
        src.execute("BEGIN")  # deferred: the read snapshot starts at the first SELECT
        try:
            tables = _tables_in_order(src)
            with _classified():
                _check_target(tgt, tables)
                report = _copy_tables(src, tgt, tables, progress)
        finally:
            src.execute("COMMIT")  # a read transaction: ends the snapshot
        changed = src.execute("PRAGMA data_version").fetchone()[0] != before
    if changed:
        raise ConfigError("the SQLite ledger changed while it was copied (is a runstile "
                          "still running on it?): stop every runstile process that uses "
                          "it and copy again; nothing was written to the target")
    if not report.ok:
        raise CountMismatch(report)
    return report


def _copy_tables(src: sqlite3.Connection, tgt: psycopg.Connection[Any], tables: list[str],
                 progress: Progress | None) -> CopyReport:
    report = CopyReport()
    _triggers(tgt, tables, enabled=False)
    tgt.execute("DELETE FROM ledger_meta")  # its schema_version row comes from the source
    for table in tables:
        columns, numbered = _columns(src, tgt, table)
        source_rows = src.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()[0]
        _copy_table(src, tgt, table, columns, progress, in_rowid_order=bool(numbered))
        target_rows = _count(tgt, table)
        report.counts[table] = (source_rows, target_rows)
    report.sequences = _reset_sequences(src, tgt)
    _triggers(tgt, tables, enabled=True)
    return report


def _tables_in_order(src: sqlite3.Connection) -> list[str]:
    """The source's tables, each after every table its foreign keys name."""
    names = [r[0] for r in src.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY name")]
    parents = {name: {r[2] for r in src.execute(f'PRAGMA foreign_key_list("{name}")')}
               - {name} for name in names}
    ordered: list[str] = []
    while len(ordered) < len(names):
        ready = [n for n in names if n not in ordered and parents[n] <= set(ordered)]
        if not ready:
            raise ConfigError(f"the ledger's foreign keys form a cycle among "
                              f"{sorted(set(names) - set(ordered))}")
        ordered += ready
    return ordered


def _check_target(tgt: psycopg.Connection[Any], tables: list[str]) -> None:
    """The target has the source's tables, and none of them holds a row but ledger_meta
    (read under the writer lock, so no other copy or runstile can be filling it)."""
    have = {r[0] for r in tgt.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}
    if have != set(tables):
        raise ConfigError(f"the target's tables differ from the source's (only in the "
                          f"source: {sorted(set(tables) - have)}; only in the target: "
                          f"{sorted(have - set(tables))})")
    holding = [t for t in tables if t != "ledger_meta" and _has_rows(tgt, t)]
    if holding:
        raise ConfigError(f"the target already holds a ledger (rows in {', '.join(holding)}); "
                          "db copy never merges two ledgers: give it an empty database")


def _has_rows(tgt: psycopg.Connection[Any], table: str) -> bool:
    row = tgt.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(
        sql.Identifier(table))).fetchone()
    return bool(row and row[0])


def _columns(src: sqlite3.Connection, tgt: psycopg.Connection[Any],
             table: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(column, PostgreSQL type) of ``table``, in the source's order; and the target's
    identity columns SQLite has no twin of (obligations.page_seq), which COPY numbers."""
    names = [r[1] for r in src.execute(f'PRAGMA table_info("{table}")')]
    found = tgt.execute(
        "SELECT column_name, data_type, is_identity FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = %s", (table,)).fetchall()
    types = {name: pg_type for name, pg_type, _ in found}
    numbered = sorted(name for name, _, identity in found
                      if identity == "YES" and name not in names)
    if set(names) != set(types) - set(numbered):
        raise ConfigError(f"table {table}: the target's columns differ from the source's "
                          f"({sorted(set(names) ^ (set(types) - set(numbered)))})")
    return [(name, types[name]) for name in names], numbered


def _copy_table(src: sqlite3.Connection, tgt: psycopg.Connection[Any], table: str,
                columns: list[tuple[str, str]], progress: Progress | None, *,
                in_rowid_order: bool = False) -> None:
    """COPY the rows in batches; values go as the target column's type, so an SQLite
    INTEGER held in a REAL column lands as that float, a BLOB as bytea.
    ``in_rowid_order``: the table has a PostgreSQL-only identity that stands for
    SQLite's rowid (obligations.page_seq), so the rows go in rowid order and COPY numbers
    them in the order the source paged them."""
    listed = ", ".join(f'"{name}"' for name, _ in columns)
    order = " ORDER BY rowid" if in_rowid_order else ""
    reader = src.execute(f'SELECT {listed} FROM "{table}"{order}')
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table), sql.SQL(", ").join(sql.Identifier(n) for n, _ in columns))
    done = 0
    try:
        with tgt.cursor().copy(statement) as copy:
            copy.set_types([pg_type for _, pg_type in columns])
            while batch := reader.fetchmany(BATCH_ROWS):
                for row in batch:
                    copy.write_row(row)
                done += len(batch)
                if progress is not None:
                    progress(table, done)
    except (psycopg.DataError, psycopg.IntegrityError) as exc:
        # A value SQLite stores and PostgreSQL does not (a NUL in text, text where a
        # number belongs, a row naming one that is missing): only a ledger edited by
        # hand or damaged holds one.
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"table {table}: PostgreSQL refuses a row of the source ({said}); "
                          "`runstile db check` the SQLite ledger") from None


def _count(tgt: psycopg.Connection[Any], table: str) -> int:
    row = tgt.execute(sql.SQL("SELECT COUNT(*) FROM {}").format(sql.Identifier(table))
                      ).fetchone()
    return int(row[0]) if row else 0


def _triggers(tgt: psycopg.Connection[Any], tables: list[str], *, enabled: bool) -> None:
    """The ledger's own triggers off (or back on) for this transaction's copy; USER
    leaves the foreign keys' system triggers as they are."""
    verb = sql.SQL("ENABLE" if enabled else "DISABLE")
    for table in tables:
        tgt.execute(sql.SQL("ALTER TABLE {} {} TRIGGER USER").format(
            sql.Identifier(table), verb))


def _reset_sequences(src: sqlite3.Connection, tgt: psycopg.Connection[Any]) -> dict[str, int]:
    """Each identity column's sequence to the last id the source ever gave out."""
    counters = {}
    if src.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").fetchone():
        counters = dict(src.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
    done = {}
    for table, column in tgt.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND is_identity = 'YES' "
            "ORDER BY table_name").fetchall():
        row = tgt.execute(sql.SQL("SELECT COALESCE(MAX({}), 0) FROM {}").format(
            sql.Identifier(column), sql.Identifier(table))).fetchone()
        last = max(int(row[0]) if row else 0, int(counters.get(table) or 0))
        if last > 0:
            tgt.execute("SELECT setval(pg_get_serial_sequence(%s, %s), %s)",
                        (table, column, last))
            done[f"{table}.{column}"] = last
    return done
