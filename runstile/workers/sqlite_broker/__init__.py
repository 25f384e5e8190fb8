"""The embedded Dramatiq broker: messages live in the ledger (RUNSTILE_BROKER_URL=sqlite),
its SQLite file or its PostgreSQL database alike (the package keeps SQLite's name).

Why a broker in the ledger: admission can then insert a run's message in the run's own
write transaction (:func:`enqueue_in`), so a ``202`` never exists without
its message and no message exists without its run (docs/guarantees.md, "1. Durable
admission").  No SQL here; the rows and their life are described in
``ledger/broker_queue.py`` and ``ledger/schema.sql``.

It follows Dramatiq's broker contract (checked against Dramatiq 2.2's Redis and stub
brokers and ``worker.py``) in three parts, each module saying which part of the contract
it keeps:

* :mod:`.broker` -- :class:`SQLiteBroker`: queues and delay queues, ``enqueue`` (and
  :func:`enqueue_in`, inside a caller's transaction), ``consume``, ``join``, ``flush``,
  dead letters; what a ``fork()`` leaves to the child.
* :mod:`.consumer` -- the consumer a worker's consumer thread iterates: ``__next__``
  returns ``None`` after its timeout, ``ack``/``nack`` come from worker threads, the
  prefetch window, giving rows back on close; :func:`current_delivery`, the message a
  worker thread is running, whose row a run's claim acks in its own transaction.
* :mod:`.watcher` -- one thread per broker and process: heartbeats its consumers (a claim
  lasts as long as its consumer lives), releases the rows of dead consumers in any
  process, and wakes idle consumers when another connection commits; :mod:`.wakeup`
  is how it learns of a commit on each engine (the WAL on SQLite, LISTEN on PostgreSQL).

Delivery is at least once: a consumer that dies, closes or is restarted by Dramatiq gives
its claimed rows back, and a delayed message is re-enqueued before its delay-queue row is
acked.  runstile's guarded claim makes every duplicate harmless (docs/guarantees.md,
"3. At-most-once execution").

``workers/broker.py`` builds the broker from ``RUNSTILE_BROKER_URL``; ``dispatch`` needs no
broker: it inserts a run's message with ``ledger/broker_queue.py`` in the run's transaction.
"""

from .broker import (
                     DEFAULT_CONSUMER_TIMEOUT_S,
                     DEFAULT_FALLBACK_POLL_S,
                     DEFAULT_POLL_INTERVAL_S,
                     MAX_HEARTBEAT_INTERVAL_S,
                     UNDECODABLE_ACTOR,
                     SQLiteBroker,
                     default_middleware,
                     delayed,
                     enqueue_in,
)
from .consumer import current_delivery

__all__ = ["DEFAULT_CONSUMER_TIMEOUT_S", "DEFAULT_FALLBACK_POLL_S", "DEFAULT_POLL_INTERVAL_S", "MAX_HEARTBEAT_INTERVAL_S",
           "UNDECODABLE_ACTOR", "SQLiteBroker", "current_delivery", "default_middleware", "delayed", "enqueue_in"]
