"""The triggers on runs (migration 3 rewrote their WHEN clauses for speed): recovery's
set-based moves rely on them to keep profiles.active_runs exact and terminal rows final,
so every status, every edge between them and every delete is checked against a count."""

from __future__ import annotations

import itertools
import sqlite3

import pytest

from runstile.ledger.states import NON_TERMINAL, TERMINAL
from tests.conftest import bare_ledger

STATUSES = sorted(s.value for s in NON_TERMINAL) + sorted(s.value for s in TERMINAL)


@pytest.fixture
def conn(tmp_path):
    conn = bare_ledger(tmp_path / "ledger.db")
    yield conn
    conn.close()


def insert(conn, run_id: str, status: str) -> None:
    conn.execute("INSERT INTO runs (id, profile_id, key_id, task, input, fingerprint, "
                 "fingerprint_version, status, created_at, updated_at) "
                 "VALUES (?, 'p', 'key_1', 't', 'null', 'f', 1, ?, 0, 0)", (run_id, status))


def active(conn) -> int:
    return conn.execute("SELECT active_runs FROM profiles WHERE id = 'p'").fetchone()[0]


def unfinished(conn) -> int:
    return conn.execute("SELECT COUNT(*) FROM runs WHERE status NOT IN "
                        "('completed', 'failed', 'cancelled', 'interrupted')").fetchone()[0]


def test_active_runs_counts_every_status_a_run_is_inserted_with(conn):
    for n, status in enumerate(STATUSES):
        insert(conn, f"r{n}", status)
        assert active(conn) == unfinished(conn), status
    assert active(conn) == len(NON_TERMINAL)


@pytest.mark.parametrize("old, new", list(itertools.product(STATUSES, STATUSES)))
def test_every_status_change_keeps_active_runs_exact_and_terminal_rows_final(conn, old, new):
    insert(conn, "r", old)
    if old in {s.value for s in TERMINAL} and new != old:
        with pytest.raises(sqlite3.IntegrityError, match="terminal run never changes"):
            conn.execute("UPDATE runs SET status = ? WHERE id = 'r'", (new,))
        assert conn.execute("SELECT status FROM runs").fetchone()[0] == old
    else:
        conn.execute("UPDATE runs SET status = ? WHERE id = 'r'", (new,))
    assert active(conn) == unfinished(conn)


def test_a_delete_of_any_status_keeps_active_runs_exact(conn):
    for n, status in enumerate(STATUSES):
        insert(conn, f"r{n}", status)
    for n, status in enumerate(STATUSES):
        conn.execute("DELETE FROM runs WHERE id = ?", (f"r{n}",))
        assert active(conn) == unfinished(conn), status
    assert active(conn) == 0
