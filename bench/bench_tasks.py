"""The execution benchmark's runstile task (``runstile up --tasks bench.bench_tasks``).

``bench.noop`` does nothing and returns None.  When its input names a file
(``{"mark": path}``), it first appends ``"<tag> <time.time()>"`` to it: that line is
the moment the body started, for the idle start-latency measurement.  The throughput
runs send no ``mark``, so their bodies do no I/O at all.  ``bench.hold`` (bench/flow.py)
holds its thread until a file exists.
"""

from __future__ import annotations

import os
import time

import runstile
from bench.peers.counter import mark_start


@runstile.task("bench.noop")
def noop(ctx, input):
    if isinstance(input, dict) and input.get("mark"):
        mark_start(input["mark"], str(input.get("tag", ctx.run_id)))
    return None


@runstile.task("bench.hold")
def hold(ctx, input):
    """Holds its worker thread until the file ``input["release"]`` exists (at most 120 s):
    the flow benchmark keeps every thread busy with these while it builds a backlog."""
    deadline = time.monotonic() + 120
    while not os.path.exists(input["release"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return None
