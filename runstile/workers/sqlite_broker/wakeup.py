"""How the watcher learns that another connection made a broker row ready: one
"commit signal" per engine, behind one interface (:class:`CommitSignal`).

:class:`.watcher.Watcher` blocks on the signal's descriptors, then asks it what it saw:
a list of wake-ups, each a reason (counted in ``Watcher.wakeups``) and either the queues
to wake or None ("something committed: ask ``broker_queue.ready_among``").  The SQL each
needs (``PRAGMA data_version``, ``LISTEN``, which notifications arrived) is in
``ledger/broker_queue.py``; which one a ledger gets is the ledger's answer
(``broker_queue.listen``), not a test of its URL.

* SQLite (:class:`WalSignal`): inotify on the ``-wal`` file (Linux) says a commit is on
  its way, ``PRAGMA data_version`` says it is visible, and the ledger's commit bell
  (inotify too) that a commit which made broker rows ready is visible already; without
  inotify, ``data_version`` is polled every ``poll_interval_s``.
* PostgreSQL (:class:`ListenSignal`): the session LISTENs on ``broker_queue.CHANNEL``,
  which the trigger of migration 11 notifies with a queue's name whenever one of its rows
  becomes ready (delivered at the writer's COMMIT).  Every ``fallback_poll_s`` it also
  asks ``ready_among`` for every queue, for a notification that never came: sent while
  this session was reconnecting, or by a writer that bypassed the trigger.
"""

from __future__ import annotations

import ctypes
import os
import sqlite3
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

from ...ledger import broker_queue, db, db_gate

if TYPE_CHECKING:
    from .broker import SQLiteBroker

#: One wake-up: its reason, and the queues to wake (None: those ``ready_among`` names).
Wake = tuple[str, "set[str] | None"]


class CommitSignal(Protocol):
    """What the watcher needs of an engine's wake-up mechanism."""

    #: "inotify", "poll" (SQLite) or "listen" (PostgreSQL), for tests and reports.
    mode: str
    #: A connection for ``ready_among`` (opened with the signal, closed with it).
    conn: sqlite3.Connection

    def waits(self, now: float, until: float) -> tuple[list[int], float]:
        """Descriptors to block on, and for how long at most (never past ``until``)."""
        ...

    def observe(self, now: float) -> list[Wake]:
        """After the block: what woke, if anything (drains the descriptors)."""
        ...

    def close(self) -> None: ...


def open_signal(broker: SQLiteBroker) -> CommitSignal:
    """The commit signal of ``broker``'s ledger, on a connection of its own."""
    conn = _connect(broker)
    try:
        if broker_queue.listen(conn):
            return ListenSignal(conn, _connect(broker), broker.fallback_poll_s)
        return WalSignal(conn, broker)
    except BaseException:
        conn.close()
        raise


def _connect(broker: SQLiteBroker) -> sqlite3.Connection:
    return db.connect(broker.path, synchronous=broker.synchronous,
                      busy_timeout_ms=broker.busy_timeout_ms)


class WalNotifier:
    """Linux inotify on the ledger's ``-wal`` file and on its commit bell; None where
    inotify is unavailable.

    * The WAL: any process appending WAL frames makes it readable.  A writer appends its
      frames *before* its commit becomes visible (the fsync and the wal-index update
      come after), so an event means "a commit is on its way", confirmed by ``PRAGMA
      data_version``.
    * The bell (``db_gate.commit_bell``): runstile's writers touch it after a commit that
      made broker rows ready has returned, so that commit is already visible.  Without
      it, a look would wait for the next ``data_version`` poll after the WAL event, up
      to a millisecond or two after the commit showed (an idle run's start paid that).
      Writers outside runstile never ring: the WAL's events still cover them.
    """

    IN_MODIFY = 0x2
    IN_ATTRIB = 0x4
    IN_NONBLOCK = 0o4000
    IN_CLOEXEC = 0o2000000
    #: struct inotify_event without its name: wd, mask, cookie, len.
    EVENT = struct.Struct("iIII")

    def __init__(self, fd: int, wal_watch: int) -> None:
        self.fd = fd
        self.wal_watch = wal_watch

    @classmethod
    def open(cls, wal_path: str, bell_path: str | None = None) -> WalNotifier | None:
        if not sys.platform.startswith("linux") or not os.path.exists(wal_path):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(cls.IN_NONBLOCK | cls.IN_CLOEXEC)
            if fd < 0:
                return None
            wal_watch = libc.inotify_add_watch(fd, os.fsencode(wal_path), cls.IN_MODIFY)
            if wal_watch < 0:
                os.close(fd)
                return None
            if bell_path is not None:
                # Without the bell's watch the WAL's alone still wakes every look.
                libc.inotify_add_watch(fd, os.fsencode(bell_path), cls.IN_ATTRIB)
        except (OSError, AttributeError):
            return None
        return cls(fd, wal_watch)

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> bool:
        """Consume pending events; True if the WAL was written (a commit on its way).
        A bell alone says False: its commit is visible already, nothing to wait for."""
        written = False
        try:
            while chunk := os.read(self.fd, 4096):
                # Whole events only: the kernel never splits one across reads.
                at = 0
                while at + self.EVENT.size <= len(chunk):
                    watch, _, _, name_len = self.EVENT.unpack_from(chunk, at)
                    written = written or watch == self.wal_watch
                    at += self.EVENT.size + name_len
        except BlockingIOError:
            pass
        return written

    def close(self) -> None:
        os.close(self.fd)


class WalSignal:
    """SQLite's commit signal: block on inotify until a writer touches the WAL, then poll
    ``PRAGMA data_version`` at doubling intervals from ``settle_interval_s`` until the
    commit is visible (or ``settle_window_s`` passes: the writer rolled back); the
    commit bell ends such a wait the moment a runstile writer's commit that made broker
    rows ready returns (:class:`WalNotifier`).  Without inotify, poll ``data_version``
    every ``poll_interval_s``.  Either way nothing spins while the ledger is idle.

    ``data_version`` never moves for a connection's own commits: this connection only
    reads, so every commit (heartbeats included, which go through another) shows."""

    #: First pause between data_version polls while a commit is on its way; it doubles
    #: at each poll (a commit is usually visible after one fsync), so one WAL write costs
    #: about eight polls even when its commit never shows (a rollback, our own write).
    settle_interval_s = 0.001
    #: Seconds after a WAL write before giving up on seeing its commit.
    settle_window_s = 0.2
    #: Longest block on inotify: a safety net for anything it could miss.
    safety_poll_s = 1.0

    def __init__(self, conn: sqlite3.Connection, broker: SQLiteBroker) -> None:
        self.conn = conn
        self.poll_interval_s = broker.poll_interval_s
        self.last_version: int | None = broker_queue.data_version(conn)  # creates -wal
        self.notifier = (WalNotifier.open(str(broker.path) + "-wal", db_gate.commit_bell(broker.path))
                         if broker.wal_notify else None)
        self.mode = "inotify" if self.notifier else "poll"
        #: The data_version at the last WAL write, while its commit is awaited.
        self.awaiting: int | None = None
        self.settle_until = self.settle_pause = 0.0

    def waits(self, now: float, until: float) -> tuple[list[int], float]:
        if self.notifier is None:
            return [], self.poll_interval_s
        if now < self.settle_until:
            # A new WAL write ends the pause at once and restarts the backoff.
            pause, self.settle_pause = self.settle_pause, self.settle_pause * 2
            return [self.notifier.fd], pause
        return [self.notifier.fd], min(self.safety_poll_s, max(0.0, until - now))

    def observe(self, now: float) -> list[Wake]:
        """Read data_version after a wake-up; a wake-up if another connection committed
        since the last look."""
        written = self.notifier.drain() if self.notifier is not None else False
        version = broker_queue.data_version(self.conn)
        moved, self.last_version = version != self.last_version, version
        if written:
            # Frames are in the WAL; their commit is visible once the version moves past
            # this one.  SQLite has one writer at a time, so every earlier commit is
            # already counted in it.
            self.awaiting = version
            self.settle_until = time.monotonic() + self.settle_window_s
            self.settle_pause = self.settle_interval_s
        elif self.awaiting is not None and (version != self.awaiting
                                            or time.monotonic() >= self.settle_until):
            self.awaiting, self.settle_until = None, 0.0
        return [("commit", None)] if moved else []

    def close(self) -> None:
        _close(self.notifier, self.conn)


class ListenSignal:
    """PostgreSQL's commit signal: notifications on a LISTENing session of its own, and
    a ``ready_among`` of every queue at most every ``fallback_poll_s`` (the first right
    away: rows may have become ready before the LISTEN, or while reconnecting).

    The listening session runs no query after its LISTEN: a notification that arrives
    during a query is read with the query's reply and set aside by psycopg, so the
    socket would not show it; ``ready_among`` goes through ``conn``, a second session."""

    mode = "listen"

    def __init__(self, listener: sqlite3.Connection, conn: sqlite3.Connection,
                 fallback_poll_s: float) -> None:
        self.listener, self.conn = listener, conn
        self.fallback_poll_s = fallback_poll_s
        self.next_fallback = 0.0

    def waits(self, now: float, until: float) -> tuple[list[int], float]:
        listener: Any = self.listener  # a PgConnection: broker_queue.listen said so
        return [listener.fileno()], max(0.0, min(until, self.next_fallback) - now)

    def observe(self, now: float) -> list[Wake]:
        wakes: list[Wake] = []
        queues = broker_queue.notified_queues(self.listener)
        if queues:
            wakes.append(("notify", queues))
        if now >= self.next_fallback:
            self.next_fallback = now + self.fallback_poll_s
            wakes.append(("fallback", None))
        return wakes

    def close(self) -> None:
        _close(self.listener, self.conn)


def _close(*closables: Any) -> None:
    for closable in closables:
        if closable is not None:
            try:
                closable.close()
            except (OSError, sqlite3.Error):
                pass
