"""Settings: read once from the environment (or flags), validated, then passed down.

Nothing below this module reads ``os.environ``; every part of runstile receives a
:class:`Settings` explicitly: settings flow in, nothing below reads the environment
(docs/configuration.md).  Every variable is
documented with its default and unit in ``docs/configuration.md``; a test keeps the
two in step.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, redact_url

#: The synchronous levels SQLite accepts; FULL is the durable default (docs/guarantees.md, "1. Durable admission").
SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")
#: Crash points that code names, for crash tests that SIGKILL a process at a named point
#: (docs/configuration.md, RUNSTILE_CRASHPOINT); see crashpoints.py.
CRASHPOINTS = ("after_admit_commit", "after_claim", "after_step_start", "after_body",
               "after_finish", "mid_recovery", "after_delivery_send", "writer_after_commit")


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be a whole number of at least 1")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be a whole number of at least 0")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a number greater than 0")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number of at least 0")
    return value


def _synchronous(raw: str) -> str:
    value = raw.strip().upper()
    if value not in SYNCHRONOUS_LEVELS:
        raise ValueError(f"must be one of {', '.join(SYNCHRONOUS_LEVELS)}")
    return value


#: Who commits the admissions of ``serve``'s web processes (web/writer/).
ADMISSION_WRITERS = ("process", "inline")


def _admission_writer(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ADMISSION_WRITERS:
        raise ValueError(f"must be one of {', '.join(ADMISSION_WRITERS)}")
    return value


def _broker_url(raw: str) -> str:
    value = raw.strip()
    if value == "sqlite":
        return value
    # RabbitMQ accepts several URLs separated by ';' (Dramatiq tries them in turn).
    amqp = value.startswith(("amqp://", "amqps://"))
    for url in value.split(";") if amqp else [value]:
        parts = urllib.parse.urlsplit(url.strip())
        schemes = ("amqp", "amqps") if amqp else ("redis", "rediss")
        if parts.scheme not in schemes or not parts.hostname:
            raise ValueError("must be 'sqlite', a redis:// URL or an amqp:// URL with a host")
        _ = parts.port  # raises ValueError for a port that is not a number in 0-65535
    return value


#: URL schemes of a PostgreSQL ledger (RUNSTILE_DATABASE_URL).
DATABASE_URL_SCHEMES = ("postgresql", "postgres")
#: Variables whose value may hold a password: shown redacted in every error.
SECRET_VARIABLES = ("RUNSTILE_DATABASE_URL",)


def database_url(raw: str) -> str | None:
    """RUNSTILE_DATABASE_URL / --database-url: a postgresql:// URL, or empty for SQLite."""
    value = raw.strip()
    if not value:
        return None
    parts = urllib.parse.urlsplit(value)
    if parts.scheme.lower() not in DATABASE_URL_SCHEMES:
        raise ValueError("must be a postgresql:// URL (unset: the SQLite ledger in the data "
                         "directory)")
    _ = parts.port  # raises ValueError for a port that is not a number in 0-65535
    return value


def _tasks(raw: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not names:
        raise ValueError("must name at least one module")
    return names


def _optional_text(raw: str) -> str | None:
    return raw.strip() or None


def _text(raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ValueError("must not be empty")
    return value


def _path(raw: str) -> Path:
    return Path(_text(raw))


def _allowlist(raw: str) -> tuple[str, ...]:
    entries = tuple(part.strip() for part in raw.split(",") if part.strip())
    for entry in entries:
        if "/" in entry:
            ipaddress.ip_network(entry, strict=False)  # raises ValueError on nonsense
    return entries


def _crashpoint(raw: str) -> str | None:
    value = raw.strip() or None
    if value is None:
        return None
    name, _, probability = value.partition(":")
    if name not in CRASHPOINTS:
        raise ValueError(f"must be NAME or NAME:PROBABILITY with NAME one of "
                         f"{', '.join(CRASHPOINTS)}")
    if probability:
        p = float(probability)
        if not 0 < p <= 1:
            raise ValueError("the probability after ':' must be in (0, 1]")
    return value


def _node_id(raw: str) -> str:
    value = raw.strip()
    if not value or len(value) > 128 or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError("must be 1-128 characters of letters, digits, '-', '_' or '.'")
    return value


def _default_node_id() -> str:
    host = socket.gethostname() or "node"
    return "".join(c if (c.isalnum() or c in "-_.") else "-" for c in host)[:128]


@dataclass(frozen=True)
class Settings:
    """Everything configurable, with units in the names (docs/architecture.md)."""

    #: Folder holding ``ledger.db``, node lock files and metrics scratch files.
    data_dir: Path = Path("./runstile-data")
    #: Modules whose ``@runstile.task`` functions are registered.
    tasks: tuple[str, ...] = ("runstile.demo",)
    #: ``sqlite`` (embedded broker in the ledger), ``redis://…`` or ``amqp://…``.
    broker_url: str = "sqlite"
    #: A PostgreSQL ledger instead of ``<data_dir>/ledger.db``; kept out of the repr, as
    #: its password must never reach a log.
    database_url: str | None = field(default=None, repr=False)
    #: SQLite ``PRAGMA synchronous``; FULL makes every acknowledged commit durable.
    synchronous: str = "FULL"
    #: Milliseconds a ledger write waits for the lock before answering 503.
    busy_timeout_ms: int = 5000
    #: Milliseconds a GET /v1/runs query may run before it is cut off (503).
    list_query_timeout_ms: int = 2000
    #: Largest accepted request body in bytes (chunked bodies included).
    max_body_bytes: int = 1024 * 1024
    #: Non-terminal runs one profile may hold before admission answers 429.
    max_active_runs: int = 10_000
    #: Runs of one profile running (or stopping) at once across the deployment; None is
    #: unlimited.  A run over it stays queued until a slot frees (ledger/slots.py).
    max_running_per_profile: int | None = None
    #: Task used when a POST names none; unset means ``task`` is required.
    default_task: str | None = None
    #: Seconds ``Retry-After`` suggests on 503 and 429 answers.
    retry_after_s: int = 1
    #: Seconds a terminal run (and its events) is kept after it ends.
    run_retention_s: float = 7 * 24 * 3600.0
    #: Seconds purged keys and run ids are remembered as tombstones (410).
    key_tombstone_s: float = 30 * 24 * 3600.0
    #: This node's identity in owners and generation numbers.
    node_id: str = field(default_factory=_default_node_id)
    #: Seconds a claimed run may go without a heartbeat before its lease expires.
    lease_s: float = 15.0
    #: Seconds between one process's heartbeats (renews all its leases at once).
    heartbeat_s: float = 5.0
    #: Seconds between scheduled recovery passes.
    recovery_interval_s: float = 10.0
    #: Recoveries of one run before it is paused instead of re-queued.
    recovery_budget: int = 3
    #: Seconds a draining process waits for running bodies before abandoning them.
    drain_timeout_s: float = 30.0
    #: Seconds a stopping run may keep running before it is interrupted.
    stop_grace_s: float = 10.0
    #: Largest task result in bytes of JSON.
    max_result_bytes: int = 1024 * 1024
    #: Event streams one web process serves at once (never more than half its threads).
    max_streams: int = 8
    #: Event streams one API key may hold open in one web process (429 beyond).
    max_streams_per_key: int = 4
    #: Seconds one event stream lives before the client must resume.
    stream_max_s: float = 300.0
    #: Seconds between keepalive comments on an idle event stream.
    stream_keepalive_s: float = 15.0
    #: First delivery retry delay in seconds (doubles up to 5 minutes).
    delivery_backoff_s: float = 1.0
    #: Longest delay between two delivery attempts, in seconds (before Retry-After).
    delivery_backoff_max_s: float = 300.0
    #: Delivery attempts before an obligation is parked.
    delivery_max_attempts: int = 12
    #: Seconds a delivery may take to connect (TCP and TLS).
    delivery_connect_timeout_s: float = 5.0
    #: Seconds a delivery may take from sending the request to the end of the answer.
    delivery_read_timeout_s: float = 10.0
    #: Seconds the old signing secret keeps signing after ``webhooks secret --rotate``.
    webhook_rotation_grace_s: float = 24 * 3600.0
    #: Hosts or CIDRs that callbacks may reach despite the SSRF guard.
    callback_allowlist: tuple[str, ...] = ()
    #: Address ``serve``/``up`` listen on.
    host: str = "127.0.0.1"
    #: Port ``serve``/``up`` listen on.
    port: int = 8000
    #: Web server (gunicorn) processes.
    web_workers: int = 2
    #: Threads per web process (gthread; event streams hold one each).
    web_threads: int = 16
    #: Seconds a request may take to arrive whole (head and body) from its first byte;
    #: the web process's event loop reads it meanwhile, not a request thread.
    request_read_timeout_s: float = 10.0
    #: "process": one admission writer process commits every web process's admissions;
    #: "inline": each web process commits its own (web/writer/ says why and when).
    admission_writer: str = "process"
    #: Dramatiq worker processes.
    workers: int = 2
    #: Threads per Dramatiq worker process.
    threads: int = 4
    #: Named crash point at which the process SIGKILLs itself (tests only).
    crashpoint: str | None = None

    @property
    def ledger_path(self) -> Path:
        return self.data_dir / "ledger.db"

    @property
    def ledger_target(self) -> Path | str:
        """What opens the ledger: the PostgreSQL URL, else the SQLite file."""
        return self.database_url or self.ledger_path

    @property
    def ledger_name(self) -> str:
        """The ledger as logs and messages may name it (no password)."""
        return redact_url(self.database_url) if self.database_url else str(self.ledger_path)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``RUNSTILE_*`` variables, then explicit overrides (flags).

        Raises :class:`ConfigError` naming the variable when a value is invalid.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, (parse, _) in ENV_VARIABLES.items():
            raw = env.get(name)
            if raw is None:
                continue
            attr = name.removeprefix("RUNSTILE_").lower()
            try:
                values[attr] = parse(raw)
            except ValueError as exc:
                shown = redact_url(raw) if name in SECRET_VARIABLES else raw
                raise ConfigError(f"{name}={shown!r} is invalid: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Cross-field rules that single values cannot express."""
        if self.heartbeat_s >= self.lease_s:
            raise ConfigError(
                f"RUNSTILE_HEARTBEAT_S ({self.heartbeat_s}) must be shorter than "
                f"RUNSTILE_LEASE_S ({self.lease_s})"
            )
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is outside 1-65535")

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def share_metrics_across_processes(folder: str) -> None:
    """Point prometheus_client's multiprocess mode at ``folder``, for this process and
    every process it starts.  prometheus_client reads the folder from its own environment
    variable (its interface, not a runstile setting), so this is the one place that sets
    it; runstile's own code is handed the folder explicitly."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder


def _port(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= 65535:
        raise ValueError("must be a port number from 1 to 65535")
    return value


#: Every environment variable runstile reads: name -> (parser, one-line meaning).
ENV_VARIABLES: dict[str, tuple[Callable[[str], Any], str]] = {
    "RUNSTILE_DATA_DIR": (_path, "data directory"),
    "RUNSTILE_TASKS": (_tasks, "task modules, comma-separated"),
    "RUNSTILE_BROKER_URL": (_broker_url, "broker"),
    "RUNSTILE_DATABASE_URL": (database_url, "PostgreSQL ledger"),
    "RUNSTILE_SYNCHRONOUS": (_synchronous, "SQLite synchronous level"),
    "RUNSTILE_BUSY_TIMEOUT_MS": (_positive_int, "ledger lock wait, ms"),
    "RUNSTILE_LIST_QUERY_TIMEOUT_MS": (_positive_int, "list query time limit, ms"),
    "RUNSTILE_MAX_BODY_BYTES": (_positive_int, "request body cap, bytes"),
    "RUNSTILE_MAX_ACTIVE_RUNS": (_positive_int, "non-terminal runs per profile"),
    "RUNSTILE_MAX_RUNNING_PER_PROFILE": (_positive_int, "running runs per profile"),
    "RUNSTILE_DEFAULT_TASK": (_optional_text, "task used when none is named"),
    "RUNSTILE_RETRY_AFTER_S": (_positive_int, "Retry-After on 503/429, s"),
    "RUNSTILE_RUN_RETENTION_S": (_non_negative_float, "terminal run retention, s"),
    "RUNSTILE_KEY_TOMBSTONE_S": (_non_negative_float, "tombstone retention, s"),
    "RUNSTILE_NODE_ID": (_node_id, "node identity"),
    "RUNSTILE_LEASE_S": (_positive_float, "lease length, s"),
    "RUNSTILE_HEARTBEAT_S": (_positive_float, "heartbeat period, s"),
    "RUNSTILE_RECOVERY_INTERVAL_S": (_positive_float, "recovery period, s"),
    "RUNSTILE_RECOVERY_BUDGET": (_non_negative_int, "recoveries per run"),
    "RUNSTILE_DRAIN_TIMEOUT_S": (_non_negative_float, "drain wait, s"),
    "RUNSTILE_STOP_GRACE_S": (_non_negative_float, "stop grace, s"),
    "RUNSTILE_MAX_RESULT_BYTES": (_positive_int, "result cap, bytes"),
    "RUNSTILE_MAX_STREAMS": (_positive_int, "event streams per web process"),
    "RUNSTILE_MAX_STREAMS_PER_KEY": (_positive_int, "event streams per API key and process"),
    "RUNSTILE_STREAM_MAX_S": (_positive_float, "event stream lifetime, s"),
    "RUNSTILE_STREAM_KEEPALIVE_S": (_positive_float, "keepalive period, s"),
    "RUNSTILE_DELIVERY_BACKOFF_S": (_positive_float, "first delivery retry delay, s"),
    "RUNSTILE_DELIVERY_BACKOFF_MAX_S": (_positive_float, "longest delivery retry delay, s"),
    "RUNSTILE_DELIVERY_MAX_ATTEMPTS": (_positive_int, "delivery attempts before parking"),
    "RUNSTILE_DELIVERY_CONNECT_TIMEOUT_S": (_positive_float, "delivery connect timeout, s"),
    "RUNSTILE_DELIVERY_READ_TIMEOUT_S": (_positive_float, "delivery answer timeout, s"),
    "RUNSTILE_WEBHOOK_ROTATION_GRACE_S": (_non_negative_float,
                                          "old secret keeps signing, s"),
    "RUNSTILE_CALLBACK_ALLOWLIST": (_allowlist, "hosts/CIDRs exempt from the SSRF guard"),
    "RUNSTILE_HOST": (_text, "listen address"),
    "RUNSTILE_PORT": (_port, "listen port"),
    "RUNSTILE_WEB_WORKERS": (_positive_int, "web processes"),
    "RUNSTILE_WEB_THREADS": (_positive_int, "threads per web process"),
    "RUNSTILE_REQUEST_READ_TIMEOUT_S": (_positive_float, "time for a request to arrive, s"),
    "RUNSTILE_ADMISSION_WRITER": (_admission_writer, "who commits admissions"),
    "RUNSTILE_WORKERS": (_positive_int, "worker processes"),
    "RUNSTILE_THREADS": (_positive_int, "threads per worker process"),
    "RUNSTILE_CRASHPOINT": (_crashpoint, "test crash point"),
}
