"""Dispatch records for brokers published to after commit: Redis and RabbitMQ
(docs/architecture.md, "Redis and RabbitMQ").

A dispatch row is written in the transaction that makes a run claimable (admission,
re-queue, a session's next run; ``runs.add_dispatch``).  With the embedded broker it is
born sent.  With Redis or RabbitMQ the message can only be published once that
transaction has committed, so the row starts unsent; ``dispatch.py`` publishes it and
then marks it with :func:`mark_sent`.  Whatever is lost between the two steps (a failed
publish, a crash, a broker that restarted empty) is found again here by recovery
(docs/operations.md, "Recovery", step 4).  A duplicate message is harmless: the claim lets
one execution in.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from . import db
from .db import NOW
from .runs import due, not_waiting_for_a_slot
from .sessions import CLAIMABLE


def unsent(conn: sqlite3.Connection, *, limit: int, older_than_s: float = 0.0,
           created_since: float | None = None,
           run_ids: Sequence[str] | None = None,
           ) -> list[tuple[int, str, float | None, int, str]]:
    """``(dispatch id, run id, the run's not_before, priority and queue)`` of unsent
    records whose run is still queued, oldest first (a delayed run's record is published
    delayed).

    ``older_than_s`` leaves alone records a publisher is probably handling right now;
    ``created_since`` (a ledger time) brings back younger ones anyway (those a recovery
    pass wrote itself).  ``run_ids`` narrows the search to runs a pass just re-dispatched.
    """
    clauses = ["d.sent_at IS NULL", "r.status = 'queued'"]
    args: list[object] = []
    if created_since is None:
        clauses.append(f"d.created_at <= {NOW} - ?")
        args.append(older_than_s)
    else:
        clauses.append(f"(d.created_at <= {NOW} - ? OR d.created_at >= ?)")
        args += [older_than_s, created_since]
    if run_ids is not None:
        if not run_ids:
            return []
        clauses.append(f"d.run_id IN ({', '.join('?' for _ in run_ids)})")
        args += list(run_ids)
    with db.ledger_errors():
        rows = conn.execute(
            "SELECT d.id, d.run_id, r.not_before, r.priority, r.queue FROM dispatches d "
            f"JOIN runs r ON r.id = d.run_id WHERE {' AND '.join(clauses)} ORDER BY "
            "d.created_at, d.id LIMIT ?", (*args, limit)).fetchall()
    return [(row[0], row[1], row[2], row[3], row[4]) for row in rows]


def mark_sent(conn: sqlite3.Connection, dispatch_id: int, *, live_in_s: float = 0.0) -> bool:
    """Record that the broker accepted the record's message: one guarded UPDATE; False
    if it was already marked (another publisher won) or is gone with its run.

    ``live_in_s`` is a delayed message's delay: ``sent_at`` is when the message becomes
    deliverable, so recovery's wait for a lost message starts from there.
    """
    with db.transaction(conn):
        row = conn.execute(f"UPDATE dispatches SET sent_at = {NOW} + ? "
                           "WHERE id = ? AND sent_at IS NULL RETURNING id",
                           (live_in_s, dispatch_id)).fetchone()
    return row is not None


def lost_queued(conn: sqlite3.Connection, *, older_than_s: float,
                limit: int) -> list[dict[str, Any]]:
    """Queued runs that could be claimed now, but whose every dispatch went to the broker
    more than ``older_than_s`` ago: their message was probably lost (a broker restarted
    empty, a queue purged).  Redis and RabbitMQ cannot be looked into, so the record's
    age is the evidence; the embedded broker's check is ``recovery.stranded_queued``.
    A run with an unsent record is left to whoever publishes that record (no pile of
    new records while a broker is down)."""
    with db.ledger_errors():
        rows = conn.execute(
            f"SELECT r.* FROM runs r WHERE r.status = 'queued' AND r.updated_at <= {NOW} - ? "
            "AND NOT EXISTS (SELECT 1 FROM dispatches d WHERE d.run_id = r.id AND "
            f"(d.sent_at IS NULL OR d.sent_at > {NOW} - ?)) AND {CLAIMABLE} "
            # A delayed run is not lost before its time: its message is due then.
            f"AND {due('r.', '?')} "
            # A run waiting for a slot of its profile or its task has no message on
            # purpose: whatever frees a slot dispatches it, and recovery step 5 covers a
            # lost one.
            f"AND {not_waiting_for_a_slot('r.')} "
            "ORDER BY r.updated_at LIMIT ?",
            (older_than_s, older_than_s, older_than_s, limit)).fetchall()
    return [db.as_dict(r) for r in rows]
