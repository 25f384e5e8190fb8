"""The consumer a Dramatiq worker's consumer thread iterates, and the messages it hands out.

:meth:`SQLiteBroker.consume <.broker.SQLiteBroker.consume>` makes one per queue and
worker process; Dramatiq's ``worker.py`` calls ``__next__`` from its consumer thread and
``ack``/``nack``/``requeue`` from its worker threads.

The part of the Dramatiq contract kept here:

* ``__next__`` returns a message or ``None`` after its timeout (the worker needs ``None``
  to handle delays and shutdown).  It sleeps on the :class:`.watcher.Watcher`, which
  wakes it when another connection commits; it then looks for ready rows with one cheap
  read before taking the write lock to claim.
* ``ack``/``nack`` come from worker threads while the consumer thread sits in
  ``__next__``: every thread uses its own connection (``db.ConnectionPool``), opened
  lazily and never carried across ``fork()``.
* A claim lasts as long as its consumer lives (the watcher heartbeats it); ``close``
  gives its rows back at once, and an ack or nack only touches a row this consumer still
  holds, so a late ack from a consumer that lost its rows changes nothing.
* A run's message is acked by the run's claim, in the claim's transaction
  (:func:`current_delivery`, ledger/execution.py ``claim``); the ack Dramatiq sends
  afterwards then only frees the prefetch slot.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

from dramatiq.broker import Consumer, MessageProxy
from dramatiq.common import dq_name
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.logging import get_logger
from dramatiq.message import Message
from dramatiq.middleware import CurrentMessage

from ...errors import RunstileError
from ...ledger import broker_queue

if TYPE_CHECKING:
    from .broker import SQLiteBroker


class SQLiteMessageProxy(MessageProxy):
    """A delivered message plus which row it came from and which consumer holds it."""

    def __init__(self, message: Message, delivery_id: int, consumer: SQLiteConsumer) -> None:
        super().__init__(message)
        self.delivery_id = delivery_id
        self.consumer_id = consumer.consumer_id
        self._owner = consumer
        #: Set once the row is gone from the ledger by a transaction of the actor's own
        #: (the run's claim acked it): Dramatiq's ack or nack then writes nothing.
        self.settled = False


def current_delivery() -> SQLiteMessageProxy | None:
    """The embedded broker's message the calling worker thread is processing; None on
    another broker, or outside an actor (the broker's CurrentMessage middleware)."""
    message = CurrentMessage.get_current_message()
    return message if isinstance(message, SQLiteMessageProxy) else None


class SQLiteConsumer(Consumer):
    """One consumer of one queue; created by :meth:`SQLiteBroker.consume`."""

    def __init__(self, broker: SQLiteBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.logger = get_logger(__name__, type(self))
        self.broker = broker
        self.queue_name = queue_name
        self.prefetch = max(1, int(prefetch))
        #: Rows a consumer that still holds some waits to have room for before it claims
        #: again: a freed slot then costs a claim transaction only every few runs.  Not on
        #: a delay queue, whose held rows wait for their eta and may hold half the window
        #: for long: a message due sooner must not wait behind them.
        self.refill = 1 if queue_name == dq_name(queue_name) else max(1, self.prefetch // 2)
        self.timeout_ms = int(timeout)
        self.consumer_id = uuid.uuid4().hex
        self.info = broker_queue.ConsumerInfo(
            self.consumer_id, queue_name, os.getpid(), socket.gethostname(),
            broker.consumer_timeout_s)
        self._cache: collections.deque = collections.deque()
        #: Delivery ids claimed and not yet acked, nacked or requeued (the prefetch window).
        self._held: set[int] = set()
        #: The etas (Unix seconds) of the held delayed rows, by delivery id.
        self._etas: dict[int, float] = {}
        self._held_lock = threading.Lock()
        self._closed = False
        #: Set when there may be work for this consumer: a commit to its queue, a
        #: released row, a freed prefetch slot, a close (Watcher.poke).
        self.woken = threading.Event()
        self._watcher = broker.watcher()
        try:
            broker_queue.register_consumer(broker.pool.get(), self.info)
        except RunstileError as exc:
            broker.pool.discard()
            raise ConnectionClosed(exc) from exc
        self._watcher.add(self)

    def __next__(self) -> MessageProxy | None:
        """The next message, or None once ``timeout`` ms passed without one."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            if self._cache:
                return self._deliver(*self._cache.popleft())
            # Clear the event before looking: a commit that lands after the look sets
            # it again, so the wait below returns at once instead of missing that commit.
            self.woken.clear()
            try:
                if not self._closed:
                    self._fetch()
            except RunstileError as exc:
                self.broker.pool.discard()
                raise ConnectionClosed(exc) from exc
            if self._cache:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            due = self._next_eta()
            if due is not None and due < remaining:
                # Dramatiq's worker moves a held delayed message when __next__ returns:
                # returning None at its eta starts it then, not up to a timeout later.
                deadline = time.monotonic() + due
                remaining = due
            # Woken by a commit that left a message on this queue, a local ack or close.
            # With room to claim, this consumer needs the watcher awake (Watcher.need);
            # without, the slot that frees sets its event itself.
            with self._held_lock:
                room = self._room()
            if room > 0:
                self._watcher.need()
            self.woken.wait(remaining)

    def wants_wakeup(self) -> bool:
        """Whether a commit elsewhere could make this consumer claim now.  False while
        its event is already set (it looks again anyway) and while its prefetch window
        is too full to claim (the slot that frees sets its event): the watcher then
        skips it, and reads nothing when no consumer of its process wants a wake-up."""
        if self.woken.is_set() or self._closed:
            return False
        with self._held_lock:
            return self._room() > 0

    def _room(self) -> int:
        """Rows to claim at the next look (under _held_lock): the free part of the
        prefetch window, or 0 while it holds rows and has less than ``refill`` free."""
        room = self.prefetch - len(self._held)
        return room if room >= self.refill or not self._held else 0

    def _fetch(self) -> None:
        with self._held_lock:
            room = self._room()
        if room <= 0:
            return
        conn = self.broker.pool.get()
        # A read first: most wake-ups are other tables' commits, and an idle consumer
        # must not queue for the write lock on each of them.
        if not broker_queue.has_ready(conn, self.queue_name):
            return
        rows = broker_queue.claim(conn, self.queue_name, self.consumer_id, room)
        with self._held_lock:
            self._held.update(row["id"] for row in rows)
            self._etas.update((row["id"], row["eta"]) for row in rows if row["eta"] is not None)
        self._cache.extend((row["id"], bytes(row["body"])) for row in rows)

    def _deliver(self, delivery_id: int, body: bytes) -> MessageProxy | None:
        try:
            message = Message.decode(body)
        except DecodeError:
            # A row nobody can run: dead-letter it rather than hand the worker garbage.
            self.logger.error("Cannot decode delivery %d on queue %r; dead-lettering it.",
                              delivery_id, self.queue_name, exc_info=True)
            self._settle(delivery_id, broker_queue.dead_letter)
            return None
        return SQLiteMessageProxy(message, delivery_id, self)

    # -- called from worker threads ---------------------------------------------------
    # Dramatiq's worker hands back only proxies this broker's consumers made (the casts).

    def ack(self, message: MessageProxy) -> None:
        """Delete the message's row, only if its consumer still holds it."""
        message = cast(SQLiteMessageProxy, message)
        if message.settled:
            message._owner._forget([message.delivery_id])
            return
        if not message._owner._settle(message.delivery_id, broker_queue.ack):
            self.logger.warning(
                "Message %s (delivery %d) was no longer held by its consumer when acked; "
                "it may be delivered again.", message.message_id, message.delivery_id)

    def nack(self, message: MessageProxy) -> None:
        """Dead-letter the message's row, only if its consumer still holds it."""
        message = cast(SQLiteMessageProxy, message)
        if message.settled:
            # Acked by the run's claim: the run is the ledger's now, not a dead letter.
            message._owner._forget([message.delivery_id])
            return
        if not message._owner._settle(message.delivery_id, broker_queue.dead_letter):
            self.logger.warning(
                "Message %s (delivery %d) was no longer held by its consumer when nacked.",
                message.message_id, message.delivery_id)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Put unprocessed (prefetched or delayed) messages back to ready."""
        by_owner: dict[SQLiteConsumer, list[int]] = collections.defaultdict(list)
        for message in cast("Iterable[SQLiteMessageProxy]", messages):
            by_owner[message._owner].append(message.delivery_id)
        for owner, delivery_ids in by_owner.items():
            owner._release(delivery_ids)

    def close(self) -> None:
        """Release every row this consumer holds and stop its heartbeat.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cache.clear()
        with self._held_lock:
            self._held.clear()
            self._etas.clear()
        # Under beat_lock, so that a heartbeat already under way cannot re-register us.
        with self._watcher.beat_lock:
            self._watcher.remove(self)
            try:
                broker_queue.close_consumer(self.broker.pool.get(), self.consumer_id)
            except RunstileError:
                # Its heartbeat has stopped, so any process's reaper releases the rows later.
                self.broker.pool.discard()
                self.logger.warning("Could not release consumer %s's messages now; they go "
                                    "back after %.0f s.", self.consumer_id,
                                    self.info.timeout_s, exc_info=True)
        self._watcher.poke()

    def abandon(self) -> None:
        """Stop heartbeating without releasing anything, as if this process had frozen or
        died: after the consumer timeout another consumer gets the rows.  For tests."""
        self._closed = True
        self._watcher.remove(self)

    # -- internals --------------------------------------------------------------------

    def _settle(self, delivery_id: int, operation) -> bool:
        try:
            done = operation(self.broker.pool.get(), delivery_id, self.consumer_id)
        except RunstileError as exc:
            # Dramatiq retries acks that fail with a connection error.
            self.broker.pool.discard()
            raise ConnectionClosed(exc) from exc
        self._forget([delivery_id])
        return done

    def _release(self, delivery_ids: Sequence[int]) -> None:
        if not delivery_ids:
            return
        self.logger.debug("Re-enqueueing deliveries %r on queue %r.", delivery_ids,
                          self.queue_name)
        try:
            broker_queue.release(self.broker.pool.get(), self.consumer_id, delivery_ids)
        except RunstileError as exc:
            self.broker.pool.discard()
            raise ConnectionClosed(exc) from exc
        self._forget(delivery_ids)

    def _next_eta(self) -> float | None:
        """Seconds until the soonest eta still ahead among the held delayed rows (a few
        milliseconds past it), or None."""
        now = time.time()
        with self._held_lock:
            ahead = [eta for eta in self._etas.values() if eta > now]
        return None if not ahead else min(ahead) - now + 0.002

    def _forget(self, delivery_ids: Iterable[int]) -> None:
        delivery_ids = list(delivery_ids)
        with self._held_lock:
            self._held.difference_update(delivery_ids)
            for delivery_id in delivery_ids:
                self._etas.pop(delivery_id, None)
        self.woken.set()  # a prefetch slot opened; __next__ may fetch again
