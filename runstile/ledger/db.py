"""Connections and transactions: the one place that knows SQLite's dialect (SPEC §10).

Connections are opened with ``isolation_level=None`` so that Python never starts a
deferred transaction behind our back; every write goes through :func:`transaction`,
which says ``BEGIN IMMEDIATE``.  Why IMMEDIATE: a deferred transaction that reads and
then writes must upgrade its lock, and when two do so at once one of them gets
SQLITE_BUSY *without* the busy handler being consulted (measured: 526 of 2,400
read-then-write transactions failed with deferred BEGIN, 0 with IMMEDIATE).
IMMEDIATE takes the write lock up front, waiting through ``busy_timeout``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path
from typing import Iterator

from ..errors import LedgerCorrupt, LedgerUnavailable

#: The ledger's clock as an SQL expression: Unix seconds with millisecond precision.
#: Every lease and timestamp comes from here so that all processes share one clock.
NOW = "((julianday('now') - 2440587.5) * 86400.0)"

#: SQLite result codes that mean "storage is unavailable right now", not "bug".
_UNAVAILABLE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_IOERR", "SQLITE_FULL",
                "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PROTOCOL", "SQLITE_NOLFS")
_CORRUPT = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def translate(exc: sqlite3.Error) -> Exception:
    """Map an SQLite error to runstile's tree; unknown errors are returned unchanged."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    if name.startswith(_CORRUPT) or "malformed" in text or "not a database" in text:
        return LedgerCorrupt(f"the ledger is damaged: {text}")
    if name.startswith(_UNAVAILABLE) or isinstance(exc, sqlite3.OperationalError) and (
        "locked" in text or "disk" in text or "readonly" in text or "unable to open" in text
    ):
        return LedgerUnavailable(f"the ledger is unavailable: {text}")
    return exc


@contextlib.contextmanager
def ledger_errors() -> Iterator[None]:
    """Re-raise storage failures as LedgerUnavailable / LedgerCorrupt."""
    try:
        yield
    except sqlite3.IntegrityError:
        raise  # uniqueness races are answered by the caller, never as 503
    except sqlite3.Error as exc:
        translated = translate(exc)
        if translated is exc:
            raise
        raise translated from exc


def connect(path: Path | str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000,
            readonly: bool = False) -> sqlite3.Connection:
    """Open one connection with runstile's pragmas.  Never share it across fork()."""
    with ledger_errors():
        if readonly:
            uri = f"file:{Path(path).resolve()}?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None,
                                   timeout=busy_timeout_ms / 1000, check_same_thread=False)
        else:
            conn = sqlite3.connect(str(path), isolation_level=None,
                                   timeout=busy_timeout_ms / 1000, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute("PRAGMA foreign_keys = ON")
        # WAL is persistent and set by migrations; a reader never needs to change it.
        return conn


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: commit, or roll back and re-raise.  Nested calls use savepoints.

    Rolls back on BaseException too: an asynchronous exception (a time limit, SIGTERM
    turned into SystemExit) can land between BEGIN and COMMIT.
    """
    with ledger_errors():
        if conn.in_transaction:
            name = f"sp_{threading.get_ident()}_{id(conn)}"
            conn.execute(f"SAVEPOINT {name}")
            try:
                yield conn
            except BaseException:
                conn.execute(f"ROLLBACK TO {name}")
                conn.execute(f"RELEASE {name}")
                raise
            conn.execute(f"RELEASE {name}")
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except BaseException:
            # A failed COMMIT (disk full, I/O error) may leave the transaction open.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


class ConnectionPool:
    """One connection per (process, thread), opened lazily after any fork."""

    def __init__(self, path: Path, *, synchronous: str, busy_timeout_ms: int) -> None:
        self.path = path
        self.synchronous = synchronous
        self.busy_timeout_ms = busy_timeout_ms
        self._local = threading.local()

    def get(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            conn = connect(self.path, synchronous=self.synchronous,
                           busy_timeout_ms=self.busy_timeout_ms)
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def discard(self) -> None:
        """Drop this thread's connection (after an error that may have broken it)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and self._local.pid == os.getpid():
            with contextlib.suppress(sqlite3.Error):
                conn.close()
