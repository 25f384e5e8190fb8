"""One heartbeat per process (docs/tasks.md, "Time limits, leases and the heartbeat"):
renews every lease it holds in one UPDATE, interrupts bodies whose lease was lost, and
enforces task time limits.

Interrupting a thread means raising an exception in it asynchronously (as Dramatiq's
TimeLimit does).  The danger is hitting a thread that has already moved on to another
message, so each execution carries a lock-protected ``finishing`` flag: the executor
sets it the moment the body returns or raises, and the keeper only interrupts an
execution that is not finishing, under the same lock.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field

from .. import dispatch
from ..config import Settings
from ..errors import RunstileError
from ..ledger import execution
from ..ledger.db import ConnectionPool
from ..ledger.execution import Owner
from .context import Interrupt, LeaseLostInterrupt, Stopped, TimeLimitInterrupt

log = logging.getLogger("runstile.workers")


@dataclass
class Execution:
    run_id: str
    owner: Owner
    thread_id: int
    tracked_at: float
    deadline: float | None
    finishing: bool = False
    lost: bool = False
    timed_out: bool = False
    stop_requested: bool = False
    #: monotonic time the heartbeat first saw the stop request (grace starts there).
    stop_seen_at: float | None = None
    stop_interrupted: bool = False


@dataclass
class Executions:
    """The bodies this process is running right now."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    active: dict[str, Execution] = field(default_factory=dict)
    #: Runs this process claimed whose outcome is not settled yet: the body runs, or it
    #: ended and its finish waits in the committer (workers/actors.py hands it over
    #: without waiting).  Settled: committed, or given up to recovery.
    owed: int = 0

    def __post_init__(self) -> None:
        #: Notified when a body ends or an outcome is settled (drain waits on it).
        self.changed = threading.Condition(self.lock)

    def outcome_owed(self) -> None:
        """A claim won: this process owes the run an outcome (or recovery does)."""
        with self.lock:
            self.owed += 1

    def outcome_settled(self) -> None:
        with self.lock:
            self.owed -= 1
            self.changed.notify_all()

    def wait_for_outcomes(self, timeout_s: float) -> bool:
        """Wait until every run whose body is not running any more has its outcome
        settled; False if ``timeout_s`` passed first.  (The runs still running are
        the drain's to mark.)"""
        with self.lock:
            return self.changed.wait_for(lambda: self.owed <= len(self.active), timeout_s)

    def begin(self, run_id: str, owner: Owner, time_limit_s: float | None) -> Execution:
        now = time.monotonic()
        item = Execution(run_id, owner, threading.get_ident(), now,
                         None if time_limit_s is None else now + time_limit_s)
        with self.lock:
            self.active[run_id] = item
        return item

    def finishing(self, item: Execution) -> bool:
        """Mark the body done; True if the keeper had not already taken the run over."""
        with self.lock:
            item.finishing = True
            return not (item.lost or item.timed_out)

    def end(self, item: Execution) -> None:
        with self.lock:
            self.active.pop(item.run_id, None)
            self.changed.notify_all()

    def snapshot(self) -> list[Execution]:
        with self.lock:
            return list(self.active.values())

    def interrupt(self, item: Execution, exc: type[Interrupt], flag: str) -> bool:
        """Raise ``exc`` in the body's thread unless it is already finishing."""
        with self.lock:
            if item.finishing or item.lost or item.timed_out or item.stop_interrupted:
                return False
            setattr(item, flag, True)
            hits = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(item.thread_id), ctypes.py_object(exc))
            if hits > 1:  # cannot happen for a live thread id; undo as CPython advises
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(item.thread_id), None)
            return hits == 1


class LeaseKeeper(threading.Thread):
    """The process's heartbeat thread."""

    def __init__(self, settings: Settings, node: str, generation: int, pid: int,
                 executions: Executions, dispatcher: dispatch.Dispatcher,
                 pool: ConnectionPool) -> None:
        super().__init__(name="runstile-heartbeat", daemon=True)
        self.settings, self.node, self.generation, self.pid = settings, node, generation, pid
        #: ``pool`` settles with ``dispatcher``: a time limit's finish pays what it owes.
        self.executions, self.dispatcher, self.pool = executions, dispatcher, pool
        self._stop_event = threading.Event()
        #: How often time limits are checked; heartbeats run every heartbeat_s.
        self.tick_s = min(0.25, settings.heartbeat_s)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        next_beat = time.monotonic() + self.settings.heartbeat_s
        while not self._stop_event.wait(self.tick_s):
            self.enforce_time_limits()
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.settings.heartbeat_s
                self.beat()

    def beat(self) -> None:
        began = time.monotonic()
        executing = [item.run_id for item in self.executions.snapshot()]
        if not executing:
            return  # nothing held: an idle worker writes nothing
        try:
            renewed = execution.heartbeat(self.pool.get(), self.node, self.generation,
                                          self.pid, self.settings.lease_s, executing)
        except RunstileError as exc:
            log.warning("heartbeat failed (leases may lapse): %s", exc.message)
            self.pool.discard()
            return
        for item in self.executions.snapshot():
            if renewed.get(item.run_id) == "stopping" and not item.stop_requested:
                item.stop_requested, item.stop_seen_at = True, time.monotonic()
            # Only executions claimed before this heartbeat's UPDATE can be judged by it.
            if item.tracked_at < began and item.run_id not in renewed:
                if self.executions.interrupt(item, LeaseLostInterrupt, "lost"):
                    log.warning("run %s: lease lost; interrupting its body", item.run_id)

    def enforce_time_limits(self) -> None:
        now = time.monotonic()
        for item in self.executions.snapshot():
            if (item.stop_seen_at is not None and not item.stop_interrupted
                    and now - item.stop_seen_at >= self.settings.stop_grace_s):
                # Past the stop grace: unwind the body; the executor records cancelled.
                if self.executions.interrupt(item, Stopped, "stop_interrupted"):
                    log.warning("run %s: stop grace passed; interrupting its body",
                                item.run_id)
            if item.deadline is None or now < item.deadline or item.finishing:
                continue
            # Write the outcome first (guarded on ownership), then unwind the body.
            try:
                failed = execution.finish(
                    self.pool.get(), item.run_id, item.owner, status="failed",
                    error_code="time_limit_exceeded",
                    error_message="the task ran past its time_limit_s",
                    enqueue=self.dispatcher.enqueue)
            except RunstileError as exc:
                log.warning("run %s: could not record its time limit: %s", item.run_id,
                            exc.message)
                continue
            if failed is None:
                self.executions.interrupt(item, LeaseLostInterrupt, "lost")
            elif self.executions.interrupt(item, TimeLimitInterrupt, "timed_out"):
                log.warning("run %s: time limit exceeded; interrupting its body", item.run_id)
