"""The embedded broker itself: :class:`SQLiteBroker`, the Dramatiq ``Broker`` whose queues
are rows in the ledger, and :func:`enqueue_in` for callers that hold a transaction.

``workers/broker.py`` builds it for worker processes; tests, the Dramatiq CLI and bench
build it directly.  Consuming is in :mod:`.consumer`, waking and heartbeats in
:mod:`.watcher` (and :mod:`.wakeup`).

The part of the Dramatiq contract kept here: ``declare_queue`` emits ``declare_queue``
and ``declare_delay_queue``; delayed messages go to ``<queue>.DQ`` with an ``eta``
option, and the *worker* holds them in memory until their eta, then enqueues a copy on
the queue and acks the delayed one.  ``join``, ``flush`` and ``flush_all`` are there for
tests and operators.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import weakref
from pathlib import Path

import dramatiq
from dramatiq.broker import Broker
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.errors import DecodeError, QueueJoinTimeout, QueueNotFound
from dramatiq.message import Message
from dramatiq.middleware import CurrentMessage, Middleware

from ...errors import RunstileError
from ...ledger import broker_queue, db
from .consumer import SQLiteConsumer
from .watcher import Watcher

#: Actor name of the placeholder :meth:`SQLiteBroker.dead_letters` lists for a dead
#: letter whose body cannot be decoded (no actor has it: it can never run).
UNDECODABLE_ACTOR = "<undecodable>"
#: Seconds a consumer may go without a heartbeat before its claimed rows go back to
#: ready (Dramatiq's Redis broker uses 60).  A dead process's prefetched messages wait
#: this long; a live one renews well within it.
DEFAULT_CONSUMER_TIMEOUT_S = 15.0
#: Longest pause between two heartbeats of one process's consumers.
MAX_HEARTBEAT_INTERVAL_S = 5.0
#: Seconds between two ``PRAGMA data_version`` polls when inotify is unavailable: the idle
#: wake-up latency is then about half of this plus one claim transaction (each poll costs
#: three syscalls, so polling much faster costs a visible share of a core).
DEFAULT_POLL_INTERVAL_S = 0.01
#: Seconds between two looks at every consumed queue on a PostgreSQL ledger, whose
#: notifications wake consumers at once: this only bounds how long a lost notification
#: (a reconnect, a writer that bypassed the trigger) can leave a message waiting.
DEFAULT_FALLBACK_POLL_S = 1.0


#: Connection pools inherited through fork(): kept referenced so that the child never
#: closes (or otherwise touches) its parent's SQLite connections.
_INHERITED_POOLS: list[db.ConnectionPool] = []


def default_middleware() -> list[Middleware]:
    """The explicit list used when a caller gives none: never Dramatiq's defaults, whose
    Retries, TimeLimit and AgeLimit fight the ledger (docs/architecture.md, "Worker
    processes").  AsyncIO runs ``async def`` actors and does nothing else."""
    return [dramatiq.middleware.AsyncIO()]


def _with_current_message(middleware: list[Middleware]) -> list[Middleware]:
    """``middleware`` with Dramatiq's CurrentMessage at the end if it lacks one: a run's
    claim acks the message it came with in its own transaction
    (:func:`.consumer.current_delivery`), so the actor must know which message it runs."""
    if any(isinstance(m, CurrentMessage) for m in middleware):
        return middleware
    return [*middleware, CurrentMessage()]


def delayed(message: Message, delay: int | None) -> tuple[Message, float | None]:
    """Dramatiq's delay convention: a delayed message moves to ``<queue>.DQ`` with an
    ``eta`` option (Unix ms).  Returns the message to store and its eta in Unix seconds."""
    if delay is None:
        eta_ms = message.options.get("eta")  # already on a delay queue, or None
        if isinstance(eta_ms, (int, float)) and message.queue_name == dq_name(message.queue_name):
            return message, eta_ms / 1000.0
        return message, None
    eta_ms = current_millis() + int(delay)
    message = message.copy(queue_name=dq_name(message.queue_name), options={"eta": eta_ms})
    return message, eta_ms / 1000.0


def enqueue_in(conn: sqlite3.Connection, message: Message, *,
               delay: int | None = None) -> tuple[Message, int]:
    """Insert ``message`` inside the caller's open transaction; it becomes visible to
    consumers only when the caller commits, and vanishes if the caller rolls back.

    No broker instance is needed (web and recovery processes have none); no middleware
    signal fires.  Returns the message as stored and its delivery id.
    """
    return _insert(conn, *delayed(message, delay))


def _insert(conn: sqlite3.Connection, message: Message, eta_s: float | None) -> tuple[Message, int]:
    # ``broker_priority`` as on RabbitMQ: a run's message carries its run's priority
    # (dispatch.message_for), and keeps it when a worker moves it back from a delay queue.
    priority = message.options.get("broker_priority", broker_queue.DEFAULT_PRIORITY)
    delivery_id = broker_queue.insert_message(
        conn, message.queue_name, message.message_id, message.encode(), eta=eta_s,
        priority=int(priority))
    return message, delivery_id


class SQLiteBroker(Broker):
    """A Dramatiq broker whose queues are rows in the ledger at ``path``.

    Parameters:
      path: the ledger, already migrated (``ledger.migrations.migrate``): its SQLite file,
        or a PostgreSQL URL (``Settings.ledger_target``; the name is SQLite's, the broker
        is the same on both engines).
      synchronous, busy_timeout_ms: settings for every connection it opens.
      middleware: the complete middleware list; :func:`default_middleware` when None.
        Dramatiq's CurrentMessage is added when it is not in it (see
        :func:`.consumer.current_delivery`).
      consumer_timeout_s: a consumer silent this long is dead; its rows go back to ready.
      heartbeat_interval_s: seconds between heartbeats (default: a third of the timeout,
        at most 5 s).
      poll_interval_s: seconds between ``PRAGMA data_version`` polls while consuming,
        where inotify is unavailable (or ``wal_notify`` is False).
      wal_notify: wake consumers through inotify on the ``-wal`` file (Linux).
      fallback_poll_s: on PostgreSQL, seconds between looks at every consumed queue
        besides the notifications (see :data:`DEFAULT_FALLBACK_POLL_S`).
    """

    def __init__(self, path: Path | str, *, synchronous: str = "FULL",
                 busy_timeout_ms: int = 5000, middleware: list[Middleware] | None = None,
                 consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S,
                 heartbeat_interval_s: float | None = None,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 wal_notify: bool = True,
                 fallback_poll_s: float = DEFAULT_FALLBACK_POLL_S) -> None:
        super().__init__(middleware=_with_current_message(
            default_middleware() if middleware is None else list(middleware)))
        if not consumer_timeout_s > 0 or not poll_interval_s > 0 or not fallback_poll_s > 0:
            raise ValueError("consumer_timeout_s, poll_interval_s and fallback_poll_s "
                             "must be > 0")
        # As given: db.connect tells a file from a URL (Path() would mangle a URL's '//').
        self.path: Path | str = path
        self.synchronous = synchronous
        self.busy_timeout_ms = busy_timeout_ms
        self.consumer_timeout_s = float(consumer_timeout_s)
        self.heartbeat_interval_s = float(
            heartbeat_interval_s if heartbeat_interval_s is not None
            else min(MAX_HEARTBEAT_INTERVAL_S, consumer_timeout_s / 3))
        if not 0 < self.heartbeat_interval_s < self.consumer_timeout_s:
            raise ValueError("heartbeat_interval_s must be > 0 and < consumer_timeout_s")
        self.poll_interval_s = float(poll_interval_s)
        self.wal_notify = bool(wal_notify)
        self.fallback_poll_s = float(fallback_poll_s)
        self.queues: set[str] = set()
        self.pool = db.ConnectionPool(self.path, synchronous=synchronous,
                                      busy_timeout_ms=busy_timeout_ms)
        self._watcher_lock = threading.Lock()
        self._watcher: Watcher | None = None
        # A lock or thread inherited through fork() is useless in the child: start over.
        ref = weakref.ref(self)

        def reset_in_child() -> None:
            broker = ref()
            if broker:
                broker._reset_after_fork()

        os.register_at_fork(after_in_child=reset_in_child)

    def _reset_after_fork(self) -> None:
        self._watcher_lock = threading.Lock()
        inherited, self._watcher = self._watcher, None
        if inherited is not None:
            inherited.forget_after_fork()
        # SQLite forbids touching a connection opened before fork(), closing included, and
        # closing an inherited PostgreSQL session would end the parent's: park the
        # inherited pool (never used, never closed) and start a fresh one.
        _INHERITED_POOLS.append(self.pool)
        self.pool = db.ConnectionPool(self.path, synchronous=self.synchronous,
                                      busy_timeout_ms=self.busy_timeout_ms)

    def watcher(self) -> Watcher:
        """This process's heartbeat-and-wake-up thread for this broker (created lazily)."""
        with self._watcher_lock:
            if self._watcher is None or self._watcher.pid != os.getpid():
                self._watcher = Watcher(self)
            return self._watcher

    # -- queues ---------------------------------------------------------------------

    def declare_queue(self, queue_name: str) -> None:
        """Declare a queue and its delay queue; idempotent (a queue needs no DDL)."""
        if queue_name in self.queues:
            return
        self.emit_before("declare_queue", queue_name)
        self.queues.add(queue_name)
        self.emit_after("declare_queue", queue_name)
        delayed_name = dq_name(queue_name)
        self.delay_queues.add(delayed_name)
        self.emit_after("declare_delay_queue", delayed_name)

    def get_declared_queues(self) -> set[str]:
        return set(self.queues)

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> SQLiteConsumer:
        """A consumer of ``queue_name`` (a declared queue or delay queue).

        ``prefetch`` caps the rows it holds unacked; ``timeout`` is the milliseconds
        ``__next__`` waits before returning None.
        """
        if queue_name not in self.queues and queue_name not in self.delay_queues:
            raise QueueNotFound(queue_name)
        return SQLiteConsumer(self, queue_name, prefetch, timeout)

    # -- enqueue ----------------------------------------------------------------------

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        """Store ``message`` in its own transaction (``delay`` in milliseconds).

        Like Dramatiq's Redis broker, the queue need not be declared in this process:
        web processes enqueue by actor name without declaring actors.
        """
        stored, eta_s = delayed(message, delay)
        self.logger.debug("Enqueueing message %r on queue %r.", stored.message_id,
                          stored.queue_name)
        self.emit_before("enqueue", stored, delay)
        conn = self.pool.get()
        try:
            with db.transaction(conn):
                _insert(conn, stored, eta_s)
        except RunstileError:
            self.pool.discard()
            raise
        self._poke_local(stored.queue_name)
        self.emit_after("enqueue", stored, delay)
        return stored

    def enqueue_in(self, conn: sqlite3.Connection, message: Message, *,
                   delay: int | None = None) -> Message:
        """:func:`enqueue_in` plus the enqueue signals.  The signals fire before the
        caller commits, so middleware must not take them as proof of delivery."""
        stored, eta_s = delayed(message, delay)
        self.emit_before("enqueue", stored, delay)
        _insert(conn, stored, eta_s)
        self.emit_after("enqueue", stored, delay)
        return stored

    def _poke_local(self, queue_name: str) -> None:
        # Same-process consumers learn of our commit at once instead of at the next poll.
        watcher = self._watcher
        if watcher is not None and watcher.pid == os.getpid():
            watcher.poke({queue_name})

    # -- test and operator helpers required by Dramatiq -----------------------------

    def flush(self, queue_name: str) -> None:
        """Drop every message of a queue, its delay queue and its dead letters."""
        broker_queue.flush(self.pool.get(), [q_name(queue_name), dq_name(queue_name)])

    def flush_all(self) -> None:
        """Drop all messages from all declared queues."""
        for queue_name in self.get_declared_queues():
            self.flush(queue_name)

    def join(self, queue_name: str, *, interval: int = 20, timeout: int | None = None) -> None:
        """Wait until no message of ``queue_name`` or its delay queue is ready or claimed.

        Raises QueueJoinTimeout after ``timeout`` milliseconds.  Dead letters do not count.
        """
        names = [q_name(queue_name), dq_name(queue_name)]
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while broker_queue.pending_count(self.pool.get(), names):
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)

    def pending(self, queue_name: str) -> int:
        """Messages of a queue and its delay queue not yet processed."""
        return broker_queue.pending_count(self.pool.get(),
                                          [q_name(queue_name), dq_name(queue_name)])

    def dead_letters(self, queue_name: str) -> list[Message]:
        """The dead-lettered messages of a queue (and its delay queue), oldest first.

        A row whose body cannot be decoded (the consumer dead-letters such a row instead
        of handing it to a worker) is listed as a placeholder rather than skipped, so the
        listing still shows every dead letter and one bad row never breaks it: a Message
        with the row's queue and message id, actor :data:`UNDECODABLE_ACTOR`, no
        arguments, and options ``{"undecodable": True, "delivery_id": <row id>}``.  A
        warning names the row.
        """
        rows = broker_queue.dead_letters(self.pool.get(), [q_name(queue_name),
                                                           dq_name(queue_name)])
        return [self._dead_letter(row) for row in rows]

    def _dead_letter(self, row) -> Message:
        try:
            return Message.decode(bytes(row["body"]))
        except DecodeError as exc:
            self.logger.warning("Dead letter %d on queue %r cannot be decoded (%s); listed "
                                "as a placeholder.", row["id"], row["queue_name"], exc)
            return Message(queue_name=row["queue_name"], actor_name=UNDECODABLE_ACTOR,
                           args=(), kwargs={}, message_id=row["message_id"],
                           message_timestamp=int((row["dead_at"] or 0) * 1000),
                           options={"undecodable": True, "delivery_id": row["id"]})

    def close(self) -> None:
        """Stop this process's heartbeat thread and close this thread's connection."""
        with self._watcher_lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher.pid == os.getpid():
            watcher.stop()
        self.pool.discard()
