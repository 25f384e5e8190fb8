"""Settings: read once from the environment (or flags), validated, then passed down.

Nothing below this module reads ``os.environ``; every part of runstile receives a
:class:`Settings` explicitly: settings flow in, nothing below reads the environment
(docs/configuration.md).  Every variable is
documented with its default and unit in ``docs/configuration.md``; a test keeps the
two in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import config_values as values_of
from . import processes
from .errors import ConfigError, redact_url

#: Variables whose value may hold a password: shown redacted in every error.
SECRET_VARIABLES = ("RUNSTILE_DATABASE_URL",)


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
    node_id: str = field(default_factory=values_of.default_node_id)
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
    #: Milliseconds the admission writer waits for more requests before committing a
    #: small batch (0: it commits whatever arrived at once).
    admission_linger_ms: float = 0.0
    #: Dramatiq worker processes.
    workers: int = 2
    #: Threads per Dramatiq worker process (the pool shared by the queues that have none
    #: of their own; deliveries have as many again).
    threads: int = 4
    #: Queues this node's workers consume; empty: every queue a registered task uses.
    queues: tuple[str, ...] = ()
    #: ``(queue, threads)``: queues with a thread pool of their own in each worker process.
    queue_threads: tuple[tuple[str, int], ...] = ()
    #: Named crash point at which the process SIGKILLs itself (tests only).
    crashpoint: str | None = None
    #: Bearer token ``GET /metrics`` requires; None: the route needs none.
    metrics_token: str | None = None
    #: "text" (one human line) or "json" (one object per line) for every log line.
    log_format: str = "text"

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


@contextlib.contextmanager
def metrics_shared_by_children() -> Iterator[str]:
    """The multiprocess folder of this process and every process it starts, for as long
    as the block runs, before any of them imports prometheus_client, so that /metrics adds
    up every process of the node (docs/operations.md, "Metrics").  The folder this process
    was started with (``runstile up`` makes one for its children, an operator may set
    PROMETHEUS_MULTIPROC_DIR) is used and kept as it is; otherwise a fresh one, removed at
    the end.  In the system's temporary directory, never beside the ledger:
    prometheus_client writes through mmap, and a full filesystem answers that with
    SIGBUS."""
    import shutil
    inherited = shared_metrics_folder()
    folder = inherited or new_metrics_folder()
    share_metrics_across_processes(folder)
    owner = os.getpid()
    try:
        yield folder
    finally:
        # Only by the process that made it: a child forked inside the block (gunicorn's
        # web processes leave by sys.exit) runs this too, while the others still use it.
        if not inherited and os.getpid() == owner:
            shutil.rmtree(folder, ignore_errors=True)


def pass_ledger_to_children(settings: Settings) -> None:
    """Hand a PostgreSQL ledger given by flag (--database-url) to every process this one
    starts, through the environment (RUNSTILE_DATABASE_URL): never through argv, which
    every user of the machine can read (ps) and which would show the URL's password."""
    if settings.database_url:
        os.environ["RUNSTILE_DATABASE_URL"] = settings.database_url


#: Prefix of the multiprocess folders ``up`` and ``serve`` make in the temporary directory.
METRICS_FOLDER_PREFIX = "runstile-metrics-"


def new_metrics_folder() -> str:
    """A fresh multiprocess folder, owned by this process (its pid in ``owner``), after
    removing the folders of owners that are gone (a ``up`` or ``serve`` killed before it
    could remove its own).  A live owner's folder, or one whose owner cannot be told,
    is left alone."""
    import shutil
    import tempfile
    base = Path(tempfile.gettempdir())
    for old in base.glob(METRICS_FOLDER_PREFIX + "*"):
        try:
            if old.stat().st_uid != os.getuid():
                continue
            pid = int((old / "owner").read_text())
        except (OSError, ValueError):
            continue  # no owner file (an older runstile), unreadable, or not ours to end
        if processes.exited(pid):
            shutil.rmtree(old, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=METRICS_FOLDER_PREFIX)
    (Path(folder) / "owner").write_text(str(os.getpid()))
    return folder


def shared_metrics_folder() -> str | None:
    """The multiprocess folder this process was started with (``runstile up`` sets it
    for its children; an operator may set it for ``serve`` and ``worker``), or None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def environment_for_children(settings: Settings) -> dict[str, str]:
    """This process's environment with the ledger's URL as RUNSTILE_DATABASE_URL: how a
    URL given as --database-url reaches the processes runstile starts, as a command line
    (``ps``, /proc/PID/cmdline) is readable by every local user and must not carry its
    password."""
    env = dict(os.environ)
    if settings.database_url:
        env["RUNSTILE_DATABASE_URL"] = settings.database_url
    return env


#: Every environment variable runstile reads: name -> (parser, one-line meaning).
ENV_VARIABLES: dict[str, tuple[Callable[[str], Any], str]] = {
    "RUNSTILE_DATA_DIR": (values_of.path, "data directory"),
    "RUNSTILE_TASKS": (values_of.tasks, "task modules, comma-separated"),
    "RUNSTILE_BROKER_URL": (values_of.broker_url, "broker"),
    "RUNSTILE_DATABASE_URL": (values_of.database_url, "PostgreSQL ledger"),
    "RUNSTILE_SYNCHRONOUS": (values_of.synchronous, "SQLite synchronous level"),
    "RUNSTILE_BUSY_TIMEOUT_MS": (values_of.positive_int, "ledger lock wait, ms"),
    "RUNSTILE_LIST_QUERY_TIMEOUT_MS": (values_of.positive_int, "list query time limit, ms"),
    "RUNSTILE_MAX_BODY_BYTES": (values_of.positive_int, "request body cap, bytes"),
    "RUNSTILE_MAX_ACTIVE_RUNS": (values_of.positive_int, "non-terminal runs per profile"),
    "RUNSTILE_MAX_RUNNING_PER_PROFILE": (values_of.positive_int, "running runs per profile"),
    "RUNSTILE_DEFAULT_TASK": (values_of.optional_text, "task used when none is named"),
    "RUNSTILE_RETRY_AFTER_S": (values_of.positive_int, "Retry-After on 503/429, s"),
    "RUNSTILE_RUN_RETENTION_S": (values_of.non_negative_float, "terminal run retention, s"),
    "RUNSTILE_KEY_TOMBSTONE_S": (values_of.non_negative_float, "tombstone retention, s"),
    "RUNSTILE_NODE_ID": (values_of.node_id, "node identity"),
    "RUNSTILE_LEASE_S": (values_of.positive_float, "lease length, s"),
    "RUNSTILE_HEARTBEAT_S": (values_of.positive_float, "heartbeat period, s"),
    "RUNSTILE_RECOVERY_INTERVAL_S": (values_of.positive_float, "recovery period, s"),
    "RUNSTILE_RECOVERY_BUDGET": (values_of.non_negative_int, "recoveries per run"),
    "RUNSTILE_DRAIN_TIMEOUT_S": (values_of.non_negative_float, "drain wait, s"),
    "RUNSTILE_STOP_GRACE_S": (values_of.non_negative_float, "stop grace, s"),
    "RUNSTILE_MAX_RESULT_BYTES": (values_of.positive_int, "result cap, bytes"),
    "RUNSTILE_MAX_STREAMS": (values_of.positive_int, "event streams per web process"),
    "RUNSTILE_MAX_STREAMS_PER_KEY": (values_of.positive_int,
                                     "event streams per API key and process"),
    "RUNSTILE_STREAM_MAX_S": (values_of.positive_float, "event stream lifetime, s"),
    "RUNSTILE_STREAM_KEEPALIVE_S": (values_of.positive_float, "keepalive period, s"),
    "RUNSTILE_DELIVERY_BACKOFF_S": (values_of.positive_float, "first delivery retry delay, s"),
    "RUNSTILE_DELIVERY_BACKOFF_MAX_S": (values_of.positive_float,
                                        "longest delivery retry delay, s"),
    "RUNSTILE_DELIVERY_MAX_ATTEMPTS": (values_of.positive_int, "delivery attempts before parking"),
    "RUNSTILE_DELIVERY_CONNECT_TIMEOUT_S": (values_of.positive_float,
                                            "delivery connect timeout, s"),
    "RUNSTILE_DELIVERY_READ_TIMEOUT_S": (values_of.positive_float, "delivery answer timeout, s"),
    "RUNSTILE_WEBHOOK_ROTATION_GRACE_S": (values_of.non_negative_float,
                                          "old secret keeps signing, s"),
    "RUNSTILE_CALLBACK_ALLOWLIST": (values_of.allowlist, "hosts/CIDRs exempt from the SSRF guard"),
    "RUNSTILE_HOST": (values_of.text, "listen address"),
    "RUNSTILE_PORT": (values_of.port, "listen port"),
    "RUNSTILE_WEB_WORKERS": (values_of.positive_int, "web processes"),
    "RUNSTILE_WEB_THREADS": (values_of.positive_int, "threads per web process"),
    "RUNSTILE_REQUEST_READ_TIMEOUT_S": (values_of.positive_float,
                                        "time for a request to arrive, s"),
    "RUNSTILE_ADMISSION_WRITER": (values_of.admission_writer, "who commits admissions"),
    "RUNSTILE_ADMISSION_LINGER_MS": (values_of.linger_ms, "admission writer's wait for more, ms"),
    "RUNSTILE_WORKERS": (values_of.positive_int, "worker processes"),
    "RUNSTILE_THREADS": (values_of.positive_int, "threads per worker process"),
    "RUNSTILE_QUEUES": (values_of.queue_list, "queues this node consumes, comma-separated"),
    "RUNSTILE_QUEUE_THREADS": (values_of.queue_threads,
                               "queues with their own threads, QUEUE=N,..."),
    "RUNSTILE_CRASHPOINT": (values_of.crashpoint, "test crash point"),
    "RUNSTILE_METRICS_TOKEN": (values_of.optional_text, "bearer token for /metrics"),
    "RUNSTILE_LOG_FORMAT": (values_of.log_format, "log line format"),
}
