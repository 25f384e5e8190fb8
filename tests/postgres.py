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


def end_frozen_writers(url: str, seconds: float) -> None:
    """Have the server end any session of ``url``'s database that sits in a transaction
    for ``seconds`` (``idle_in_transaction_session_timeout``, for sessions opened from
    now on), as docs/operations.md tells operators to: a process frozen in a write
    transaction (SIGSTOP) otherwise holds the ledger's writer lock until it resumes."""
    import psycopg

    name = urlsplit(url).path.lstrip("/")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET idle_in_transaction_session_timeout = '
                     f"'{int(seconds * 1000)}ms'")


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


class OwnServer:
    """A PostgreSQL server of this test's own (initdb into a fresh folder, a free port,
    trust auth on 127.0.0.1), for tests that stop and start the server: never the
    machine's shared one.  As root, the server runs as the ``postgres`` user (PostgreSQL
    refuses to run as root)."""

    BIN = "/usr/lib/postgresql/15/bin"

    def __init__(self, port: int) -> None:
        import shutil
        import tempfile

        if not os.path.exists(f"{self.BIN}/initdb"):
            found = shutil.which("initdb")
            if found is None:
                _absent("initdb is not installed: cannot start a PostgreSQL server of "
                        "the test's own")
            self.BIN = os.path.dirname(found)
        self.port = port
        # Not under pytest's tmp_path: its 0700 parents keep the postgres user out.
        self.folder = tempfile.mkdtemp(prefix="runstile-pg-")
        self.data = os.path.join(self.folder, "data")
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        self._as = ["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else []
        if os.getuid() == 0:
            os.chown(self.folder, *_postgres_ids())
        self._run("initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def _run(self, tool: str, *args: str) -> None:
        import subprocess

        done = subprocess.run([*self._as, f"{self.BIN}/{tool}", *args], capture_output=True,
                              text=True, timeout=120, cwd=self.folder)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stdout}{done.stderr}")

    def start(self) -> OwnServer:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories={self.folder} -c fsync=on")
        self._run("pg_ctl", "-D", self.data, "-l", os.path.join(self.folder, "log"),
                  "-o", options, "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server; ``immediate`` is a crash as far as clients can tell (no
        shutdown checkpoint, every session cut)."""
        self._run("pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop")

    def close(self) -> None:
        import shutil

        with contextlib.suppress(RuntimeError):
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _postgres_ids() -> tuple[int, int]:
    import pwd

    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid


def _absent(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
    pytest.skip(message)
