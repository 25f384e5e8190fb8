"""`runstile db copy --to`: an SQLite ledger full of varied rows moved into PostgreSQL
holds every row exactly, works as a ledger afterwards, and every refusal or failure
leaves the target empty (docs/operations.md, "Moving a ledger from SQLite to
PostgreSQL").  Needs RUNSTILE_TEST_DATABASE_URL (tests/postgres.py); fails under CI
without it."""

from __future__ import annotations

import signal
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from runstile.cli import main
from runstile.errors import ConfigError
from runstile.ledger import (
    admission,
    broker_queue,
    db,
    db_postgresql_copy,
    execution,
    keys,
    maintenance,
    migrations,
)
from runstile.ledger import runs as ledger_runs
from runstile.ledger.keys import Principal
from runstile.nodelock import NodeLock
from tests import postgres
from tests.conftest import bare_ledger, free_port, wait_until
from tests.unit import ledger_fill
from tests.unit.ledger_fill import OWNER

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

PASSWORD = "s3cret-Pa55"  # the test server trusts every local user: any password does


@pytest.fixture
def pg_url():
    with postgres.fresh_database(required=True) as url:
        yield url


@pytest.fixture
def filled(tmp_path):
    data_dir = tmp_path / "data"
    return data_dir, ledger_fill.fill(data_dir)


def with_password(url: str, port: int | None = None) -> str:
    parts = urlsplit(url)
    host = f"{parts.hostname}:{port or parts.port}"
    return urlunsplit(parts._replace(netloc=f"{parts.username}:{PASSWORD}@{host}"))


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def tables_and_columns(sqlite_path) -> dict[str, list[str]]:
    conn = db.connect(sqlite_path, readonly=True)
    try:
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        return {t: [r[1] for r in conn.execute(f"PRAGMA table_info({t})")] for t in tables}
    finally:
        conn.close()


def rows(target, table: str, columns: list[str]) -> list[tuple]:
    """Every row of ``table``, its values as Python gives them (bytea's memoryview as
    bytes), in one order on both engines."""
    conn = db.connect(target)
    try:
        found = conn.execute(f"SELECT {', '.join(columns)} FROM {table}").fetchall()
    finally:
        conn.close()
    found = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in found]
    return sorted(found, key=repr)


def non_empty_tables(url: str) -> dict[str, int]:
    conn = db.connect(url)
    try:
        names = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")]
        counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in names}
    finally:
        conn.close()
    return {t: n for t, n in counts.items() if n}


def insertion_order(target) -> list[str]:
    """The obligations' ids in the order GET /v1/deliveries pages them."""
    conn = db.connect(target)
    try:
        order = db.dialect(conn).obligation_order
        return [r[0] for r in conn.execute(f"SELECT id FROM obligations ORDER BY {order}")]
    finally:
        conn.close()


def disabled_triggers(url: str) -> int:
    conn = db.connect(url)
    try:
        return conn.execute("SELECT COUNT(*) FROM pg_trigger WHERE NOT tgisinternal "
                            "AND tgenabled = 'D'").fetchone()[0]
    finally:
        conn.close()


def test_a_copy_holds_every_row_of_every_table_exactly_as_the_source_has_it(
        filled, pg_url, capsys):
    data_dir, _ = filled
    code, out, err = run(["db", "copy", "--data-dir", str(data_dir),
                          "--to", with_password(pg_url)], capsys)
    assert code == 0, err
    assert PASSWORD not in out + err
    schema = tables_and_columns(data_dir / "ledger.db")
    assert len(schema) >= 17
    for table, columns in schema.items():
        source = rows(data_dir / "ledger.db", table, columns)
        # Row by row, value by value, type by type (1.0 is not 1, bytes are not text).
        copied = rows(pg_url, table, columns)
        assert [[type(v) for v in r] for r in copied] == [[type(v) for v in r] for r in source]
        assert copied == source, table
        # The counts table names every table with its count on both sides.
        assert any(line.split() == [table, str(len(source)), str(len(source))]
                   for line in out.splitlines()), (table, out)
    # Event inserts wrote no second obligation, run inserts no second active_runs count.
    assert rows(pg_url, "obligations", ["id"]) == rows(data_dir / "ledger.db", "obligations",
                                                       ["id"])
    assert disabled_triggers(pg_url) == 0
    # Deliveries page in the order they had (SQLite's rowid, PostgreSQL's page_seq).
    assert insertion_order(pg_url) == insertion_order(data_dir / "ledger.db")
    assert "copied" in out.splitlines()[-1]


def test_the_copy_works_as_a_ledger(filled, pg_url):
    data_dir, made = filled
    report = db_postgresql_copy.copy_ledger(data_dir / "ledger.db", pg_url)
    assert report.ok and report.sequences["runs.seq"] == 12  # two purged runs counted
    assert report.sequences["broker_messages.id"] == 6  # the acknowledged last one too
    assert report.sequences["obligations.page_seq"] == len(insertion_order(pg_url)) > 0
    conn = db.connect(pg_url)
    try:
        for key_id, secret in made.secrets.items():
            principal = keys.authenticate(conn, secret)
            assert principal is not None and principal.key_id == key_id
        client = keys.authenticate(conn, next(iter(made.secrets.values())))
        assert client is not None
        run = ledger_runs.get_visible(conn, client, made.runs["completed"])
        assert run is not None and run["status"] == "completed"
        _new_runs_continue_the_copied_counters(conn, client)
        assert maintenance.check(conn)["ok"], maintenance.check(conn)["problems"]
    finally:
        conn.close()


def test_a_committed_copy_leaves_the_planner_the_statistics_of_every_table(filled, pg_url):
    # Without them, PostgreSQL plans the first minute's claims and admissions blind
    # (pg_class.reltuples is -1 until something analyzes the table).
    data_dir, _ = filled
    report = db_postgresql_copy.copy_ledger(data_dir / "ledger.db", pg_url)
    assert report.ok and report.analyzed
    with psycopg.connect(pg_url) as conn:
        estimated = dict(conn.execute(
            "SELECT relname, reltuples FROM pg_class WHERE relname = ANY(%s)",
            (list(report.counts),)).fetchall())
    assert estimated == {table: float(target) for table, (_, target) in report.counts.items()}
    assert estimated["runs"] > 0


def _new_runs_continue_the_copied_counters(conn, client: Principal) -> None:
    dispatched = conn.execute("SELECT MAX(id) FROM dispatches").fetchone()[0]
    made = admission.admit(conn, ledger_fill.request(client, key="after-copy",
                                                     callback="https://hooks.example.com/z"),
                           refusal=None, max_active_runs=10_000)
    assert made.run["seq"] == 13 and made.dispatch_id == dispatched + 1
    with db.transaction(conn):
        assert broker_queue.insert_message(conn, "default", "new", b"\x01") == 7
    # The triggers are on again: this run's end writes its callback obligation.
    assert execution.claim(conn, made.run["id"], OWNER, lease_s=60,
                           task_known=lambda t: True).run
    assert execution.finish(conn, made.run["id"], OWNER, status="completed", result_json="1")
    assert conn.execute("SELECT COUNT(*) FROM obligations WHERE run_id = ?",
                        (made.run["id"],)).fetchone()[0] == 1
    active = conn.execute("SELECT active_runs FROM profiles WHERE id = 'acme'").fetchone()[0]
    assert active == conn.execute(
        "SELECT COUNT(*) FROM runs WHERE profile_id = 'acme' AND status IN ('queued', "
        "'running', 'stopping', 'waiting_for_approval', 'paused')").fetchone()[0]


def test_a_target_that_holds_a_ledger_is_refused_and_left_as_it_was(filled, pg_url, capsys):
    data_dir, _ = filled
    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    keys.create(conn, "elsewhere")
    conn.close()
    before = non_empty_tables(pg_url)
    code, out, err = run(["db", "copy", "--data-dir", str(data_dir),
                          "--to", with_password(pg_url)], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "already holds a ledger" in err
    assert "profiles" in err and "api_keys" in err and PASSWORD not in err
    assert non_empty_tables(pg_url) == before


def test_a_second_copy_into_the_same_target_is_refused(filled, pg_url, capsys):
    data_dir, _ = filled
    assert run(["db", "copy", "--data-dir", str(data_dir), "--to", pg_url], capsys)[0] == 0
    before = non_empty_tables(pg_url)
    code, _, err = run(["db", "copy", "--data-dir", str(data_dir), "--to", pg_url], capsys)
    assert code == 2 and "never merges two ledgers" in err
    assert non_empty_tables(pg_url) == before


def test_an_unreachable_target_is_refused_without_showing_its_password(filled, capsys):
    data_dir, _ = filled
    url = with_password("postgresql://postgres@127.0.0.1/postgres", port=free_port())
    code, out, err = run(["db", "copy", "--data-dir", str(data_dir), "--to", url], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "unavailable" in err
    assert PASSWORD not in err and "***" in err


def test_a_missing_source_is_refused_and_the_target_untouched(tmp_path, pg_url, capsys):
    code, _, err = run(["db", "copy", "--data-dir", str(tmp_path / "nothing"),
                        "--to", pg_url], capsys)
    assert code == 2 and "no ledger at" in err
    conn = db.connect(pg_url)
    assert migrations.current_version(conn) == 0  # not even migrated
    conn.close()
    assert not (tmp_path / "nothing" / "ledger.db").exists()


def test_a_url_that_is_not_postgresql_is_a_usage_error(filled, capsys):
    data_dir, _ = filled
    code, _, err = run(["db", "copy", "--data-dir", str(data_dir), "--to", "mysql://x/y"],
                       capsys)
    assert code == 2 and "--to" in err


def test_a_copy_that_fails_midway_leaves_the_target_empty(filled, pg_url):
    data_dir, _ = filled
    seen = []

    def fail_in_events(table: str, done: int) -> None:
        seen.append(table)
        if table == "events":
            raise RuntimeError("the copy dies here")

    with pytest.raises(RuntimeError, match="dies here"):
        db_postgresql_copy.copy_ledger(data_dir / "ledger.db", pg_url, progress=fail_in_events)
    assert {"profiles", "api_keys", "runs"} <= set(seen)  # rows had gone in before
    assert non_empty_tables(pg_url) == {"ledger_meta": 1}  # as `db migrate` left it
    assert disabled_triggers(pg_url) == 0
    assert db_postgresql_copy.copy_ledger(data_dir / "ledger.db", pg_url).ok  # and again


def test_a_source_written_to_during_the_copy_is_refused(filled, pg_url):
    data_dir, _ = filled
    writer = db.connect(data_dir / "ledger.db")

    def write_once(table: str, done: int) -> None:
        if not keys.list_keys(writer, "late"):
            keys.create(writer, "late")  # another process's commit, mid-copy

    try:
        with pytest.raises(ConfigError, match="changed while it was copied"):
            db_postgresql_copy.copy_ledger(data_dir / "ledger.db", pg_url, progress=write_once)
    finally:
        writer.close()
    assert non_empty_tables(pg_url) == {"ledger_meta": 1}


def test_a_running_node_of_the_data_dir_holds_the_copy_off(filled, pg_url, capsys):
    data_dir, _ = filled
    lock = NodeLock(data_dir, "node-a").acquire()
    try:
        code, _, err = run(["db", "copy", "--data-dir", str(data_dir), "--to", pg_url], capsys)
    finally:
        lock.release()
    assert code == 2 and "'node-a' is already running" in err and "stop it first" in err
    assert non_empty_tables(pg_url) == {}
    assert run(["db", "copy", "--data-dir", str(data_dir), "--to", pg_url], capsys)[0] == 0


def test_the_json_report_counts_every_table(filled, pg_url, capsys):
    import json
    data_dir, _ = filled
    code, out, _ = run(["db", "copy", "--json", "--data-dir", str(data_dir),
                        "--to", with_password(pg_url)], capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"] and PASSWORD not in out
    assert report["counts"]["runs"] == {"sqlite": 10, "postgresql": 10}
    assert set(report["counts"]) == set(tables_and_columns(data_dir / "ledger.db"))


def test_without_to_the_target_is_runstile_database_url(filled, pg_url, monkeypatch, capsys):
    data_dir, _ = filled
    monkeypatch.delenv("RUNSTILE_DATABASE_URL", raising=False)
    code, _, err = run(["db", "copy", "--data-dir", str(data_dir)], capsys)
    assert code == 2 and "RUNSTILE_DATABASE_URL" in err
    monkeypatch.setenv("RUNSTILE_DATABASE_URL", with_password(pg_url))
    code, out, err = run(["db", "copy", "--data-dir", str(data_dir)], capsys)
    assert code == 0, err
    assert PASSWORD not in out + err and "runs" in out
    assert non_empty_tables(pg_url)["runs"] == 10


def many_messages(data_dir, count: int) -> None:
    """A ledger of ``count`` broker messages (written by hand, for their number)."""
    conn = bare_ledger(data_dir / "ledger.db")
    with db.transaction(conn):
        conn.executemany(
            "INSERT INTO broker_messages (queue_name, message_id, body, state, enqueued_at) "
            "VALUES ('default', ?, ?, 'ready', 0)",
            ((f"m{n}", n.to_bytes(4, "big") * 64) for n in range(count)))
    conn.close()


def test_a_large_table_reports_its_progress_every_100000_rows(tmp_path, pg_url, capsys):
    many_messages(tmp_path / "data", 100_001)
    code, out, err = run(["db", "copy", "--data-dir", str(tmp_path / "data"), "--to", pg_url],
                         capsys)
    assert code == 0 and "broker_messages       100001      100001" in out
    assert err.splitlines() == ["copying broker_messages: 100000 rows so far"]


def test_a_copy_killed_midway_leaves_the_target_empty(tmp_path, pg_url):
    # A real `runstile db copy` process SIGKILLed while its COPY streams rows: the server
    # rolls its transaction back when the connection drops.
    data_dir = tmp_path / "data"
    many_messages(data_dir, 100_000)
    proc = subprocess.Popen([sys.executable, "-m", "runstile", "db", "copy", "--data-dir",
                             str(data_dir), "--to", pg_url], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    watcher = psycopg.connect(pg_url, autocommit=True)
    try:
        wait_until(lambda: proc.poll() is not None or watcher.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND "
            "query LIKE 'COPY%' AND state = 'active'").fetchone(), timeout_s=60,
            interval_s=0.005, what="the copy's COPY")
        assert proc.poll() is None, "the copy ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not watcher.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND "
            "pid != pg_backend_pid() AND backend_type = 'client backend'").fetchone(),
            what="the killed copy's session to end")
    finally:
        watcher.close()
        if proc.poll() is None:
            proc.kill()
    assert non_empty_tables(pg_url) == {"ledger_meta": 1}
    assert disabled_triggers(pg_url) == 0


def test_the_tables_owner_copies_without_being_a_superuser_and_another_role_is_refused(
        filled, capsys):
    # The triggers are held with ALTER TABLE, which needs the tables' owner: on a server
    # of the test's own, an ordinary role owning the database copies; a role with every
    # privilege on the tables but not their ownership is refused, the target left empty.
    data_dir, _ = filled
    server = postgres.OwnServer(free_port()).start()
    try:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE ROLE owner LOGIN NOSUPERUSER")
            admin.execute("CREATE ROLE stranger LOGIN NOSUPERUSER")
            admin.execute("CREATE DATABASE ledger OWNER owner")
        owner = f"postgresql://owner@127.0.0.1:{server.port}/ledger"
        stranger = f"postgresql://stranger@127.0.0.1:{server.port}/ledger"
        migrations.migrate(owner)
        with psycopg.connect(owner, autocommit=True) as conn:
            conn.execute("GRANT ALL ON ALL TABLES IN SCHEMA public TO stranger")
            conn.execute("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO stranger")
        code, out, err = run(["db", "copy", "--data-dir", str(data_dir), "--to", stranger],
                             capsys)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert "must own the target's tables" in err
        assert non_empty_tables(owner) == {"ledger_meta": 1}
        code, out, err = run(["db", "copy", "--data-dir", str(data_dir), "--to", owner], capsys)
        assert code == 0, err
        assert non_empty_tables(owner)["runs"] == 10 and disabled_triggers(owner) == 0
    finally:
        server.close()


def test_a_value_postgresql_cannot_hold_is_refused_naming_its_table(tmp_path, pg_url, capsys):
    # SQLite keeps a NUL inside text; PostgreSQL's text cannot hold one.
    conn = bare_ledger(tmp_path / "data" / "ledger.db")
    conn.execute("INSERT INTO key_tombstones VALUES ('p', 'key_1', 'a' || char(0) || 'b', 0)")
    conn.close()
    code, out, err = run(["db", "copy", "--data-dir", str(tmp_path / "data"), "--to", pg_url],
                         capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "table key_tombstones: PostgreSQL refuses a row" in err
    assert non_empty_tables(pg_url) == {"ledger_meta": 1}
