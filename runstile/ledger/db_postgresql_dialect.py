"""How the PostgreSQL ledger spells what SQLite spells otherwise (docs/architecture.md,
"Two dialects, one ledger"): the dialect object, and the translation of a statement's
text written in SQLite's spelling, done once per text."""

from __future__ import annotations

import functools
import re
from typing import Any

from .db_dialect import NOW as SQLITE_NOW
from .db_dialect import SqliteDialect

#: The ledger clock: Unix seconds of the statement's start, as SQLite's is per statement.
NOW = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS double precision)"
#: The namespace of node locks: ``pg_advisory_lock(NODE_LOCKS, nodes.lock_key)``, the
#: two-int4 form (pg_locks: classid, objid, objsubid 2), apart from the writer lock's one
#: bigint key (objsubid 1) whatever the keys.  'rnod'.
NODE_LOCKS = 0x726E6F64
#: pg_locks rows of node lock ``{key}`` in this database (advisory locks are per
#: database, pg_locks shows the whole server's).
NODE_LOCK_ROWS = (
    "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND database = "
    "(SELECT oid FROM pg_database WHERE datname = current_database()) AND "
    f"CAST(classid AS bigint) = {NODE_LOCKS} AND CAST(objid AS bigint) = {{key}} "
    "AND objsubid = 2 AND granted")
#: A row-id column for inserts whose callers read ``lastrowid`` (SQLite's rowid).
_ROW_IDS = {"dispatches": "id", "broker_messages": "id", "recovery_reports": "id",
            "runs": "seq"}


class PostgresDialect(SqliteDialect):
    """PostgreSQL's spelling (see db_dialect.SqliteDialect for what each one means)."""

    name = "postgresql"
    now = NOW
    text_param = "CAST(? AS text)"
    json_param = "CAST(? AS json)"
    checkpoint = None
    obligation_order = "page_seq"  # PostgreSQL has no rowid: a column of its own
    #: Concurrent claims skip each other's rows instead of queueing on them (the claim
    #: runs outside the writer lock: docs/architecture.md, "The embedded broker").
    skip_locked = " FOR UPDATE SKIP LOCKED"
    #: A cursor's rowcount leaves out what triggers wrote: units keep their savepoints
    #: (sent with the next statement, so they cost no round trip).
    counts_changes = False

    def listen(self, channel: str) -> str | None:
        return f"LISTEN {channel}"

    def pass_setup(self, cache_kib: int) -> list[str]:
        return []  # the server's memory settings are the operator's

    def batch_setup(self) -> list[str]:
        return []  # the server keeps no per-connection spill files to avoid

    def integrity_problems(self, conn: Any) -> list[str]:
        # Foreign keys are enforced on every write, and pages checked by the server
        # (data checksums, amcheck): nothing for runstile to walk here.
        return []

    def storage_report(self, conn: Any) -> dict[str, str]:
        return {"synchronous_commit": str(conn.execute("SHOW synchronous_commit").fetchone()[0])}

    def durability(self, conn: Any, synchronous: str) -> tuple[str, bool]:
        # The server's synchronous_commit, which runstile leaves alone; RUNSTILE_SYNCHRONOUS
        # is SQLite's.  Only "off" acknowledges a commit before it is flushed.
        setting = self.storage_report(conn)["synchronous_commit"]
        return setting, setting != "off"

    def storage_line(self, report: dict[str, Any]) -> str:
        return f"synchronous_commit {report['synchronous_commit']}"

    def json_invalid(self, column: str) -> str | None:
        return None  # PostgreSQL 13-15 have no non-raising JSON test (16's pg_input_is_valid)

    def schema_version(self, conn: Any) -> int:
        """The 'schema_version' row of ledger_meta (PostgreSQL has no user_version)."""
        # pg_tables, not to_regclass(): a catalog lookup may answer from this session's
        # cache, which an advisory lock does not refresh, so a process that waited on the
        # writer lock would not see the table the previous holder created.  A query of
        # the catalog reads it as of this statement.
        if not conn.execute("SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = "
                            "current_schema() AND tablename = 'ledger_meta')").fetchone()[0]:
            return 0
        row = conn.execute(
            "SELECT value FROM ledger_meta WHERE name = 'schema_version'").fetchone()
        return 0 if row is None else int(row[0])

    def json_array_values(self, param: str = "?") -> str:
        return f"(SELECT json_array_elements_text(CAST({param} AS json)))"

    def json_rows(self, param: str, alias: str) -> str:
        return f"json_array_elements(CAST({param} AS json)) AS {alias}"

    def json_at(self, expr: str, index: int, sql_type: str) -> str:
        pg_type = {"INTEGER": "bigint", "REAL": "double precision"}.get(sql_type, "text")
        return f"CAST({expr} ->> {int(index)} AS {pg_type})"

    def json_object(self, pairs: str) -> str:
        return f"CAST(json_build_object({pairs}) AS text)"

    def json_text(self, column: str, key: str) -> str:
        return f"(CAST({column} AS json) ->> '{key}')"

    def json_set(self, column: str, pairs: list[tuple[str, str]]) -> str:
        sets = ", ".join(f"'{key}', {value}" for key, value in pairs)
        return f"CAST(CAST({column} AS jsonb) || jsonb_build_object({sets}) AS text)"

    def metadata_has(self, column: str) -> str:
        return (f"EXISTS (SELECT 1 FROM jsonb_each(CAST({column} AS jsonb)) AS m "
                "WHERE m.key = ? AND jsonb_typeof(m.value) = 'string' "
                "AND m.value #>> '{}' = ?)")

    def greatest(self, first: str, second: str) -> str:
        return f"GREATEST({first}, {second})"

    def node_lock_free(self, key: str) -> str | None:
        # pg_locks is read as it is now, not as of a snapshot: so is the lock's holder.
        return f"NOT EXISTS ({NODE_LOCK_ROWS.format(key=f'CAST({key} AS bigint)')})"


POSTGRESQL = PostgresDialect()

_IS_NOT = re.compile(r"\bIS\s+NOT\s+(?!NULL\b|DISTINCT\b|TRUE\b|FALSE\b)")
_IS = re.compile(r"\bIS\s+(?!NOT\b|NULL\b|DISTINCT\b|TRUE\b|FALSE\b)")
_INSERT = re.compile(r"\s*INSERT\s+INTO\s+(\w+)", re.IGNORECASE)


@functools.lru_cache(maxsize=4096)
def translate(sql: str, many: bool = False) -> tuple[str, str, str | None]:
    """(PostgreSQL text, placeholder style, row-id column appended as RETURNING).

    The closed list of rewrites: the ledger clock; ``a IS b`` / ``a IS NOT b`` between
    two values (PostgreSQL's IS takes only NULL/TRUE/FALSE); placeholders ``?``, ``?N``
    and ``:name`` (outside quotes; ``%`` doubled); and ``RETURNING <rowid>`` on an insert
    whose caller may read ``lastrowid``.  Anything else is spelled by the dialect object.
    """
    text = _IS.sub("IS NOT DISTINCT FROM ", _IS_NOT.sub("IS DISTINCT FROM ",
                                                       sql.replace(SQLITE_NOW, NOW)))
    pg_sql, style = _placeholders(text)
    row_id = None
    insert = _INSERT.match(pg_sql)
    if insert and not many and "RETURNING" not in pg_sql.upper():
        row_id = _ROW_IDS.get(insert.group(1))
        if row_id is not None:
            pg_sql += f" RETURNING {row_id}"
    return pg_sql, style, row_id


def _placeholders(text: str) -> tuple[str, str]:
    """psycopg's placeholders for SQLite's, outside quotes; ``%`` doubled."""
    out, style, i, quote = [], "positional", 0, ""
    while i < len(text):
        ch = text[i]
        if quote:
            quote = "" if ch == quote else quote
            out.append("%%" if ch == "%" else ch)
        elif ch in "'\"":
            quote = ch
            out.append(ch)
        elif ch == "%":
            out.append("%%")
        elif ch == "?":
            digits = re.match(r"\d+", text[i + 1:])
            if digits:
                style = "numbered"
                out.append(f"%(p{digits.group()})s")
                i += len(digits.group())
            else:
                out.append("%s")
        elif ch == ":" and re.match(r"[A-Za-z_]", text[i + 1:i + 2]) and text[i - 1] != ":":
            name = re.match(r"\w+", text[i + 1:]).group()  # type: ignore[union-attr]
            style = "named"
            out.append(f"%({name})s")
            i += len(name)
        else:
            out.append(ch)
        i += 1
    return "".join(out), style


def params_for(style: str, params: Any) -> Any:
    """The statement's parameters as psycopg takes them for its placeholder style."""
    if style == "numbered":
        return {f"p{n}": value for n, value in enumerate(params, start=1)}
    return params
