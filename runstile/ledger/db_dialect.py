"""The SQL that differs between the ledger's two engines (docs/architecture.md, "Two
dialects, one ledger").

The ledger's statements are written once, in SQLite's spelling, which is the default
engine's and so costs the default nothing.  What cannot be spelled the same on both
engines is asked of the connection's dialect object (:func:`ledger.db.dialect`): this
class is SQLite's, and ``db_postgresql_dialect.PostgresDialect`` overrides each method with
PostgreSQL's.  Every method returns SQL text, so a statement is still one f-string at its
call site and no ledger module branches on the engine.

Besides these, the PostgreSQL connection rewrites a closed list of spellings once per
statement text (``db_postgresql_dialect.translate``): ``?``/``?N``/``:name`` placeholders, the
ledger clock :data:`NOW`, and ``IS``/``IS NOT`` between two values.  The engines' result
rows differ too (``sqlite3.Row``, ``db_postgresql.Row``); :func:`as_dict` reads either.
"""

from __future__ import annotations

from typing import Any

#: URL schemes that name a PostgreSQL ledger (anything else is an SQLite file path).
POSTGRESQL_SCHEMES = ("postgresql", "postgres")


def is_database_url(target: object) -> bool:
    """True for a PostgreSQL URL, False for an SQLite path."""
    return isinstance(target, str) and target.split(":", 1)[0].lower() in POSTGRESQL_SCHEMES


def as_dict(row: Any) -> dict[str, Any]:
    """A result row (``sqlite3.Row``, or the PostgreSQL connection's Row) as a dict, in
    column order, as ``dict(row)`` makes it.  Cheaper: ``dict(row)`` looks each column up
    by name, and ``sqlite3.Row`` finds a name by comparing it with every column's in
    turn, ignoring case, which is quadratic on the runs table's 38 columns (measured:
    87,000 instructions per row, about 20,000 this way; a worker converts three per run)."""
    converted = dict(zip(row.keys(), row, strict=False))
    # A repeated column name (``SELECT x AS page_seq, *``): dict(row) keeps its first
    # value, and PostgreSQL's Row lists the name once, which misaligns the zip above.
    return converted if len(converted) == len(row) else dict(row)


class ConstraintViolation(Exception):
    """PostgreSQL refused a write on a uniqueness or check constraint (or a trigger's
    guard): what SQLite reports as IntegrityError, answered by the caller as a race."""


#: The ledger's clock as an SQL expression: Unix seconds with millisecond precision.
#: Every lease and timestamp comes from here so that all processes share one clock.
NOW = "((julianday('now') - 2440587.5) * 86400.0)"


class SqliteDialect:
    """SQLite's spelling of what the engines spell differently."""

    name = "sqlite"
    #: The ledger clock (see :data:`NOW`).
    now = NOW
    #: A parameter used where its type must be known: as text, as a JSON document.
    text_param = "?"
    json_param = "json(?)"

    #: The obligations table's insertion order, a whole number that a keyset pages on.
    obligation_order = "rowid"

    #: The statement that copies the WAL back into the file (None: the engine's business).
    checkpoint: str | None = "PRAGMA wal_checkpoint(PASSIVE)"
    #: Appended to the broker's claim subquery (ledger/broker_queue.py): SQLite's claim
    #: holds the file's write lock, so it needs no row lock.
    skip_locked = ""
    #: Whether the connection's ``total_changes`` counts every row its statements wrote,
    #: triggers' included: a group commit then runs a unit without a savepoint and
    #: checks that a unit refusing wrote nothing (ledger/group_commit.py).
    counts_changes = True

    def listen(self, channel: str) -> str | None:
        """The statement that subscribes a session to ``channel``'s notifications; None
        where the engine has none (SQLite: the broker watches the WAL instead)."""
        return None

    def schema_version(self, conn: Any) -> int:
        """The ledger's schema version (ledger/migrations.py); 0 for an empty ledger."""
        version: int = conn.execute("PRAGMA user_version").fetchone()[0]
        return version

    def integrity_problems(self, conn: Any) -> list[str]:
        """What the engine's own checks find wrong with the stored data (`db check`)."""
        problems: list[str] = []
        integrity = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        if integrity != ["ok"]:
            problems += [f"integrity: {line}" for line in integrity[:20]]
        for row in conn.execute("PRAGMA foreign_key_check").fetchall()[:20]:
            problems.append(f"foreign key: {tuple(row)}")
        return problems

    def storage_report(self, conn: Any) -> dict[str, str]:
        """How the engine stores commits, for `db check`'s report."""
        return {"journal_mode": str(conn.execute("PRAGMA journal_mode").fetchone()[0])}

    def durability(self, conn: Any, synchronous: str) -> tuple[str, bool]:
        """The commit setting in force and whether an acknowledged commit survives a
        power loss: SQLite's is RUNSTILE_SYNCHRONOUS, set on every connection."""
        return synchronous, synchronous in ("FULL", "EXTRA")

    def storage_line(self, report: dict[str, Any]) -> str:
        """The part of `db check`'s first line that says it."""
        return f"journal {report['journal_mode']}"

    def json_invalid(self, column: str) -> str | None:
        """A condition: ``column`` holds text that is not JSON (None: not checkable)."""
        return f"NOT json_valid({column})"

    def pass_setup(self, cache_kib: int) -> list[str]:
        """Statements that tune a recovery pass's own connection (ledger/recovery.py)."""
        return [f"PRAGMA cache_size = -{int(cache_kib)}", "PRAGMA temp_store = MEMORY",
                "PRAGMA wal_autocheckpoint = 0"]

    def batch_setup(self) -> list[str]:
        """Statements that tune a group committer's own connection (ledger/group_commit.py).

        Its transactions nest savepoints (one per ``db.transaction`` inside a unit) and
        write rows with triggers, so SQLite keeps a sub-journal of every page a savepoint
        or statement changes.  Past 64 KiB -- a batch of a few admissions -- that journal
        spills to a temporary file, created, written and unlinked per batch: under load,
        about four page writes per admission and five system calls per commit that
        nothing ever reads back (the journal only serves a rollback).  In memory it costs
        a copy of each page, bounded by the batch (MAX_BATCH units of a few rows each)."""
        return ["PRAGMA temp_store = MEMORY"]

    def json_array_values(self, param: str = "?") -> str:
        """A subquery of the scalar elements of the JSON array ``param`` (as text)."""
        return f"(SELECT value FROM json_each({param}))"

    def json_rows(self, param: str, alias: str) -> str:
        """A FROM item: one row per element of the JSON array ``param``, as ``alias.value``."""
        return f"json_each({param}) AS {alias}"

    def json_at(self, expr: str, index: int, sql_type: str) -> str:
        """Element ``index`` of the JSON array ``expr``, as a value of ``sql_type``
        ('INTEGER', 'REAL' or 'TEXT'); SQLite's ``->>`` already gives the SQL value."""
        return f"{expr} ->> {int(index)}"

    def json_object(self, pairs: str) -> str:
        """A JSON object (as text) from ``'key', value, ...``."""
        return f"json_object({pairs})"

    def json_text(self, column: str, key: str) -> str:
        """The top-level member ``key`` of the JSON object in ``column``, as SQL text."""
        return f"json_extract({column}, '$.{key}')"

    def json_set(self, column: str, pairs: list[tuple[str, str]]) -> str:
        """``column``'s JSON object with each (key, SQL value) of ``pairs`` set."""
        sets = ", ".join(f"'$.{key}', {value}" for key, value in pairs)
        return f"json_set({column}, {sets})"

    def metadata_has(self, column: str) -> str:
        """A condition: the JSON object in ``column`` has a string member; two
        parameters, its key then its value."""
        return (f"EXISTS (SELECT 1 FROM json_each({column}) AS m "
                "WHERE m.key = ? AND m.value = ? AND m.type = 'text')")

    def greatest(self, first: str, second: str) -> str:
        """The larger of two SQL values."""
        return f"MAX({first}, {second})"

    def node_lock_free(self, key: str) -> str | None:
        """A condition: no session holds the node lock of ``key`` (nodes.lock_key), read
        without taking it.  None where the engine cannot tell that way: SQLite's lock is
        an flock, and a probe that took it would refuse a node starting at that moment;
        there, another node's runs are recovered when their leases lapse."""
        return None


SQLITE = SqliteDialect()
