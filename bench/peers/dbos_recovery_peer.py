"""DBOS on SQLite, the recovery benchmark's peer (bench/README.md, "Recovery benchmark").

Two roles, each its own process, both the same DBOS application (same name, same
application version, the same registered workflows):

``crash URL EXECUTOR N TEMPLATES``
    The application that dies.  It launches DBOS with ``executor_id=EXECUTOR``, runs
    ``TEMPLATES`` no-op workflows to completion (real completed rows the benchmark copies
    as filler), then starts ``N`` workflows whose body blocks forever with
    ``DBOS.start_workflow`` (each one's ``workflow_status`` row is ``PENDING`` and owned
    by ``EXECUTOR`` once ``start_workflow`` returns), prints ``crash ready`` and waits to
    be SIGKILLed by the benchmark.

``recover URL EXECUTOR DEAD_EXECUTOR``
    A new executor of the same application.  It launches DBOS with
    ``executor_id=EXECUTOR`` (its own start-up recovery finds nothing: no workflow is
    owned by it), then times DBOS's recovery of the dead executor's pending workflows,
    ``DBOS._recover_pending_workflows([DEAD_EXECUTOR])`` — in dbos 3.4.0 the classmethod
    behind DBOS's executor recovery; ``DBOS.launch()`` runs the same code
    (``get_pending_workflows`` + ``_recover_workflow`` per workflow) for its own executor
    id in a background thread.  Each workflow is recovered by one committed UPDATE,
    ``PENDING`` -> ``ENQUEUED`` (on its queue, or DBOS's internal queue), from which a
    queue runner starts it again.  It prints one JSON line (workflows recovered, seconds)
    and exits without waiting for the re-started workflows.

Environment: BENCH_DBOS_WAL (``1``: the system database in WAL mode with
``synchronous=FULL`` on every connection, as in the execution benchmark's WAL variant;
otherwise SQLite as DBOS opens it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

APP = "runstile-bench-recovery"
VERSION = "bench-recovery-1"
BLOCK = "bench_block"
NOOP = "bench_noop"
#: Workflow ids: blocked ones (left PENDING by the crash) and completed templates.
BLOCKED_PREFIX = "blocked-"
TEMPLATE_PREFIX = "template-"


def _dbos(url: str, executor_id: str):
    from dbos import DBOS

    from .dbos_peer import wal_engine

    config = {"name": APP, "application_version": VERSION, "executor_id": executor_id,
              "system_database_url": url, "log_level": "WARNING"}
    if os.environ.get("BENCH_DBOS_WAL") == "1":
        config["system_database_engine"] = wal_engine(url)
    DBOS(config=config)
    forever = threading.Event()

    @DBOS.workflow(name=BLOCK)
    def bench_block(i):
        forever.wait()      # never set: the process dies (or exits) with the body running

    @DBOS.workflow(name=NOOP)
    def bench_noop(i):
        return None

    return DBOS, bench_block, bench_noop


def crash(url: str, executor_id: str, n: int, templates: int) -> None:
    from dbos import SetWorkflowID

    DBOS, bench_block, bench_noop = _dbos(url, executor_id)
    DBOS.launch()
    for i in range(templates):
        with SetWorkflowID(f"{TEMPLATE_PREFIX}{i}"):
            DBOS.start_workflow(bench_noop, i).get_result()
    for i in range(n):
        with SetWorkflowID(f"{BLOCKED_PREFIX}{i}"):
            DBOS.start_workflow(bench_block, i)
    print(f"crash ready: {templates} completed, {n} started (pid {os.getpid()})", flush=True)
    threading.Event().wait()   # until SIGKILL


def recover(url: str, executor_id: str, dead_executor: str) -> None:
    queue_thread = os.environ.get("BENCH_DBOS_QUEUE_THREAD") == "1"
    if not queue_thread:
        import dbos._dbos as core
        if not callable(getattr(core, "queue_thread", None)):
            raise SystemExit("dbos._dbos.queue_thread not found: this dbos release differs "
                             "from 3.4.0; run with BENCH_DBOS_QUEUE_THREAD=1")
        core.queue_thread = lambda stop_event, dbos: None   # launch() starts nothing
    DBOS, _, _ = _dbos(url, executor_id)
    t_launch = time.perf_counter()
    DBOS.launch()
    t0 = time.perf_counter()
    handles = DBOS._recover_pending_workflows([dead_executor])
    t1 = time.perf_counter()
    print(json.dumps({"recovered": len(handles), "duration_s": t1 - t0,
                      "launch_s": t0 - t_launch, "queue_thread": queue_thread,
                      "workflow_ids": sorted(h.get_workflow_id() for h in handles)}),
          flush=True)
    os._exit(0)     # the re-started bodies block forever; do not wait for them


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "crash":
        crash(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif role == "recover":
        recover(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown role {role!r}")
