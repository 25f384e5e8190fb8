"""Group commit: many request threads, one write transaction, one fsync.

A durable commit costs an fsync, and SQLite admits one writer at a time, so threads
that each commit their own admission spend most of their time queueing for the lock.
Here the request threads of one process hand their unit of work to a committer thread,
which runs every unit waiting at that moment inside ONE ``BEGIN IMMEDIATE`` transaction,
then commits once and wakes every waiter.  A unit refuses (a 409, a 429) only before it
writes, so a refusal needs no savepoint: on SQLite none is taken, and a unit that refuses
after writing anyway is caught by the count of rows written (:func:`_run_unit`); any
other failure after writing aborts the batch, which is then retried one unit per
transaction.

Durability is unchanged: a waiter learns its result only after the COMMIT that holds
it returned, so no answer is sent for anything that is not on disk; if the COMMIT
fails, every unit of the batch fails with LedgerUnavailable and none was acknowledged.

The batch is topped up once the transaction holds the write lock: whatever was handed
over while the committer waited for the lock (other processes hold it most of the time
under load) rides in this commit instead of waiting out another turn of the lock.

A thread may also hand a unit over without waiting (:meth:`GroupCommitter.hand_over`):
it is told on the committer thread once the unit is settled, under the same rule (after
the COMMIT, or of the failure).  A worker thread hands over its run's finish that way
and goes on to its next message, whose claim then usually rides in the same commit.

A unit's work may be a :class:`BatchWork`, offering ``run_many(conn, works) -> [(result,
refusal), ...]``: the units of a batch that share it are then run by one call, so that their writes can be
set-based (admissions: ``ledger.admission.reserve_many``).  Same contract: refusals per unit,
before writing; any other exception aborts the batch.
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from ..errors import LedgerUnavailable, RunstileError
from . import db

log = logging.getLogger("runstile.ledger")

#: Most units one transaction carries; bounds the time the write lock is held.
MAX_BATCH = 64


class BatchWork(Protocol):
    """Work that a batch may run together with the other units of its kind."""

    def __call__(self, conn: sqlite3.Connection) -> Any:
        """The work alone, in its own transaction (the fallback after a failed batch)."""

    def run_many(self, conn: sqlite3.Connection,
                 works: list[Any]) -> Sequence[tuple[Any, RunstileError | None] | None]:
        """Every work of the group, in order: ``(result, None)`` or ``(None, refusal)``;
        raising aborts the batch."""


class Unit:
    """One piece of work for a shared transaction, and what became of it."""

    __slots__ = ("work", "result", "error")

    def __init__(self, work: Callable[[sqlite3.Connection], Any]) -> None:
        self.work = work
        self.result: Any = None
        self.error: BaseException | None = None

    def settled(self) -> None:
        """Called by the committer thread once the unit's batch committed or failed."""


class _Waiting(Unit):
    """A unit whose request thread sleeps until the committer has settled it."""

    __slots__ = ("done",)

    def __init__(self, work: Callable[[sqlite3.Connection], Any]) -> None:
        super().__init__(work)
        #: A latch: held from birth, released once by the committer when the unit is
        #: settled; the waiting request thread acquires it.  (A bare lock, not an
        #: Event: one wake-up without a Condition's bookkeeping.)
        self.done = threading.Lock()
        self.done.acquire()

    def settled(self) -> None:
        self.done.release()


class _HandedOver(Unit):
    """A unit nobody waits for: its ``then`` is told, on the committer thread."""

    __slots__ = ("then",)

    def __init__(self, work: Callable[[sqlite3.Connection], Any],
                 then: Callable[[Unit], None]) -> None:
        super().__init__(work)
        self.then = then

    def settled(self) -> None:
        try:
            self.then(self)
        except Exception:  # noqa: BLE001 - the committer thread must outlive a callback
            log.exception("a committed unit's follow-up failed")


#: ``more(room)``: units that arrived since the batch was taken (the committer thread's:
#: at most ``room``, the room left under MAX_BATCH).
TopUp = Callable[[int], list[Unit]]


class Batches:
    """Settles batches of units on one connection of its own, reopened after a failure.

    Used by the committer thread below and, one batch per wake-up, by the admission
    writer process (web/writer/).
    """

    def __init__(self, connect: Callable[[], sqlite3.Connection]) -> None:
        self._connect = connect
        self._conn: sqlite3.Connection | None = None

    def settle(self, batch: list[Unit], more: TopUp | None = None) -> None:
        """Commit ``batch`` in one transaction; every unit ends with a result or an
        error.  Never raises: when the batch does not commit, nobody is acknowledged.

        ``more(room)``, called once the transaction holds the write lock, returns the
        units that arrived meanwhile; they are appended to ``batch`` and share
        its fate, so the caller answers every unit of ``batch`` afterwards."""
        try:
            if self._conn is None:
                self._conn = self._open()
            _commit(self._conn, batch, more)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter of the batch
            # The batch did not commit: nobody was acknowledged.
            failure = exc if isinstance(exc, LedgerUnavailable) else LedgerUnavailable(
                f"the ledger could not commit: {exc}")
            for unit in batch:
                unit.result, unit.error = None, unit.error or failure
            if self._conn is not None:
                try:
                    self._conn.close()
                except sqlite3.Error:
                    pass
                self._conn = None  # reopen: the failure may have broken the connection

    def _open(self) -> sqlite3.Connection:
        conn = self._connect()
        for statement in db.dialect(conn).batch_setup():
            conn.execute(statement)
        return conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class GroupCommitter:
    """One per (ledger, process); started lazily, so it is created after any fork."""

    def __init__(self, connect: Callable[[], sqlite3.Connection]) -> None:
        self._connect = connect
        self._queue: queue.SimpleQueue[Unit] = queue.SimpleQueue()
        self._pid: int | None = None
        self._start_lock = threading.Lock()

    def run(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``work(conn)`` inside a shared write transaction; return once committed."""
        unit = _Waiting(work)
        self._hand(unit)
        unit.done.acquire()
        if unit.error is not None:
            raise unit.error
        return unit.result

    def hand_over(self, work: Callable[[sqlite3.Connection], Any],
                  then: Callable[[Unit], None]) -> None:
        """Run ``work(conn)`` inside a shared write transaction without waiting for it:
        ``then(unit)`` is called on the committer thread once the batch is settled
        (``unit.result``, or ``unit.error`` when it did not commit), outside the
        transaction and the write lock.  ``then`` must be quick and must never wait
        for this committer (it would wait for itself).  Units are settled in the order
        they were handed over, waited for or not."""
        self._hand(_HandedOver(work, then))

    def _hand(self, unit: Unit) -> None:
        self._ensure_thread()
        self._queue.put(unit)

    def _ensure_thread(self) -> None:
        if self._pid == os.getpid():
            return
        with self._start_lock:
            if self._pid != os.getpid():
                self._queue = queue.SimpleQueue()  # never inherit a parent's waiters
                threading.Thread(target=self._loop, name="runstile-group-commit",
                                 daemon=True).start()
                self._pid = os.getpid()

    def _loop(self) -> None:
        batches = Batches(self._connect)
        while True:
            batch: list[Unit] = [self._queue.get()]
            batch += self._waiting(MAX_BATCH - 1)
            batches.settle(batch, self._waiting)
            for unit in batch:
                unit.settled()

    def _waiting(self, room: int) -> list[Unit]:
        """Up to ``room`` units already handed over, without waiting for more."""
        units: list[Unit] = []
        while len(units) < room:
            try:
                units.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return units


def _commit(conn: sqlite3.Connection, batch: list[Unit], more: TopUp | None = None) -> None:
    """All units in one transaction.  A unit may *refuse* (a RunstileError raised
    before it writes anything, as ledger units promise) without disturbing the
    others; anything else aborts the batch, which is then retried unit by unit."""
    try:
        with db.transaction(conn):
            if more is not None and len(batch) < MAX_BATCH:
                # The write lock is ours now.  Waiting for it took about as long as the
                # other writers' turns (most of the time under load), and what was handed
                # over meanwhile would otherwise wait out one more turn: take it along.
                # Before any unit runs, so a failure below retries these units too.
                batch += more(MAX_BATCH - len(batch))
            for run_many, units in _by_kind(batch):
                if run_many is not None:
                    outcomes = run_many(conn, [unit.work for unit in units])
                    for unit, (result, error) in zip(units, outcomes, strict=False):
                        unit.result, unit.error = result, error
                    continue
                for unit in units:
                    try:
                        unit.result = _run_unit(conn, unit.work)
                    except RunstileError as exc:
                        if isinstance(exc, LedgerUnavailable):
                            raise
                        unit.error = exc
    except LedgerUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - retried unit by unit; each waiter gets its error
        if isinstance(exc, db.RefusedAfterWriting):
            log.warning("a unit refused (%s) after writing; its batch is retried one unit "
                        "per transaction", exc)
        _each_alone(conn, batch)


def _each_alone(conn: sqlite3.Connection, batch: list[Unit]) -> None:
    """After a batch that broke mid-write (a uniqueness race, a bug, a unit that refused
    after writing) and committed nothing: each unit in a transaction of its own, so that
    one bad unit cannot fail its neighbours."""
    for unit in batch:
        unit.result, unit.error = None, None
        try:
            with db.transaction(conn):
                unit.result = unit.work(conn)
        except LedgerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - the unit's waiter raises it
            unit.error = exc


def _run_unit(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], Any]) -> Any:
    """``work(conn)``, one unit of the batch in progress.

    A unit that refuses (raises a RunstileError) must leave nothing of its own behind,
    while the rest of its batch commits.  Where the engine counts the rows a connection
    writes (SQLite), that is checked rather than paid for: the unit runs without a
    savepoint (its own transaction opens none either: ``LedgerConnection.bare_unit``),
    and one that refuses after writing, from its own transaction (``db._nested``) or
    outside one (here), aborts the batch, which is then retried one unit per
    transaction, where its refusal rolls its writes back.  Units refuse before they
    write, so the check costs nothing, where a savepoint cost two statements per unit.
    """
    if not db.dialect(conn).counts_changes:
        # PostgreSQL: one savepoint around the whole unit (sent with the next statement),
        # which a refusal rolls back wherever in the unit it was raised.
        with db.transaction(conn):
            return work(conn)
    ledger_conn = cast(db.LedgerConnection, conn)
    written = conn.total_changes
    ledger_conn.bare_unit = True
    try:
        return work(conn)
    except RunstileError as exc:
        if conn.total_changes != written and not isinstance(exc, LedgerUnavailable):
            raise db.RefusedAfterWriting(exc.code) from exc
        raise
    finally:
        ledger_conn.bare_unit = False


def _by_kind(batch: Sequence[Unit]) -> list[tuple[Any, list[Unit]]]:
    """The batch's units with the same ``run_many`` together (in order of first
    appearance, each group in batch order); units without one each on their own."""
    groups: dict[Any, list[Unit]] = {}
    out: list[tuple[Any, list[Unit]]] = []
    for unit in batch:
        # getattr, not isinstance(BatchWork): a runtime Protocol check walks the
        # protocol's members on every call, and this runs for every unit of every batch.
        run_many = getattr(unit.work, "run_many", None)
        if run_many is None:
            out.append((None, [unit]))
        elif run_many in groups:
            groups[run_many].append(unit)
        else:
            groups[run_many] = [unit]
            out.append((run_many, groups[run_many]))
    return out
