"""The execution benchmark's runstile task (``runstile up --tasks bench.bench_tasks``).

``bench.noop`` does nothing and returns None.  When its input names a file
(``{"mark": path}``), it first appends ``"<tag> <time.time()>"`` to it: that line is
the moment the body started, for the idle start-latency measurement.  The throughput
runs send no ``mark``, so their bodies do no I/O at all.
"""

from __future__ import annotations

import os
import time

import runstile


def mark_start(path: str, tag: str) -> None:
    """Append one line ``"<tag> <unix time>"``; O_APPEND keeps lines whole across processes."""
    line = f"{tag} {time.time():.6f}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@runstile.task("bench.noop")
def noop(ctx, input):
    if isinstance(input, dict) and input.get("mark"):
        mark_start(input["mark"], str(input.get("tag", ctx.run_id)))
    return None
