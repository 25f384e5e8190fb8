"""Handing runs to workers: the Dramatiq message for a run, by actor name
(docs/architecture.md, "Packages").

The web tier and recovery publish through here and never import ``workers.actors``
(decorating an actor binds it to a broker).  On the embedded broker the message row is
written inside the caller's transaction (the admission's own), so a committed run
always has its message and a rolled-back one never does.

With Redis or RabbitMQ (docs/architecture.md, "Redis and RabbitMQ") a message cannot
join an SQLite transaction.  The transaction writes an unsent dispatch record instead;
after the commit the caller publishes it here and marks it sent (one guarded UPDATE).  A
publish that fails never fails the caller: the record stays unsent and recovery
publishes it later (docs/operations.md, "Recovery", step 4), as it re-publishes runs
left queued long after their dispatch (a broker restarted empty loses messages).
Duplicates are harmless: the claim lets one execution through.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import dramatiq

from .config import Settings
from .errors import RunstileError
from .ledger import broker_queue, db, dispatches, obligations, owed
from .ledger.owed import Owed
from .ledger.runs import Enqueue, eta_ms, publish_wait, wait_of
from .queues import DEFAULT_QUEUE, DELIVERY_QUEUE, queue_of
from .queues import broker_queue as broker_queue_of

log = logging.getLogger("runstile.dispatch")

#: The broker queue of the default queue (runstile/queues.py names the others), the
#: actor that executes runs, and the actor that makes one delivery attempt of an
#: obligation (docs/architecture.md, "Deliveries"; workers/delivery.py).
QUEUE = broker_queue_of(DEFAULT_QUEUE)
ACTOR = "runstile_execute"
DELIVER_ACTOR = "runstile_deliver"


def message_for(run_id: str, dispatch_id: int | None = None,
                priority: int = broker_queue.DEFAULT_PRIORITY,
                queue: str = DEFAULT_QUEUE) -> dramatiq.Message:
    """A run's message, on its queue's broker queue (a queue other than the default is
    named in it too, for a claim retried later); ``broker_priority`` is the run's, which
    RabbitMQ orders by and the embedded broker stores in its row; Redis ignores it
    (docs/architecture.md, "The embedded broker")."""
    kwargs: dict[str, Any] = {"dispatch_id": dispatch_id}
    if queue != DEFAULT_QUEUE:
        kwargs["queue"] = queue
    return dramatiq.Message(queue_name=broker_queue_of(queue), actor_name=ACTOR,
                            args=(run_id,), kwargs=kwargs,
                            options={"broker_priority": priority})


def priority_of(run: dict[str, Any]) -> int:
    """A run row's priority (the default for a row read before migration 8 applied)."""
    return int(run.get("priority", broker_queue.DEFAULT_PRIORITY))


def delivery_message(obligation_id: str) -> dramatiq.Message:
    return dramatiq.Message(queue_name=DELIVERY_QUEUE, actor_name=DELIVER_ACTOR,
                            args=(obligation_id,), kwargs={}, options={})


class _EmbeddedEnqueue:
    """The embedded broker's enqueue: the message row joins the transaction.  A run with a
    not_before ahead gets a delayed message, due then, whatever ``delay_s`` says."""

    in_transaction = True

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def __call__(self, conn: sqlite3.Connection, run: dict[str, Any], dispatch_id: int) -> None:
        queue_name, message_id, body, eta, run_id, priority = self.message(run, dispatch_id)
        broker_queue.insert_message(conn, queue_name, message_id, body, eta=eta, run_id=run_id,
                                    priority=priority)

    def message(self, run: dict[str, Any], dispatch_id: int) -> broker_queue.NewMessage:
        priority = priority_of(run)
        message = message_for(run["id"], dispatch_id, priority, queue_of(run))
        if self.delay_s <= 0 and wait_of(run) <= 0:
            return (message.queue_name, message.message_id, message.encode(), None,
                    run["id"], priority)
        # Dramatiq's convention: a delayed message waits on ``<queue>.DQ`` with an eta.
        eta = eta_ms(run, self.delay_s)
        delayed = message.copy(queue_name=f"{message.queue_name}.DQ",
                               options={"eta": eta, "broker_priority": priority})
        return (delayed.queue_name, delayed.message_id, delayed.encode(), eta / 1000,
                run["id"], priority)


class _PublishAfterCommit:
    """Redis and RabbitMQ: a message cannot join an SQLite transaction, so the commit owes
    the publish of the record (ledger/owed.py) and :meth:`Dispatcher.after_commit` pays:
    delayed until the run's not_before, if that is further than ``delay_s``."""

    in_transaction = False

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def __call__(self, conn: sqlite3.Connection, run: dict[str, Any], dispatch_id: int) -> None:
        owed.owe_publish(conn, dispatch_id, run["id"], max(self.delay_s, publish_wait(run)),
                       priority_of(run), queue_of(run))

    def message(self, run: dict[str, Any], dispatch_id: int) -> None:
        return None


# ------------------------------------------------------------ Redis and RabbitMQ

#: Seconds a publishing connection may take to connect or to answer; bounds how long an
#: unreachable broker can hold a request thread.
PUBLISH_TIMEOUT_S = 5.0
#: Seconds a process leaves its broker alone after a failed publish: while the broker is
#: down, admissions answer at once and their records wait, unsent, for recovery.
PUBLISH_PAUSE_S = 2.0
#: Unsent records one :func:`publish_pending` call publishes at most.
PENDING_BATCH = 200


def external_broker(url: str, *, middleware: list, publishing: bool = False) -> dramatiq.Broker:
    """Dramatiq's Redis or RabbitMQ broker for ``url`` (workers consume through it too).

    ``publishing``: for a process that only publishes — bounded socket timeouts, and
    RabbitMQ publisher confirms, so that "sent" means the broker took the message.
    """
    if url.startswith(("redis://", "rediss://")):
        from dramatiq.brokers.redis import RedisBroker
        if not publishing:
            return RedisBroker(url=url, middleware=middleware)
        import redis
        client = redis.Redis.from_url(url, socket_connect_timeout=PUBLISH_TIMEOUT_S,
                                      socket_timeout=PUBLISH_TIMEOUT_S)
        return RedisBroker(client=client, middleware=middleware)
    from .rabbitmq import PriorityRabbitmqBroker
    # x-max-priority on the queue and its delay queue: a run's priority is its message's
    # (docs/operations.md, "RabbitMQ and run priority").
    broker = PriorityRabbitmqBroker(url=url, middleware=middleware,
                                    confirm_delivery=publishing,
                                    max_priority=broker_queue.MAX_PRIORITY)
    if publishing:
        parameters = broker.parameters
        for params in parameters if isinstance(parameters, list) else [parameters]:
            params.connection_attempts = 1
            params.socket_timeout = PUBLISH_TIMEOUT_S
            params.stack_timeout = PUBLISH_TIMEOUT_S
            # A broker under a resource alarm blocks publishers; never wait forever.
            params.blocked_connection_timeout = PUBLISH_TIMEOUT_S
    return broker


class Publisher:
    """Publishes runs' messages to Redis/RabbitMQ; one per process (:func:`publisher_for`).

    The Dramatiq broker is created on first use in the process that uses it (its
    connections never cross a fork) and has no middleware: publishing needs none.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._broker: dramatiq.Broker | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._paused_until = 0.0

    @property
    def broker(self) -> dramatiq.Broker:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._broker = external_broker(self.settings.broker_url, middleware=[],
                                                   publishing=True)
                    self._pid = os.getpid()
        assert self._broker is not None  # made just above, in this process
        return self._broker

    def send(self, run_id: str, dispatch_id: int, *, delay_s: float = 0.0,
             priority: int = broker_queue.DEFAULT_PRIORITY,
             queue: str = DEFAULT_QUEUE) -> bool:
        """Publish one run's message; True if the broker took it.  Never raises."""
        return self.enqueue(message_for(run_id, dispatch_id, priority, queue),
                            delay_s=delay_s, what=f"run {run_id}: dispatch {dispatch_id}")

    def enqueue(self, message: dramatiq.Message, *, delay_s: float = 0.0,
                what: str = "") -> bool:
        """Publish any message; True if the broker took it.  Never raises."""
        if time.monotonic() < self._paused_until:
            return False
        delay_ms = int(delay_s * 1000)
        try:
            self.broker.enqueue(message, delay=delay_ms or None)
        except Exception as exc:  # noqa: BLE001 - reported; recovery publishes it later
            # Any broker or network failure: the record stays unsent.
            self._paused_until = time.monotonic() + PUBLISH_PAUSE_S
            log.warning("%s: publishing failed (%s: %s); it stays unsent until recovery "
                        "publishes it", what or message.message_id, type(exc).__name__, exc)
            return False
        return True


_publishers: dict[str, Publisher] = {}
_publishers_guard = threading.Lock()


def publisher_for(settings: Settings) -> Publisher | None:
    """This process's publisher for the configured broker; None for the embedded one."""
    if settings.broker_url == "sqlite":
        return None
    with _publishers_guard:
        publisher = _publishers.get(settings.broker_url)
        if publisher is None:
            publisher = _publishers[settings.broker_url] = Publisher(settings)
        return publisher


def publish(settings: Settings, conn: sqlite3.Connection | None, run_id: str,
            dispatch_id: int, *, delay_s: float = 0.0,
            priority: int = broker_queue.DEFAULT_PRIORITY, queue: str = DEFAULT_QUEUE,
            mark: Callable[[Callable[[sqlite3.Connection], Any]], Any] | None = None) -> bool:
    """After the commit that wrote dispatch record ``dispatch_id``: publish it, then mark
    it sent.  True if the broker took the message.  Never raises: an admission or a
    re-queue stands whatever happens here (an unsent or unmarked record is published
    again by recovery, and the duplicate is harmless).

    ``mark`` runs the marking unit instead of ``conn`` (the web passes its group
    committer, so the marks share the admissions' transactions).  ``priority`` and
    ``queue``: the run's.
    """
    publisher = publisher_for(settings)
    if publisher is None or not publisher.send(run_id, dispatch_id, delay_s=delay_s,
                                               priority=priority, queue=queue):
        return False
    def work(c: sqlite3.Connection) -> bool:
        return dispatches.mark_sent(c, dispatch_id, live_in_s=delay_s)

    try:
        if mark is not None:
            mark(work)
        else:
            assert conn is not None  # without ``mark``, the caller passes its connection
            work(conn)
    except RunstileError as exc:
        log.warning("run %s: dispatch %s was published but could not be marked sent (%s); "
                    "recovery will publish it again", run_id, dispatch_id, exc.message)
    return True


def publish_pending(settings: Settings, conn: sqlite3.Connection, *,
                    limit: int = PENDING_BATCH, older_than_s: float = 0.0,
                    created_since: float | None = None,
                    run_ids: Sequence[str] | None = None) -> int:
    """Publish up to ``limit`` unsent dispatch records of queued runs (filters as in
    ``ledger.dispatches.unsent``), oldest first; returns how many the broker took.
    Recovery's sweep (the records no commit's settlement published: a process died, or
    the broker was down).  Stops at the first failed publish.  Never raises."""
    if publisher_for(settings) is None:
        return 0
    try:
        pending = dispatches.unsent(conn, limit=limit, older_than_s=older_than_s,
                                    created_since=created_since, run_ids=run_ids)
    except RunstileError as exc:
        log.warning("could not read unsent dispatch records (%s); recovery retries",
                    exc.message)
        return 0
    published = 0
    for dispatch_id, run_id, not_before, priority, queue in pending:
        wait = publish_wait({"not_before": not_before})
        if not publish(settings, conn, run_id, dispatch_id, delay_s=wait,
                       priority=priority, queue=queue):
            break
        published += 1
    return published


# ------------------------------------------------------------ delivery obligations

def send_deliveries(settings: Settings, conn: sqlite3.Connection, *,
                    run_ids: Sequence[str] | None = None, stale_s: float | None = None,
                    grace_s: float = 0.0, limit: int = PENDING_BATCH) -> int:
    """Send a deliverer message for each pending, due obligation that has none (of these
    runs, or all; with ``stale_s`` also those whose message is that long overdue; with
    ``grace_s`` only those due at least that long), and mark them sent.  Called after the
    commits that create obligations (:meth:`Dispatcher.after_commit`) and by recovery's
    sweep (docs/operations.md, "Recovery", step 2).  Never raises: anything not sent here
    is found by the next sweep; a duplicate message loses the claim and does nothing."""
    def pending() -> list[str]:
        return obligations.unsent(conn, run_ids=run_ids, stale_s=stale_s, grace_s=grace_s,
                                  limit=limit)

    try:
        # A read first, without the write lock: most commits that may owe a delivery
        # (a run without a callback_url ending) owe none.
        if not pending():
            return 0
        if settings.broker_url == "sqlite":
            return _send_embedded(conn, pending)
        publisher = publisher_for(settings)
        assert publisher is not None  # not the embedded broker
        sent = []
        for obligation_id in pending():
            if not publisher.enqueue(delivery_message(obligation_id),
                                     what=f"delivery {obligation_id}"):
                break
            sent.append(obligation_id)
        obligations.mark_sent(conn, sent)
        return len(sent)
    except RunstileError as exc:
        log.warning("could not send delivery messages (%s); recovery sends them", exc.message)
        return 0


def _send_embedded(conn: sqlite3.Connection, pending: Callable[[], list[str]]) -> int:
    """The messages and their marks commit together (``pending`` read again under the
    lock: another process may have sent them since)."""
    with db.transaction(conn):
        ids = pending()
        for message in map(delivery_message, ids):
            broker_queue.insert_message(conn, message.queue_name, message.message_id,
                                        message.encode())
        obligations.mark_sent(conn, ids)
    return len(ids)


def send_delivery_later(settings: Settings, conn: sqlite3.Connection, obligation_id: str,
                        delay_s: float) -> bool:
    """The message for an obligation's next attempt, due in ``delay_s`` seconds (its
    ``message_due_at`` is already set).  Never raises; recovery covers a lost one."""
    message = delivery_message(obligation_id)
    try:
        if settings.broker_url == "sqlite":
            eta_ms = int((time.time() + max(0.0, delay_s)) * 1000)
            delayed = message.copy(queue_name=f"{DELIVERY_QUEUE}.DQ", options={"eta": eta_ms})
            with db.transaction(conn):
                broker_queue.insert_message(conn, delayed.queue_name, delayed.message_id,
                                            delayed.encode(), eta=eta_ms / 1000)
            return True
        publisher = publisher_for(settings)
        assert publisher is not None  # not the embedded broker
        return publisher.enqueue(message, delay_s=delay_s, what=f"delivery {obligation_id}")
    except RunstileError as exc:
        log.warning("delivery %s: could not send its next attempt's message (%s); "
                    "recovery sends it", obligation_id, exc.message)
        return False


# ------------------------------------------------------------ what a commit owes

class Dispatcher:
    """How one process hands runs and deliveries on: built once per process, from its
    settings, and given to every ledger connection it opens (docs/architecture.md,
    "What a commit owes").

    ``enqueue`` is what transitions pass to the ledger; :meth:`after_commit` pays what
    their commits owe — the Redis/RabbitMQ publish of the dispatch records they wrote
    (a session's next run, a freed profile slot's waiter, a re-queue, a recovered run)
    and the deliverer messages of the obligations their events created.  So no caller
    remembers which of these its transition may have caused.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.embedded = settings.broker_url == "sqlite"
        #: For every transition that makes a run claimable now.
        self.enqueue = self.delayed(0.0)
        #: The embedded broker's enqueue, or None with Redis/RabbitMQ: for the writers
        #: that publish their records themselves after the commit — admission, which may
        #: commit in the admission writer (another process, settling no debts), and
        #: recovery, whose sweeps publish and count every unsent record.
        self.in_transaction: Enqueue | None = self.enqueue if self.embedded else None

    def delayed(self, delay_s: float) -> Enqueue:
        """The enqueue for a run that may start only ``delay_s`` from now (a retry)."""
        return _EmbeddedEnqueue(delay_s) if self.embedded else _PublishAfterCommit(delay_s)

    def pool(self) -> db.ConnectionPool:
        """This process's connections to the ledger, each settling its debts here."""
        return db.ConnectionPool(self.settings.ledger_target,
                                 synchronous=self.settings.synchronous,
                                 busy_timeout_ms=self.settings.busy_timeout_ms,
                                 after_commit=self.after_commit)

    def after_commit(self, conn: sqlite3.Connection, owed: Owed) -> None:
        """Pay what a commit owes, right after it (ledger/db.py calls this).  Never
        raises: an unpaid debt is a committed, unsent row, which recovery sends."""
        for dispatch_id, run_id, delay_s, priority, queue in owed.publish:
            if not publish(self.settings, conn, run_id, dispatch_id, delay_s=delay_s,
                           priority=priority, queue=queue):
                break  # the broker is unreachable: the rest waits for recovery too
        if owed.deliveries:
            send_deliveries(self.settings, conn, run_ids=list(dict.fromkeys(owed.deliveries)))
