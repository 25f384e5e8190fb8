"""huey on SQLite, an execution-benchmark peer (bench/README.md).

Workers: two ``huey_consumer bench.peers.huey_peer.huey -w 4 -k thread`` processes on
the same SQLite file (BENCH_HUEY_DB), the closest huey gets to runstile's 2 worker
processes x 4 threads: huey's consumer runs one kind of worker (threads *or*
processes), and two consumers on one SQLite file share the queue safely (a dequeue is
one ``BEGIN EXCLUSIVE`` transaction that deletes the task row).  ``SqliteHuey`` as huey
ships it: WAL journal, SQLite's default ``synchronous`` (FULL), 5 s busy timeout.  The
no-op returns None, which huey's result store does not keep (``store_none=False``), so
completions are counted with :mod:`bench.peers.counter` (BENCH_DONE_FILE).  Clients
enqueue by calling the task (``bench_noop(mark, tag)``).
"""

from __future__ import annotations

import os

from huey import SqliteHuey

from .counter import done, mark_start

DONE_FILE = os.environ.get("BENCH_DONE_FILE", "/dev/null")

huey = SqliteHuey(name="runstile-bench", filename=os.environ.get("BENCH_HUEY_DB", "huey.db"))


@huey.on_startup()
def _ready():
    print(f"huey worker ready (pid {os.getpid()})", flush=True)


@huey.task(name="bench_noop")
def bench_noop(mark, tag):
    if mark:
        mark_start(mark, tag)
    done(DONE_FILE)
