"""The ledger's own mechanics: migrations, transactions, fingerprints, states, the SSRF guard."""

from __future__ import annotations

import multiprocessing
import sqlite3

import pytest

from runstile.errors import LedgerCorrupt, LedgerUnavailable
from runstile.fingerprint import fingerprint
from runstile.ledger import db, migrations
from runstile.ledger.states import TERMINAL, RunStatus, can_transition
from runstile.netguard import callback_refusal
from tests.conftest import bare_ledger


def _migrate_together(path: str, barrier, results) -> None:
    barrier.wait()  # all start at once, so the WAL switches and migrations collide
    try:
        results.put(migrations.migrate(__import__("pathlib").Path(path)))
    except Exception as exc:  # reported to the test, which fails on it
        results.put(repr(exc))
        raise


def test_migrations_from_several_processes_apply_once(tmp_path):
    # Eight processes released together on each of forty fresh files: one's WAL switch
    # meets another's (SQLite answers "locked" at once there, without its busy handler)
    # and every migration races; each applies once and no process fails its start.
    ctx = multiprocessing.get_context("fork")
    for n in range(40):
        path = str(tmp_path / f"ledger-{n}.db")
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_migrate_together, args=(path, barrier, results))
                 for _ in range(8)]
        for proc in procs:
            proc.start()
        starts = [results.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(30)
        assert all(isinstance(s, int) for s in starts), starts
        assert starts.count(0) >= 1
        conn = db.connect(path)
        assert migrations.current_version(conn) == migrations.LATEST_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT value FROM ledger_meta WHERE name = 'schema_version'"
                            ).fetchone()[0] == str(migrations.LATEST_VERSION)
        conn.close()


def test_migrating_twice_changes_nothing(ledger_target):
    path = ledger_target
    assert migrations.migrate(path) == 0
    assert migrations.migrate(path) == migrations.LATEST_VERSION


def test_a_ledger_from_a_newer_runstile_is_refused(tmp_path):
    path = tmp_path / "ledger.db"
    migrations.migrate(path)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(LedgerCorrupt, match="newer"):
        migrations.migrate(path)


def test_a_transaction_rolls_back_on_base_exceptions(ledger_target):
    path = ledger_target
    migrations.migrate(path)
    conn = db.connect(path)
    with pytest.raises(KeyboardInterrupt):
        with db.transaction(conn):
            conn.execute("INSERT INTO profiles (id, created_at) VALUES ('gone', 0)")
            raise KeyboardInterrupt
    assert not conn.in_transaction
    assert conn.execute("SELECT COUNT(*) FROM profiles").fetchone()[0] == 0


def test_nested_transactions_use_savepoints(ledger_target):
    path = ledger_target
    migrations.migrate(path)
    conn = db.connect(path)
    with db.transaction(conn):
        conn.execute("INSERT INTO profiles (id, created_at) VALUES ('outer', 0)")
        with pytest.raises(ValueError):
            with db.transaction(conn):
                conn.execute("INSERT INTO profiles (id, created_at) VALUES ('inner', 0)")
                raise ValueError
    assert [r[0] for r in conn.execute("SELECT id FROM profiles")] == ["outer"]


def test_a_held_write_lock_becomes_ledger_unavailable(tmp_path):
    path = tmp_path / "ledger.db"
    migrations.migrate(path)
    holder = db.connect(path)
    holder.execute("BEGIN IMMEDIATE")
    waiter = db.connect(path, busy_timeout_ms=50)
    with pytest.raises(LedgerUnavailable):
        with db.transaction(waiter):
            pass
    holder.execute("ROLLBACK")


def test_a_terminal_run_never_changes_status_even_through_raw_sql(ledger_target):
    conn = bare_ledger(ledger_target)
    conn.execute("INSERT INTO runs (id, profile_id, key_id, task, input, fingerprint, "
                 "fingerprint_version, status, created_at, updated_at) "
                 "VALUES ('r', 'p', 'key_1', 't', 'null', 'f', 1, 'queued', 0, 0)")
    assert conn.execute("SELECT active_runs FROM profiles").fetchone()[0] == 1
    conn.execute("UPDATE runs SET status = 'completed'")
    assert conn.execute("SELECT active_runs FROM profiles").fetchone()[0] == 0
    with pytest.raises(db.INTEGRITY_ERRORS, match="terminal"):
        conn.execute("UPDATE runs SET status = 'queued'")


def test_the_fingerprint_is_canonical():
    base = {"task": "t", "input": {"a": 1, "b": [1.0, "x"]}}
    assert fingerprint(base) == fingerprint({"input": {"b": [1, "x"], "a": 1.0}, "task": "t"})
    assert fingerprint(base) == fingerprint({**base, "metadata": None, "run_id": None})
    assert fingerprint(base) != fingerprint({**base, "session_key": "s"})
    assert fingerprint({"task": "t", "input": None}) != fingerprint({"task": "t", "input": {}})


def test_the_lifecycle_allows_exactly_the_spec_edges():
    assert can_transition("queued", "running") and can_transition("running", "stopping")
    assert can_transition("paused", "queued") and can_transition("stopping", "cancelled")
    assert not can_transition("queued", "completed")
    assert not can_transition("waiting_for_approval", "running")
    for status in TERMINAL:
        assert not any(can_transition(status, target) for target in RunStatus)


@pytest.mark.parametrize("url", ["http://127.1/", "http://2130706433/", "http://0x7f.1/",
                                 "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/",
                                 "http://[::1]/", "http://100.64.0.1/", "http://224.0.0.1/",
                                 "http://169.254.169.254/", "http://192.168.1.1/",
                                 "http://foo.localhost/", "gopher://example.com/",
                                 "http:///nohost", "http://example.com:99999/"])
def test_refused_callback_targets(url):
    assert callback_refusal(url) is not None


def test_public_and_allowlisted_callback_targets_pass():
    assert callback_refusal("https://hooks.example.com/x?y=1") is None
    assert callback_refusal("http://127.0.0.1:8080/", ("127.0.0.0/8",)) is None
    assert callback_refusal("http://internal.svc/", ("internal.svc",)) is None


def test_a_row_as_a_dict_is_what_dict_of_the_row_gives_in_the_same_column_order(conn):
    wide = conn.execute("SELECT " + ", ".join(f"{n} AS col_{n}" for n in range(40))).fetchone()
    assert db.as_dict(wide) == dict(wide) == {f"col_{n}": n for n in range(40)}
    assert list(db.as_dict(wide)) == list(dict(wide))
    # A name the row repeats keeps the value dict(row) gives it, on either engine.
    repeated = conn.execute("SELECT 1 AS a, 2 AS b, 3 AS a, 4 AS c").fetchone()
    assert db.as_dict(repeated) == dict(repeated)
    assert list(db.as_dict(repeated)) == ["a", "b", "c"]
