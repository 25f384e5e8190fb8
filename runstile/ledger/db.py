"""Connections and transactions: the one place that knows SQLite's dialect
(docs/architecture.md, "Why BEGIN IMMEDIATE").

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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..errors import LedgerCorrupt, LedgerUnavailable, RunstileError
from ..filemodes import private_file
from .db_deadline import progress_deadline
from .db_dialect import NOW, SQLITE, ConstraintViolation, SqliteDialect, as_dict, is_database_url
from .db_gate import writer_gate
from .owed import Owed

if TYPE_CHECKING:  # nodes imports this module: the type only, for the checker
    from .nodes import HeldLock

__all__ = ["NOW", "INTEGRITY_ERRORS", "SqliteDialect", "as_dict", "dialect", "is_database_url"]

#: A write refused by a uniqueness or check constraint, on either engine: a race that the
#: caller answers (a replay, a 409), never a 503.
INTEGRITY_ERRORS: tuple[type[Exception], ...] = (sqlite3.IntegrityError, ConstraintViolation)

#: One statement and its parameters, for :func:`together`.
Statement = tuple[str, Sequence[Any]]


def dialect(conn: object) -> SqliteDialect:
    """The SQL spelling of ``conn``'s engine (ledger/db_dialect.py)."""
    found: SqliteDialect = getattr(conn, "dialect", SQLITE)
    return found

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
    except sqlite3.IntegrityError as exc:
        if getattr(exc, "sqlite_errorname", "") == "SQLITE_CONSTRAINT_FOREIGNKEY":
            # Not a race: a row names one that does not exist, which runstile never
            # writes (say, an obligation for a run that is gone).  Stop with a clear
            # error instead of a traceback at every pass.
            raise LedgerCorrupt(f"the ledger is damaged: {exc} (a row names one that does "
                                f"not exist; `runstile db check` lists them)") from exc
        raise  # uniqueness races are answered by the caller, never as 503
    except sqlite3.Error as exc:
        translated = translate(exc)
        if translated is exc:
            raise
        raise translated from exc


def time_limit(conn: sqlite3.Connection, seconds: float,
               timeout: Callable[[], Exception]) -> contextlib.AbstractContextManager[None]:
    """Abort the statements run inside past ``seconds``, raising ``timeout()``."""
    return cast(LedgerConnection, conn).time_limit(seconds, timeout)


def connect(path: Path | str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000,
            readonly: bool = False) -> sqlite3.Connection:
    """Open one connection with runstile's pragmas.  Never share it across fork().

    ``path`` may be a PostgreSQL URL instead (ledger/db_postgresql.py); the connection
    then presents the same methods, and ``synchronous`` is the server's business."""
    if is_database_url(path):
        # Imported here: psycopg only for a PostgreSQL ledger, so SQLite's start stays quick.
        from . import db_postgresql
        return cast(sqlite3.Connection, db_postgresql.connect(
            str(path), busy_timeout_ms=busy_timeout_ms, readonly=readonly))
    with ledger_errors():
        if readonly:
            uri = f"file:{Path(path).resolve()}?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, factory=LedgerConnection,
                                   timeout=busy_timeout_ms / 1000, check_same_thread=False)
        else:
            private_file(path)  # a new ledger (and so its WAL and SHM) is 0600
            conn = sqlite3.connect(str(path), isolation_level=None, factory=LedgerConnection,
                                   timeout=busy_timeout_ms / 1000, check_same_thread=False)
        conn.owed = Owed()
        conn.synchronous = synchronous.upper()
        conn.writer_path = str(Path(path).resolve())
        conn.busy_timeout_s = busy_timeout_ms / 1000
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute("PRAGMA foreign_keys = ON")
        # WAL is persistent and set by migrations; a reader never needs to change it.
        return conn


def ledger_exists(target: Path | str) -> bool:
    """Whether there is a ledger to open: an SQLite file that exists; a PostgreSQL
    database always (connecting, and its schema version, tell the rest)."""
    return is_database_url(target) or Path(target).exists()


def node_lock(target: Path | str, *, data_dir: Path, node_id: str,
              busy_timeout_ms: int) -> HeldLock:
    """The engine's lock of ``node_id`` (not yet taken): an flock in ``data_dir`` for an
    SQLite file (runstile/nodelock.py), a session advisory lock for a PostgreSQL ledger
    (ledger/db_postgresql_nodes.py)."""
    if is_database_url(target):
        from .db_postgresql_nodes import AdvisoryNodeLock  # psycopg only for PostgreSQL
        return AdvisoryNodeLock(str(target), node_id, busy_timeout_ms=busy_timeout_ms)
    from ..nodelock import NodeLock
    return NodeLock(data_dir, node_id)


def check_usable(target: Path | str, *, busy_timeout_ms: int = 5000, write: bool = True) -> None:
    """At a command's start: a PostgreSQL ledger this runstile cannot use (unreachable,
    refused, too old, no privileges) is a ConfigError of one line; an SQLite path is
    left to its own open (ledger/db_postgresql_checks.py)."""
    if is_database_url(target):
        from . import db_postgresql_checks
        db_postgresql_checks.check_usable(str(target), busy_timeout_ms=busy_timeout_ms,
                                          write=write)


#: What a connection's owner does with what its commits owe (``dispatch.Dispatcher``).
AfterCommit = Callable[[sqlite3.Connection, Owed], None]


class LedgerConnection(sqlite3.Connection):
    """A connection that knows its file's writer lock, its busy timeout, and what its
    open transaction owes once it commits (ledger/owed.py)."""

    writer_path: str = ""
    busy_timeout_s: float = 5.0
    #: This connection's ``PRAGMA synchronous`` (a transaction that need not be durable
    #: lowers it for its own commit, then puts it back).
    synchronous: str = "FULL"
    #: Written down by the transaction in progress; emptied at every BEGIN.
    owed: Owed
    #: Called after a COMMIT that owes something; None: the debt is dropped (recovery
    #: pays it).
    after_commit: AfterCommit | None = None
    #: True while ``after_commit`` runs: its own commits (marking a record sent) do not
    #: call it again.
    settling: bool = False
    #: How this engine spells what engines spell differently (ledger/db_dialect.py).
    dialect: SqliteDialect = SQLITE
    #: Set by a transaction that makes broker rows ready (broker_queue._made_ready).
    bell: bool = False
    #: Set by a group commit for the unit it runs (ledger/group_commit.py): the unit's
    #: own :func:`transaction` then opens no savepoint (deeper ones still do).
    bare_unit: bool = False

    @contextlib.contextmanager
    def writing(self, rows_only: bool = False, durable: bool = True) -> Iterator[None]:
        """One write transaction: the writer gate, then BEGIN IMMEDIATE ... COMMIT (SQLite
        locks the file however few rows a transaction writes: ``rows_only`` changes nothing).
        Not ``durable``: its COMMIT does not fsync (see :func:`transaction`)."""
        gate = writer_gate(self.writer_path)
        with gate.held(self.busy_timeout_s), self._synchronous(durable), _immediate(self):
            self.bell = False
            yield
        if self.bell:  # committed and visible; rung after the gate, so no writer waits on it
            gate.ring()

    @contextlib.contextmanager
    def _synchronous(self, durable: bool) -> Iterator[None]:
        """synchronous=NORMAL around a transaction that need not be ``durable`` (read at its
        COMMIT, it cannot change inside one); under the writer gate, so no other commit of
        ours runs between."""
        if durable or self.synchronous not in ("FULL", "EXTRA"):
            yield
            return
        with ledger_errors():
            self.execute("PRAGMA synchronous = NORMAL")
        try:
            yield
        finally:
            with ledger_errors():
                self.execute(f"PRAGMA synchronous = {self.synchronous}")

    def execute_together(self, statements: Sequence[Statement]) -> list[sqlite3.Cursor]:
        """Run ``statements`` in order; their cursors.  A PostgreSQL connection sends them
        in one round trip (db_postgresql.PgConnection.execute_together)."""
        return [self.execute(sql, args) for sql, args in statements]

    def defer(self, sql: str) -> None:
        """Run ``sql``, a statement whose answer nobody reads.  A PostgreSQL connection
        sends it with the next statement instead (db_postgresql.PgConnection.defer);
        SQLite has no round trips to save."""
        self.execute(sql)

    def time_limit(self, seconds: float,
                   timeout: Callable[[], Exception]) -> contextlib.AbstractContextManager[None]:
        return progress_deadline(self, seconds, timeout)


def together(conn: sqlite3.Connection, statements: Sequence[Statement]) -> list[Any]:
    """Execute ``statements``, none of which needs another's answer, in order; return
    their cursors.  On PostgreSQL they travel in one round trip (a pipeline) instead of
    one each: inside a write transaction each round trip is paid under the writer lock.
    An error is raised once all were sent, by this call, so it still belongs to the
    caller's transaction or savepoint; the statements after the one that failed did not
    run."""
    with ledger_errors():
        cursors: list[Any] = cast(LedgerConnection, conn).execute_together(statements)
    return cursors


def row_transaction(
        conn: sqlite3.Connection, *,
        durable: bool = True) -> contextlib.AbstractContextManager[sqlite3.Connection]:
    """:func:`transaction` for guarded writes of a few rows that row locks alone protect:
    SQLite's (file-wide) lock as usual; PostgreSQL's BEGIN without the writer lock.  Only
    for the embedded broker's claim and acks (docs/architecture.md, "The embedded broker")."""
    return transaction(conn, rows_only=True, durable=durable)


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection, *, rows_only: bool = False,
                durable: bool = True) -> Iterator[sqlite3.Connection]:
    """One write transaction: commit, or roll back and re-raise.  Nested calls use savepoints.

    ``durable=False`` is for bookkeeping whose loss in a power cut is harmless: its COMMIT
    does not wait for the disk (SQLite: ``synchronous=NORMAL`` for that commit; PostgreSQL:
    ``synchronous_commit = off``).  It is still atomic, and ordered before every later
    commit: the first durable commit after it makes it durable too (the WAL is one log,
    synced as a prefix).  A crash of the process alone loses nothing; a power cut may
    lose it, never a durable commit that followed it.  Nested calls keep the outer
    transaction's durability.

    Rolls back on BaseException too: an asynchronous exception (a time limit, SIGTERM
    turned into SystemExit) can land between BEGIN and COMMIT.

    Writers pass the WriterGate (ledger/db_gate.py) before BEGIN IMMEDIATE.  After the
    COMMIT, and outside the writer gate, what the transaction owes goes to the
    connection's ``after_commit`` (ledger/owed.py).
    """
    ledger_conn = cast(LedgerConnection, conn)  # every connection comes from connect()
    if conn.in_transaction:
        with _nested(ledger_conn):
            yield conn
        return
    ledger_conn.owed.take()  # a debt dropped by a failed settle or a rollback: gone
    try:
        # SQLite: the writer gate, then BEGIN IMMEDIATE; PostgreSQL: BEGIN, then the
        # ledger's advisory writer lock (docs/architecture.md, "Two dialects, one ledger").
        with ledger_conn.writing(rows_only=rows_only, durable=durable):
            yield conn
    except BaseException:
        ledger_conn.owed.take()  # rolled back: nothing of it is owed
        raise
    _settle(ledger_conn)


def _settle(conn: LedgerConnection) -> None:
    """Hand what the committed transaction owes to the connection's owner.  Never from
    inside another settle: the marks it commits owe nothing, and what they might owe
    waits for the next commit's settle."""
    if conn.after_commit is None or conn.settling or not conn.owed:
        return
    conn.settling = True
    try:
        conn.after_commit(conn, conn.owed.take())
    finally:
        conn.settling = False


class RefusedAfterWriting(Exception):
    """A group commit's unit refused after writing (not a RunstileError: its batch aborts
    and is retried one unit per transaction, where the refusal rolls the unit back)."""


@contextlib.contextmanager
def _nested(conn: LedgerConnection) -> Iterator[None]:
    """A transaction inside another: a savepoint, undone with what it owed if it raises.
    A group commit's unit on SQLite (``bare_unit``) takes none: what it wrote is counted
    instead, and a refusal after a write escapes as RefusedAfterWriting, which no
    ``except`` for the refusal inside the unit can swallow (ledger/group_commit.py)."""
    mark = conn.owed.mark()
    bare, conn.bare_unit = conn.bare_unit, False  # a deeper transaction takes a savepoint
    written = conn.total_changes if bare else 0
    try:
        if bare:
            yield
        else:
            with _savepoint(conn):
                yield
    except BaseException as exc:
        conn.owed.undo(mark)
        if bare and isinstance(exc, RunstileError) and conn.total_changes != written and \
                not isinstance(exc, LedgerUnavailable):
            raise RefusedAfterWriting(exc.code) from exc
        raise


@contextlib.contextmanager
def _savepoint(conn: sqlite3.Connection) -> Iterator[None]:
    # Set and released through ``defer``: a PostgreSQL ledger sends them with the next
    # statement instead of one round trip each (db_postgresql.PgConnection.defer).
    ledger_conn = cast(LedgerConnection, conn)
    with ledger_errors():
        name = f"sp_{threading.get_ident()}_{id(conn)}"
        ledger_conn.defer(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            conn.execute(f"ROLLBACK TO {name}")
            ledger_conn.defer(f"RELEASE {name}")
            raise
        ledger_conn.defer(f"RELEASE {name}")


@contextlib.contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    with ledger_errors():
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
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

    def __init__(self, path: Path | str, *, synchronous: str, busy_timeout_ms: int,
                 after_commit: AfterCommit | None = None) -> None:
        self.path = path
        self.synchronous = synchronous
        self.busy_timeout_ms = busy_timeout_ms
        #: Given to every connection the pool opens (ledger/owed.py).
        self.after_commit = after_commit
        self._local = threading.local()
        #: Connections inherited across a fork: never used, never closed (SQLite forbids
        #: touching them in the child, closing included), just kept from the collector.
        self._inherited: list[sqlite3.Connection] = []

    def get(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid != os.getpid():
            self._inherited.append(conn)
            conn = None
        if conn is None:
            conn = self.open()
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def open(self) -> sqlite3.Connection:
        """A new connection set up as the pool's are, owned by the caller (a thread of
        its own, such as a group committer's), not kept by the pool."""
        conn = connect(self.path, synchronous=self.synchronous,
                       busy_timeout_ms=self.busy_timeout_ms)
        cast(LedgerConnection, conn).after_commit = self.after_commit
        return conn

    def discard(self) -> None:
        """Drop this thread's connection (after an error that may have broken it)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and self._local.pid == os.getpid():
            with contextlib.suppress(sqlite3.Error):
                conn.close()
