"""The embedded broker's rows (RUNSTILE_BROKER_URL=sqlite, docs/architecture.md, "The
embedded broker"), on either engine: all of its SQL.

``workers/sqlite_broker/`` turns these functions into a Dramatiq ``Broker`` and
``Consumer``; admission calls :func:`insert_message` inside its own transaction so the
run and its message commit together (no dual write).

A row's life: ``ready`` → ``claimed`` (by one consumer) → deleted by ack, or ``dead``
(nack: Dramatiq's dead-letter queue, ``<queue>.XQ``), or back to ``ready`` (requeue,
consumer close, or a consumer whose heartbeat stopped).  A claim is held for as long
as its consumer is alive, not for a fixed time: Dramatiq workers prefetch messages and
hold delayed ones in memory until their eta, however long that is (the Redis broker
ties its acks to a heartbeat for the same reason).

Every time comes from the ledger clock (``db.NOW``).  Functions that are one unit of
work open their own transaction (a savepoint when the caller already has one);
:func:`insert_message` runs in the caller's.

On PostgreSQL the hot path -- :func:`claim`, :func:`ack`, :func:`dead_letter` -- runs
outside the ledger-wide writer lock (``db.row_transaction``), guarded by row locks
alone; why that is safe is argued at :func:`claim` and in docs/architecture.md, "The
embedded broker".  Every other write here keeps the writer lock.

The same three commit without waiting for the disk (``durable=False``): each only moves
a message that runstile's claim makes harmless to deliver twice, so a power cut that
loses one of them costs a redelivery, never a run (docs/guarantees.md, "Commits per
run").  A run's message is usually not acked by :func:`ack` at all but by the run's
claim, in its transaction (:func:`ack_in`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from . import db
from .db import NOW

#: The states a broker row can be in (schema.sql CHECKs the same list).
READY, CLAIMED, DEAD = "ready", "claimed", "dead"
#: A run's priority (docs/api.md, "POST /v1/runs"): higher first; a message without one
#: (a delivery, an actor's .send()) has the default.  schema_v8_priority.sql's DEFAULTs
#: are the same 5.
MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 9, 5
#: The channel PostgreSQL notifies with a queue's name when one of its rows becomes ready
#: (the trigger of postgresql/0011_broker_notify.sql spells the same name).
CHANNEL = "runstile_broker"


@dataclass(frozen=True)
class ConsumerInfo:
    """What a consumer's row says about it: renewed by its process's heartbeat."""

    consumer_id: str
    queue_name: str
    pid: int
    host: str
    #: Seconds without a heartbeat after which the consumer counts as dead.
    timeout_s: float


def insert_message(conn: sqlite3.Connection, queue_name: str, message_id: str, body: bytes,
                   eta: float | None = None, run_id: str | None = None,
                   priority: int = DEFAULT_PRIORITY) -> int:
    """Add one ready message; return its delivery id.  Runs in the caller's transaction.

    ``eta`` is the Unix time (seconds) of a delayed message, which lives on the delay
    queue ``<queue>.DQ`` (Dramatiq's convention); it orders that queue, soonest first.
    The same ``message_id`` may be inserted more than once: the broker does not dedupe
    (runstile's claim does).  ``priority``: a higher one is claimed first among the
    queue's rows ready at the same moment (:func:`claim`).
    """
    _made_ready(conn, 1)
    with db.ledger_errors():
        # lastrowid, not RETURNING: fetching a RETURNING row costs a second sqlite3_step,
        # and every step releases and re-takes the GIL while the write lock is held.
        # (After an INSERT, lastrowid is the new row's id: never None.)
        return cast(int, conn.execute(
            "INSERT INTO broker_messages (queue_name, message_id, body, eta, state, "
            f"enqueued_at, run_id, priority) VALUES (?, ?, ?, ?, '{READY}', {NOW}, ?, ?)",
            (queue_name, message_id, sqlite3.Binary(body), eta, run_id, int(priority))
        ).lastrowid)


#: One message for :func:`insert_messages`: (queue name, message id, body, eta, run id,
#: priority).
NewMessage = tuple[str, str, bytes, float | None, str | None, int]


def insert_messages(conn: sqlite3.Connection, messages: Sequence[NewMessage]) -> None:
    """:func:`insert_message` for several messages with one statement (a batch of
    admissions).  Runs in the caller's transaction."""
    sql, args = insert_messages_statement(conn, messages)
    with db.ledger_errors():
        conn.execute(sql, args)


def insert_messages_statement(conn: sqlite3.Connection,
                              messages: Sequence[NewMessage]) -> db.Statement:
    """The one INSERT of :func:`insert_messages`, for a caller that sends it with others
    (db.together) on ``conn``, in the transaction it is part of."""
    _made_ready(conn, len(messages))
    args: list[object] = []
    for queue_name, message_id, body, eta, run_id, priority in messages:
        args += (queue_name, message_id, sqlite3.Binary(body), eta, run_id, int(priority))
    return ("INSERT INTO broker_messages (queue_name, message_id, body, eta, state, "
            "enqueued_at, run_id, priority) VALUES "
            + ", ".join([f"(?, ?, ?, ?, '{READY}', {NOW}, ?, ?)"] * len(messages)), args)


def register_consumer(conn: sqlite3.Connection, info: ConsumerInfo) -> None:
    """Record a live consumer (first heartbeat)."""
    with db.transaction(conn):
        _upsert_consumers(conn, [info])


def heartbeat(conn: sqlite3.Connection, live: Sequence[ConsumerInfo]) -> int:
    """Renew the live consumers of one process, then release the rows of dead ones.

    A consumer whose row was already reaped (its process was frozen past its timeout)
    is registered again; the rows it lost may be delivered twice, which runstile's claim
    makes harmless.  Returns how many rows went back to ready.
    """
    # Under the writer lock on PostgreSQL too: the upsert and the reap lock many rows
    # (consumers and messages) in no fixed order, and two processes reaping at once
    # without it could each wait on a row the other holds.  Serialized, they cannot;
    # and a claim, which may briefly hold a row they want, never waits on anything.
    with db.transaction(conn):
        _upsert_consumers(conn, live)
        return _reap(conn)


def reap_dead_consumers(conn: sqlite3.Connection) -> int:
    """Release the rows of consumers whose heartbeat is older than their timeout."""
    with db.transaction(conn):
        return _reap(conn)


def _upsert_consumers(conn: sqlite3.Connection, infos: Iterable[ConsumerInfo]) -> None:
    conn.executemany(
        "INSERT INTO broker_consumers (id, queue_name, pid, host, timeout_s, started_at, "
        f"last_seen_at) VALUES (?, ?, ?, ?, ?, {NOW}, {NOW}) "
        f"ON CONFLICT (id) DO UPDATE SET last_seen_at = {NOW}",
        [(i.consumer_id, i.queue_name, i.pid, i.host, i.timeout_s) for i in infos])


def _reap(conn: sqlite3.Connection) -> int:
    # NOT IN also catches rows claimed by a consumer whose row is already gone.
    released = conn.execute(
        f"UPDATE broker_messages SET state = '{READY}', claimed_by = NULL, claimed_at = NULL "
        f"WHERE state = '{CLAIMED}' AND claimed_by NOT IN "
        f"(SELECT id FROM broker_consumers WHERE last_seen_at + timeout_s >= {NOW})").rowcount
    conn.execute(f"DELETE FROM broker_consumers WHERE last_seen_at + timeout_s < {NOW}")
    return _made_ready(conn, released)


def _made_ready(conn: sqlite3.Connection, count: int) -> int:
    """``count`` rows became ready in the open transaction: when there are any, an SQLite
    ledger rings its commit bell once that transaction has committed, so that the
    embedded broker's watchers look at once (``WriterGate.ring``; a PostgreSQL ledger's
    trigger notifies them itself, migration 11).  Returns ``count``."""
    if count and isinstance(conn, db.LedgerConnection):
        conn.bell = True
    return count


def consumers_on(conn: sqlite3.Connection, host: str) -> list[tuple[str, int]]:
    """(consumer id, pid) of the consumers registered from ``host``."""
    with db.ledger_errors():
        return [(row[0], row[1]) for row in conn.execute(
            "SELECT id, pid FROM broker_consumers WHERE host = ?", (host,))]


def has_ready(conn: sqlite3.Connection, queue_name: str) -> bool:
    """Cheap read: is anything waiting on ``queue_name``?  (Avoids an idle write lock.)"""
    with db.ledger_errors():
        return conn.execute(
            f"SELECT 1 FROM broker_messages WHERE queue_name = ? AND state = '{READY}' LIMIT 1",
            (queue_name,)).fetchone() is not None


def ready_among(conn: sqlite3.Connection, queue_names: Iterable[str]) -> set[str]:
    """Cheap read: which of ``queue_names`` have a message waiting?  The watcher asks it
    once per commit it sees, for every consumer of its process
    (workers/sqlite_broker/watcher.py); each name is one probe of the ready index,
    however long that queue's backlog."""
    names = sorted(set(queue_names))
    if not names:
        return set()
    probe = (f"SELECT {db.dialect(conn).text_param} WHERE EXISTS (SELECT 1 FROM "
             f"broker_messages WHERE queue_name = ? AND state = '{READY}')")
    with db.ledger_errors():
        rows = conn.execute(" UNION ALL ".join([probe] * len(names)),
                            [arg for name in names for arg in (name, name)]).fetchall()
    return {row[0] for row in rows}


def claim(conn: sqlite3.Connection, queue_name: str, consumer_id: str,
          limit: int) -> list[sqlite3.Row]:
    """Claim up to ``limit`` ready rows for one consumer: highest priority first, then
    oldest first; on a delay queue soonest eta first, then priority.  Returns (id,
    message_id, body) rows in that order, read from broker_messages_ready_by_priority
    (schema_v8_priority.sql; docs/architecture.md, "The embedded broker")."""
    if limit < 1:
        return []
    # The race with other claims, and why no writer lock (PostgreSQL): the subquery
    # row-locks the rows it picks, skipping rows another claim has locked, so two
    # consumers never wait on each other and never pick one row twice; a row changed
    # by a commit since the statement began (claimed, reaped, acked) is re-read once
    # its lock is ours and dropped if no longer ready.  (Without the lock the subquery
    # can hand two claims the same ids, and after a wait the UPDATE re-checks only its
    # own WHERE: hence the outer ``state`` guard too.)  A claim waits on no lock at
    # all, so it can be in no deadlock.  The other writers of broker_messages need no
    # writer lock against it: admission and recovery's re-publish only insert rows
    # (a claim sees them once committed, woken by their NOTIFY); retention's purge only
    # deletes dead rows, which a claim never picks; the reap, a release and a consumer's
    # close (under the writer lock) only touch claimed rows, likewise, and wait for a
    # claim's row locks rather than the other way round; a flush (tests, operators)
    # deletes what it finds, as on SQLite; acks and dead letters are guarded on their
    # consumer still holding the row, and each locks that one row only.  No writer
    # relies on broker rows staying put for the length of its transaction: recovery's
    # one read of them (ledger/recovery.py stranded_queued) is a single statement.
    with db.row_transaction(conn, durable=False):
        rows = conn.execute(
            f"UPDATE broker_messages SET state = '{CLAIMED}', claimed_by = ?, "
            f"claimed_at = {NOW} WHERE state = '{READY}' AND id IN (SELECT id FROM "
            f"broker_messages WHERE queue_name = ? AND state = '{READY}' "
            "ORDER BY eta, priority DESC, id "
            f"LIMIT ?{db.dialect(conn).skip_locked}) RETURNING id, message_id, body, eta, "
            "priority", (consumer_id, queue_name, int(limit))).fetchall()
    # RETURNING gives no order; restore the queue's.
    return sorted(rows, key=lambda r: (r["eta"] is not None, r["eta"] or 0, -r["priority"],
                                       r["id"]))


def ack(conn: sqlite3.Connection, delivery_id: int, consumer_id: str) -> bool:
    """Delete a processed row, only if this consumer still holds it.  True if it did.

    Outside the writer lock on PostgreSQL (see :func:`claim`): one row's lock, taken by
    the DELETE itself; a reap or release that got there first leaves a row this
    consumer no longer holds, which READ COMMITTED re-reads after the wait, so the
    DELETE finds nothing and the ack reports False, as it would after them on SQLite."""
    with db.row_transaction(conn, durable=False):
        return ack_in(conn, delivery_id, consumer_id)


def ack_in(conn: sqlite3.Connection, delivery_id: int, consumer_id: str) -> bool:
    """:func:`ack` inside the caller's transaction: the run's claim acks the message that
    brought it in its own transaction (ledger/execution.py), so a run costs no commit of
    its own for the ack.  True if the row was still this consumer's."""
    sql, args = ack_in_statement(delivery_id, consumer_id)
    return conn.execute(sql, args).rowcount > 0


def ack_in_statement(delivery_id: int, consumer_id: str) -> db.Statement:
    """The DELETE of :func:`ack_in`, for a claim that sends it with its own UPDATE
    (db.together)."""
    return (f"DELETE FROM broker_messages WHERE id = ? AND claimed_by = ? AND "
            f"state = '{CLAIMED}'", (delivery_id, consumer_id))


def dead_letter(conn: sqlite3.Connection, delivery_id: int, consumer_id: str) -> bool:
    """Move a rejected row to the dead letters, only if this consumer still holds it.
    Outside the writer lock on PostgreSQL, and not durable, as :func:`ack` is."""
    with db.row_transaction(conn, durable=False):
        return conn.execute(
            f"UPDATE broker_messages SET state = '{DEAD}', claimed_by = NULL, "
            f"claimed_at = NULL, dead_at = {NOW} "
            f"WHERE id = ? AND claimed_by = ? AND state = '{CLAIMED}'",
            (delivery_id, consumer_id)).rowcount > 0


def release(conn: sqlite3.Connection, consumer_id: str, delivery_ids: Iterable[int]) -> int:
    """Put rows this consumer holds back to ready (keeping their place in the queue).
    Under the writer lock, as :func:`heartbeat` is: it locks several rows, which a reap
    may be locking in another order."""
    with db.transaction(conn):
        return _made_ready(conn, sum(conn.execute(
            f"UPDATE broker_messages SET state = '{READY}', claimed_by = NULL, claimed_at = NULL "
            f"WHERE id = ? AND claimed_by = ? AND state = '{CLAIMED}'",
            (delivery_id, consumer_id)).rowcount for delivery_id in delivery_ids))


def close_consumer(conn: sqlite3.Connection, consumer_id: str) -> int:
    """Release every row the consumer holds and forget it; returns rows released."""
    with db.transaction(conn):
        released = conn.execute(
            f"UPDATE broker_messages SET state = '{READY}', claimed_by = NULL, claimed_at = NULL "
            f"WHERE claimed_by = ? AND state = '{CLAIMED}'", (consumer_id,)).rowcount
        conn.execute("DELETE FROM broker_consumers WHERE id = ?", (consumer_id,))
        return _made_ready(conn, released)


def pending_count(conn: sqlite3.Connection, queue_names: Sequence[str]) -> int:
    """Rows not yet processed (ready or claimed) on these queues; dead letters excluded."""
    marks = ", ".join("?" for _ in queue_names)
    with db.ledger_errors():
        count: int = conn.execute(
            f"SELECT COUNT(*) FROM broker_messages WHERE queue_name IN ({marks}) "
            f"AND state IN ('{READY}', '{CLAIMED}')", tuple(queue_names)).fetchone()[0]
        return count


def flush(conn: sqlite3.Connection, queue_names: Sequence[str]) -> int:
    """Delete every row of these queues, dead letters included (Dramatiq's purge)."""
    marks = ", ".join("?" for _ in queue_names)
    with db.transaction(conn):
        return conn.execute(f"DELETE FROM broker_messages WHERE queue_name IN ({marks})",
                            tuple(queue_names)).rowcount


def dead_letters(conn: sqlite3.Connection, queue_names: Sequence[str],
                 limit: int = 1000) -> list[sqlite3.Row]:
    """Dead-lettered rows of these queues, oldest first (for operators and tests)."""
    marks = ", ".join("?" for _ in queue_names)
    with db.ledger_errors():
        return conn.execute(
            f"SELECT id, queue_name, message_id, body, dead_at FROM broker_messages "
            f"WHERE queue_name IN ({marks}) AND state = '{DEAD}' ORDER BY id LIMIT ?",
            (*queue_names, int(limit))).fetchall()


def purge_dead_letters(conn: sqlite3.Connection, older_than_s: float, limit: int = 1000) -> int:
    """Delete up to ``limit`` dead letters older than ``older_than_s`` (for retention)."""
    with db.transaction(conn):
        return conn.execute(
            f"DELETE FROM broker_messages WHERE id IN (SELECT id FROM broker_messages "
            f"WHERE state = '{DEAD}' AND dead_at < {NOW} - ? ORDER BY dead_at LIMIT ?)",
            (float(older_than_s), int(limit))).rowcount


def listen(conn: sqlite3.Connection) -> bool:
    """Subscribe ``conn`` to the notifications of ready rows (:data:`CHANNEL`); False
    where the engine sends none (SQLite: the watcher reads :func:`data_version`)."""
    statement = db.dialect(conn).listen(CHANNEL)
    if statement is None:
        return False
    with db.ledger_errors():
        conn.execute(statement)
    return True


def notified_queues(conn: Any) -> set[str]:
    """The queues named by the notifications ``conn`` has received since the last call
    (a connection :func:`listen` subscribed; never waits)."""
    with db.ledger_errors():
        return {payload for channel, payload in conn.notifications() if channel == CHANNEL}


def data_version(conn: sqlite3.Connection) -> int:
    """SQLite's change counter for this connection: it moves whenever *another*
    connection commits.  Polling it is a shared-memory read, not a query of any table."""
    with db.ledger_errors():
        version: int = conn.execute("PRAGMA data_version").fetchone()[0]
        return version
