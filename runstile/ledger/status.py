"""Small read-only probes used by health, readiness and capabilities."""

from __future__ import annotations

import sqlite3

from . import db


def ping(conn: sqlite3.Connection) -> bool:
    with db.ledger_errors():
        one: int = conn.execute("SELECT 1").fetchone()[0]
        return one == 1


def node_generation(conn: sqlite3.Connection, node_id: str) -> int:
    """The node's current boot generation (0 until a worker of this node has booted)."""
    with db.ledger_errors():
        row = conn.execute("SELECT generation FROM nodes WHERE id = ?", (node_id,)).fetchone()
    return 0 if row is None else int(row[0])
