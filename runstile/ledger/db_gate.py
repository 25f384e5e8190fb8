"""The writer gate of an SQLite ledger (docs/architecture.md, "The writer gate and group
commit"): writers of one ledger file queue here before SQLite's BEGIN IMMEDIATE."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator

from ..errors import LedgerUnavailable
from ..filemodes import open_lock


class WriterGate:
    """Hands the ledger's write lock from writer to writer without SQLite's backoff naps.

    SQLite admits one writer at a time, and its busy handler waits by sleeping with
    backoff (up to 100 ms a nap): sixteen threads polling for a lock held ~1 ms each
    leave it idle most of the time (measured: 78% of a web worker's thread time asleep
    in BEGIN IMMEDIATE, admission p99 over 1 s).  So writers queue here first: threads
    of one process on a Python lock (handed over at once), processes on an flock of
    ``<ledger>-writer.lock`` polled at sub-millisecond intervals by at most one thread
    per process.  BEGIN IMMEDIATE then rarely waits; when something outside runstile
    writes (the sqlite3 shell), SQLite's own busy handler still covers it.
    """

    #: Seconds between two flock attempts; short, because the lock is held ~1 ms.
    POLL_S = (0.0002, 0.0005, 0.001, 0.002)

    def __init__(self, ledger_path: str) -> None:
        self.lock_path = ledger_path + "-writer.lock"
        self.thread_lock = threading.Lock()
        self._fd: int | None = None

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
            naps = 0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LedgerUnavailable(
                            f"the ledger stayed busy for more than {timeout_s:g}s") from None
                    time.sleep(self.POLL_S[min(naps, len(self.POLL_S) - 1)])
                    naps += 1
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self.thread_lock.release()


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
