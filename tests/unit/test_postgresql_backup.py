"""`runstile db backup` of a PostgreSQL ledger: pg_dump's custom format, restored by
pg_restore into another database row for row; the password never in pg_dump's argv;
a clear refusal when pg_dump is not on PATH (docs/operations.md, "Backups").  Needs
RUNSTILE_TEST_DATABASE_URL (tests/postgres.py); fails under CI without it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from urllib.parse import quote, unquote

import psycopg
import pytest

from runstile.ledger import db_postgresql_copy, migrations
from tests import postgres
from tests.conftest import free_port
from tests.unit import ledger_fill
from tests.unit.test_db_copy import PASSWORD, rows, run, tables_and_columns, with_password

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

#: The client programs of the test server's major version (Debian's wrapper picks them).
PG_DUMP = shutil.which("pg_dump") or "/usr/bin/pg_dump"
PG_RESTORE = shutil.which("pg_restore") or "/usr/bin/pg_restore"


@pytest.fixture
def pg_ledger(tmp_path):
    """A PostgreSQL ledger full of varied rows (the filled SQLite ledger, copied)."""
    data_dir = tmp_path / "data"
    ledger_fill.fill(data_dir)
    with postgres.fresh_database(required=True) as url:
        assert db_postgresql_copy.copy_ledger(data_dir / "ledger.db", url).ok
        yield data_dir, url


@pytest.fixture
def recording_pg_dump(tmp_path, monkeypatch):
    """pg_dump first on PATH as a script that writes down its argv, then runs the real one."""
    if not os.path.exists(PG_DUMP):
        pytest.skip("pg_dump is not installed")
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "argv.log"
    script = folder / "pg_dump"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> "{log}"\nexec {PG_DUMP} "$@"\n')
    script.chmod(0o700)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return log


def test_a_backup_is_pg_dump_custom_format_and_restores_row_for_row(
        pg_ledger, recording_pg_dump, tmp_path, capsys):
    data_dir, url = pg_ledger
    target = tmp_path / "backups" / "ledger.dump"
    code, out, err = run(["db", "backup", "--database-url", with_password(url),
                          str(target), "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["path"] == str(target) and report["bytes"] == target.stat().st_size > 0
    assert target.read_bytes()[:5] == b"PGDMP"  # the custom format's signature
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not target.with_name("ledger.dump.partial").exists()
    argv = recording_pg_dump.read_text()
    assert "--format=custom" in argv and PASSWORD not in argv and PASSWORD not in out + err
    # The password went by a file (0600, in a 0700 folder), removed once pg_dump ended.
    passfile = unquote(argv.split("passfile=", 1)[1].split()[0].split("&")[0])
    assert passfile.startswith("/") and not os.path.exists(os.path.dirname(passfile))
    with postgres.fresh_database(required=True) as restored:
        done = subprocess.run([PG_RESTORE, "--no-owner", "--exit-on-error",
                               f"--dbname={restored}", str(target)],
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        for table, columns in tables_and_columns(data_dir / "ledger.db").items():
            assert rows(restored, table, columns) == rows(url, table, columns), table


def test_without_pg_dump_on_path_a_backup_is_refused_naming_it(pg_ledger, tmp_path,
                                                               monkeypatch, capsys):
    _, url = pg_ledger
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-bin"))
    target = tmp_path / "ledger.dump"
    code, out, err = run(["db", "backup", "--database-url", url, str(target)], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "pg_dump is not on PATH" in err
    assert not target.exists() and not target.with_name("ledger.dump.partial").exists()


def test_a_failing_pg_dump_says_why_without_the_password_and_keeps_the_old_backup(
        pg_ledger, tmp_path, capsys):
    _, url = pg_ledger
    if not os.path.exists(PG_DUMP):
        pytest.skip("pg_dump is not installed")
    target = tmp_path / "ledger.dump"
    target.write_bytes(b"the old backup")
    missing = with_password(url.rsplit("/", 1)[0] + "/runstile_no_such_database")
    code, _, err = run(["db", "backup", "--database-url", missing, str(target), "--force"],
                       capsys)
    assert code == 1 and "pg_dump of" in err and "does not exist" in err
    assert PASSWORD not in err and "***" in err
    assert target.read_bytes() == b"the old backup"


#: With every character a .pgpass line or a URL must escape.
HARD_PASSWORD = "pa:ss\\w@rd/%?#"


def test_a_server_that_asks_for_the_password_gets_it_from_the_passfile(tmp_path, capsys):
    # The shared server trusts everyone; this one of the test's own asks for a password
    # (scram-sha-256), so the dump works only if the passfile carried it.
    if not os.path.exists(PG_DUMP):
        pytest.skip("pg_dump is not installed")
    server = postgres.OwnServer(free_port()).start()
    try:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute(f"ALTER ROLE postgres PASSWORD '{HARD_PASSWORD}'")
            admin.execute("CREATE DATABASE ledger")
        with open(os.path.join(server.data, "pg_hba.conf"), "w") as hba:
            hba.write("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        server._run("pg_ctl", "-D", server.data, "reload")
        netloc = f"postgres:{quote(HARD_PASSWORD, safe='')}@127.0.0.1:{server.port}"
        url = f"postgresql://{netloc}/ledger"
        wrong = f"postgresql://postgres:no@127.0.0.1:{server.port}/ledger"
        migrations.migrate(url)
        target = tmp_path / "ledger.dump"
        code, out, err = run(["db", "backup", "--database-url", url, str(target)], capsys)
        assert code == 0, err
        assert target.read_bytes()[:5] == b"PGDMP" and HARD_PASSWORD not in out + err
        code, _, err = run(["db", "backup", "--database-url", wrong, str(target), "--force"],
                           capsys)
        assert code == 1 and "password authentication failed" in err
    finally:
        server.close()
