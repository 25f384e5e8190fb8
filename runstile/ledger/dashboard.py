"""Reads the dashboard needs beyond the API's (docs/dashboard.md): a signed-in key by
id, deliveries across runs, status counts and the node's health.

Only reads: every change the dashboard makes goes through the same ledger functions
as the API's routes.  Every query that shows runs or deliveries is limited by
:func:`runs.visible_clause`, the API's scoping (docs/guarantees.md, "6. Isolation").
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from . import db
from .keys import Principal
from .runs import visible_clause

#: The delivery states a person may act on, the dashboard's default view.
OPEN_DELIVERY_STATES = ("parked", "pending", "attempting")
DELIVERY_STATES = ("pending", "attempting", "parked", "delivered", "discarded")


def live_principal(conn: sqlite3.Connection, key_id: str) -> Principal | None:
    """The key as a principal while it is live; None once revoked or gone.  Read at
    every dashboard request, so a revocation signs the session out at its next one."""
    with db.ledger_errors():
        row = conn.execute("SELECT id, profile_id, role FROM api_keys "
                           "WHERE id = ? AND revoked_at IS NULL", (key_id,)).fetchone()
    return None if row is None else Principal(row["profile_id"], row["id"], row["role"])


def deliveries(conn: sqlite3.Connection, principal: Principal, states: Sequence[str], *,
               limit: int = 200) -> list[dict[str, Any]]:
    """Obligations of the runs the key may see, in ``states``, oldest first (the one
    waiting longest is the first a person should look at), with their run's task."""
    where, args = visible_clause(principal)
    marks = ", ".join("?" for _ in states)
    sql = (f"SELECT o.*, r.task AS run_task FROM obligations AS o JOIN (SELECT id, task "
           f"FROM runs WHERE {where}) AS r ON r.id = o.run_id WHERE o.state IN ({marks}) "
           "ORDER BY o.created_at, o.id LIMIT ?")
    with db.ledger_errors():
        rows = conn.execute(sql, (*args, *states, limit)).fetchall()
    return [db.as_dict(r) for r in rows]


def status_counts(conn: sqlite3.Connection, principal: Principal) -> dict[str, int]:
    """How many runs the key may see, by status."""
    where, args = visible_clause(principal)
    with db.ledger_errors():
        rows = conn.execute(f"SELECT status, COUNT(*) AS n FROM runs WHERE {where} "
                            "GROUP BY status", args).fetchall()
    return {r["status"]: r["n"] for r in rows}


def statuses(conn: sqlite3.Connection, principal: Principal,
             run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Status and last change of those of ``run_ids`` the key may see (the live view's
    poll; ids it may not see are simply absent)."""
    if not run_ids:
        return {}
    where, args = visible_clause(principal)
    marks = ", ".join("?" for _ in run_ids)
    with db.ledger_errors():
        rows = conn.execute(f"SELECT id, status, updated_at FROM runs WHERE id IN ({marks}) "
                            f"AND {where}", (*run_ids, *args)).fetchall()
    return {r["id"]: {"status": r["status"], "updated_at": r["updated_at"]} for r in rows}


def node(conn: sqlite3.Connection, node_id: str) -> dict[str, Any] | None:
    with db.ledger_errors():
        row = conn.execute("SELECT id, generation, booted_at, recovered_generation "
                           "FROM nodes WHERE id = ?", (node_id,)).fetchone()
    return None if row is None else db.as_dict(row)


def consumers(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The embedded broker's live consumers (one per worker process and queue); empty
    with Redis or RabbitMQ, whose consumers the ledger does not see."""
    with db.ledger_errors():
        rows = conn.execute("SELECT host, pid, queue_name, started_at, last_seen_at "
                            "FROM broker_consumers ORDER BY host, pid, queue_name").fetchall()
    return [db.as_dict(r) for r in rows]


def queue_depths(conn: sqlite3.Connection) -> dict[str, int]:
    """The embedded broker's messages not yet done (ready or claimed), by queue."""
    with db.ledger_errors():
        rows = conn.execute("SELECT queue_name, COUNT(*) AS n FROM broker_messages "
                            "WHERE state IN ('ready', 'claimed') GROUP BY queue_name "
                            "ORDER BY queue_name").fetchall()
    return {r["queue_name"]: r["n"] for r in rows}
