"""The watcher: one thread per embedded broker and process that keeps its consumers
alive and wakes them when there may be work.

:class:`.broker.SQLiteBroker` makes it lazily (``broker.watcher()``) when the first
consumer of the process registers; :class:`.consumer.SQLiteConsumer` sleeps on it in
``__next__``.  Its SQL (the heartbeat, ``PRAGMA data_version``) is in
``ledger/broker_queue.py``.

* A claim lasts as long as its consumer lives.  The thread heartbeats this process's
  consumers (a ``broker_consumers`` row each) and releases the rows of consumers whose
  heartbeat stopped, in any process.  A per-message timer would redeliver the delayed
  messages a live worker is rightly holding.
* Idle wake-up without a busy loop: the thread sleeps on inotify for the ledger's
  ``-wal`` file (Linux), and when a writer appends frames it polls ``PRAGMA
  data_version`` (which moves when another connection commits) for the few milliseconds
  until the commit is visible; elsewhere it polls ``data_version`` every
  ``poll_interval_s``.
"""

from __future__ import annotations

import ctypes
import os
import select
import sqlite3
import sys
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from dramatiq.errors import ConnectionClosed
from dramatiq.logging import get_logger

from ...errors import RunstileError
from ...ledger import broker_queue, db

if TYPE_CHECKING:
    from .broker import SQLiteBroker
    from .consumer import SQLiteConsumer


class WalNotifier:
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
    def open(cls, wal_path: str) -> WalNotifier | None:
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


class Watcher:
    """One thread per broker and process: heartbeats its consumers, reaps dead ones in
    every process, and wakes waiting consumers when another connection commits.

    Wake-up: block on inotify (:class:`WalNotifier`) until a writer touches the WAL,
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
        #: Held by a heartbeat and by a consumer's close (see SQLiteConsumer.close).
        self.beat_lock = threading.Lock()
        self.consumers: dict[str, SQLiteConsumer] = {}
        self.thread: threading.Thread | None = None
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: "inotify" or "poll" once the thread has started (for tests and reports).
        self.mode: str | None = None

    def add(self, consumer: SQLiteConsumer) -> None:
        with self.cond:
            if self._wake_r < 0:
                raise ConnectionClosed("this broker was closed")
            self.consumers[consumer.consumer_id] = consumer
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="runstile-sqlite-broker")
                self.thread.start()

    def remove(self, consumer: SQLiteConsumer) -> None:
        with self.cond:
            self.consumers.pop(consumer.consumer_id, None)
            if not self.consumers:
                self._interrupt()  # let the thread exit now

    def poke(self, queue_names: Collection[str] | None = None) -> None:
        """Wake the consumers of ``queue_names`` (every consumer when None).

        Each consumer waits on an event of its own, so a wake-up meant for one queue
        costs the others nothing: a process consumes each queue, its delay queue and
        the deliveries' queues (workers/pools.py), and a commit that wakes them all
        would cost every run a thread switch per consumer."""
        with self.cond:
            woken = [c for c in self.consumers.values()
                     if queue_names is None or c.queue_name in queue_names]
        for consumer in woken:
            consumer.woken.set()

    def _wake_ready(self, conn: sqlite3.Connection) -> None:
        """Another connection committed: wake the consumers whose queue has a message.

        Why no consumer sleeps through one: a consumer clears its event *before* it
        looks for messages, so a message committed after its look is committed after
        the clear; its commit moves data_version, which this thread sees afterwards and
        answers with this read, which shows the message and sets the event."""
        with self.cond:
            names = {c.queue_name for c in self.consumers.values()}
        ready = broker_queue.ready_among(conn, names)
        if ready:
            self.poke(ready)

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
        loop = _Loop(self)
        try:
            while not self._should_exit():
                try:
                    self._step(loop)
                except (RunstileError, sqlite3.Error, OSError):
                    self.logger.warning("Embedded broker heartbeat failed; retrying.",
                                        exc_info=True)
                    loop.close()
                    pause = min(1.0, self.broker.heartbeat_interval_s)
                    loop.next_beat = time.monotonic() + pause
                    select.select([self._wake_r], [], [], pause)
        finally:
            with self.cond:
                if self.thread is threading.current_thread():
                    self.thread = None
            loop.close()

    def _step(self, loop: _Loop) -> None:
        """One turn of the thread: open what is closed, heartbeat when due, block until a
        wake-up reason or a timeout, then wake consumers if another connection committed."""
        if loop.conn is None:
            self.mode = loop.open()
        now = time.monotonic()
        if loop.beat_due(now):
            assert loop.beat_conn is not None  # opened above, with loop.conn
            self._beat(loop.beat_conn)
        waits, timeout = loop.waits(self._wake_r, now)
        ready, _, _ = select.select(waits, [], [], timeout)
        if self._wake_r in ready:
            _drain_pipe(self._wake_r)
        written = loop.notifier.drain() if loop.notifier is not None else False
        if loop.observe(written):
            assert loop.conn is not None  # opened above
            self._wake_ready(loop.conn)

    def _beat(self, conn: sqlite3.Connection) -> None:
        # Under beat_lock: a consumer's close takes it too, so a heartbeat already under
        # way cannot re-register a consumer that has just closed.
        with self.beat_lock:
            with self.cond:
                live = [c.info for c in self.consumers.values()]
            released = broker_queue.heartbeat(conn, live)
        if released:
            self.poke()  # rows came back: local consumers may take them


class _Loop:
    """What one life of the watcher thread holds (the thread exits when its last consumer
    closes and starts again with the next one): its connections and inotify watch, when
    the next heartbeat is due, and whether a commit it saw being written is still on its
    way.  Only that thread touches it."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.broker = watcher.broker
        # Two connections: data_version never moves for a connection's own commits, so
        # heartbeats go through a second one and show up like anyone else's commit
        # (otherwise each heartbeat would look like a commit that never arrives).
        self.conn: sqlite3.Connection | None = None
        self.beat_conn: sqlite3.Connection | None = None
        self.notifier: WalNotifier | None = None
        self.last_version: int | None = None
        #: The data_version at the last WAL write, while its commit is awaited.
        self.awaiting: int | None = None
        self.next_beat = self.settle_until = self.settle_pause = 0.0

    def open(self) -> str:
        """Open both connections (and the inotify watch); returns the wake-up mode."""
        broker = self.broker
        self.conn, self.beat_conn = (
            db.connect(broker.path, synchronous=broker.synchronous,
                       busy_timeout_ms=broker.busy_timeout_ms)
            for _ in range(2))
        self.last_version = broker_queue.data_version(self.conn)  # creates -wal
        if broker.wal_notify:
            self.notifier = WalNotifier.open(str(broker.path) + "-wal")
        return "inotify" if self.notifier else "poll"

    def beat_due(self, now: float) -> bool:
        """Whether a heartbeat is due at ``now``; if so, the next one is scheduled."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.broker.heartbeat_interval_s
        return True

    def waits(self, wake_fd: int, now: float) -> tuple[list[int], float]:
        """The descriptors to block on, and for how many seconds at most."""
        if self.notifier is None:
            return [wake_fd], self.broker.poll_interval_s
        if now < self.settle_until:
            # A new WAL write ends the pause at once and restarts the backoff.
            pause, self.settle_pause = self.settle_pause, self.settle_pause * 2
            return [wake_fd, self.notifier.fd], pause
        return [wake_fd, self.notifier.fd], min(self.watcher.safety_poll_s,
                                                max(0.0, self.next_beat - now))

    def observe(self, written: bool) -> bool:
        """Read data_version after a wake-up (``written``: inotify saw WAL frames).
        True if another connection committed since the last look."""
        assert self.conn is not None  # opened at the start of this turn
        version = broker_queue.data_version(self.conn)
        moved, self.last_version = version != self.last_version, version
        if written:
            # Frames are in the WAL; their commit is visible once the version moves past
            # this one.  SQLite has one writer at a time, so every earlier commit is
            # already counted in it.
            self.awaiting = version
            self.settle_until = time.monotonic() + self.watcher.settle_window_s
            self.settle_pause = self.watcher.settle_interval_s
        elif self.awaiting is not None and (version != self.awaiting
                                            or time.monotonic() >= self.settle_until):
            self.awaiting, self.settle_until = None, 0.0
        return moved

    def close(self) -> None:
        _close(self.notifier, self.conn, self.beat_conn)
        self.conn = self.beat_conn = self.notifier = None


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
