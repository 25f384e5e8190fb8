"""Procrastinate on PostgreSQL, a PostgreSQL section peer (bench/README.md).

Worker process (``python -m bench.peers.procrastinate_peer NAME``, the database URL in
BENCH_PROCRASTINATE_URL, never in argv): Procrastinate's ``App`` on a ``PsycopgConnector`` runs
``run_worker(concurrency=4)`` with every other worker option at Procrastinate's
default: LISTEN/NOTIFY on (a deferred job wakes a worker at once; the 5 s poll is only
the fallback), jobs kept after they finish (``delete_jobs="never"``), so each run
leaves its row with status ``succeeded`` and its events, which is what the benchmark
counts.  The task is ``async``: Procrastinate's ``concurrency`` runs that many jobs at
once on the worker's event loop, its own recommended shape (a sync task would go
through a thread instead); a no-op does no blocking work either way.

Clients defer from other processes through :func:`client_app` (a
``SyncPsycopgConnector``, the synchronous defer path Procrastinate ships for code that
is not async) and :func:`defer`.  Procrastinate has no idempotency key: its
``queueing_lock`` only refuses a second job while the first is still queued, so the
client's unique key travels as a task argument and nothing de-duplicates on it.
"""

from __future__ import annotations

import os
import sys

from procrastinate import App, PsycopgConnector, SyncPsycopgConnector

from .counter import mark_start

TASK = "bench_noop"
QUEUE = "bench"
CONCURRENCY = int(os.environ.get("BENCH_PROCRASTINATE_CONCURRENCY", "4"))


def _register(app: App) -> None:
    @app.task(name=TASK, queue=QUEUE)
    async def bench_noop(mark: str | None, tag: str) -> None:
        if mark:
            mark_start(mark, tag)


def client_app(url: str, pool_size: int = 4) -> App:
    """An opened app for deferring from a client process (one pool per process)."""
    app = App(connector=SyncPsycopgConnector(conninfo=url, min_size=1,
                                             max_size=pool_size))
    _register(app)
    return app.open()


def defer(app: App, key: str, mark: str | None = None) -> None:
    app.tasks[TASK].defer(mark=mark, tag=key)


def apply_schema(url: str) -> None:
    """Procrastinate's own schema, applied once before any worker starts."""
    app = App(connector=SyncPsycopgConnector(conninfo=url, min_size=1, max_size=1))
    with app.open():
        app.schema_manager.apply_schema()


def worker(name: str) -> None:
    url = os.environ["BENCH_PROCRASTINATE_URL"]
    app = App(connector=PsycopgConnector(conninfo=url, min_size=1, max_size=8))
    _register(app)
    print(f"procrastinate worker {name} starting (pid {os.getpid()})", flush=True)
    # Procrastinate installs its own SIGTERM/SIGINT handlers and stops gracefully.
    app.run_worker(name=name, queues=[QUEUE], concurrency=CONCURRENCY)


if __name__ == "__main__":
    if sys.argv[1:2] == ["schema"]:
        apply_schema(os.environ["BENCH_PROCRASTINATE_URL"])
    else:
        worker(sys.argv[1] if len(sys.argv) > 1 else "bench-worker")
