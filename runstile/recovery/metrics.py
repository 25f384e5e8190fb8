"""What recovery passes count (docs/operations.md, "Metrics"): how long each pass took
and what it did, by the names of its report's counts.

The passes of ``runstile up`` and ``runstile worker`` run in the supervisor, which shares
the node's multiprocess folder with its children, so the web's /metrics shows them.
prometheus_client is imported on the first pass, not with this module: it reads that
folder from the environment when it is imported, and the supervisor sets it first.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

#: Seconds: a pass over an idle ledger takes milliseconds, a boot after a crash minutes.
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0, 300.0)


@functools.cache
def _metrics() -> tuple[Any, Any]:
    from prometheus_client import Counter, Histogram
    seconds = Histogram("runstile_recovery_pass_seconds",
                        "Duration of one recovery pass (boot, scheduled or command)",
                        ["trigger"], buckets=PASS_BUCKETS)
    classified = Counter("runstile_recovery_classified_total",
                         "What recovery passes did, by the name of the report's count "
                         "(requeued, paused, interrupted, deliveries_rearmed, purged, ...)",
                         ["outcome"])
    return seconds, classified


def observe_pass(trigger: str, duration_s: float, counts: Mapping[str, int]) -> None:
    seconds, classified = _metrics()
    seconds.labels(trigger=trigger).observe(duration_s)
    for outcome, n in counts.items():
        if n:
            classified.labels(outcome=outcome).inc(n)
