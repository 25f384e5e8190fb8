"""DBOS on SQLite or PostgreSQL, the execution benchmark's durable peer (bench/README.md).

Worker process (``python -m bench.peers.dbos_peer [DB_URL] EXECUTOR_ID``; without DB_URL
the URL is read from BENCH_DBOS_URL, which keeps a PostgreSQL URL and any password out of
argv): configures DBOS with that system database (``sqlite:///…``, or
``postgresql://…``: DBOS's own PostgreSQL system database, its tables in the ``dbos``
schema of that database, LISTEN/NOTIFY on, as DBOS ships it), registers the no-op
workflow and the durable queue ``bench`` (``worker_concurrency`` workflows at a time in
this process), launches, and runs until SIGTERM/SIGINT.  Clients enqueue from other processes with
:class:`dbos.DBOSClient` (:func:`client`, :func:`enqueue`), each with its own workflow
id (DBOS's idempotency key).

Environment of a worker: BENCH_DBOS_CONCURRENCY (workflows at once per process;
``none``: no limit),
BENCH_DBOS_POLL_S (queue polling interval), BENCH_DBOS_WAL (``1``: the system database
in WAL mode, ``synchronous=FULL``; otherwise DBOS's own default, a rollback journal).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .counter import mark_start

APP = "runstile-bench"
VERSION = "bench-1"          # one application version for workers and clients
QUEUE = "bench"
WORKFLOW = "bench_noop"


def wal_engine(url: str):
    """A SQLAlchemy engine whose connections use WAL with synchronous=FULL (the same
    durable settings as runstile's ledger), for the WAL variant."""
    import sqlalchemy as sa
    from sqlalchemy import event

    engine = sa.create_engine(url, pool_size=20, max_overflow=0, pool_timeout=30)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, record):  # noqa: ARG001
        dbapi_conn.isolation_level = "IMMEDIATE"   # as DBOS's own SQLite engine does
        dbapi_conn.execute("PRAGMA busy_timeout=30000")
        dbapi_conn.execute("PRAGMA foreign_keys=ON")
        dbapi_conn.execute("PRAGMA journal_mode=WAL")
        dbapi_conn.execute("PRAGMA synchronous=FULL")

    return engine


def client(url: str, wal: bool, pool_size: int = 5):
    from dbos import DBOSClient
    if wal:
        return DBOSClient(system_database_engine=wal_engine(url), application_name=APP)
    return DBOSClient(system_database_url=url, system_database_pool_size=pool_size,
                      application_name=APP)


def enqueue(dbos_client, workflow_id: str, mark: str | None = None) -> None:
    dbos_client.enqueue({"workflow_name": WORKFLOW, "queue_name": QUEUE,
                         "workflow_id": workflow_id, "app_version": VERSION,
                         "application_name": APP}, mark, workflow_id)


def worker(url: str, executor_id: str) -> None:
    from dbos import DBOS

    raw = os.environ.get("BENCH_DBOS_CONCURRENCY", "4")
    concurrency = None if raw == "none" else int(raw)
    poll_s = float(os.environ.get("BENCH_DBOS_POLL_S", "0.01"))
    wal = os.environ.get("BENCH_DBOS_WAL") == "1"
    config = {"name": APP, "application_version": VERSION, "executor_id": executor_id,
              "log_level": "WARNING"}
    if wal:
        config["system_database_engine"] = wal_engine(url)
        config["system_database_url"] = url
    else:
        config["system_database_url"] = url
    DBOS(config=config)

    @DBOS.workflow(name=WORKFLOW)
    def bench_noop(mark, tag):
        if mark:
            mark_start(mark, tag)
        return None

    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=concurrency, polling_interval_sec=poll_s)
    print(f"dbos worker {executor_id} up (pid {os.getpid()})", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    os._exit(0)


if __name__ == "__main__":
    worker(sys.argv[1] if len(sys.argv) > 2 else os.environ["BENCH_DBOS_URL"], sys.argv[-1])
