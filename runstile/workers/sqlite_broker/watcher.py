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
* Idle wake-up without a busy loop: the thread sleeps on its ledger's commit signal
  (:mod:`.wakeup`): on SQLite inotify for the ``-wal`` file (Linux) and then ``PRAGMA
  data_version`` until the commit is visible (elsewhere ``data_version`` every
  ``poll_interval_s``); on PostgreSQL a LISTEN session that the ledger notifies with the
  queue of every row that becomes ready, and a look at every queue each
  ``fallback_poll_s`` for a notification that was lost.
"""

from __future__ import annotations

import collections
import os
import select
import sqlite3
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from dramatiq.errors import ConnectionClosed
from dramatiq.logging import get_logger

from ...errors import RunstileError
from ...ledger import broker_queue, db
from .wakeup import CommitSignal, open_signal

#: Shortest pause between two looks at the commits: a look right after a quiet spell is
#: immediate, while a stream of commits (thousands a second under load, most of them
#: other processes' runs) is seen a few at a time instead of one look each.
MIN_LOOK_INTERVAL_S = 0.002
#: Longest pause: each look that sees commits but wakes no consumer doubles the pause up
#: to this, and one that wakes a consumer (or comes after a quiet spell) brings it back
#: to the shortest; a look that sees no commit changes nothing (``Watcher._look``).
#: Under load the consumers that still want wake-ups are those of idle queues (a delay
#: queue, the deliveries'), whose looks find nothing: looking every 2 ms for them cost a
#: worker process about a fifth of its CPU.  A message for such a queue in a stream of
#: other commits waits at most this much longer.
MAX_LOOK_INTERVAL_S = 0.016

if TYPE_CHECKING:
    from .broker import SQLiteBroker
    from .consumer import SQLiteConsumer


class Watcher:
    """One thread per broker and process: heartbeats its consumers, reaps dead ones in
    every process, and wakes waiting consumers when another connection commits.

    Wake-up: block on the ledger's commit signal (:mod:`.wakeup`), which says which
    queues may have a ready row, or that something committed (then one
    ``broker_queue.ready_among`` read says which).  Nothing spins while the ledger is
    idle.  It runs only while the process has open consumers; a web process that only
    enqueues never starts it.
    """

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
        #: "inotify", "poll" or "listen" once the thread has started (tests, reports).
        self.mode: str | None = None
        #: True while no consumer of this process wants a wake-up (every one is busy or
        #: already woken): the thread then watches no commit at all, only its pipe and
        #: the heartbeat's clock.  Read and written under ``cond`` (see :meth:`need`).
        self.dormant = False
        #: Wake-ups that found work for a consumer, by reason: "commit" (SQLite),
        #: "notify" or "fallback" (PostgreSQL).  Only this thread writes it.
        self.wakeups: collections.Counter[str] = collections.Counter()
        #: Looks at the commits since the thread started (tests: how often it looks).
        self.looks = 0

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

    def need(self) -> None:
        """A consumer with room is about to wait: make sure commits are watched.

        Why no commit is missed across a dormant spell: the thread decides to go
        dormant under ``cond`` after reading every consumer's event, and a consumer calls
        this under ``cond`` after clearing its event and looking; so either the thread
        saw the event clear (and stayed awake), or this sees it dormant and wakes it.
        Awake again, the thread's commit signal still holds what came meanwhile (the
        inotify events, the notifications, a data_version that moved), so its first
        look covers them."""
        with self.cond:
            if self.dormant:
                self.dormant = False
                self._interrupt()

    def _wanted(self) -> bool:
        """Whether any consumer wants a wake-up; if none does, the thread is dormant."""
        with self.cond:
            wanted = any(c.wants_wakeup() for c in self.consumers.values())
            self.dormant = not wanted
            return wanted

    def _wake_ready(self, conn: sqlite3.Connection, reason: str,
                    queues: set[str] | None) -> bool:
        """Wake the consumers of ``queues`` (None: of those queues that have a message);
        whether any was woken.

        Why no consumer sleeps through one: a consumer clears its event *before* it
        looks for messages, so a message committed after its look is committed after
        the clear; its commit moves data_version (SQLite) or sends its notification
        (PostgreSQL, at COMMIT), which this thread sees afterwards and answers by
        setting the event -- on SQLite after this read, which shows the message."""
        with self.cond:
            # Busy consumers are skipped (SQLiteConsumer.wants_wakeup): under load most
            # are, and this thread then reads nothing at all for the commit.
            names = {c.queue_name for c in self.consumers.values() if c.wants_wakeup()}
        if not names:
            return False
        ready = names & queues if queues is not None else broker_queue.ready_among(conn, names)
        if ready:
            self.wakeups[reason] += 1
            self.poke(ready)
        return bool(ready)

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
        wake-up reason or a timeout, then wake the consumers the commit signal names."""
        if loop.signal is None:
            self.mode = loop.open()
        signal, beat_conn = loop.signal, loop.beat_conn
        assert signal is not None and beat_conn is not None  # opened above
        now = time.monotonic()
        if loop.beat_due(now):
            self._beat(beat_conn)
        # Under load every consumer is busy, and watching each commit of every process
        # would cost this thread more than the runs' own work: dormant, it waits for a
        # consumer's need() (its pipe) or the next heartbeat only.
        wanted = self._wanted()
        waits, timeout = (signal.waits(now, loop.next_beat) if wanted
                          else ([], max(0.0, loop.next_beat - now)))
        ready, _, _ = select.select([self._wake_r, *waits], [], [], timeout)
        if self._wake_r in ready:
            _drain_pipe(self._wake_r)
        if wanted:
            self._look(loop, signal)

    def _look(self, loop: _Loop, signal: CommitSignal) -> None:
        """After a wake-up: wait out the pause since the last look, look at what was
        committed, wake the consumers it names and pace the next look."""
        # A commit seen this soon after the last look waits out the interval (a
        # close or stop still ends the pause at once), then one look covers all.
        pause = loop.last_look + loop.look_interval - time.monotonic()
        if pause > 0 and select.select([self._wake_r], [], [], pause)[0]:
            _drain_pipe(self._wake_r)
        # Quiet: the signal came after the whole pause had passed, so nothing was
        # held back (a stream of commits signals again at once after each look).
        quiet = pause <= 0
        now = time.monotonic()
        self.looks += 1
        seen = signal.observe(now)
        if not seen:
            # No commit visible yet (inotify announces one before it is): this look
            # neither starts a pause nor says anything about the stream, so the
            # look that sees the commit is not held back by it.
            return
        loop.last_look = now
        woke = False
        for reason, queues in seen:
            woke = self._wake_ready(signal.conn, reason, queues) or woke
        loop.pace(woke=woke, quiet=quiet)

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
    closes and starts again with the next one): its commit signal, the connection its
    heartbeats go through, and when the next heartbeat is due.  Only that thread
    touches it."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.broker = watcher.broker
        self.signal: CommitSignal | None = None
        # A connection apart from the signal's: data_version never moves for a
        # connection's own commits, so heartbeats show up like anyone else's commit
        # (otherwise each heartbeat would look like a commit that never arrives).
        self.beat_conn: sqlite3.Connection | None = None
        self.next_beat = 0.0
        #: When the commits were last looked at, and the pause before the next look.
        self.last_look = 0.0
        self.look_interval = MIN_LOOK_INTERVAL_S

    def pace(self, *, woke: bool, quiet: bool) -> None:
        """After a look: back to the shortest pause if it woke a consumer or ended a
        quiet spell, else twice the pause (MAX_LOOK_INTERVAL_S at most)."""
        self.look_interval = (MIN_LOOK_INTERVAL_S if woke or quiet
                              else min(MAX_LOOK_INTERVAL_S, 2 * self.look_interval))

    def open(self) -> str:
        """Open the commit signal and the heartbeat connection; returns the wake-up mode."""
        broker = self.broker
        self.signal = open_signal(broker)
        self.beat_conn = db.connect(broker.path, synchronous=broker.synchronous,
                                    busy_timeout_ms=broker.busy_timeout_ms)
        return self.signal.mode

    def beat_due(self, now: float) -> bool:
        """Whether a heartbeat is due at ``now``; if so, the next one is scheduled."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.broker.heartbeat_interval_s
        return True

    def close(self) -> None:
        for closable in (self.signal, self.beat_conn):
            if closable is not None:
                try:
                    closable.close()
                except (OSError, sqlite3.Error):
                    pass
        self.signal = self.beat_conn = None


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass
