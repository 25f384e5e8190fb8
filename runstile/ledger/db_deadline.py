"""A time limit on an SQLite connection's statements (``db.time_limit``): SQLite has no
statement timeout of its own.  PostgreSQL's connection sets ``statement_timeout`` instead
(ledger/db_postgresql.py)."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator

#: SQLite virtual-machine instructions between two looks at a statement's deadline: often
#: enough to stop within a fraction of a millisecond, rare enough to cost ~nothing.
DEADLINE_CHECK_OPS = 10_000


@contextlib.contextmanager
def progress_deadline(conn: sqlite3.Connection, seconds: float,
                      timeout: Callable[[], Exception]) -> Iterator[None]:
    """SQLite has no statement timeout; a progress handler that answers "stop" once the
    deadline has passed makes the running statement fail with SQLITE_INTERRUPT, which
    also ends its read snapshot (a long read holds back WAL checkpoints).  The handler
    is removed on the way out: the connection is pooled, and every later statement on it
    must run without a deadline.
    """
    deadline = time.monotonic() + seconds
    conn.set_progress_handler(lambda: time.monotonic() > deadline, DEADLINE_CHECK_OPS)
    try:
        yield
    except sqlite3.OperationalError as exc:
        if getattr(exc, "sqlite_errorname", "") != "SQLITE_INTERRUPT":
            raise
        raise timeout() from exc
    finally:
        conn.set_progress_handler(None, 0)
