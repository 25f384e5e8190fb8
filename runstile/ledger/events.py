"""Each run's durable event log: docs/api.md, "GET /v1/runs/{run_id}/events — the event log".
seq counts from 1 per run."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ..jsondepth import loads_for_reading
from . import db, owed
from .db import NOW

#: The event types that the trigger ``obligations_from_events`` (migration 2) turns into
#: a callback obligation when their run has a ``callback_url``.
CALLBACK_EVENTS = frozenset({"run.completed", "run.failed", "run.cancelled",
                             "run.interrupted", "run.paused", "approval.requested"})


def append(conn: sqlite3.Connection, run_id: str, type_: str, data: object = None, *,
           run: dict[str, Any] | None = None) -> int:
    """Append one event inside the caller's transaction; return its seq.

    No race on seq: callers hold the write lock (BEGIN IMMEDIATE), and the primary key
    (run_id, seq) would reject a duplicate on a database without one.  An event the
    trigger may turn into an obligation makes the commit owe a deliverer message
    (ledger/owed.py): every transition that ends or parks a run passes here.  ``run``:
    the run's row as this transaction wrote it, when the caller has it; a run without a
    ``callback_url`` gets no obligation from the trigger, so its commit owes nothing
    (and its settlement looks nothing up).
    """
    if type_ in CALLBACK_EVENTS and (run is None or run.get("callback_url") is not None):
        owed.owe_deliveries(conn, run_id)
    row = conn.execute(
        "INSERT INTO events (run_id, seq, type, data, created_at) "
        f"SELECT ?, COALESCE(MAX(seq), 0) + 1, ?, ?, {NOW} FROM events WHERE run_id = ? "
        "RETURNING seq",
        (run_id, type_, json.dumps({} if data is None else data, separators=(",", ":")), run_id),
    ).fetchone()
    seq: int = row[0]
    return seq


def append_first(conn: sqlite3.Connection, run_id: str, type_: str, data: object) -> int:
    """The first event of a run that was created in this very transaction: seq 1."""
    conn.execute(f"INSERT INTO events (run_id, seq, type, data, created_at) VALUES (?, 1, ?, ?, {NOW})",
                 (run_id, type_, json.dumps(data, separators=(",", ":"))))
    return 1


def after(conn: sqlite3.Connection, run_id: str, after_seq: int = 0,
          limit: int = 1000) -> list[dict[str, Any]]:
    """Events of a run with seq > after_seq, in order.  A single short read: no
    transaction is held open between polls (it would block WAL checkpoints)."""
    with db.ledger_errors():
        rows = conn.execute(
            "SELECT seq, type, data, created_at FROM events WHERE run_id = ? AND seq > ? "
            "ORDER BY seq LIMIT ?", (run_id, after_seq, limit)).fetchall()
    return [{"seq": r["seq"], "type": r["type"], "data": loads_for_reading(r["data"]),
             "created_at": r["created_at"]} for r in rows]
