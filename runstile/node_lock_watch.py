"""The node lock a supervisor holds, watched, and taken again once lost
(docs/operations.md, "Node lock and generations").

An flock (SQLite) lives as long as the process, but PostgreSQL's advisory lock lives in
a server session, which a cut connection or a server restart ends under a live node.
:class:`LockWatch` confirms the lock from a thread of its own, judges it lost, and takes
it again on a new session; ``runstile/up.py`` decides what happens to the children in
between.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .config import Settings
from .errors import NodeLocked, RunstileError
from .ledger import nodes

#: Most seconds between two confirmations that the node lock is still held.
LOCK_CHECK_S = 1.0
#: Seconds between two tries to take a lost lock again.
RETAKE_S = 1.0


@dataclass
class _Held:
    """One taken lock and the time.monotonic() of its latest confirmation.  One per
    lock, so that the confirming thread of a lock already given up can never touch the
    record of the lock taken after it."""

    lock: nodes.HeldLock
    confirmed: float


class LockWatch:
    def __init__(self, settings: Settings, say: Callable[..., None]) -> None:
        self.settings = settings
        self.say = say
        self.held: _Held | None = None
        self.closed = False

    def _take(self) -> None:
        """Take the lock (or raise NodeLocked) and, if it can be lost, start confirming it."""
        s = self.settings
        lock = nodes.node_lock(s.ledger_target, data_dir=s.data_dir, node_id=s.node_id,
                               busy_timeout_ms=s.busy_timeout_ms).acquire()
        held = self.held = _Held(lock, time.monotonic())
        if lock.can_be_lost:  # an flock cannot be: only this process's death ends it
            threading.Thread(target=self._confirm, args=(held,), name="runstile-node-lock",
                             daemon=True).start()

    def acquire(self) -> LockWatch:
        """The first take, at start: a live node of this name is the operator's mistake
        (NodeLocked, exit 2)."""
        self._take()
        return self

    def _confirm(self, held: _Held) -> None:
        """Ask the lock every LOCK_CHECK_S (or heartbeat) whether it is still held.  In a
        thread of its own, so a server that stops answering never stalls the supervisor:
        :meth:`lost` judges by the time of the last yes."""
        while not self.closed and self.held is held:
            if not held.lock.held():
                held.confirmed = float("-inf")  # a definite no: lost now
                return
            held.confirmed = time.monotonic()
            time.sleep(min(LOCK_CHECK_S, self.settings.heartbeat_s))

    def holding(self) -> bool:
        """Whether a lock is held and not judged lost."""
        return self.held is not None and not self.lost()

    def lost(self) -> bool:
        """True once the lock is gone, or has not been confirmed for RUNSTILE_LEASE_S (a
        server that stopped answering: by then this node's leases are lapsing anyway): the
        node is no longer provably alive, and another node may take over its runs.  Never
        for an flock."""
        held = self.held
        if held is None or not held.lock.can_be_lost:
            return False
        return time.monotonic() - held.confirmed > self.settings.lease_s

    def drop(self) -> None:
        """Give up the lock held (lost already, or about to be).  Released from a thread:
        the unlock speaks to a server that may not answer, and the supervisor must not
        wait for it."""
        held, self.held = self.held, None
        if held is not None:
            threading.Thread(target=_release, args=(held.lock,), name="runstile-node-unlock",
                             daemon=True).start()

    def retake(self, pause: Callable[[float], bool]) -> bool:
        """Try to take the lock again on a new session every RETAKE_S, until it is taken
        (True) or ``pause`` says to stop (False).  A live node holding the name is said
        once, and so is each new reason the server gives for not answering."""
        told: set[str] = set()
        while True:
            try:
                self._take()
                return True
            except NodeLocked as exc:
                reason = f"{exc.message.split(';')[0]}: waiting for it to stop"
            except Exception as exc:  # noqa: BLE001 - the server is down or starting
                reason = f"cannot take the node lock yet: {_one_line(exc)}"
            if reason not in told:
                told.add(reason)
                self.say(f"runstile: {reason}", err=True, level="WARNING")
            if pause(RETAKE_S):
                return False

    def close(self) -> None:
        """At the supervisor's end: stop confirming, release the lock now."""
        self.closed = True
        held, self.held = self.held, None
        if held is not None:
            _release(held.lock)


def _release(lock: nodes.HeldLock) -> None:
    with contextlib.suppress(RunstileError, OSError):
        lock.release()


def _one_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, RunstileError) else str(exc) or type(exc).__name__
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
