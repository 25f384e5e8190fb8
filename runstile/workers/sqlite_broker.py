"""The embedded Dramatiq broker: messages live in the ledger file (RUNSTILE_BROKER_URL=sqlite).

Why a broker in the ledger: admission can then insert a run's message in the run's own
``BEGIN IMMEDIATE`` transaction (:func:`enqueue_in`), so a ``202`` never exists without
its message and no message exists without its run (SPEC §2.1, §5).  No SQL here; the rows
and their life are described in ``ledger/broker_queue.py`` and ``ledger/schema.sql``.

The Dramatiq contract this follows (checked against Dramatiq 2.2's Redis and stub
brokers and ``worker.py``):

* ``declare_queue`` emits ``declare_queue`` and ``declare_delay_queue``; delayed messages
  go to ``<queue>.DQ`` with an ``eta`` option, and the *worker* holds them in memory
  until their eta, then enqueues a copy on the queue and acks the delayed one.
* ``consume()`` returns a consumer whose ``__next__`` returns a message or ``None`` after
  its timeout (the worker needs ``None`` to handle delays and shutdown).
* ``ack``/``nack`` come from worker threads while the consumer thread sits in
  ``__next__``: every thread uses its own connection (``db.ConnectionPool``), opened
  lazily and never carried across ``fork()``.
* A claim lasts as long as its consumer lives.  Each process runs one small thread per
  broker that heartbeats its consumers (a ``broker_consumers`` row) and releases the
  rows of consumers whose heartbeat stopped, in any process.  A per-message timer would
  redeliver the delayed messages a live worker is rightly holding.
* Idle wake-up without a busy loop: that same thread sleeps on inotify for the ledger's
  ``-wal`` file (Linux), and when a writer appends frames it polls ``PRAGMA
  data_version`` (which moves when another connection commits) for the few milliseconds
  until the commit is visible; elsewhere it polls ``data_version`` every
  ``poll_interval_s``.  Woken consumers look for ready rows with one cheap read before
  taking the write lock to claim.

Delivery is at least once: a consumer that dies, closes or is restarted by Dramatiq gives
its claimed rows back, and a delayed message is re-enqueued before its delay-queue row is
acked.  runstile's guarded claim makes every duplicate harmless (SPEC §2.3).
"""

from __future__ import annotations

import collections
import ctypes
import os
import select
import socket
import sqlite3
import sys
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Iterable, Optional, Sequence

import dramatiq
from dramatiq.broker import Broker, Consumer, MessageProxy
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.errors import ConnectionClosed, DecodeError, QueueJoinTimeout, QueueNotFound
from dramatiq.logging import get_logger
from dramatiq.message import Message
from dramatiq.middleware import Middleware

from ..errors import RunstileError
from ..ledger import broker_queue, db

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


#: Connection pools inherited through fork(): kept referenced so that the child never
#: closes (or otherwise touches) its parent's SQLite connections.
_INHERITED_POOLS: list[db.ConnectionPool] = []


def default_middleware() -> list[Middleware]:
    """The explicit list used when a caller gives none: never Dramatiq's defaults, whose
    Retries, TimeLimit and AgeLimit fight the ledger (DESIGN §4).  AsyncIO runs
    ``async def`` actors and does nothing else."""
    return [dramatiq.middleware.AsyncIO()]


def delayed(message: Message, delay: Optional[int]) -> tuple[Message, Optional[float]]:
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
               delay: Optional[int] = None) -> tuple[Message, int]:
    """Insert ``message`` inside the caller's open transaction; it becomes visible to
    consumers only when the caller commits, and vanishes if the caller rolls back.

    No broker instance is needed (web and recovery processes have none); no middleware
    signal fires.  Returns the message as stored and its delivery id.
    """
    return _insert(conn, *delayed(message, delay))


def _insert(conn: sqlite3.Connection, message: Message, eta_s: Optional[float]) -> tuple[Message, int]:
    delivery_id = broker_queue.insert_message(
        conn, message.queue_name, message.message_id, message.encode(), eta=eta_s)
    return message, delivery_id


class SQLiteBroker(Broker):
    """A Dramatiq broker whose queues are rows in the ledger at ``path``.

    Parameters:
      path: the ledger file, already migrated (``ledger.migrations.migrate``).
      synchronous, busy_timeout_ms: SQLite settings for every connection it opens.
      middleware: the complete middleware list; :func:`default_middleware` when None.
      consumer_timeout_s: a consumer silent this long is dead; its rows go back to ready.
      heartbeat_interval_s: seconds between heartbeats (default: a third of the timeout,
        at most 5 s).
      poll_interval_s: seconds between ``PRAGMA data_version`` polls while consuming,
        where inotify is unavailable (or ``wal_notify`` is False).
      wal_notify: wake consumers through inotify on the ``-wal`` file (Linux).
    """

    def __init__(self, path: Path | str, *, synchronous: str = "FULL",
                 busy_timeout_ms: int = 5000, middleware: Optional[list[Middleware]] = None,
                 consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S,
                 heartbeat_interval_s: Optional[float] = None,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 wal_notify: bool = True) -> None:
        super().__init__(middleware=default_middleware() if middleware is None
                         else list(middleware))
        if not consumer_timeout_s > 0 or not poll_interval_s > 0:
            raise ValueError("consumer_timeout_s and poll_interval_s must be > 0")
        self.path = Path(path)
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
        self.queues: set[str] = set()
        self.pool = db.ConnectionPool(self.path, synchronous=synchronous,
                                      busy_timeout_ms=busy_timeout_ms)
        self._watcher_lock = threading.Lock()
        self._watcher: Optional[_Watcher] = None
        # A lock or thread inherited through fork() is useless in the child: start over.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (b := ref()) and b._reset_after_fork())

    def _reset_after_fork(self) -> None:
        self._watcher_lock = threading.Lock()
        inherited, self._watcher = self._watcher, None
        if inherited is not None:
            inherited.forget_after_fork()
        # SQLite forbids touching a connection opened before fork(), closing included:
        # park the inherited pool (never used, never closed) and start a fresh one.
        _INHERITED_POOLS.append(self.pool)
        self.pool = db.ConnectionPool(self.path, synchronous=self.synchronous,
                                      busy_timeout_ms=self.busy_timeout_ms)

    def watcher(self) -> "_Watcher":
        """This process's heartbeat-and-wake-up thread for this broker (created lazily)."""
        with self._watcher_lock:
            if self._watcher is None or self._watcher.pid != os.getpid():
                self._watcher = _Watcher(self)
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

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> "_SQLiteConsumer":
        """A consumer of ``queue_name`` (a declared queue or delay queue).

        ``prefetch`` caps the rows it holds unacked; ``timeout`` is the milliseconds
        ``__next__`` waits before returning None.
        """
        if queue_name not in self.queues and queue_name not in self.delay_queues:
            raise QueueNotFound(queue_name)
        return _SQLiteConsumer(self, queue_name, prefetch, timeout)

    # -- enqueue ----------------------------------------------------------------------

    def enqueue(self, message: Message, *, delay: Optional[int] = None) -> Message:
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
        self._poke_local()
        self.emit_after("enqueue", stored, delay)
        return stored

    def enqueue_in(self, conn: sqlite3.Connection, message: Message, *,
                   delay: Optional[int] = None) -> Message:
        """:func:`enqueue_in` plus the enqueue signals.  The signals fire before the
        caller commits, so middleware must not take them as proof of delivery."""
        stored, eta_s = delayed(message, delay)
        self.emit_before("enqueue", stored, delay)
        _insert(conn, stored, eta_s)
        self.emit_after("enqueue", stored, delay)
        return stored

    def _poke_local(self) -> None:
        # Same-process consumers learn of our commit at once instead of at the next poll.
        watcher = self._watcher
        if watcher is not None and watcher.pid == os.getpid():
            watcher.poke()

    # -- test and operator helpers required by Dramatiq -----------------------------

    def flush(self, queue_name: str) -> None:
        """Drop every message of a queue, its delay queue and its dead letters."""
        broker_queue.flush(self.pool.get(), [q_name(queue_name), dq_name(queue_name)])

    def flush_all(self) -> None:
        """Drop all messages from all declared queues."""
        for queue_name in self.get_declared_queues():
            self.flush(queue_name)

    def join(self, queue_name: str, *, interval: int = 20, timeout: Optional[int] = None) -> None:
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


class _SQLiteMessageProxy(MessageProxy):
    """A delivered message plus which row it came from and which consumer holds it."""

    def __init__(self, message: Message, delivery_id: int, consumer: "_SQLiteConsumer") -> None:
        super().__init__(message)
        self.delivery_id = delivery_id
        self.consumer_id = consumer.consumer_id
        self._owner = consumer


class _SQLiteConsumer(Consumer):
    """One consumer of one queue; created by :meth:`SQLiteBroker.consume`."""

    def __init__(self, broker: SQLiteBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.logger = get_logger(__name__, type(self))
        self.broker = broker
        self.queue_name = queue_name
        self.prefetch = max(1, int(prefetch))
        self.timeout_ms = int(timeout)
        self.consumer_id = uuid.uuid4().hex
        self.info = broker_queue.ConsumerInfo(
            self.consumer_id, queue_name, os.getpid(), socket.gethostname(),
            broker.consumer_timeout_s)
        self._cache: collections.deque = collections.deque()
        #: Delivery ids claimed and not yet acked, nacked or requeued (the prefetch window).
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        self._closed = False
        self._watcher = broker.watcher()
        try:
            broker_queue.register_consumer(broker.pool.get(), self.info)
        except RunstileError as exc:
            broker.pool.discard()
            raise ConnectionClosed(exc) from exc
        self._watcher.add(self)

    def __next__(self) -> Optional[MessageProxy]:
        """The next message, or None once ``timeout`` ms passed without one."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            if self._cache:
                return self._deliver(*self._cache.popleft())
            seen = self._watcher.generation
            try:
                if not self._closed:
                    self._fetch()
            except RunstileError as exc:
                self.broker.pool.discard()
                raise ConnectionClosed(exc) from exc
            if self._cache:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # Woken by any commit to the ledger (polled), a local ack or close.
            self._watcher.wait(seen, remaining)

    def _fetch(self) -> None:
        with self._held_lock:
            room = self.prefetch - len(self._held)
        if room <= 0:
            return
        conn = self.broker.pool.get()
        # A read first: most wake-ups are other tables' commits, and an idle consumer
        # must not queue for the write lock on each of them.
        if not broker_queue.has_ready(conn, self.queue_name):
            return
        rows = broker_queue.claim(conn, self.queue_name, self.consumer_id, room)
        with self._held_lock:
            self._held.update(row["id"] for row in rows)
        self._cache.extend((row["id"], bytes(row["body"])) for row in rows)

    def _deliver(self, delivery_id: int, body: bytes) -> Optional[MessageProxy]:
        try:
            message = Message.decode(body)
        except DecodeError:
            # A row nobody can run: dead-letter it rather than hand the worker garbage.
            self.logger.error("Cannot decode delivery %d on queue %r; dead-lettering it.",
                              delivery_id, self.queue_name, exc_info=True)
            self._settle(delivery_id, broker_queue.dead_letter)
            return None
        return _SQLiteMessageProxy(message, delivery_id, self)

    # -- called from worker threads ---------------------------------------------------

    def ack(self, message: _SQLiteMessageProxy) -> None:
        """Delete the message's row, only if its consumer still holds it."""
        if not message._owner._settle(message.delivery_id, broker_queue.ack):
            self.logger.warning(
                "Message %s (delivery %d) was no longer held by its consumer when acked; "
                "it may be delivered again.", message.message_id, message.delivery_id)

    def nack(self, message: _SQLiteMessageProxy) -> None:
        """Dead-letter the message's row, only if its consumer still holds it."""
        if not message._owner._settle(message.delivery_id, broker_queue.dead_letter):
            self.logger.warning(
                "Message %s (delivery %d) was no longer held by its consumer when nacked.",
                message.message_id, message.delivery_id)

    def requeue(self, messages: Iterable[_SQLiteMessageProxy]) -> None:
        """Put unprocessed (prefetched or delayed) messages back to ready."""
        by_owner: dict[_SQLiteConsumer, list[int]] = collections.defaultdict(list)
        for message in messages:
            by_owner[message._owner].append(message.delivery_id)
        for owner, delivery_ids in by_owner.items():
            owner._release(delivery_ids)

    def close(self) -> None:
        """Release every row this consumer holds and stop its heartbeat.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cache.clear()
        with self._held_lock:
            self._held.clear()
        # Under beat_lock, so that a heartbeat already under way cannot re-register us.
        with self._watcher.beat_lock:
            self._watcher.remove(self)
            try:
                broker_queue.close_consumer(self.broker.pool.get(), self.consumer_id)
            except RunstileError:
                # Its heartbeat has stopped, so any process's reaper releases the rows later.
                self.broker.pool.discard()
                self.logger.warning("Could not release consumer %s's messages now; they go "
                                    "back after %.0f s.", self.consumer_id,
                                    self.info.timeout_s, exc_info=True)
        self._watcher.poke()

    def abandon(self) -> None:
        """Stop heartbeating without releasing anything, as if this process had frozen or
        died: after the consumer timeout another consumer gets the rows.  For tests."""
        self._closed = True
        self._watcher.remove(self)

    # -- internals --------------------------------------------------------------------

    def _settle(self, delivery_id: int, operation) -> bool:
        try:
            done = operation(self.broker.pool.get(), delivery_id, self.consumer_id)
        except RunstileError as exc:
            # Dramatiq retries acks that fail with a connection error.
            self.broker.pool.discard()
            raise ConnectionClosed(exc) from exc
        self._forget([delivery_id])
        return done

    def _release(self, delivery_ids: Sequence[int]) -> None:
        if not delivery_ids:
            return
        self.logger.debug("Re-enqueueing deliveries %r on queue %r.", delivery_ids,
                          self.queue_name)
        try:
            broker_queue.release(self.broker.pool.get(), self.consumer_id, delivery_ids)
        except RunstileError as exc:
            self.broker.pool.discard()
            raise ConnectionClosed(exc) from exc
        self._forget(delivery_ids)

    def _forget(self, delivery_ids: Iterable[int]) -> None:
        with self._held_lock:
            self._held.difference_update(delivery_ids)
        self._watcher.poke()  # a prefetch slot opened; __next__ may fetch again


class _WalNotifier:
    """Linux inotify on the ledger's ``-wal`` file: readable when any process appends
    WAL frames.  A writer appends its frames *before* its commit becomes visible (the
    fsync and the wal-index update come after), so an event means "a commit is on its
    way", confirmed by ``PRAGMA data_version``.  None where inotify is unavailable."""

    IN_MODIFY = 0x2
    IN_NONBLOCK = 0o4000
    IN_CLOEXEC = 0o2000000

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def open(cls, wal_path: str) -> Optional["_WalNotifier"]:
        if not sys.platform.startswith("linux") or not os.path.exists(wal_path):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(cls.IN_NONBLOCK | cls.IN_CLOEXEC)
            if fd < 0:
                return None
            if libc.inotify_add_watch(fd, os.fsencode(wal_path), cls.IN_MODIFY) < 0:
                os.close(fd)
                return None
        except (OSError, AttributeError):
            return None
        return cls(fd)

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> bool:
        """Consume pending events; True if there were any."""
        seen = False
        try:
            while os.read(self.fd, 4096):
                seen = True
        except BlockingIOError:
            pass
        return seen

    def close(self) -> None:
        os.close(self.fd)


class _Watcher:
    """One thread per broker and process: heartbeats its consumers, reaps dead ones in
    every process, and wakes waiting consumers when another connection commits.

    Wake-up: block on inotify (:class:`_WalNotifier`) until a writer touches the WAL,
    then poll ``PRAGMA data_version`` at doubling intervals from ``settle_interval_s``
    until the commit is visible (or ``settle_window_s`` passes: the writer rolled back).  Without
    inotify, poll ``data_version`` every ``poll_interval_s``.  Either way nothing spins
    while the ledger is idle.  It runs only while the process has open consumers; a web
    process that only enqueues never starts it.
    """

    #: First pause between data_version polls while a commit is on its way; it doubles
    #: at each poll (a commit is usually visible after one fsync), so one WAL write costs
    #: about eight polls even when its commit never shows (a rollback, our own write).
    settle_interval_s = 0.001
    #: Seconds after a WAL write before giving up on seeing its commit.
    settle_window_s = 0.2
    #: Longest block on inotify: a safety net for anything it could miss.
    safety_poll_s = 1.0

    def __init__(self, broker: SQLiteBroker) -> None:
        self.broker = broker
        self.pid = os.getpid()
        self.logger = get_logger(__name__, type(self))
        self.cond = threading.Condition()
        #: Held by a heartbeat and by a consumer's close (see _SQLiteConsumer.close).
        self.beat_lock = threading.Lock()
        #: Grows at every wake-up reason; consumers wait for it to change.
        self.generation = 0
        self.consumers: dict[str, _SQLiteConsumer] = {}
        self.thread: Optional[threading.Thread] = None
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: "inotify" or "poll" once the thread has started (for tests and reports).
        self.mode: Optional[str] = None

    def add(self, consumer: _SQLiteConsumer) -> None:
        with self.cond:
            if self._wake_r < 0:
                raise ConnectionClosed("this broker was closed")
            self.consumers[consumer.consumer_id] = consumer
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="runstile-sqlite-broker")
                self.thread.start()

    def remove(self, consumer: _SQLiteConsumer) -> None:
        with self.cond:
            self.consumers.pop(consumer.consumer_id, None)
            if not self.consumers:
                self._interrupt()  # let the thread exit now

    def poke(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def wait(self, seen: int, timeout_s: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.generation != seen, timeout_s)

    def stop(self) -> None:
        """Stop the thread for good (the broker makes a new watcher if it consumes again)."""
        with self.cond:
            self._stopping = True
            thread = self.thread
            self._interrupt()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self.cond:
            if thread is None or not thread.is_alive():
                self._close_pipe()
        self.poke()

    def _close_pipe(self) -> None:
        # Under self.cond; a closed descriptor number may be reused by another file.
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _interrupt(self) -> None:
        # Under self.cond.
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending

    def forget_after_fork(self) -> None:
        """In a forked child: the thread did not survive; close the inherited pipe."""
        self.cond = threading.Condition()
        self.beat_lock = threading.Lock()
        self.thread = None
        with self.cond:
            self._close_pipe()

    def _should_exit(self) -> bool:
        with self.cond:
            if self._stopping or not self.consumers:
                self.thread = None
                return True
            return False

    def _run(self) -> None:
        broker, monotonic = self.broker, time.monotonic
        # Two connections: data_version never moves for a connection's own commits, so
        # heartbeats go through a second one and show up like anyone else's commit
        # (otherwise each heartbeat would look like a commit that never arrives).
        conn: Optional[sqlite3.Connection] = None
        beat_conn: Optional[sqlite3.Connection] = None
        notifier: Optional[_WalNotifier] = None
        last_version = awaiting = None
        next_beat = settle_until = settle_pause = 0.0
        try:
            while not self._should_exit():
                try:
                    if conn is None:
                        conn, beat_conn = (
                            db.connect(broker.path, synchronous=broker.synchronous,
                                       busy_timeout_ms=broker.busy_timeout_ms)
                            for _ in range(2))
                        last_version = broker_queue.data_version(conn)  # creates -wal
                        if broker.wal_notify:
                            notifier = _WalNotifier.open(str(broker.path) + "-wal")
                        self.mode = "inotify" if notifier else "poll"
                    now = monotonic()
                    if now >= next_beat:
                        next_beat = now + broker.heartbeat_interval_s
                        with self.beat_lock:
                            with self.cond:
                                live = [c.info for c in self.consumers.values()]
                            released = broker_queue.heartbeat(beat_conn, live)
                        if released:
                            self.poke()  # rows came back: local consumers may take them
                    if notifier is None:
                        waits, timeout = [self._wake_r], broker.poll_interval_s
                    elif now < settle_until:
                        # A new WAL write ends the pause at once and restarts the backoff.
                        waits, timeout = [self._wake_r, notifier.fd], settle_pause
                        settle_pause *= 2
                    else:
                        waits = [self._wake_r, notifier.fd]
                        timeout = min(self.safety_poll_s, max(0.0, next_beat - now))
                    ready, _, _ = select.select(waits, [], [], timeout)
                    if self._wake_r in ready:
                        _drain_pipe(self._wake_r)
                    written = notifier.drain() if notifier is not None else False
                    version = broker_queue.data_version(conn)
                    if version != last_version:
                        last_version = version
                        self.poke()
                    if written:
                        # Frames are in the WAL; their commit is visible once the version
                        # moves past this one.  SQLite has one writer at a time, so every
                        # earlier commit is already counted in it.
                        awaiting, settle_until = version, monotonic() + self.settle_window_s
                        settle_pause = self.settle_interval_s
                    elif awaiting is not None and (version != awaiting
                                                   or monotonic() >= settle_until):
                        awaiting, settle_until = None, 0.0
                except (RunstileError, sqlite3.Error, OSError):
                    self.logger.warning("Embedded broker heartbeat failed; retrying.",
                                        exc_info=True)
                    _close(notifier, conn, beat_conn)
                    conn = beat_conn = notifier = None
                    pause = min(1.0, broker.heartbeat_interval_s)
                    next_beat = monotonic() + pause
                    select.select([self._wake_r], [], [], pause)
        finally:
            with self.cond:
                if self.thread is threading.current_thread():
                    self.thread = None
            _close(notifier, conn, beat_conn)


def _close(*closables) -> None:
    for closable in closables:
        if closable is not None:
            try:
                closable.close()
            except (OSError, sqlite3.Error):
                pass


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass
