"""One worker process: Dramatiq's own Worker over runstile's broker, plus the heartbeat.

Started by ``runstile up`` or ``runstile worker`` (the parent holds the node lock and
passes the node generation it started).  SIGTERM/SIGINT, once or repeatedly, stop
consumption and let running bodies finish up to the drain timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import dramatiq

from .. import dispatch, logs
from .. import tasks as registry
from ..config import Settings
from ..errors import RunstileError
from ..ledger import recovery
from ..ledger.db import ConnectionPool
from ..signals import StopSignals
from . import actors, delivery, pools
from .broker import make_broker
from .lease import Executions, LeaseKeeper

log = logging.getLogger("runstile.workers")

#: Milliseconds Dramatiq's consumers wait in __next__ before checking for shutdown.
CONSUMER_TIMEOUT_MS = 1000
#: Seconds the main thread waits on the signal pipe before looking again.
SIGNAL_POLL_S = 1.0
#: Seconds a drain past its timeout still gives the outcomes of ended bodies to commit
#: (normally they commit within milliseconds; the supervisor SIGKILLs 5 s after the timeout).
OUTCOME_GRACE_S = 2.0


def run(settings: Settings, generation: int) -> int:
    logs.configure(settings.log_format, node=settings.node_id,
                   text_format="%(asctime)s %(levelname)s [worker %(process)d] %(message)s")
    registry.load(settings.tasks)
    # Checked by `up` and `worker` before they start anything; again here, for a process
    # started by hand (a refusal is a ConfigError: exit 2).
    plan = pools.plan(settings, registry.queues())
    # One dispatcher per process; every connection of its pool settles with it.
    dispatcher = dispatch.Dispatcher(settings)
    pool = dispatcher.pool()
    broker = make_broker(settings)
    executions = Executions()
    executor = actors.Executor(settings, broker, node=settings.node_id, generation=generation,
                               executions=executions, pool=pool, dispatcher=dispatcher)
    actors.declare(broker, executor)
    delivery.declare(broker, delivery.Deliverer(settings, pool, node=settings.node_id,
                                                generation=generation))
    keeper = LeaseKeeper(settings, settings.node_id, generation, os.getpid(), executions,
                         dispatcher, pool)
    keeper.start()
    # Before the first message: a stop signal from now on is a drain (never an
    # Event.set() in a handler, which can deadlock: see runstile/signals.py).
    signals = StopSignals()
    workers = pools.start(broker, plan, worker_timeout_ms=CONSUMER_TIMEOUT_MS)
    log.info("worker up: node %s generation %d, threads by queue: %s", settings.node_id,
             generation, pools.describe(plan))
    while not signals.wait(SIGNAL_POLL_S):
        pass
    drain(settings, workers, executions, pool, generation)
    keeper.stop()
    logging.shutdown()
    # Do not wait for abandoned body threads (docs/operations.md, "Signals").
    os._exit(0)


def drain(settings: Settings, workers: list[dramatiq.Worker], executions: Executions,
          pool: ConnectionPool, generation: int) -> None:
    """Stop consuming, let running bodies finish for up to the drain timeout
    (heartbeats go on), then mark every run still in flight as a controlled interruption
    in ONE transaction.  The next recovery re-queues those runs with attempt + 1."""
    log.info("draining: no new messages; waiting up to %.1fs for %d running bodies",
             settings.drain_timeout_s, len(executions.snapshot()))
    # Dramatiq's stop lets worker threads finish and puts prefetched messages back; it
    # runs beside us because it may wait longer than our drain timeout.  Every pool's
    # Worker stops at once: one busy pool must not hold the others' messages.
    for worker in workers:
        threading.Thread(target=worker.stop,
                         kwargs={"timeout": int(settings.drain_timeout_s * 1000)},
                         name="runstile-dramatiq-stop", daemon=True).start()
    deadline = time.monotonic() + settings.drain_timeout_s
    while executions.snapshot() and time.monotonic() < deadline:
        time.sleep(0.02)
    if executions.snapshot():
        try:
            drained = recovery.mark_drained(pool.get(), node=settings.node_id,
                                            generation=generation, pid=os.getpid())
            log.warning("drain timeout: %d runs marked as a controlled interruption: %s",
                        len(drained), ", ".join(drained))
        except RunstileError as exc:
            log.error("drain: could not mark running runs (%s); their leases will lapse "
                      "and recovery will classify them", exc.message)
    else:
        log.info("drained: every running body finished")
    # The outcomes of the bodies that ended are handed to the committer without waiting
    # (workers/actors.py): they commit before the process exits, or the runs would be
    # left to recovery as if their bodies had died.
    if not executions.wait_for_outcomes(max(deadline - time.monotonic(), OUTCOME_GRACE_S)):
        log.error("drain: some outcomes were not recorded in time; recovery will "
                  "classify their runs")
