"""The parsers of runstile's settings: one function per kind of value, each turning the
text of an environment variable or a flag into its value or raising ValueError with the
reason (config.py names the variable).  Pure: nothing here reads the environment."""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from pathlib import Path

from . import queues
from .errors import ConfigError

#: The synchronous levels SQLite accepts; FULL is the durable default (docs/guarantees.md, "1. Durable admission").
SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")
#: Crash points that code names, for crash tests that SIGKILL a process at a named point
#: (docs/configuration.md, RUNSTILE_CRASHPOINT); see crashpoints.py.
CRASHPOINTS = ("after_admit_commit", "after_claim", "after_step_start", "after_body",
               "after_finish", "mid_recovery", "after_delivery_send", "writer_after_commit")


def positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be a whole number of at least 1")
    return value


def non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be a whole number of at least 0")
    return value


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a number greater than 0")
    return value


def non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number of at least 0")
    return value


#: Longest admission linger: beyond a few milliseconds it only adds latency.
MAX_LINGER_MS = 20.0


def linger_ms(raw: str) -> float:
    value = non_negative_float(raw)
    if value > MAX_LINGER_MS:
        raise ValueError(f"must be at most {MAX_LINGER_MS:g} (milliseconds)")
    return value


def synchronous(raw: str) -> str:
    value = raw.strip().upper()
    if value not in SYNCHRONOUS_LEVELS:
        raise ValueError(f"must be one of {', '.join(SYNCHRONOUS_LEVELS)}")
    return value


#: Who commits the admissions of ``serve``'s web processes (web/writer/).
ADMISSION_WRITERS = ("process", "inline")


def admission_writer(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ADMISSION_WRITERS:
        raise ValueError(f"must be one of {', '.join(ADMISSION_WRITERS)}")
    return value


def broker_url(raw: str) -> str:
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


def tasks(raw: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not names:
        raise ValueError("must name at least one module")
    return names


def queue_name(name: str) -> str:
    try:
        return queues.check_name(name, "queue")
    except ConfigError as exc:
        raise ValueError(exc.message) from None


def queue_list(raw: str) -> tuple[str, ...]:
    """``a,b``: the queues a node consumes (RUNSTILE_QUEUES, ``--queues``); empty: all.
    Whether a task uses each is checked where the registry is loaded (workers/pools.py)."""
    return tuple(dict.fromkeys(queue_name(part.strip()) for part in raw.split(",")
                               if part.strip()))


#: Most threads ``--queue-threads`` may give one queue (as ``--threads``).
MAX_QUEUE_THREADS = 256


def queue_threads(raw: str) -> tuple[tuple[str, int], ...]:
    """``email=2,reports=1``: queues with a thread pool of their own, in each worker
    process (RUNSTILE_QUEUE_THREADS, ``--queue-threads``).  A queue named twice, a part
    without ``=`` or a count outside 1-256 is refused with ValueError."""
    pairs: dict[str, int] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        name, eq, count = (x.strip() for x in part.partition("="))
        if not eq or not name or not count.isdigit() \
                or not 1 <= int(count) <= MAX_QUEUE_THREADS:
            raise ValueError(f"{part!r} is not QUEUE=THREADS with THREADS a whole number "
                             f"from 1 to {MAX_QUEUE_THREADS} (e.g. email=2)")
        if name in pairs:
            raise ValueError(f"queue {name!r} is given threads twice")
        pairs[queue_name(name)] = int(count)
    return tuple(pairs.items())


def optional_text(raw: str) -> str | None:
    return raw.strip() or None


def text(raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ValueError("must not be empty")
    return value


def path(raw: str) -> Path:
    return Path(text(raw))


def allowlist(raw: str) -> tuple[str, ...]:
    entries = tuple(part.strip() for part in raw.split(",") if part.strip())
    for entry in entries:
        if "/" in entry:
            ipaddress.ip_network(entry, strict=False)  # raises ValueError on nonsense
    return entries


#: How every process of runstile writes its log lines (runstile/logs.py).
LOG_FORMATS = ("text", "json")


def log_format(raw: str) -> str:
    value = raw.strip().lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"must be one of {', '.join(LOG_FORMATS)}")
    return value


def crashpoint(raw: str) -> str | None:
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


def node_id(raw: str) -> str:
    value = raw.strip()
    if not value or len(value) > 128 or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError("must be 1-128 characters of letters, digits, '-', '_' or '.'")
    return value


def default_node_id() -> str:
    host = socket.gethostname() or "node"
    return "".join(c if (c.isalnum() or c in "-_.") else "-" for c in host)[:128]


def port(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= 65535:
        raise ValueError("must be a port number from 1 to 65535")
    return value
