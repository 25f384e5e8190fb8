"""Prometheus metrics.  With several web processes, prometheus_client's multiprocess
mode (PROMETHEUS_MULTIPROC_DIR, set by ``runstile serve`` before any process starts)
aggregates every process's samples into each /metrics answer."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

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


#: This process's counter per outcome (labels() takes a lock and builds a key per call).
_admissions_by_outcome: dict[str, Counter] = {}


def observe_admission(outcome: str, seconds: float) -> None:
    counter = _admissions_by_outcome.get(outcome)
    if counter is None:
        counter = _admissions_by_outcome[outcome] = ADMISSIONS.labels(outcome=outcome)
    counter.inc()
    ADMISSION_SECONDS.observe(seconds)


def render(multiprocess_dir: str | None) -> tuple[bytes, str]:
    """Every process's samples when ``serve`` shares them through ``multiprocess_dir``;
    this process's alone otherwise (an app built without ``serve``, as in tests)."""
    if multiprocess_dir:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    from prometheus_client import REGISTRY
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST

