"""Small read-only probes used by health, readiness and capabilities."""

from __future__ import annotations

import sqlite3

from . import db


def ping(conn: sqlite3.Connection) -> bool:
    with db.ledger_errors():
        one: int = conn.execute("SELECT 1").fetchone()[0]
        return one == 1


def storage(conn: sqlite3.Connection) -> dict[str, str]:
    """The ledger's engine and how it stores commits (``/readyz``): SQLite's journal
    mode, PostgreSQL's ``synchronous_commit``."""
    with db.ledger_errors():
        engine = db.dialect(conn)
        return {"engine": engine.name, **engine.storage_report(conn)}


def durability(conn: sqlite3.Connection, synchronous: str) -> tuple[str, bool]:
    """What ``/v1/capabilities`` says of commits: the setting in force (SQLite's
    RUNSTILE_SYNCHRONOUS, PostgreSQL's synchronous_commit) and whether an acknowledged
    commit survives a power loss."""
    with db.ledger_errors():
        return db.dialect(conn).durability(conn, synchronous)


def node_generation(conn: sqlite3.Connection, node_id: str) -> int:
    """The node's current boot generation (0 until a worker of this node has booted)."""
    with db.ledger_errors():
        row = conn.execute("SELECT generation FROM nodes WHERE id = ?", (node_id,)).fetchone()
    return 0 if row is None else int(row[0])


#: The statuses the runs gauge counts: the ones a partial index holds, so a scrape costs
#: a walk of what is in flight, never of the ledger's history.  Paused and
#: waiting_for_approval runs have no such index (each count would scan every run).
GAUGED_STATUSES = ("queued", "running", "stopping")


def active_runs(conn: sqlite3.Connection) -> dict[str, int]:
    """Queued, running and stopping runs (the metrics gauge, read at every scrape)."""
    counts = dict.fromkeys(GAUGED_STATUSES, 0)
    with db.ledger_errors():
        # Written as the partial indexes' own WHERE clauses (runs_queued, runs_in_flight):
        # SQLite reads an index only for a query whose WHERE implies the index's.
        counts["queued"] = int(conn.execute(
            "SELECT COUNT(*) FROM runs WHERE status = 'queued'").fetchone()[0])
        for status, n in conn.execute(
                "SELECT status, COUNT(*) FROM runs WHERE status IN ('running', 'stopping') "
                "GROUP BY status").fetchall():
            counts[status] = int(n)
    return counts
