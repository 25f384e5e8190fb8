"""A PostgreSQL ledger that runstile cannot use is refused when a command starts, with one
line and exit 2 (docs/operations.md, "A PostgreSQL ledger that cannot be used"); the
commands that open a ledger (keys, webhooks secret, deliveries, schedules, serve) run on
one that it can.  Every case against a real server: a port nobody listens on, a role
that does not exist, a wrong password (on a server of the test's own that asks for one),
roles made here without privileges (dropped afterwards)."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from runstile.cli import main
from runstile.errors import ConfigError
from runstile.ledger import db_postgresql_checks, migrations
from tests import postgres
from tests.conftest import ROOT, RUNSTILE, free_port, wait_until

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

SECRET = "hunter2-not-a-password"


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def as_user(url: str, user: str, password: str | None = None) -> str:
    parts = urlsplit(url)
    auth = f"{user}:{password}" if password else user
    return urlunsplit(parts._replace(netloc=f"{auth}@{parts.hostname}:{parts.port or 5432}"))


def refused(argv, tmp_path, capsys, url: str) -> str:
    """The one line a command printed when it refused ``url`` (exit 2)."""
    code, out, err = run([*argv, "--data-dir", str(tmp_path), "--database-url", url], capsys)
    assert code == 2, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert SECRET not in out + err
    return err.strip()


@pytest.fixture
def database():
    with postgres.fresh_database(required=True) as url:
        yield url


@contextlib.contextmanager
def role(url: str, *setup: str):
    """A login role of its own (``setup`` run in ``url``'s database with {role} filled
    in), its privileges and itself dropped on the way out."""
    name = "runstile_test_role_" + secrets.token_hex(4)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
        for statement in setup:
            conn.execute(statement.format(role=f'"{name}"'))
    try:
        yield as_user(url, name, SECRET)  # trust auth on loopback ignores the password
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{name}"')
            conn.execute(f'DROP ROLE "{name}"')


def test_a_server_that_does_not_answer_is_one_line_and_exit_2(tmp_path, capsys):
    url = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/runs"
    line = refused(["keys", "list"], tmp_path, capsys, url)
    assert line.startswith("error: the PostgreSQL ledger postgresql://app:***@127.0.0.1:")
    assert "cannot be used: the server does not answer (Connection refused)" in line


def test_serve_refuses_an_unusable_ledger_before_it_starts_anything(tmp_path):
    url = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/runs"
    done = subprocess.run([*RUNSTILE, "serve", "--data-dir", str(tmp_path), "--port",
                           str(free_port()), "--database-url", url],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "the server does not answer" in done.stderr and SECRET not in done.stderr


def test_a_role_that_does_not_exist_is_wrong_credentials(database, tmp_path, capsys):
    line = refused(["keys", "create", "--profile", "p"], tmp_path, capsys,
                   as_user(database, "no_such_role_" + secrets.token_hex(3), SECRET))
    assert "cannot be used: wrong credentials: role" in line and "does not exist" in line


def test_a_wrong_password_is_wrong_credentials(tmp_path, capsys):
    """On a server of the test's own that asks this role for its password (the shared
    one trusts loopback)."""
    server = postgres.OwnServer(free_port())
    try:
        server.start()
        hba = f"{server.data}/pg_hba.conf"
        with open(hba) as f:
            rules = f.read()
        with open(hba, "w") as f:  # the first matching line wins
            f.write("host all app 127.0.0.1/32 scram-sha-256\n" + rules)
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE ROLE app LOGIN PASSWORD 'the-right-one'")
            conn.execute("SELECT pg_reload_conf()")
        wrong = as_user(server.url, "app", SECRET)
        # The postmaster rereads pg_hba.conf on the signal, a moment after the call.
        wait_until(lambda: _refuses(wrong), 10, 0.05, "the server to ask for passwords")
        right = as_user(server.url, "app", "the-right-one")
        db_postgresql_checks.check_usable(right, write=False)  # the password is asked
        line = refused(["keys", "list"], tmp_path, capsys, wrong)
    finally:
        server.close()
    assert 'wrong credentials: password authentication failed for user "app"' in line


def _refuses(url: str) -> bool:
    try:
        psycopg.connect(url, connect_timeout=2).close()
    except psycopg.OperationalError:
        return True
    return False


def test_a_database_that_does_not_exist_is_named(database, tmp_path, capsys):
    missing = urlunsplit(urlsplit(database)._replace(path="/runstile_never_created"))
    line = refused(["schedules", "list"], tmp_path, capsys, missing)
    assert 'no such database: database "runstile_never_created" does not exist' in line


def test_a_role_that_may_not_create_tables_cannot_start_an_empty_ledger(database, tmp_path,
                                                                         capsys):
    with role(database) as url:  # PostgreSQL 15: CREATE on public is the owner's alone
        line = refused(["keys", "create", "--profile", "p"], tmp_path, capsys, url)
    assert "the role may not create tables in schema public" in line
    with psycopg.connect(database) as conn:  # and nothing was half made
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
                            ).fetchone()[0] == 0


def test_a_role_that_may_only_read_cannot_write_but_may_check(database, tmp_path, capsys):
    migrations.migrate(database)
    with role(database, "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}") as url:
        line = refused(["keys", "create", "--profile", "p"], tmp_path, capsys, url)
        assert "the role may not read and write table(s) api_keys" in line
        assert "(it needs SELECT, INSERT, UPDATE and DELETE)" in line
        code, out, err = run(["db", "check", "--data-dir", str(tmp_path),
                              "--database-url", url], capsys)
        assert code == 0 and "synchronous_commit on" in out, err


def test_a_role_that_may_write_a_migrated_ledger_needs_no_create(database, tmp_path, capsys):
    migrations.migrate(database)
    with role(database, "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                        "public TO {role}") as url:
        code, out, err = run(["keys", "create", "--profile", "p", "--json", "--data-dir",
                              str(tmp_path), "--database-url", url], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["profile"] == "p"


def test_a_read_only_session_is_refused_for_writing(database, tmp_path, capsys):
    migrations.migrate(database)
    with role(database, "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                        "public TO {role}",
              "ALTER ROLE {role} SET default_transaction_read_only = on") as url:
        line = refused(["keys", "create", "--profile", "p"], tmp_path, capsys, url)
    assert "the server only allows reading" in line


def test_a_server_older_than_needed_is_refused_naming_its_version(database):
    with psycopg.connect(database) as conn:
        num, version = conn.execute("SELECT current_setting('server_version_num')::int, "
                                    "current_setting('server_version')").fetchone()
    db_postgresql_checks.check_usable(database, min_version=num)  # this one is enough
    with pytest.raises(ConfigError) as too_old:
        db_postgresql_checks.check_usable(database, min_version=num + 1)
    assert f"the server is PostgreSQL {version} and runstile needs" in too_old.value.message
    with pytest.raises(ConfigError, match=r"PostgreSQL 12\.17 and runstile needs 13 or later"):
        db_postgresql_checks.check_version(database, 120017, "12.17")
    assert num >= db_postgresql_checks.MIN_SERVER_VERSION  # the test server itself is fine


def test_the_ledger_commands_run_on_postgresql(database, tmp_path, capsys):
    def ok(*argv: str) -> str:
        code, out, err = run([*argv, "--data-dir", str(tmp_path), "--database-url",
                              database], capsys)
        assert code == 0, (argv, out, err)
        return out

    key = json.loads(ok("keys", "create", "--profile", "acme", "--json").splitlines()[-1])
    listed = json.loads(ok("keys", "list", "--json").splitlines()[-1])
    assert [k["id"] for k in listed["data"]] == [key["key_id"]]
    assert json.loads(ok("keys", "rotate", key["key_id"], "--json"))["key_id"] == key["key_id"]
    secret = ok("webhooks", "secret", "--profile", "acme").strip().splitlines()[-1]
    assert secret == ok("webhooks", "secret", "--profile", "acme").strip().splitlines()[-1]
    assert json.loads(ok("deliveries", "list", "--json"))["data"] == []
    assert json.loads(ok("schedules", "list", "--json"))["object"] == "list"
    assert json.loads(ok("keys", "revoke", key["key_id"], "--json"))["revoked"] is True
    assert not (tmp_path / "ledger.db").exists()
