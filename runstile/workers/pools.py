"""Which queues a worker process consumes, and with which threads (docs/architecture.md,
"Queues and thread pools").

Dramatiq's Worker feeds one set of threads from every queue it consumes: a queue whose
runs sleep would take every thread, and the other queues' messages would wait behind it.
So a worker process runs one Dramatiq Worker per *pool*: the queues ``--queue-threads``
names each get a Worker of their own with that many threads; every other consumed queue
shares one Worker of ``--threads`` threads; and delivery attempts have a Worker of their
own (``--threads`` threads), so that no user queue, however slow, holds a webhook back.
A Worker consumes only its own broker queues (and their delay queues): a message is
never taken by a pool it was not meant for.

:func:`plan` checks what the node was asked to consume against the task registry and
refuses with ConfigError (exit 2 from ``up`` and ``worker``, before any process starts).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import dramatiq

from ..config import Settings
from ..errors import ConfigError
from ..queues import DELIVERY_QUEUE, broker_queue


@dataclass(frozen=True)
class Pool:
    """One Dramatiq Worker of a worker process: its name (for logs), the queues it
    consumes (runstile's names; deliveries' pool has none) and its threads."""

    name: str
    queues: tuple[str, ...]
    threads: int

    @property
    def broker_queues(self) -> set[str]:
        return {broker_queue(q) for q in self.queues} if self.queues else {DELIVERY_QUEUE}


def consumed(settings: Settings, registered: Sequence[str]) -> tuple[str, ...]:
    """The queues this node consumes: ``--queues``, each one that a registered task uses
    (or the default queue); every registered queue when ``--queues`` is empty."""
    if not settings.queues:
        return tuple(registered)
    unknown = [q for q in settings.queues if q not in registered]
    if unknown:
        raise ConfigError(f"--queues names {_names(unknown)}, which no registered task "
                          f"uses; the registered queues are {', '.join(registered)}")
    return settings.queues


def plan(settings: Settings, registered: Sequence[str]) -> list[Pool]:
    """The pools of each worker process of this node, or ConfigError when ``--queues`` or
    ``--queue-threads`` names a queue the node cannot consume."""
    queues = consumed(settings, registered)
    own = dict(settings.queue_threads)
    strays = [q for q in own if q not in queues]
    if strays:
        raise ConfigError(f"--queue-threads names {_names(strays)}, which this node does "
                          f"not consume; it consumes {', '.join(queues)}")
    pools = [Pool(q, (q,), n) for q, n in own.items()]
    shared = tuple(q for q in queues if q not in own)
    if shared:
        pools.insert(0, Pool("shared", shared, settings.threads))
    return [*pools, Pool("deliveries", (), settings.threads)]


def _names(queues: Sequence[str]) -> str:
    return ", ".join(repr(q) for q in queues)


def describe(pools: Sequence[Pool]) -> str:
    """``shared[default,reports] x4, email x2, deliveries x4`` (for logs)."""
    return ", ".join(f"{p.name}[{','.join(p.queues)}] x{p.threads}" if p.name == "shared"
                     else f"{p.name} x{p.threads}" for p in pools)


class _SameMiddlewareTwice(logging.Filter):
    """Each Dramatiq Worker adds its own consumer-spawning middleware to the broker, and
    the broker warns at the second of one type; for several Workers that is the design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "middleware of the same type twice" not in record.getMessage()


def start(broker: dramatiq.Broker, pools: Sequence[Pool], *,
          worker_timeout_ms: int) -> list[dramatiq.Worker]:
    """Declare every pool's broker queues, then start one Dramatiq Worker per pool, each
    consuming only its own (Dramatiq's ``queues=`` keeps its delay queues too)."""
    for pool in pools:
        for name in sorted(pool.broker_queues):
            broker.declare_queue(name)
    broker.logger.addFilter(_SameMiddlewareTwice())
    workers = []
    for pool in pools:
        worker = dramatiq.Worker(broker, queues=pool.broker_queues,
                                 worker_threads=pool.threads,
                                 worker_timeout=worker_timeout_ms)
        worker.start()
        workers.append(worker)
    return workers
