"""A group commit's units (ledger/group_commit.py): a unit whose work writes and then
refuses commits nothing of its own while the rest of its batch commits, on each engine;
on SQLite a unit's own transaction opens no savepoint, because that promise is checked
by counting the rows the connection wrote instead."""

from __future__ import annotations

from runstile.errors import CapacityExceeded
from runstile.ledger import db, group_commit
from tests.unit.commit_helpers import handed_rows, insert


def _refuses_after_writing(n: int, *, own_transaction: bool):
    def work(conn):
        if own_transaction:
            with db.transaction(conn):
                conn.execute(f"INSERT INTO handed (n) VALUES ({int(n)})")
                raise CapacityExceeded("refused after writing")
        conn.execute(f"INSERT INTO handed (n) VALUES ({int(n)})")
        raise CapacityExceeded("refused after writing")
    return work


def _write_then_refuse_caught(conn, n: int) -> None:
    """A transaction that writes ``n`` and refuses, its refusal caught by the caller."""
    try:
        with db.transaction(conn):
            conn.execute(f"INSERT INTO handed (n) VALUES ({int(n)})")
            raise CapacityExceeded("refused after writing, then caught")
    except CapacityExceeded:
        pass


def _traced(target, statements: list[str]):
    def connect():
        conn = db.connect(target)
        conn.set_trace_callback(statements.append)
        return conn
    return connect


def test_a_unit_that_refuses_after_writing_commits_nothing_and_its_batch_commits(handed_ledger):
    target, _ = handed_ledger
    batch = [group_commit.Unit(insert(0)),
             group_commit.Unit(_refuses_after_writing(1, own_transaction=True)),
             group_commit.Unit(insert(2)),
             group_commit.Unit(_refuses_after_writing(3, own_transaction=False)),
             group_commit.Unit(insert(4))]
    group_commit.Batches(lambda: db.connect(target)).settle(batch)

    assert [unit.result for unit in batch] == [0, None, 2, None, 4]
    assert [type(unit.error).__name__ for unit in batch] == [
        "NoneType", "CapacityExceeded", "NoneType", "CapacityExceeded", "NoneType"]
    assert handed_rows(target) == [0, 2, 4]


def test_a_refusal_a_unit_catches_inside_itself_undoes_only_the_writes_it_wrapped(handed_ledger):
    target, _ = handed_ledger

    def work(conn):
        with db.transaction(conn):
            conn.execute("INSERT INTO handed (n) VALUES (10)")
            _write_then_refuse_caught(conn, 11)
            conn.execute("INSERT INTO handed (n) VALUES (12)")
        return "done"

    batch = [group_commit.Unit(work), group_commit.Unit(insert(13))]
    group_commit.Batches(lambda: db.connect(target)).settle(batch)

    assert [unit.result for unit in batch] == ["done", 13]
    assert handed_rows(target) == [10, 12, 13]


def test_a_refusal_a_unit_catches_around_its_own_transaction_still_undoes_that_write(
        handed_ledger):
    target, _ = handed_ledger

    def work(conn):
        _write_then_refuse_caught(conn, 20)  # the unit's own transaction, this time
        conn.execute("INSERT INTO handed (n) VALUES (21)")
        return "went on"

    batch = [group_commit.Unit(insert(19)), group_commit.Unit(work)]
    group_commit.Batches(lambda: db.connect(target)).settle(batch)

    assert [unit.result for unit in batch] == [19, "went on"]
    assert handed_rows(target) == [19, 21]


def test_a_units_own_transaction_opens_a_savepoint_only_where_writes_are_not_counted(
        handed_ledger):
    target, _ = handed_ledger
    statements: list[str] = []

    def work(conn):
        with db.transaction(conn):
            conn.execute("INSERT INTO handed (n) VALUES (1)")
            with db.transaction(conn):  # deeper: always a savepoint of its own
                conn.execute("INSERT INTO handed (n) VALUES (2)")
        return 1

    batch = [group_commit.Unit(work), group_commit.Unit(work)]
    group_commit.Batches(_traced(target, statements)).settle(batch)

    assert [unit.result for unit in batch] == [1, 1]
    savepoints = [s for s in statements if "SAVEPOINT" in s.upper() and "RELEASE" not in
                  s.upper()]
    # SQLite counts what a unit writes: one savepoint per unit, for the deeper level only.
    # A PostgreSQL unit keeps one at each level and one around the whole unit (each sent
    # with the next statement).
    on_postgresql = isinstance(target, str)  # a URL; SQLite's target is a file's Path
    assert len(savepoints) == (6 if on_postgresql else 2), statements
    assert handed_rows(target) == [1, 1, 2, 2]
