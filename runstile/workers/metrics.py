"""What worker processes count (docs/operations.md, "Metrics"): runs finished, their wait
in the queue and their duration, claims lost, delivery attempts.

Each worker process writes its samples to the node's multiprocess folder (set up by the
``up``/``worker`` supervisor before it starts the process), and the web's /metrics adds
up every process's files: nothing here serves them.  Without that folder (a worker
built in a test) the samples stay in this process.
"""

from __future__ import annotations

import functools
import time

from prometheus_client import Counter, Histogram

#: Seconds, from a few milliseconds to half an hour: a queue wait or a run's duration.
RUN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               120.0, 300.0, 600.0, 1800.0)

RUNS_FINISHED = Counter("runstile_runs_finished_total",
                        "Runs a worker brought to a terminal status, by task and status",
                        ["task", "status"])
QUEUE_WAIT = Histogram("runstile_queue_wait_seconds",
                       "From admission to a worker's claim of the run's first attempt",
                       ["task"], buckets=RUN_BUCKETS)
RUN_DURATION = Histogram("runstile_run_duration_seconds",
                         "From a worker's claim to the run's terminal status (one attempt)",
                         ["task"], buckets=RUN_BUCKETS)
CLAIMS_LOST = Counter("runstile_claims_lost_total",
                      "Messages whose claim lost (a duplicate, a run already finished or "
                      "stopped, a slot busy), by the claim's reason", ["reason"])
DELIVERIES = Counter("runstile_deliveries_total",
                     "Delivery attempts, by outcome (delivered; retry: failed, tried again "
                     "later; parked; lost: recovery took the attempt back first)", ["outcome"])


#: A labelled child per task (and status), looked up once: ``labels()`` takes a lock and
#: checks its arguments on every call, and these run for every run.  Tasks come from
#: the registry, so the caches stay small.
_finished_child = functools.lru_cache(maxsize=1024)(
    lambda task, status: RUNS_FINISHED.labels(task=task, status=status))
_duration_child = functools.lru_cache(maxsize=1024)(lambda task: RUN_DURATION.labels(task=task))
_wait_child = functools.lru_cache(maxsize=1024)(lambda task: QUEUE_WAIT.labels(task=task))


def claimed(run: dict) -> None:
    """A won claim (the run row it returned): on the run's first start, its wait since
    admission, or since its not_before for a delayed run.  Later claims (a retry, a
    recovery, an approval's continuation) waited on a backoff or a person, not on the
    queue.  The claim keeps a first start's started_at and sets updated_at to the same
    ledger time, so the two are equal exactly on a first start."""
    first_start = run.get("started_at") is not None and run["started_at"] == run["updated_at"]
    if first_start and run.get("attempt") == 1:
        due = max(run["created_at"], run.get("not_before") or 0.0)
        _wait_child(run["task"]).observe(max(0.0, run["started_at"] - due))


def finished(task: str, status: str, started_monotonic: float) -> None:
    _finished_child(task, status).inc()
    _duration_child(task).observe(time.monotonic() - started_monotonic)


def claim_lost(reason: str) -> None:
    CLAIMS_LOST.labels(reason=reason).inc()


def delivery(outcome: str) -> None:
    DELIVERIES.labels(outcome=outcome).inc()
