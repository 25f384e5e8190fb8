"""What the group-commit tests share: a write lock held from outside, a count of the write
transactions a connection begins, and units that write to a table of their own."""

from __future__ import annotations

import threading

from runstile.ledger import db


class WriteLockHolder:
    """A write transaction of another connection, held open until released: every other
    writer of the ledger waits for it (the writer gate on SQLite, the advisory lock on
    PostgreSQL)."""

    def __init__(self, target) -> None:
        self.conn = db.connect(target)
        self.held = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        with db.transaction(self.conn):
            self.held.set()
            self.release.wait(30)

    def __enter__(self) -> WriteLockHolder:
        self.thread.start()
        assert self.held.wait(10)
        return self

    def __exit__(self, *exc_info) -> None:
        self.release.set()
        self.thread.join(10)
        self.conn.close()


def counting_transactions(connect, begun: list[int]):
    """``connect``, whose connections count each write transaction they begin in
    ``begun`` (the count goes up as the transaction starts waiting for the lock)."""
    def opened():
        conn = connect()
        real = conn.writing

        def writing(*args, **kwargs):
            begun.append(1)
            return real(*args, **kwargs)
        conn.writing = writing  # an instance attribute: this connection alone
        return conn
    return opened


#: The table the units below write to (the ``handed_ledger`` fixture makes it).
HANDED_TABLE = "CREATE TABLE handed (n INTEGER NOT NULL)"


def insert(n: int):
    """A unit's work: one row ``n`` into ``handed``; its result is ``n``."""
    def work(conn):
        conn.execute(f"INSERT INTO handed (n) VALUES ({int(n)})")
        return n
    return work


def handed_rows(target) -> list[int]:
    """What another connection sees committed in ``handed``, in order."""
    conn = db.connect(target)
    try:
        return [r[0] for r in conn.execute("SELECT n FROM handed ORDER BY n")]
    finally:
        conn.close()
