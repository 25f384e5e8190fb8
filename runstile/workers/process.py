"""One worker process: Dramatiq's own Worker over runstile's broker, plus the heartbeat.

Started by ``runstile up`` or ``runstile worker`` (the parent holds the node lock and
passes the node generation it started).  SIGTERM/SIGINT, once or repeatedly, stop
consumption and let running bodies finish up to the drain timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import dramatiq

from ..config import Settings
from ..ledger.db import ConnectionPool
from . import actors, registry
from .broker import make_broker
from .lease import Executions, LeaseKeeper

log = logging.getLogger("runstile.workers")

#: Milliseconds Dramatiq's consumers wait in __next__ before checking for shutdown.
CONSUMER_TIMEOUT_MS = 1000


def run(settings: Settings, generation: int) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s [worker %(process)d] %(message)s")
    registry.load(settings.tasks)
    pool = ConnectionPool(settings.ledger_path, synchronous=settings.synchronous,
                          busy_timeout_ms=settings.busy_timeout_ms)
    broker = make_broker(settings)
    executions = Executions()
    executor = actors.Executor(settings, broker, node=settings.node_id, generation=generation,
                               executions=executions, pool=pool)
    actors.declare(broker, executor)
    keeper = LeaseKeeper(settings, settings.node_id, generation, os.getpid(), executions, pool)
    keeper.start()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    worker = dramatiq.Worker(broker, worker_threads=settings.threads,
                             worker_timeout=CONSUMER_TIMEOUT_MS)
    worker.start()
    log.info("worker up: node %s generation %d, %d threads", settings.node_id, generation,
             settings.threads)
    stop.wait()
    log.info("stopping: no new messages; waiting up to %.0fs for running bodies",
             settings.drain_timeout_s)
    worker.stop(timeout=int(settings.drain_timeout_s * 1000))
    keeper.stop()
    broker.close()
    # Do not wait for abandoned body threads (SPEC §6.4): their leases lapse and
    # recovery classifies their runs.
    logging.shutdown()
    os._exit(0)
