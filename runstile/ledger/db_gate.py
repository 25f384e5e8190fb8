"""The writer gate of an SQLite ledger (docs/architecture.md, "The writer gate and group
commit"): writers of one ledger file queue here before SQLite's BEGIN IMMEDIATE."""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import LedgerUnavailable
from ..filemodes import open_lock
from .db_dialect import is_database_url


class WriterGate:
    """Hands the ledger's write lock from writer to writer without SQLite's backoff naps.

    SQLite admits one writer at a time, and its busy handler waits by sleeping with
    backoff (up to 100 ms a nap): sixteen threads polling for a lock held ~1 ms each
    leave it idle most of the time (measured: 78% of a web worker's thread time asleep
    in BEGIN IMMEDIATE, admission p99 over 1 s).  So writers queue here first: threads
    of one process on a Python lock (handed over at once), processes on an flock of
    ``<ledger>-writer.lock``, waited for in the kernel, which wakes a waiter the moment
    the holder lets go.  BEGIN IMMEDIATE then rarely waits; when something outside
    runstile writes (the sqlite3 shell), SQLite's own busy handler still covers it.

    The lock file is also the ledger's commit bell (:meth:`ring`).
    """

    def __init__(self, ledger_path: str) -> None:
        self.lock_path = bell_path(ledger_path)
        self.thread_lock = threading.Lock()
        self._fd: int | None = None
        self._waiter: _FlockWaiter | None = None

    def _fd_for_process(self) -> int:
        if self._fd is None:
            # 0600: a user who could open it (read-only is enough) could flock it and
            # hold every writer of the ledger out.
            self._fd = open_lock(self.lock_path)
        return self._fd

    @contextlib.contextmanager
    def held(self, timeout_s: float) -> Iterator[None]:
        deadline = time.monotonic() + timeout_s
        if not self.thread_lock.acquire(timeout=timeout_s):
            raise LedgerUnavailable(f"the ledger stayed busy for more than {timeout_s:g}s")
        try:
            fd = self._fd_for_process()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # Another process writes.  Polling with naps (as this gate once did) left
                # the lock idle between a release and the next poll: blocked in the
                # kernel instead, the end-to-end row ran 630-636 runs/s against 530-555
                # (3 alternating pairs, 2026-12-04).
                if self._waiter is None:
                    self._waiter = _FlockWaiter(fd)
                if not self._waiter.acquire(deadline - time.monotonic()):
                    raise LedgerUnavailable(
                        f"the ledger stayed busy for more than {timeout_s:g}s") from None
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self.thread_lock.release()

    def ring(self) -> None:
        """Touch the lock file (its times, never its bytes): the commit that just
        returned made broker rows ready, and the embedded broker's watchers, which
        watch this file with inotify, look at the ledger at once instead of polling
        for that commit to show (workers/sqlite_broker/wakeup.py).  Best effort: a
        bell that fails only leaves them to that polling."""
        if self._fd is None:
            return  # never held here, so nothing of ours committed
        try:
            os.utime(self._fd)
        except OSError:
            pass


class _Ask:
    """One wait for the flock: ``granted`` once the waiter holds it for the asker,
    ``abandoned`` once the asker stopped waiting (then the waiter lets it go at once)."""

    __slots__ = ("done", "state")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.state = "waiting"


class _FlockWaiter:
    """A blocking flock with a deadline: a daemon thread of the process blocks in
    ``flock(LOCK_EX)`` for each ask, in order; the asker waits on an event, at most until
    its deadline.  (A blocking flock cannot be given a timeout, and a thread started per
    wait would cost more than the wait.)  Only the holder of the gate's thread lock asks,
    so at most one ask is live; those abandoned before it are granted and released first.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.asks: queue.SimpleQueue[_Ask] = queue.SimpleQueue()
        self.decided = threading.Lock()  # an ask is granted or abandoned, never both
        threading.Thread(target=self._serve, name="runstile-writer-gate", daemon=True).start()

    def acquire(self, timeout_s: float) -> bool:
        """Whether this thread now holds the flock (False: it does not, past ``timeout_s``)."""
        ask = _Ask()
        self.asks.put(ask)
        if ask.done.wait(max(0.0, timeout_s)):
            return True
        with self.decided:
            # The race: the waiter may have taken the flock after the wait timed out and
            # before this lock.  Then the flock is this thread's after all.
            if ask.state == "granted":
                return True
            ask.state = "abandoned"
            return False

    def _serve(self) -> None:
        while True:
            ask = self.asks.get()
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            with self.decided:
                if ask.state == "abandoned":
                    # Its asker gave up (503): nobody will unlock it, so this thread does.
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                    continue
                # Held now for the asker, which unlocks it in ``held``: flock belongs to the
                # open file description, not to a thread.
                ask.state = "granted"
                ask.done.set()


def bell_path(ledger_path: str) -> str:
    """The file the writers of the ledger file ``ledger_path`` (an absolute path, as
    ``db.connect`` resolves it) queue on and ring: ``<ledger>-writer.lock``."""
    return ledger_path + "-writer.lock"


def commit_bell(target: Path | str) -> str | None:
    """The file that SQLite ledger ``target``'s writers ring after a commit that made
    broker rows ready (``broker_queue._made_ready``), created as a gate creates it if
    missing, so that it can be watched before anyone writes; None for a PostgreSQL
    ledger, or where it neither exists nor can be created."""
    if is_database_url(target):
        return None
    path = bell_path(str(Path(target).resolve()))
    try:
        os.close(open_lock(path))
    except OSError:
        return path if os.path.exists(path) else None
    return path


_gates: dict[str, WriterGate] = {}
_gates_guard = threading.Lock()


def _forget_gates() -> None:
    # A gate copied into a forked child may be held by a thread that does not exist
    # there, and its flock descriptor is shared with the parent: start afresh.
    global _gates_guard
    _gates.clear()
    _gates_guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_gates)


def writer_gate(ledger_path: str) -> WriterGate:
    with _gates_guard:
        gate = _gates.get(ledger_path)
        if gate is None:
            gate = _gates[ledger_path] = WriterGate(ledger_path)
        return gate
