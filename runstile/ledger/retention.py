"""Retention (docs/operations.md "Retention"): purge old terminal runs, leaving
tombstones; purge old tombstones; prune old recovery reports.

Called by the scheduled recovery job in bounded batches, never on the request path.
Non-terminal runs are never touched: the WHERE clause names terminal statuses only; nor
are runs that still owe a delivery (their obligations go with them, ON DELETE CASCADE).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from . import db
from .db import NOW
from .states import TERMINAL, sql_list

#: Recovery reports always kept, newest first, whatever their age: enough to read a few
#: hours of scheduled passes of a node (one every RUNSTILE_RECOVERY_INTERVAL_S) back.
REPORTS_KEPT = 1000


@dataclass(frozen=True)
class PurgeReport:
    runs: int
    tombstones: int


def purge(conn: sqlite3.Connection, *, run_retention_s: float, key_tombstone_s: float,
          batch: int = 500) -> PurgeReport:
    """Purge one batch; call again while it reports a full batch."""
    with db.transaction(conn):
        victims = conn.execute(
            f"SELECT id, profile_id, key_id FROM runs WHERE status IN {sql_list(TERMINAL)} "
            f"AND finished_at IS NOT NULL AND finished_at <= {NOW} - ? "
            # A run is kept while it owes a delivery, and for the retention period after
            # its last one was delivered or discarded (docs/operations.md, "Retention").
            "AND NOT EXISTS (SELECT 1 FROM obligations o WHERE o.run_id = runs.id AND "
            f"(o.state NOT IN ('delivered', 'discarded') OR o.settled_at > {NOW} - ?)) "
            "LIMIT ?", (run_retention_s, run_retention_s, batch)).fetchall()
        for run in victims:
            conn.execute(
                "INSERT INTO run_tombstones (run_id, profile_id, key_id, expires_at) "
                f"VALUES (?, ?, ?, {NOW} + ?) ON CONFLICT (run_id) DO NOTHING",
                (run["id"], run["profile_id"], run["key_id"], key_tombstone_s))
            conn.execute(
                "INSERT INTO key_tombstones (profile_id, key_id, idempotency_key, expires_at) "
                f"SELECT profile_id, key_id, idempotency_key, {NOW} + ? FROM idempotency_keys "
                "WHERE run_id = ? ON CONFLICT DO NOTHING", (key_tombstone_s, run["id"]))
            conn.execute("DELETE FROM idempotency_keys WHERE run_id = ?", (run["id"],))
            # Guarded on status again: a terminal row never changes, but say so in SQL.
            conn.execute(f"DELETE FROM runs WHERE id = ? AND status IN {sql_list(TERMINAL)}",
                         (run["id"],))
        # Bounded like the runs: a large backlog of expired tombstones takes several passes.
        expired = conn.execute(
            "DELETE FROM run_tombstones WHERE run_id IN (SELECT run_id FROM run_tombstones "
            f"WHERE expires_at <= {NOW} LIMIT ?)", (batch,)).rowcount
        expired += conn.execute(
            "DELETE FROM key_tombstones WHERE (profile_id, key_id, idempotency_key) IN "
            "(SELECT profile_id, key_id, idempotency_key FROM key_tombstones "
            f"WHERE expires_at <= {NOW} LIMIT ?)", (batch,)).rowcount
    return PurgeReport(runs=len(victims), tombstones=expired)


def prune_reports(conn: sqlite3.Connection, *, younger_than_s: float, keep: int = REPORTS_KEPT,
                  batch: int = 500) -> int:
    """Delete one batch of recovery reports that are neither among the newest ``keep``
    nor younger than ``younger_than_s`` (the run retention); returns how many.  A
    scheduled pass writes one every RUNSTILE_RECOVERY_INTERVAL_S (8,640 a day at 10 s),
    so without this the table only grows.  Call again while it reports a full batch."""
    with db.transaction(conn):
        # ids grow with time (AUTOINCREMENT): "newest" is the largest ids.  Below the
        # keep-th newest id only the age decides.
        return conn.execute(
            "DELETE FROM recovery_reports WHERE id IN (SELECT id FROM recovery_reports "
            "WHERE id < (SELECT id FROM recovery_reports ORDER BY id DESC LIMIT 1 OFFSET ?) "
            f"AND finished_at <= {NOW} - ? ORDER BY id LIMIT ?)",
            (keep - 1, younger_than_s, batch)).rowcount
