"""The PostgreSQL ledger's connection (docs/architecture.md, "Two dialects, one ledger").

:class:`PgConnection` presents what the ledger functions use of an ``sqlite3``
connection: ``execute(sql, params)`` with SQLite's placeholders, rows read as
``row[0]`` or ``row["name"]``, ``rowcount``, ``lastrowid``, ``in_transaction``, and
the after-commit bookkeeping of ``db.LedgerConnection``.  Each statement text is
translated once (db_postgresql_dialect.translate, cached) and errors are classified at the source
(:func:`classify`), so the ledger modules never see a psycopg exception.

Write transactions: ``BEGIN`` then ``pg_advisory_xact_lock(WRITER_LOCK)``, one key for
the whole ledger.  Writers are thus serialized exactly as SQLite's ``BEGIN IMMEDIATE``
serializes them, and each statement after the lock (READ COMMITTED) sees every
transaction committed before it: every guarded UPDATE's read-then-write argument made for
SQLite holds unchanged.  ``lock_timeout`` plays ``busy_timeout``.  The one exception is
``db.row_transaction`` (the embedded broker's claim, ack and dead letter), which row
locks alone guard: its argument is at ``broker_queue.claim``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import psycopg
import psycopg_pool
from psycopg import errors as pg_errors
from psycopg.adapt import Dumper
from psycopg.pq import TransactionStatus

from ..errors import LedgerCorrupt, LedgerUnavailable, redact_url
from .db_dialect import ConstraintViolation
from .db_postgresql_dialect import POSTGRESQL, params_for, translate
from .owed import Owed

#: The advisory lock every write transaction takes: one writer at a time, ledger-wide.
WRITER_LOCK = 0x72756E7374696C65  # 'runstile'


class Row(tuple[Any, ...]):
    """A result row read by position or by column name, like ``sqlite3.Row``."""

    __slots__ = ()
    _index: dict[str, int] = {}

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


@functools.lru_cache(maxsize=1024)
def _row_class(names: tuple[bytes, ...]) -> type[Row]:
    return type("Row", (Row,), {"__slots__": (),
                                "_index": {n.decode(): i for i, n in enumerate(names)}})


def _has_columns(cursor: psycopg.Cursor[Any]) -> bool:
    result = cursor.pgresult
    return result is not None and result.nfields > 0


def _row_factory(cursor: Any) -> Callable[[Sequence[Any]], Any]:
    # The result's field names, read as they came: ``cursor.description`` would build a
    # Column object per column for every statement (measured: a quarter of the client
    # CPU of a claim, whose SELECT * reads 34 columns).
    if not _has_columns(cursor):
        return tuple
    result = cursor.pgresult
    return _row_class(tuple(result.fname(i) for i in range(result.nfields)))


class _BoolAsUnknown(Dumper):
    """Python booleans go as untyped '1'/'0': SQLite's ledger stores them in INTEGER
    columns and also tests them in CASE WHEN; PostgreSQL reads '1' as either."""

    oid = 0

    def dump(self, obj: Any) -> bytes:
        return b"1" if obj else b"0"


def classify(exc: psycopg.Error) -> Exception:
    """psycopg's error as the ledger's: LedgerUnavailable for storage that is busy or
    gone (connection lost, lock timeout 55P03, cancel, serialization failure 40001,
    deadlock 40P01, shutdown), LedgerCorrupt for damage or a dangling reference,
    ConstraintViolation for a refused write (a race the caller answers), or unchanged."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, pg_errors.ForeignKeyViolation):
        return LedgerCorrupt(f"the ledger is damaged: {text} (a row names one that does "
                             f"not exist; `runstile db check` lists them)")
    if isinstance(exc, psycopg.IntegrityError | pg_errors.RaiseException):
        return ConstraintViolation(text)
    if isinstance(exc, pg_errors.DataCorrupted | pg_errors.IndexCorrupted):
        return LedgerCorrupt(f"the ledger is damaged: {text}")
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return LedgerUnavailable(f"the ledger is unavailable: {text}")
    return exc


@contextlib.contextmanager
def _classified() -> Iterator[None]:
    try:
        yield
    except psycopg.Error as exc:
        translated = classify(exc)
        if translated is exc:
            raise
        raise translated from exc


#: A statement that writes rows (DDL and TRUNCATE are the migrations' and tests').
_WRITE = re.compile(r"\s*(?:INSERT|UPDATE|DELETE)\b", re.IGNORECASE)


class PgCursor:
    """What a statement gave back: its rows, rowcount, and the inserted row id."""

    def __init__(self, cursor: psycopg.Cursor[Any], row_id: str | None) -> None:
        self._cursor = cursor
        self.rowcount = cursor.rowcount
        self.lastrowid: int | None = None
        self._has_rows = _has_columns(cursor)
        if row_id is not None:
            rows = cursor.fetchall()
            self.lastrowid = rows[-1][0] if rows else None

    @property
    def description(self) -> Any:
        """As sqlite3's: one entry per result column (its name first), or None."""
        return self._cursor.description

    def fetchone(self) -> Any:
        if self.lastrowid is not None or not self._has_rows:
            return None
        with _classified():
            return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        if self.lastrowid is not None or not self._has_rows:
            return []
        with _classified():
            return self._cursor.fetchall()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fetchall())


class PgConnection:
    """One PostgreSQL session in autocommit mode; transactions are explicit."""

    dialect = POSTGRESQL
    #: Shown where SQLite shows its file: the URL without its password.
    writer_path: str = ""
    busy_timeout_s: float = 5.0
    after_commit: Callable[[Any, Owed], None] | None = None
    settling: bool = False
    bare_unit: bool = False  # never set: a PostgreSQL unit keeps its savepoints

    def __init__(self, raw: psycopg.Connection[Any], url: str, busy_timeout_s: float) -> None:
        self._raw = raw
        self._trace: Callable[[str], object] | None = None
        #: Statements whose answer nobody reads (savepoints), sent with the next one.
        self._deferred: list[str] = []
        self.owed = Owed()
        self.writer_path = redact_url(url)
        self.busy_timeout_s = busy_timeout_s

    def __repr__(self) -> str:
        return f"<PgConnection {self.writer_path}>"

    @property
    def in_transaction(self) -> bool:
        return self._raw.info.transaction_status in (
            TransactionStatus.INTRANS, TransactionStatus.INERROR, TransactionStatus.ACTIVE)

    def set_trace_callback(self, trace: Callable[[str], object] | None) -> None:
        """As sqlite3's: ``trace`` gets each statement sent, its values bound in."""
        self._trace = trace

    def _traced(self, pg_sql: str, params: Any) -> None:
        if self._trace is not None:
            self._trace(psycopg.ClientCursor(self._raw).mogrify(pg_sql, params))

    def execute(self, sql: str, params: Any = ()) -> PgCursor:
        pg_sql, style, row_id = translate(sql)
        args = params_for(style, params)
        with self._alone(sql):
            self._traced(pg_sql, args)
            with _classified(), self._with_deferred():
                cursor = self._raw.execute(pg_sql, args)
            return PgCursor(cursor, row_id)

    def executemany(self, sql: str, seq: Iterable[Any]) -> PgCursor:
        pg_sql, style, _ = translate(sql, many=True)
        rows = [params_for(style, p) for p in seq]
        with self._alone(sql):
            for row in rows:
                self._traced(pg_sql, row)
            with _classified(), self._with_deferred():
                cursor = self._raw.cursor()
                cursor.executemany(pg_sql, rows)
            return PgCursor(cursor, None)

    def execute_together(self, statements: Sequence[tuple[str, Any]]) -> list[PgCursor]:
        """Execute ``statements`` (and what was deferred) in one pipeline, one round trip;
        their cursors, read once all came back (db.together).  The first error is raised
        at the end, and the statements after it did not run."""
        translated = [(translate(sql), params) for sql, params in statements]
        writes = next((sql for sql, _ in statements if _WRITE.match(sql)), "")
        with self._alone(writes):
            with _classified(), self._pipeline():
                sent = []
                for (pg_sql, style, row_id), params in translated:
                    args = params_for(style, params)
                    self._traced(pg_sql, args)
                    sent.append((self._raw.execute(pg_sql, args), row_id))
            return [PgCursor(cursor, row_id) for cursor, row_id in sent]

    def defer(self, sql: str) -> None:
        """Send ``sql`` with the next statement, in its round trip, instead of alone: for
        statements whose answer nobody reads (a savepoint set or released, db._savepoint).
        Each round trip to the server is paid while holding the ledger's writer lock, so
        a group commit's two savepoints per unit cost as much as its real statements.
        What is deferred runs before the next statement, in order, so the transaction
        is exactly what it would have been; a failure of a deferred statement (which can
        only follow one already reported) is raised by the statement it rode with."""
        self._traced(sql, None)
        self._deferred.append(sql)

    def _with_deferred(self) -> contextlib.AbstractContextManager[None]:
        """:meth:`_pipeline` when something was deferred; else nothing (a statement alone
        goes as it is)."""
        return self._pipeline() if self._deferred else contextlib.nullcontext()

    @contextlib.contextmanager
    def _pipeline(self) -> Iterator[None]:
        """A pipeline that sends the deferred statements ahead of those executed in the
        block, all in one round trip (psycopg's pipeline mode: the answers are read when
        the block ends, and the first error is raised then)."""
        deferred, self._deferred = self._deferred, []
        with self._raw.pipeline():
            for sql in deferred:
                self._raw.execute(sql)
            yield

    def _alone(self, sql: str) -> contextlib.AbstractContextManager[None]:
        """A write outside any transaction gets one of its own, with the writer lock:
        on SQLite such a statement takes the file's write lock too, so it never lands
        between another writer's read and its write."""
        if self.in_transaction or not _WRITE.match(sql):
            return contextlib.nullcontext()
        return self.writing()

    def execute_script(self, script: str) -> None:
        """Run a migration script as it is (several statements, no parameters)."""
        with _classified():
            self._raw.execute(script.encode("utf-8"))

    def close(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self._raw.close()

    def _rollback(self) -> None:
        self._deferred = []  # savepoints of the transaction rolled back
        self._traced("ROLLBACK", None)
        if self.in_transaction:
            with contextlib.suppress(psycopg.Error):
                self._raw.execute("ROLLBACK")

    @contextlib.contextmanager
    def writing(self, rows_only: bool = False, durable: bool = True) -> Iterator[None]:
        """BEGIN + the ledger's writer lock ... COMMIT (or ROLLBACK and re-raise).
        ``rows_only``: no writer lock, the rows' own locks guard the writes (db.row_transaction).
        Not ``durable``: the COMMIT does not wait for the WAL flush (db.transaction).

        The BEGIN and its settings and lock go in one round trip, and so do the COMMIT
        and what was deferred before it: several statements in one simple query, which
        stops at the first that fails (the lock's timeout, say) and reports it."""
        head = ["BEGIN"]
        if not durable:
            head.append("SET LOCAL synchronous_commit = off")
        if not rows_only:
            head.append(f"SELECT pg_advisory_xact_lock({WRITER_LOCK})")
        self._traced("; ".join(head), None)
        try:
            with _classified():
                self._raw.execute("; ".join(head))
            yield
        except BaseException:
            self._rollback()
            raise
        if self._raw.info.transaction_status == TransactionStatus.INERROR:
            # An error was swallowed inside: PostgreSQL would answer this COMMIT with a
            # silent ROLLBACK, and the caller would take it for a commit.
            self._rollback()
            raise LedgerUnavailable("the transaction failed before its commit; "
                                    "nothing of it was committed")
        tail, self._deferred = [*self._deferred, "COMMIT"], []
        try:
            self._traced("; ".join(tail), None)
            with _classified():
                self._raw.execute("; ".join(tail))
        except BaseException:
            self._rollback()
            raise

    def fileno(self) -> int:
        """The session's socket: readable when a notification (LISTEN) has arrived."""
        return self._raw.fileno()

    def notifications(self) -> list[tuple[str, str]]:
        """(channel, payload) of the notifications received so far, without waiting."""
        with _classified():
            return [(n.channel, n.payload) for n in self._raw.notifies(timeout=0)]

    @contextlib.contextmanager
    def time_limit(self, seconds: float, timeout: Callable[[], Exception]) -> Iterator[None]:
        """statement_timeout for the statements inside; a cancel becomes ``timeout()``."""
        self.execute(f"SET statement_timeout = {max(1, int(seconds * 1000))}")
        try:
            yield
        except LedgerUnavailable as exc:
            if not isinstance(exc.__cause__, pg_errors.QueryCanceled):
                raise
            raise timeout() from exc
        finally:
            with contextlib.suppress(LedgerUnavailable):
                self.execute("SET statement_timeout = 0")


def connect(url: str, *, busy_timeout_ms: int = 5000,
            readonly: bool = False) -> PgConnection:
    """Open one session with runstile's settings.  Never share it across fork()."""
    try:
        with _classified():
            raw = psycopg.connect(url, autocommit=True, row_factory=_row_factory,
                                  connect_timeout=max(1, busy_timeout_ms // 1000))
    except LedgerUnavailable as exc:
        # The server's message names the host, never the password; drop it anyway in
        # case a driver ever echoes the URL.
        password = urlsplit(url).password
        if password and password in str(exc):
            raise LedgerUnavailable(str(exc).replace(password, "***")) from None
        raise
    if readonly:
        raw.execute("SET default_transaction_read_only = on")
    _configure(raw, busy_timeout_ms)
    return PgConnection(raw, url, busy_timeout_ms / 1000)


def _configure(raw: psycopg.Connection[Any], busy_timeout_ms: int) -> None:
    """What every session of the ledger needs, whether opened alone or by a pool."""
    raw.adapters.register_dumper(bool, _BoolAsUnknown)
    raw.execute(f"SET lock_timeout = {int(busy_timeout_ms)}")


class SessionPool:
    """Sessions shared by a process's threads (psycopg_pool), for processes with more
    threads than the server should have connections.  Each borrowed session is a
    PgConnection set up as :func:`connect` sets one up; a borrower that waits past the
    busy timeout gets LedgerUnavailable, as a writer waiting for the lock does."""

    def __init__(self, url: str, *, size: int, busy_timeout_ms: int = 5000) -> None:
        self.url = url
        self.busy_timeout_s = busy_timeout_ms / 1000
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=size, open=False, timeout=self.busy_timeout_s,
            kwargs={"autocommit": True, "row_factory": _row_factory},
            configure=lambda raw: _configure(raw, busy_timeout_ms))

    def open(self) -> None:
        with _classified():
            self._pool.open(wait=True, timeout=max(1.0, self.busy_timeout_s))

    def close(self) -> None:
        self._pool.close()

    @contextlib.contextmanager
    def connection(self) -> Iterator[PgConnection]:
        """Borrow a session; it goes back (rolled back if a transaction was left open)."""
        with _classified(), self._pool.connection() as raw:
            yield PgConnection(raw, self.url, self.busy_timeout_s)
