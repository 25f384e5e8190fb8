"""Queue names and the broker queues they travel on (docs/tasks.md, "Queues";
docs/architecture.md, "Queues and thread pools").

A task's runs travel on its queue (``@runstile.task(..., queue="email")``, ``default``
when none is named).  A queue is a Dramatiq queue of the broker: the default queue is
``runstile``, the broker queue runs always travelled on (messages written before queues
existed keep flowing), and queue ``q`` is ``runstile.q``.  Delivery attempts travel on
``runstile_deliveries``, outside every user queue, so that a slow user queue never holds
a webhook back; no queue name maps onto it (a name has no dot and ``_deliveries`` is not
one).  Imported by the registry, the settings and ``dispatch`` alike: nothing here but
names.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

#: The queue of a task that names none.
DEFAULT_QUEUE = "default"
#: A queue name: a lowercase letter, then up to 63 lowercase letters, digits, ``_`` or
#: ``-``.  No dot: a broker queue whose name ends in ``.DQ`` or ``.XQ`` is one of
#: Dramatiq's delay or dead-letter queues.  No capitals: Redis keys and RabbitMQ queue
#: names are case-sensitive, so ``Email`` and ``email`` would be two queues that read as
#: one.
QUEUE_PATTERN = "[a-z][a-z0-9_-]{0,63}"
_QUEUE = re.compile(QUEUE_PATTERN)
#: The broker queue of the default queue, and the prefix of every other queue's.
BROKER_QUEUE = "runstile"
#: The broker queue of delivery attempts (workers/delivery.py), consumed by every
#: worker process in a thread pool of its own.
DELIVERY_QUEUE = "runstile_deliveries"


def check_name(queue: object, what: str) -> str:
    """``queue`` if it is a queue name; ConfigError naming ``what`` otherwise."""
    if not isinstance(queue, str) or not _QUEUE.fullmatch(queue):
        raise ConfigError(f"{what} {queue!r} is not a queue name: 1-64 characters, a "
                          f"lowercase letter first, then lowercase letters, digits, '_' "
                          f"or '-' ({QUEUE_PATTERN})")
    return queue


def broker_queue(queue: str) -> str:
    """The Dramatiq queue the runs of ``queue`` travel on."""
    return BROKER_QUEUE if queue == DEFAULT_QUEUE else f"{BROKER_QUEUE}.{queue}"


def queue_of(run: dict[str, Any]) -> str:
    """A run row's queue (the default for a row read before migration 9 applied)."""
    return run.get("queue") or DEFAULT_QUEUE
