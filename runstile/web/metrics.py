"""Prometheus metrics (docs/operations.md, "Metrics").  prometheus_client's multiprocess
mode (PROMETHEUS_MULTIPROC_DIR, set by ``runstile up`` for the whole node, or by
``runstile serve`` for its own processes, before any process starts) adds every
process's samples into each /metrics answer: the web's admissions, and what the worker
processes and the supervisor's recovery passes wrote (runstile/workers/metrics.py,
runstile/recovery/metrics.py).  The gauges of runs and deliveries are read from the
ledger at each scrape instead, so every web process answers the same."""

from __future__ import annotations

import hmac
import sqlite3
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..ledger import obligations, status

ADMISSIONS = Counter("runstile_admissions_total",
                     "POST /v1/runs answers by outcome (created, replayed or error code)",
                     ["outcome"])
ADMISSION_SECONDS = Histogram(
    "runstile_admission_seconds", "Time to answer POST /v1/runs, including the commit",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))

WRITER_UNREACHABLE = Counter(
    "runstile_admission_writer_unreachable_total",
    "Admissions a web process committed itself because serve's admission writer could "
    "not be reached (not listening, or the request could not be sent whole)")


RUNS_ADMITTED = Counter("runstile_runs_admitted_total",
                        "Runs created by admission (POST /v1/runs and retries; replays are "
                        "not new runs), by task", ["task"])

#: This process's counter per outcome (labels() takes a lock and builds a key per call).
_admissions_by_outcome: dict[str, Counter] = {}


def observe_admission(outcome: str, seconds: float) -> None:
    counter = _admissions_by_outcome.get(outcome)
    if counter is None:
        counter = _admissions_by_outcome[outcome] = ADMISSIONS.labels(outcome=outcome)
    counter.inc()
    ADMISSION_SECONDS.observe(seconds)


def observe_admitted(task: str) -> None:
    RUNS_ADMITTED.labels(task=task).inc()


class LedgerGauges(Collector):
    """``runstile_runs{status}`` and ``runstile_deliveries_backlog{state}``, counted in
    the ledger when scraped (each count reads a partial index: ledger/status.py,
    ledger/obligations.py)."""

    def __init__(self, conn: Callable[[], sqlite3.Connection]) -> None:
        self.conn = conn

    def collect(self) -> Iterator[Metric]:
        connection = self.conn()
        runs = GaugeMetricFamily("runstile_runs", "Runs queued, running or stopping now",
                                 labels=["status"])
        for name, n in status.active_runs(connection).items():
            runs.add_metric([name], n)
        backlog = GaugeMetricFamily("runstile_deliveries_backlog",
                                    "Delivery obligations not yet settled, by state",
                                    labels=["state"])
        for name, n in obligations.backlog(connection).items():
            backlog.add_metric([name], n)
        return iter([runs, backlog])


def token_matches(expected: str | None, authorization: str) -> bool:
    """True when no token is configured, or the header is ``Bearer <token>`` (compared
    in constant time, so the answer's timing tells nothing of the token)."""
    if expected is None:
        return True
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), expected.encode())


def render(multiprocess_dir: str | None,
           conn: Callable[[], sqlite3.Connection]) -> tuple[bytes, str]:
    """Every process's samples when ``up`` or ``serve`` shares them through
    ``multiprocess_dir`` (this process's alone otherwise: an app built in a test), and
    the ledger's gauges."""
    registry = CollectorRegistry()
    if multiprocess_dir:
        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
    else:
        from prometheus_client import REGISTRY
        registry = REGISTRY
    # A registry of its own for the gauges: registering them on the process's global
    # registry would count them into every later scrape twice.
    gauges = CollectorRegistry()
    gauges.register(LedgerGauges(conn))
    return generate_latest(registry) + generate_latest(gauges), CONTENT_TYPE_LATEST

