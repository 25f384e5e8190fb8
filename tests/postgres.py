"""A PostgreSQL database of its own for each test (docs/architecture.md, "Two dialects,
one ledger").

Set RUNSTILE_TEST_DATABASE_URL to a server's URL (say
``postgresql://postgres@127.0.0.1:5432/postgres``; the role must be allowed to create
databases): every test that asks gets a fresh database there, named at random, dropped
afterwards.  Unset, those tests skip, saying so; the PostgreSQL-only tests
(:func:`require_server`) fail instead when CI is set.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

URL_VARIABLE = "RUNSTILE_TEST_DATABASE_URL"


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
def fresh_database(*, required: bool = False) -> Iterator[str]:
    """The URL of a new, empty database, dropped on the way out."""
    import psycopg

    admin = server_url(required=required)
    name = "runstile_test_" + secrets.token_hex(6)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _with_database(admin, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


DIALECTS = ["sqlite", "postgresql"]


def sqlite_only(conn, why: str) -> None:
    """Skip a test that checks something only SQLite has, on a PostgreSQL ledger."""
    from runstile.ledger import db

    if db.dialect(conn).name != "sqlite":
        pytest.skip(f"SQLite only: {why}")
