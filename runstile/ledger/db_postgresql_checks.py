"""Whether a PostgreSQL ledger can be used at all, asked once when a command starts
(docs/operations.md, "A PostgreSQL ledger that cannot be used").

A server that does not answer, a role it refuses, a server older than runstile needs, or
a role that may not create runstile's tables or write them would otherwise surface as a
503 at every request, or as a traceback in the middle of a migration.  Asked up front,
each is one line naming what to fix, raised as :class:`ConfigError` (exit 2 for a
command).  Nothing here is asked again while a process runs: a server that goes away
later is LedgerUnavailable (a 503, retried), as for SQLite.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError, redact_url

#: The oldest server runstile runs on, as ``server_version_num`` spells it (13.0).
MIN_SERVER_VERSION = 130000

#: What the server's refusal at connect time says, and what runstile says of it.
_REFUSALS = (
    (r"password authentication failed|role \".*\" does not exist", "wrong credentials"),
    (r"database \".*\" does not exist", "no such database"),
    (r"no pg_hba\.conf entry", "the server's access rules (pg_hba.conf) refuse this client"),
)


def _fail(url: str, why: str) -> ConfigError:
    return ConfigError(f"the PostgreSQL ledger {redact_url(url)} cannot be used: {why}")


def _one_line(text: str, password: str | None) -> str:
    line = " ".join(text.split())
    return line.replace(password, "***") if password else line


def connect_refusal(url: str, message: str) -> ConfigError:
    """The one-line error for a connection that failed with libpq's ``message``."""
    password = urlsplit(url).password
    fatal = re.search(r"FATAL:\s+(.*)", message, re.DOTALL)
    if fatal is None:
        # No answer from a server at all: refused, timed out, a host that does not resolve.
        reason = message.split("failed:")[-1].strip().splitlines() or ["no reason given"]
        detail = _one_line(reason[0], password)
        return _fail(url, f"the server does not answer ({detail})")
    detail = _one_line(fatal.group(1).splitlines()[0], password)
    for pattern, meaning in _REFUSALS:
        if re.search(pattern, detail):
            return _fail(url, f"{meaning}: {detail}")
    return _fail(url, f"the server refused the connection: {detail}")


def check_version(url: str, version_num: int, version: str,
                  min_version: int = MIN_SERVER_VERSION) -> None:
    """Refuse a server older than ``min_version`` (``server_version_num`` spelling)."""
    if version_num < min_version:
        raise _fail(url, f"the server is PostgreSQL {version} and runstile needs "
                         f"{min_version // 10000} or later")


def ledger_tables() -> tuple[str, ...]:
    """The tables runstile's PostgreSQL migrations create (the ones it must write)."""
    names: list[str] = []
    folder = resources.files(__package__).joinpath("postgresql")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            names += re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)",
                                entry.read_text(encoding="utf-8"))
    return tuple(dict.fromkeys(names))


#: Read in one statement, before anything else is asked of the server.
_FACTS = ("SELECT current_setting('server_version_num')::int, "
          "current_setting('server_version'), current_schema(), "
          "current_schema() IS NOT NULL AND has_schema_privilege(current_schema(), 'CREATE'), "
          "pg_is_in_recovery(), current_setting('default_transaction_read_only') = 'on', "
          "EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = current_schema() "
          "AND tablename = 'ledger_meta')")

#: Ledger tables of the current schema that this role may not read and change.
_UNWRITABLE = ("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
               "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') "
               "AND c.relname = ANY(%s) AND NOT (has_table_privilege(c.oid, 'SELECT') "
               "AND has_table_privilege(c.oid, 'INSERT') AND has_table_privilege(c.oid, 'UPDATE') "
               "AND has_table_privilege(c.oid, 'DELETE')) ORDER BY c.relname")


def check_privileges(url: str, raw: Any, facts: tuple[Any, ...]) -> None:
    """Refuse a role that cannot do what a writing command will: create the schema in an
    empty database, and read and change every ledger table."""
    schema, may_create, standby, read_only, migrated = facts
    if standby or read_only:
        raise _fail(url, "the server only allows reading (a standby, or "
                         "default_transaction_read_only); point the URL at the primary")
    if schema is None:
        raise _fail(url, "no schema to keep the ledger in (the role's search_path names "
                         "none that exists)")
    if not may_create and _schema_version(raw, migrated) < _latest_version():
        # Only a migration creates anything: a role that may merely read and write a
        # ledger someone else brought up to date is enough.
        raise _fail(url, f"the role may not create tables in schema {schema} "
                         f"(GRANT CREATE ON SCHEMA {schema} TO the role, or migrate the "
                         "ledger once with a role that may)")
    refused = [row[0] for row in raw.execute(_UNWRITABLE, (list(ledger_tables()),))]
    if refused:
        shown = ", ".join(refused[:5]) + (" ..." if len(refused) > 5 else "")
        raise _fail(url, f"the role may not read and write table(s) {shown} of schema "
                         f"{schema} (it needs SELECT, INSERT, UPDATE and DELETE)")


def _schema_version(raw: Any, migrated: bool) -> int:
    if not migrated:
        return 0
    row = raw.execute("SELECT value FROM ledger_meta WHERE name = 'schema_version'").fetchone()
    return 0 if row is None else int(row[0])


def _latest_version() -> int:
    from .migrations import LATEST_VERSION  # here: migrations imports db, which imports us
    return LATEST_VERSION


def check_usable(url: str, *, busy_timeout_ms: int = 5000, write: bool = True,
                 min_version: int = MIN_SERVER_VERSION) -> None:
    """Connect to ``url`` and refuse, with one line, a ledger runstile cannot use."""
    import psycopg
    try:
        raw = psycopg.connect(url, autocommit=True,
                              connect_timeout=max(1, busy_timeout_ms // 1000))
    except psycopg.OperationalError as exc:
        raise connect_refusal(url, str(exc)) from None
    try:
        row: Any = raw.execute(_FACTS).fetchone()
        num, version, *facts = row
        check_version(url, num, version, min_version)
        if write:
            check_privileges(url, raw, tuple(facts))
    except psycopg.Error as exc:
        raise _fail(url, _one_line(str(exc), urlsplit(url).password)) from None
    finally:
        raw.close()
