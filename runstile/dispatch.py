"""Handing runs to workers: the Dramatiq message for a run, by actor name (DESIGN §2).

The web tier and recovery publish through here and never import ``workers.actors``
(decorating an actor binds it to a broker).  On the embedded broker the message row is
written inside the caller's transaction (the admission's own), so a committed run
always has its message and a rolled-back one never does.
"""

from __future__ import annotations

import sqlite3
import time

import dramatiq

from .config import Settings
from .ledger import broker_queue
from .ledger.runs import Enqueue

#: The one queue runs travel on, and the actor that executes them.
QUEUE = "runstile"
ACTOR = "runstile_execute"


def message_for(run_id: str, dispatch_id: int | None = None) -> dramatiq.Message:
    return dramatiq.Message(queue_name=QUEUE, actor_name=ACTOR, args=(run_id,),
                            kwargs={"dispatch_id": dispatch_id}, options={})


def _embedded_enqueue(conn: sqlite3.Connection, run: dict, dispatch_id: int) -> None:
    message = message_for(run["id"], dispatch_id)
    broker_queue.insert_message(conn, QUEUE, message.message_id, message.encode(),
                                run_id=run["id"])


def in_transaction_enqueue(settings: Settings, *, delay_s: float = 0.0) -> Enqueue | None:
    """The callback admission and re-queues pass to the ledger, or None for brokers that
    are published to after commit (Redis, RabbitMQ).  With ``delay_s`` the message waits
    on the delay queue (Dramatiq's ``<queue>.DQ`` convention with an ``eta``)."""
    if settings.broker_url != "sqlite":
        return None
    if delay_s <= 0:
        return _embedded_enqueue

    def delayed(conn: sqlite3.Connection, run: dict, dispatch_id: int) -> None:
        eta_ms = int((time.time() + delay_s) * 1000)
        message = message_for(run["id"], dispatch_id).copy(
            queue_name=f"{QUEUE}.DQ", options={"eta": eta_ms})
        broker_queue.insert_message(conn, message.queue_name, message.message_id,
                                    message.encode(), eta=eta_ms / 1000, run_id=run["id"])

    return delayed
