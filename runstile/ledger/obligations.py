"""Delivery obligations (docs/architecture.md, "Deliveries"): every move of an obligation
row, and nothing else.

Callback obligations are inserted by the ``obligations_from_events`` trigger (migration
2) in the transaction of the run's own transition; ``insert_deliver`` adds the ones a
task asks for with ``ctx.deliver``.  After that an obligation only moves through the
guarded UPDATEs below, each reporting whether it won:

- ``claim``: pending and due -> attempting, fence + 1, one more attempt, with an owner
  and a lease long enough for one attempt's timeouts;
- ``settle``: attempting -> delivered | pending (retry later) | parked, a compare-and-set
  on (id, run_id, fence, 'attempting'): a deliverer that lost its attempt changes nothing;
- ``rearm_orphans`` (recovery): attempting with its owner gone -> pending, ``ambiguous``
  (the receiver may have it: the next send says ``"recovered": true``);
- ``rearm`` / ``discard``: a person's decision on a parked (or pending) obligation.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ListQueryTimeout
from . import db, events, owed
from .db import NOW


def new_id() -> str:
    return "msg_" + secrets.token_hex(16)


def insert_deliver(conn: sqlite3.Connection, run: dict[str, Any], *, url: str,
                   payload_json: str) -> str:
    """A ``ctx.deliver`` obligation, inside the caller's (fenced) transaction."""
    obligation_id = new_id()
    conn.execute(
        "INSERT INTO obligations (id, run_id, profile_id, kind, type, url, payload, "
        "occurred_at, next_attempt_at, created_at, updated_at) VALUES (?, ?, ?, 'deliver', "
        f"'task.delivery', ?, ?, {NOW}, {NOW}, {NOW}, {NOW})",
        (obligation_id, run["id"], run["profile_id"], url, payload_json))
    owed.owe_deliveries(conn, run["id"])
    return obligation_id


# --------------------------------------------------------------------------- reading

def get(conn: sqlite3.Connection, obligation_id: str) -> dict[str, Any] | None:
    with db.ledger_errors():
        row = conn.execute("SELECT * FROM obligations WHERE id = ?", (obligation_id,)).fetchone()
    return None if row is None else db.as_dict(row)


def for_run(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    with db.ledger_errors():
        rows = conn.execute("SELECT * FROM obligations WHERE run_id = ? ORDER BY created_at, id",
                            (run_id,)).fetchall()
    return [db.as_dict(r) for r in rows]


def run_row(conn: sqlite3.Connection, run_id: str) -> dict[str, Any] | None:
    """The run an obligation belongs to (kept from retention while it owes anything)."""
    with db.ledger_errors():
        row = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    return None if row is None else db.as_dict(row)


STATES = ("pending", "attempting", "delivered", "parked", "discarded")
#: The states an operator watches: what is still owed (docs/operations.md, "Metrics").
BACKLOG_STATES = ("pending", "attempting", "parked")


def list_visible(conn: sqlite3.Connection, scope: tuple[str, tuple[str, ...]], *,
                 states: Sequence[str], before: int | None, limit: int,
                 timeout_s: float | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Obligations of the runs ``scope`` (``runs.visible_clause``) may see, newest first,
    keyset-paged on insertion order (an insert while a client pages gets a larger one, so
    pages never repeat or skip); ``states`` empty means every state.  Also returns
    has_more.

    On SQLite that is the rowid: the table has no INTEGER PRIMARY KEY, so its rowid is
    insertion order; only VACUUM could renumber it, and nothing runs VACUUM on a ledger
    (a backup copies pages).  PostgreSQL has a column for it (the dialect names it).
    Past ``timeout_s`` the query stops (ListQueryTimeout), as a runs list does."""
    where, args = scope
    order = db.dialect(conn).obligation_order
    clauses, params = [f"run_id IN (SELECT id FROM runs WHERE {where})"], list[object](args)
    if states:
        clauses.append(f"state IN ({', '.join('?' for _ in states)})")
        params += list(states)
    if states and all(s in BACKLOG_STATES for s in states):
        # What is still owed: read from the obligations_unsettled partial index (this
        # clause is its WHERE), never a walk of every delivered obligation.
        clauses.append("state NOT IN ('delivered', 'discarded')")
    if before is not None:
        clauses.append(f"{order} < ?")
        params.append(before)
    sql = (f"SELECT {order} AS page_seq, * FROM obligations WHERE {' AND '.join(clauses)} "
           f"ORDER BY {order} DESC LIMIT ?")
    limited = contextlib.nullcontext() if timeout_s is None else db.time_limit(
        conn, timeout_s, lambda: ListQueryTimeout(
            f"the delivery list query ran past its limit of {timeout_s * 1000:g} ms and "
            "was stopped; narrow it (state) or lower limit"))
    with limited, db.ledger_errors():
        rows = conn.execute(sql, (*params, limit + 1)).fetchall()
    return [db.as_dict(r) for r in rows[:limit]], len(rows) > limit


def list_all(conn: sqlite3.Connection, *, states: Sequence[str],
             limit: int) -> tuple[list[dict[str, Any]], bool]:
    """Every run's obligations, newest first (``runstile deliveries list`` on the local
    ledger: an operator sees every profile)."""
    return list_visible(conn, ("1 = 1", ()), states=states, before=None, limit=limit)


def backlog(conn: sqlite3.Connection) -> dict[str, int]:
    """Obligations not yet settled, by state, node-wide (the metrics gauge).  The WHERE clause is
    obligations_unsettled's own, so SQLite reads that partial index, never the history.
    """
    counts = dict.fromkeys(BACKLOG_STATES, 0)
    with db.ledger_errors():
        for state, n in conn.execute(
                "SELECT state, COUNT(*) FROM obligations "
                "WHERE state NOT IN ('delivered', 'discarded') GROUP BY state").fetchall():
            counts[state] = n
    return counts


def unsent(conn: sqlite3.Connection, *, run_ids: Sequence[str] | None = None,
           stale_s: float | None = None, grace_s: float = 0.0, limit: int = 500) -> list[str]:
    """Pending obligations due (``grace_s`` ago) that need a message (of these runs, or
    of all): none was sent, or (with ``stale_s``) the one sent is that long overdue — a
    broker can lose messages."""
    params: dict[str, object] = {"stale": stale_s, "grace": grace_s, "limit": limit}
    stale = "" if stale_s is None else f" OR message_due_at <= {NOW} - :stale"
    by_run = ""
    if run_ids is not None:
        params.update({f"r{i}": run_id for i, run_id in enumerate(run_ids)})
        by_run = f" AND run_id IN ({', '.join(f':r{i}' for i in range(len(run_ids)))})"
    with db.ledger_errors():
        rows = conn.execute(
            "SELECT id FROM obligations WHERE state = 'pending' AND "
            f"next_attempt_at <= {NOW} - :grace AND (message_due_at IS NULL{stale}){by_run} "
            "ORDER BY next_attempt_at LIMIT :limit", params).fetchall()
    return [r[0] for r in rows]


def mark_sent(conn: sqlite3.Connection, obligation_ids: list[str]) -> int:
    """A message for each of these is on its way (guarded: still pending)."""
    if not obligation_ids:
        return 0
    marks = ", ".join("?" for _ in obligation_ids)
    with db.transaction(conn):
        return conn.execute(
            "UPDATE obligations SET message_due_at = "
            f"{db.dialect(conn).greatest('next_attempt_at', NOW)} "
            f"WHERE id IN ({marks}) AND state = 'pending'", obligation_ids).rowcount


# --------------------------------------------------------------------------- attempts

@dataclass(frozen=True)
class Claim:
    """``row`` when this deliverer won the attempt; else ``wait_s`` > 0 when the
    obligation is pending but not yet due (the message came early), or neither."""

    row: dict[str, Any] | None = None
    wait_s: float = 0.0


def claim(conn: sqlite3.Connection, obligation_id: str, *, node: str, generation: int,
          pid: int, lease_s: float) -> Claim:
    """pending and due -> attempting for this owner.  A duplicate message, or one for an
    obligation already delivered, parked or being attempted, loses and does nothing."""
    with db.transaction(conn):
        row = conn.execute(
            "UPDATE obligations SET state = 'attempting', attempts = attempts + 1, "
            "fence = fence + 1, owner_node = ?, owner_generation = ?, owner_pid = ?, "
            f"lease_expires_at = {NOW} + ?, message_due_at = NULL, updated_at = {NOW} "
            f"WHERE id = ? AND state = 'pending' AND next_attempt_at <= {NOW} RETURNING *",
            (node, generation, pid, lease_s, obligation_id)).fetchone()
        if row is not None:
            return Claim(row=db.as_dict(row))
        early = conn.execute(
            f"SELECT next_attempt_at - {NOW} FROM obligations WHERE id = ? "
            "AND state = 'pending'", (obligation_id,)).fetchone()
    return Claim(wait_s=max(0.0, early[0]) if early is not None else 0.0)


def _cas(row: dict[str, Any]) -> tuple[str, tuple[object, ...]]:
    return ("id = ? AND run_id = ? AND fence = ? AND state = 'attempting'",
            (row["id"], row["run_id"], row["fence"]))


def settle_delivered(conn: sqlite3.Connection, row: dict[str, Any], *,
                     status: int | None) -> bool:
    where, args = _cas(row)
    with db.transaction(conn):
        won = conn.execute(
            "UPDATE obligations SET state = 'delivered', owner_node = NULL, "
            "owner_generation = NULL, owner_pid = NULL, lease_expires_at = NULL, "
            f"last_status = ?, last_error = NULL, settled_at = {NOW}, updated_at = {NOW} "
            f"WHERE {where}", (status, *args)).rowcount == 1
        if won:
            events.append(conn, row["run_id"], "delivery.delivered", _event_data(row))
    return won


def settle_failed(conn: sqlite3.Connection, row: dict[str, Any], *, status: int | None,
                  error: str, delay_s: float, park: bool) -> bool:
    """A failed attempt: back to pending after ``delay_s``, or parked (``park``: a 410,
    or the attempts are used up).  A parked obligation stays until a person acts."""
    where, args = _cas(row)
    with db.transaction(conn):
        if park:
            won = conn.execute(
                "UPDATE obligations SET state = 'parked', owner_node = NULL, "
                "owner_generation = NULL, owner_pid = NULL, lease_expires_at = NULL, "
                f"last_status = ?, last_error = ?, settled_at = {NOW}, updated_at = {NOW} "
                f"WHERE {where}", (status, error, *args)).rowcount == 1
            if won:
                events.append(conn, row["run_id"], "delivery.parked",
                              {**_event_data(row), "error": error, "status": status})
            return won
        # The retry's message is sent right after this commits; message_due_at says so
        # already, and if that send never happens recovery finds it overdue.
        return conn.execute(
            "UPDATE obligations SET state = 'pending', owner_node = NULL, "
            "owner_generation = NULL, owner_pid = NULL, lease_expires_at = NULL, "
            f"next_attempt_at = {NOW} + ?, message_due_at = {NOW} + ?, last_status = ?, "
            f"last_error = ?, updated_at = {NOW} WHERE {where}",
            (delay_s, delay_s, status, error, *args)).rowcount == 1


def _event_data(row: dict[str, Any]) -> dict[str, Any]:
    return {"delivery_id": row["id"], "type": row["type"], "attempts": row["attempts"]}


# --------------------------------------------------------------------------- recovery

def rearm_orphans(conn: sqlite3.Connection, *, node_id: str, generation: int,
                  max_attempts: int, limit: int) -> tuple[int, int]:
    """Recovery's step 2 (docs/operations.md, "Recovery"): attempts whose owner is gone
    (lease expired, or an earlier generation of this node) go back to pending and count
    as ambiguous — the receiver may have the request.  One that has used all its attempts
    parks instead, so a payload that kills its deliverer cannot loop forever.  Returns
    (re-armed, parked)."""
    gone = (f"state = 'attempting' AND (lease_expires_at <= {NOW} OR "
            "(owner_node = :node AND owner_generation < :generation))")
    params = {"node": node_id, "generation": generation, "max": max_attempts,
              "limit": limit}
    with db.transaction(conn):
        parked = conn.execute(
            "UPDATE obligations SET state = 'parked', ambiguous = 1, owner_node = NULL, "
            "owner_generation = NULL, owner_pid = NULL, lease_expires_at = NULL, "
            "last_error = 'the deliverer died during the last attempt', "
            f"settled_at = {NOW}, updated_at = {NOW} WHERE id IN (SELECT id FROM obligations "
            f"WHERE {gone} AND attempts >= :max LIMIT :limit) RETURNING *", params).fetchall()
        for row in parked:
            events.append(conn, row["run_id"], "delivery.parked",
                          {**_event_data(db.as_dict(row)), "error": row["last_error"]})
        rearmed = conn.execute(
            "UPDATE obligations SET state = 'pending', ambiguous = 1, owner_node = NULL, "
            "owner_generation = NULL, owner_pid = NULL, lease_expires_at = NULL, "
            f"next_attempt_at = {NOW}, message_due_at = NULL, updated_at = {NOW} "
            f"WHERE id IN (SELECT id FROM obligations WHERE {gone} LIMIT :limit)",
            params).rowcount
    return rearmed, len(parked)


# --------------------------------------------------------------------------- people

def rearm(conn: sqlite3.Connection, obligation_id: str, *,
          by: str) -> tuple[dict[str, Any], bool] | None:
    """parked -> pending with a fresh set of attempts: (row, changed).  Repeats, and a
    retry of one that is already pending or in flight, change nothing."""
    return _decide(conn, obligation_id, by, "delivery.rearmed",
                   "state = 'pending', attempts = 0, next_attempt_at = " + NOW + ", "
                   "message_due_at = NULL, settled_at = NULL", ("parked",))


def discard(conn: sqlite3.Connection, obligation_id: str, *,
            by: str) -> tuple[dict[str, Any], bool] | None:
    """pending | parked -> discarded, for good: (row, changed).  Not while an attempt
    is in flight (its outcome would race the decision)."""
    return _decide(conn, obligation_id, by, "delivery.discarded",
                   f"state = 'discarded', settled_at = {NOW}", ("pending", "parked"))


def _decide(conn: sqlite3.Connection, obligation_id: str, by: str, event: str, assignments: str,
            from_states: tuple[str, ...]) -> tuple[dict[str, Any], bool] | None:
    """A person's decision: one guarded UPDATE and its event, or the row as it stands
    (None if there is no such obligation)."""
    marks = ", ".join("?" for _ in from_states)
    with db.transaction(conn):
        row = conn.execute(
            f"UPDATE obligations SET {assignments}, settled_by = ?, updated_at = {NOW} "
            f"WHERE id = ? AND state IN ({marks}) RETURNING *",
            (by, obligation_id, *from_states)).fetchone()
        if row is not None:
            events.append(conn, row["run_id"], event, {"delivery_id": obligation_id, "by": by})
            if row["state"] == "pending":  # re-armed: its next attempt needs a message
                owed.owe_deliveries(conn, row["run_id"])
            return db.as_dict(row), True
        current = conn.execute("SELECT * FROM obligations WHERE id = ?",
                               (obligation_id,)).fetchone()
    return None if current is None else (db.as_dict(current), False)


def payload_of(row: dict[str, Any]) -> object:
    return None if row["payload"] is None else json.loads(row["payload"])
