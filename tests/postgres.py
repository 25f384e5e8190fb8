"""Which ledger the suite runs on, and a PostgreSQL database of its own for each test
(docs/architecture.md, "Two dialects, one ledger").

The suite runs once per ledger.  ``RUNSTILE_TEST_LEDGER`` unset (or ``sqlite``): every
ledger is an SQLite file.  ``RUNSTILE_TEST_LEDGER=postgresql`` (``make test
LEDGER=postgresql``): every ledger the fixtures make (tests/conftest.py) is a fresh
database on the server named by RUNSTILE_TEST_DATABASE_URL (say
``postgresql://postgres@127.0.0.1:5432/postgres``; the role must be allowed to create
databases), named at random and dropped afterwards, and every server, worker and command
the tests start gets it as RUNSTILE_DATABASE_URL.  A test that reads or writes the
ledger file itself skips on that pass, saying so.

Tests that need a server whatever the pass (the schema comparison of the two engines)
skip without RUNSTILE_TEST_DATABASE_URL, or fail when CI is set.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

URL_VARIABLE = "RUNSTILE_TEST_DATABASE_URL"
LEDGER_VARIABLE = "RUNSTILE_TEST_LEDGER"


def ledger_kind() -> str:
    """The ledger of this pass of the suite: "sqlite" (also when unset) or "postgresql"."""
    kind = os.environ.get(LEDGER_VARIABLE) or "sqlite"
    if kind not in ("sqlite", "postgresql"):
        raise pytest.UsageError(f"{LEDGER_VARIABLE} must be sqlite or postgresql, not {kind!r}")
    return kind


def on_postgresql() -> bool:
    return ledger_kind() == "postgresql"


def server_url(*, required: bool = False) -> str:
    """The test server's URL; skip (or, with ``required`` under CI, fail) when unset."""
    url = os.environ.get(URL_VARIABLE)
    if not url:
        message = f"{URL_VARIABLE} is not set: no PostgreSQL server to test the ledger on"
        if required and os.environ.get("CI"):
            pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
        pytest.skip(message)
    return url


def _with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


@contextlib.contextmanager
def fresh_database(*, required: bool = False, migrated: bool = False) -> Iterator[str]:
    """The URL of a new database, dropped on the way out: empty, or (``migrated``) at
    the current schema, copied from a template migrated once per session (CREATE
    DATABASE ... TEMPLATE copies files; migrating each test's database anew cost about
    a quarter of a second a test)."""
    import psycopg

    admin = server_url(required=required)
    name = "runstile_test_" + secrets.token_hex(6)
    template = f' TEMPLATE "{_template(admin)}"' if migrated else ""
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{template}')
    try:
        yield _with_database(admin, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_templates: dict[str, str] = {}


def _template(admin: str) -> str:
    """A database migrated to the current schema, made at first use and dropped when the
    session ends; nobody stays connected to it, which CREATE DATABASE ... TEMPLATE
    requires."""
    if admin not in _templates:
        import psycopg

        from runstile.ledger import migrations

        name = "runstile_template_" + secrets.token_hex(6)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        atexit.register(_drop, admin, name)
        migrations.migrate(_with_database(admin, name))
        _templates[admin] = name
    return _templates[admin]


def _drop(admin: str, name: str) -> None:
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


#: The engines a test of both engines (``dual_ledger``) runs on in this pass: SQLite on
#: ``RUNSTILE_TEST_LEDGER=sqlite``, PostgreSQL on ``=postgresql`` (so the two passes of
#: .ci/run run each such test once per engine), and, with the variable unset, SQLite and
#: (when RUNSTILE_TEST_DATABASE_URL is set) PostgreSQL.
DIALECTS = (["postgresql"] if on_postgresql() else
            ["sqlite"] if os.environ.get(LEDGER_VARIABLE) == "sqlite" else
            ["sqlite", "postgresql"] if os.environ.get(URL_VARIABLE) else ["sqlite"])


def sqlite_only(conn, why: str) -> None:
    """Skip a test that checks something only SQLite has, on a PostgreSQL ledger."""
    from runstile.ledger import db

    if db.dialect(conn).name != "sqlite":
        pytest.skip(f"SQLite only: {why}")
